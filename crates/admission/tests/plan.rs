//! The plan end to end: issue 4's boundary matrix, DRAMA3.md §5 figures, the ADMISSION.md scale
//! figure, plans that do not fit, and sizes near `u64::MAX`.

use admission::{
    plan, Backend, BudgetSource, Bytes, CapKind, FrameCap, Frames, Lanes, Memory, MemoryBudget,
    ModelGeometry, PlanRequest, PromptRows, ReplyMode, Rows, Verdict, Window,
};

fn flag(bytes: u64) -> Option<MemoryBudget> {
    Some(MemoryBudget {
        bytes: Bytes(bytes),
        source: BudgetSource::Flag,
    })
}

fn gib(g: u64) -> Option<MemoryBudget> {
    flag(g << 30)
}

fn request(c: u64, p: u64, cap: FrameCap) -> PlanRequest {
    PlanRequest {
        context: Some(Window(c)),
        prompt_rows: Some(PromptRows(p)),
        frames: cap,
        ..PlanRequest::new(Backend::Cuda)
    }
}

#[test]
fn boundary_matrix_through_the_plan() {
    let g = ModelGeometry::drama3();
    for c in [16u64, 8192, 262_144] {
        for p in [2u64, 7, c - 3] {
            let f = c - p - 1;
            // P + F + 1 = C admitted, with exactly the explicit F.
            let r = plan(&g, &request(c, p, FrameCap::Explicit(Frames(f))));
            assert!(r.is_admitted(), "C={c} P={p} F={f}: {:?}", r.verdict);
            let a = r.budgets.admission.unwrap();
            assert_eq!(a.frames, Frames(f));
            assert_eq!(a.cap, CapKind::Explicit);
            assert_eq!(r.budgets.rows_reserved, Some(Rows(c)));
            // One more frame refused.
            let r = plan(&g, &request(c, p, FrameCap::Explicit(Frames(f + 1))));
            assert_eq!(r.refusal_code(), Some("frames_exceeded"));
            match &r.verdict {
                Verdict::Refused { message, .. } => {
                    assert!(
                        message.contains(&format!("largest cap that fits is {f} frames")),
                        "{message}"
                    );
                }
                v => panic!("{v:?}"),
            }
            // One more prompt row refused.
            let r = plan(&g, &request(c, p + 1, FrameCap::Explicit(Frames(f))));
            assert!(!r.is_admitted());
            assert_eq!(r.refusal_code(), Some("frames_exceeded"));
        }
        // A prompt with no room for a frame.
        let r = plan(&g, &request(c, c - 1, FrameCap::Default));
        assert_eq!(r.refusal_code(), Some("window_exceeded"));
        // F = 0 and P < 2 refused.
        let r = plan(&g, &request(c, 2, FrameCap::Explicit(Frames(0))));
        assert_eq!(r.refusal_code(), Some("frames_zero"));
        for p in [0, 1] {
            let r = plan(&g, &request(c, p, FrameCap::Default));
            assert_eq!(r.refusal_code(), Some("prompt_too_short"));
        }
    }
}

#[test]
fn drama3_model_maximum_is_262144() {
    let g = ModelGeometry::drama3();
    let r = plan(&g, &request(262_144, 2, FrameCap::Default));
    assert!(r.is_admitted(), "{:?}", r.verdict);
    assert_eq!(r.budgets.frames_max, Some(Frames(262_141)));
    assert_eq!(r.budgets.prompt_rows_max, Some(PromptRows(262_142)));
    let r = plan(&g, &request(262_145, 2, FrameCap::Default));
    assert_eq!(r.refusal_code(), Some("context_over_model_max"));
    // The default window is the model maximum.
    let r = plan(&g, &PlanRequest::new(Backend::Cuda));
    assert_eq!(r.budgets.window, Window(262_144));
    assert!(r.is_admitted());
    // The tiny fixture declares the same maximum.
    let r = plan(&ModelGeometry::tiny(), &PlanRequest::new(Backend::Cpu));
    assert_eq!(r.budgets.window, Window(262_144));
}

#[test]
fn default_cap_shrink_is_reported() {
    let g = ModelGeometry::tiny();
    let r = plan(&g, &request(8192, 100, FrameCap::Default));
    let a = r.budgets.admission.unwrap();
    assert_eq!((a.frames, a.cap), (Frames(1024), CapKind::Default));
    let r = plan(&g, &request(1000, 100, FrameCap::Default));
    let a = r.budgets.admission.unwrap();
    assert_eq!((a.frames, a.cap), (Frames(899), CapKind::DefaultShrunk));
    assert!(r.render_table().contains("default_shrunk cap"));
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["budgets"]["admission"]["cap"], "default_shrunk");
    assert_eq!(json["budgets"]["admission"]["frames"], 899);
}

#[test]
fn drama3_per_row_state_matches_drama3_md() {
    let g = ModelGeometry::drama3();
    let r = plan(&g, &request(262_144, 2, FrameCap::Default));
    let row = r.state_per_row.unwrap();
    // 10 layers x 2 KV heads x 256 x (K, V) x BF16.
    assert_eq!(row.backbone_kv, Bytes(10 * 2 * 256 * 2 * 2));
    assert_eq!(row.backbone_kv, Bytes(20_480));
    // 13 layers x 2 x 256 x 2 x BF16.
    assert_eq!(row.tower_kv, Bytes(13 * 2 * 256 * 2 * 2));
    assert_eq!(row.tower_kv, Bytes(26_624));
    assert_eq!(row.total, Bytes(47_104));
    assert_eq!(row.full_window, Bytes(47_104 * 262_144));
    assert_eq!(row.full_window, Bytes(12_348_030_976));
    // One lane: the pool is one full window; DRAMA3.md §5's split.
    assert_eq!(r.class("backbone_kv").unwrap().bytes, Bytes(5_368_709_120));
    assert_eq!(r.class("tower_kv").unwrap().bytes, Bytes(6_979_321_856));
    assert_eq!(r.class("gdn_recurrent").unwrap().bytes, Bytes(62_914_560));
    assert_eq!(r.class("gdn_conv").unwrap().bytes, Bytes(2_949_120));
    let lane = r.state_per_lane.unwrap();
    assert_eq!(lane.gdn_recurrent, Bytes(30 * 32 * 128 * 128 * 4));
    assert_eq!(lane.gdn_conv, Bytes(30 * 3 * 8192 * 4));
    assert!(r.class("backbone_kv_cfg").is_none());
    // Device classes hold the model; host classes hold replies.
    assert_eq!(r.class("tower_kv").unwrap().memory, Memory::Device);
    assert_eq!(r.class("pcm_whole_reply").unwrap().memory, Memory::Host);
    assert_eq!(r.class("staging_pinned_host").unwrap().memory, Memory::Host);
    assert_eq!(r.class("staging_device").unwrap().memory, Memory::Device);

    let table = r.render_table();
    assert!(table.contains("47,104 B (46 KiB)"), "{table}");
    assert!(
        table.contains("12,348,030,976 B (12.35 GB, 11.500 GiB)"),
        "{table}"
    );
    assert!(table.contains("20,480 B"), "{table}");
    assert!(table.contains("26,624 B"), "{table}");
    assert!(table.contains("verdict: admitted"), "{table}");
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["state_per_row"]["total"], 47_104);
    assert_eq!(json["state_per_row"]["full_window"], 12_348_030_976u64);
    assert_eq!(json["verdict"]["verdict"], "admitted");
}

#[test]
fn cpu_keeps_kv_in_f32_and_everything_on_the_host() {
    let g = ModelGeometry::drama3();
    let r = plan(
        &g,
        &PlanRequest {
            backend: Backend::Cpu,
            ..request(262_144, 2, FrameCap::Default)
        },
    );
    let row = r.state_per_row.unwrap();
    assert_eq!(row.backbone_kv, Bytes(40_960));
    assert_eq!(row.tower_kv, Bytes(53_248));
    assert_eq!(row.total, Bytes(2 * 47_104));
    assert!(r.classes.iter().all(|c| c.memory == Memory::Host));
    assert!(r.class("staging_device").is_none());
    assert!(r.total(Memory::Device).is_none());
}

#[test]
fn cfg_doubles_backbone_state_only() {
    let g = ModelGeometry::drama3();
    let r = plan(
        &g,
        &PlanRequest {
            cfg: true,
            ..request(8192, 2, FrameCap::Default)
        },
    );
    let row = r.state_per_row.unwrap();
    assert_eq!(row.backbone_kv_cfg, row.backbone_kv);
    assert_eq!(row.total, Bytes(2 * 20_480 + 26_624));
    assert_eq!(
        r.class("backbone_kv_cfg").unwrap().bytes,
        r.class("backbone_kv").unwrap().bytes
    );
    assert_eq!(
        r.class("gdn_cfg").unwrap().bytes,
        Bytes(62_914_560 + 2_949_120)
    );
    assert!(r.class("tower_kv_cfg").is_none());
}

#[test]
fn weights_by_format_are_classes() {
    let g = ModelGeometry::drama3();
    let r = plan(&g, &request(8192, 2, FrameCap::Default));
    assert_eq!(
        r.class("weights_experts_fp8").unwrap().bytes,
        Bytes(32_212_254_720)
    );
    assert!(r.class("weights_expert_scales").is_some());
    assert!(r.class("weights_backbone_bf16").is_some());
    assert!(r.class("weights_tower_bf16").is_some());
    assert!(r.class("weights_embeddings_bf16").is_some());
    assert!(r.class("weights_codec").is_some());
    let mut pruned = g.clone();
    pruned.expert_format = admission::ExpertFormat::Nvfp4 {
        kept_experts_per_layer: vec![192; 40],
    };
    let r = plan(&pruned, &request(8192, 2, FrameCap::Default));
    assert_eq!(
        r.class("weights_experts_nvfp4").unwrap().bytes,
        Bytes(40 * 192 * 3 * 2048 * 512 / 2)
    );
}

#[test]
fn scale_figure_whole_reply_needs_the_host_budget() {
    let g = ModelGeometry::drama3();
    // F = 262141 frames x 2048 samples = 536,864,768 samples, 2,147,459,072 B of f32.
    assert_eq!(262_141u64 * g.codec.frame_length, 536_864_768);
    let whole = PlanRequest {
        device_budget: gib(141),
        host_budget: flag(2_000_000_000),
        ..request(262_144, 2, FrameCap::Explicit(Frames(262_141)))
    };
    let r = plan(&g, &whole);
    assert_eq!(
        r.class("pcm_whole_reply").unwrap().bytes,
        Bytes(2_147_459_072)
    );
    assert_eq!(r.refusal_code(), Some("host_memory_exceeded"));
    match &r.verdict {
        Verdict::Refused {
            does_not_fit: Some(d),
            ..
        } => {
            assert_eq!(d.memory, Memory::Host);
            assert_eq!(d.class, "pcm_whole_reply");
            assert_eq!(d.budget, Bytes(2_000_000_000));
            // F is explicit and already fills the window: no smaller context holds it.
            assert_eq!(d.largest_context, None);
            assert_eq!(d.largest_lanes, None);
        }
        v => panic!("{v:?}"),
    }
    assert_eq!(r.total(Memory::Device).unwrap().fits, Some(true));
    assert_eq!(r.total(Memory::Host).unwrap().fits, Some(false));

    let streamed = PlanRequest {
        reply: ReplyMode::Streamed,
        ..whole.clone()
    };
    let r = plan(&g, &streamed);
    assert!(r.is_admitted(), "{:?}", r.verdict);
    assert!(r.class("pcm_whole_reply").is_none());
    assert!(r.class("pcm_stream_buffer").is_some());

    // A redraw keeps a second buffer of the same size.
    let redraw = PlanRequest {
        reply: ReplyMode::Whole {
            redraw_buffer: true,
        },
        host_budget: gib(64),
        ..whole
    };
    let r = plan(&g, &redraw);
    assert!(r.is_admitted());
    assert_eq!(
        r.class("pcm_redraw_buffer").unwrap().bytes,
        Bytes(2_147_459_072)
    );
    // i16 halves it.
    let r = plan(
        &g,
        &PlanRequest {
            pcm: admission::PcmFormat::I16,
            ..redraw
        },
    );
    assert_eq!(
        r.class("pcm_whole_reply").unwrap().bytes,
        Bytes(1_073_729_536)
    );
}

#[test]
fn a_plan_that_does_not_fit_names_the_class_and_what_fits() {
    let g = ModelGeometry::drama3();
    let req = PlanRequest {
        lanes: Lanes(4),
        device_budget: gib(80),
        host_budget: gib(64),
        ..PlanRequest::new(Backend::Cuda)
    };
    let r = plan(&g, &req);
    assert_eq!(r.refusal_code(), Some("device_memory_exceeded"));
    let Verdict::Refused {
        does_not_fit: Some(d),
        message,
        ..
    } = &r.verdict
    else {
        panic!("{:?}", r.verdict)
    };
    // Weights (~35 GiB) and the backbone KV of 4 full windows fit; the tower KV tips it over.
    assert_eq!(d.class, "tower_kv");
    assert_eq!(d.memory, Memory::Device);
    assert!(message.contains("tower_kv"), "{message}");
    assert!(message.contains("largest fitting context"), "{message}");
    let c = d.largest_context.unwrap();
    let lanes = d.largest_lanes.unwrap();
    assert!(c < Window(262_144));
    assert_eq!(lanes, Lanes(3));
    // The largest C is exact: it fits, and one more row does not.
    let at = |c: u64, n: u64| {
        plan(
            &g,
            &PlanRequest {
                context: Some(Window(c)),
                lanes: Lanes(n),
                ..req.clone()
            },
        )
    };
    assert!(at(c.0, 4).is_admitted());
    assert_eq!(
        at(c.0 + 1, 4).refusal_code(),
        Some("device_memory_exceeded")
    );
    assert!(at(262_144, 3).is_admitted());
    let table = r.render_table();
    assert!(table.contains("DOES NOT FIT"), "{table}");
    assert!(
        table.contains("verdict: refused (device_memory_exceeded)"),
        "{table}"
    );
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["verdict"]["verdict"], "refused");
    assert_eq!(json["verdict"]["does_not_fit"]["class"], "tower_kv");

    // Weights alone over budget: no context or lane count helps.
    let r = plan(
        &g,
        &PlanRequest {
            device_budget: gib(16),
            ..req
        },
    );
    let Verdict::Refused {
        does_not_fit: Some(d),
        ..
    } = &r.verdict
    else {
        panic!("{:?}", r.verdict)
    };
    assert_eq!(d.class, "weights_experts_fp8");
    assert_eq!((d.largest_context, d.largest_lanes), (None, None));
}

#[test]
fn unknown_budgets_are_reported_not_assumed() {
    let r = plan(&ModelGeometry::drama3(), &PlanRequest::new(Backend::Cuda));
    assert_eq!(
        r.verdict,
        Verdict::Admitted {
            unchecked_budgets: vec![Memory::Device, Memory::Host]
        }
    );
    assert!(r.render_table().contains("fit not checked"));
}

#[test]
fn explicit_pool_smaller_than_window_is_refused() {
    let g = ModelGeometry::tiny();
    let r = plan(
        &g,
        &PlanRequest {
            pool_rows: Some(Rows(8191)),
            ..request(8192, 2, FrameCap::Default)
        },
    );
    assert_eq!(r.refusal_code(), Some("pool_smaller_than_window"));
    let r = plan(
        &g,
        &PlanRequest {
            pool_rows: Some(Rows(8192)),
            lanes: Lanes(8),
            ..request(8192, 2, FrameCap::Default)
        },
    );
    assert!(r.is_admitted());
    // 8 lanes share one window's worth of KV rows; recurrent state is per lane.
    assert_eq!(r.budgets.pool_rows, Some(Rows(8192)));
    let row = r.state_per_row.unwrap();
    assert_eq!(
        r.class("backbone_kv").unwrap().bytes,
        Bytes(8192 * row.backbone_kv.0)
    );
    assert_eq!(
        r.class("gdn_recurrent").unwrap().bytes,
        Bytes(8 * g.gdn_recurrent_bytes().unwrap())
    );
}

#[test]
fn sizes_near_u64_max_are_refusals_not_panics() {
    let big = u64::try_from(usize::MAX).unwrap();
    let mut g = ModelGeometry::drama3();
    g.max_position_embeddings = u64::MAX;
    for (c, lanes, frames) in [
        (u64::MAX, 1, FrameCap::Default),
        (u64::MAX, u64::MAX, FrameCap::Default),
        (big, 2, FrameCap::Default),
        (8192, u64::MAX, FrameCap::Default),
        (u64::MAX, 1, FrameCap::Explicit(Frames(u64::MAX - 3))),
        (1 << 40, 1, FrameCap::Explicit(Frames((1 << 40) - 3))),
    ] {
        let r = plan(
            &g,
            &PlanRequest {
                lanes: Lanes(lanes),
                device_budget: gib(80),
                host_budget: gib(64),
                ..request(c, 2, frames)
            },
        );
        assert!(!r.is_admitted(), "C={c} lanes={lanes}");
        let code = r.refusal_code().unwrap();
        assert!(
            code == "size_overflow" || code.ends_with("_memory_exceeded"),
            "C={c} lanes={lanes}: {code}"
        );
        // Rendering a refused plan never panics either.
        let _ = r.render_table();
        let _ = serde_json::to_string(&r).unwrap();
    }
    // Without budgets the arithmetic itself must refuse.
    let r = plan(&g, &request(u64::MAX, 2, FrameCap::Default));
    assert_eq!(r.refusal_code(), Some("size_overflow"));
    // Request figures near the maximum on the real geometry.
    let g = ModelGeometry::drama3();
    let r = plan(&g, &request(262_144, u64::MAX, FrameCap::Default));
    assert_eq!(r.refusal_code(), Some("window_exceeded"));
    let r = plan(&g, &request(262_144, 2, FrameCap::Explicit(Frames(big))));
    assert_eq!(r.refusal_code(), Some("frames_exceeded"));
    let r = plan(&g, &request(u64::MAX, 2, FrameCap::Default));
    assert_eq!(r.refusal_code(), Some("context_over_model_max"));
    let mut g = ModelGeometry::drama3();
    g.tower_head_dim = u64::MAX / 3;
    let r = plan(&g, &PlanRequest::new(Backend::Cuda));
    assert_eq!(r.refusal_code(), Some("size_overflow"));
}

#[test]
fn invalid_configuration_is_refused() {
    let mut g = ModelGeometry::tiny();
    g.codec.frame_length = 0;
    assert_eq!(
        plan(&g, &PlanRequest::new(Backend::Cpu)).refusal_code(),
        Some("invalid_geometry")
    );
    let g = ModelGeometry::tiny();
    let r = plan(
        &g,
        &PlanRequest {
            lanes: Lanes(0),
            ..PlanRequest::new(Backend::Cpu)
        },
    );
    assert_eq!(r.refusal_code(), Some("lanes_zero"));
    let r = plan(
        &g,
        &PlanRequest {
            prefill_chunk_rows: Rows(0),
            ..PlanRequest::new(Backend::Cpu)
        },
    );
    assert_eq!(r.refusal_code(), Some("prefill_chunk_zero"));
    let r = plan(
        &g,
        &PlanRequest {
            context: Some(Window(3)),
            ..PlanRequest::new(Backend::Cpu)
        },
    );
    assert_eq!(r.refusal_code(), Some("window_too_small"));
}

#[test]
fn the_table_shows_every_budget_in_its_unit() {
    let r = plan(
        &ModelGeometry::drama3(),
        &PlanRequest {
            device_budget: gib(141),
            host_budget: gib(128),
            ..request(262_144, 2, FrameCap::Default)
        },
    );
    let t = r.render_table();
    for needle in [
        "262,144 window rows",
        "262,142 prompt rows",
        "262,141 frames",
        "1,024 frames",
        "1,027 KV rows",
        "33,554,432 bytes",
        "1,048,576 bytes and 262,144 code points",
        "4 reference passages",
        "4,096 reference transcript bytes",
        "646 reference frames",
        "62,914,560 B",
        "2,949,120 B",
        "weights_experts_fp8",
        "pcm_whole_reply",
        "reference_cache",
        "verdict: admitted",
    ] {
        assert!(t.contains(needle), "missing {needle:?} in\n{t}");
    }
    for c in &r.classes {
        assert!(t.contains(c.class), "class {} missing", c.class);
    }
}

#[test]
fn budget_flags_override_detection() {
    assert_eq!(
        MemoryBudget::choose(Some(Bytes(1)), Some(Bytes(2))),
        Some(MemoryBudget {
            bytes: Bytes(1),
            source: BudgetSource::Flag
        })
    );
    assert_eq!(
        MemoryBudget::choose(None, Some(Bytes(2))),
        Some(MemoryBudget {
            bytes: Bytes(2),
            source: BudgetSource::Detected
        })
    );
    assert_eq!(MemoryBudget::choose(None, None), None);
    // `--host-gib 0.5` style figures.
    assert_eq!(Bytes::from_gib_f64(0.5), Some(Bytes(1 << 29)));
}

#[test]
fn device_state_is_the_device_total_less_the_weights() {
    let g = ModelGeometry::drama3();
    let mut req = request(4096, 100, FrameCap::Default);
    req.lanes = Lanes(32);
    let r = plan(&g, &req);
    let total = r.total(Memory::Device).unwrap().needed.0;
    let weights: u64 = r
        .classes
        .iter()
        .filter(|c| c.memory == Memory::Device && c.class.starts_with("weights_"))
        .map(|c| c.bytes.0)
        .sum();
    assert!(
        weights > 30 << 30,
        "FP8 experts alone are over 30 GiB: {weights}"
    );
    let state = r.device_state_bytes().0;
    assert_eq!(state + weights, total);
    // the KV pool is in it, and grows with the lanes
    let kv: u64 = ["backbone_kv", "tower_kv"]
        .iter()
        .map(|k| r.classes.iter().find(|c| c.class == *k).unwrap().bytes.0)
        .sum();
    assert!(state > kv && kv > 0);
    req.lanes = Lanes(1);
    assert!(plan(&g, &req).device_state_bytes().0 < state);
    // the CPU backend's plan has no device side
    let cpu = plan(&g, &PlanRequest::new(Backend::Cpu));
    assert_eq!(cpu.device_state_bytes(), Bytes(0));
}

//! Property tests: for arbitrary (C, P, F, lanes, geometry sizes, budgets) the plan either admits
//! with consistent sums or refuses with a reason, and never panics.

use admission::{
    plan, Backend, BudgetSource, Bytes, FrameCap, Frames, KvPool, Lanes, Memory, MemoryBudget,
    ModelGeometry, PlanRequest, PromptRows, ReplyMode, Rows, Verdict, Window, WindowContract,
};
use proptest::prelude::*;

/// Mostly in `lo..=hi`, sometimes anything up to `u64::MAX`.
fn figure(lo: u64, hi: u64) -> impl Strategy<Value = u64> {
    prop_oneof![
        12 => lo..=hi,
        1 => any::<u64>(),
        1 => (0u64..=8).prop_map(|d| u64::MAX - d),
    ]
}

/// `None` (keep the base geometry's value) most of the time.
fn maybe(lo: u64, hi: u64) -> impl Strategy<Value = Option<u64>> {
    prop::option::weighted(0.25, figure(lo, hi))
}

fn geometry() -> impl Strategy<Value = ModelGeometry> {
    (
        prop::bool::ANY,
        maybe(0, 4096),
        maybe(0, 512),
        maybe(0, 64),
        maybe(0, 8192),
        maybe(0, 1 << 20),
        maybe(0, 16),
        maybe(0, 8),
    )
        .prop_map(
            |(tiny, hidden, head_dim, kv_heads, inter, max_pos, tower_layers, conv)| {
                let mut g = if tiny {
                    ModelGeometry::tiny()
                } else {
                    ModelGeometry::drama3()
                };
                g.hidden_size = hidden.unwrap_or(g.hidden_size);
                g.head_dim = head_dim.unwrap_or(g.head_dim);
                g.num_key_value_heads = kv_heads.unwrap_or(g.num_key_value_heads);
                g.tower_intermediate_size = inter.unwrap_or(g.tower_intermediate_size);
                g.max_position_embeddings = max_pos.unwrap_or(g.max_position_embeddings);
                g.tower_layers = tower_layers.unwrap_or(g.tower_layers);
                g.linear_conv_kernel_dim = conv.unwrap_or(g.linear_conv_kernel_dim);
                g
            },
        )
}

fn budget() -> impl Strategy<Value = Option<MemoryBudget>> {
    prop::option::weighted(
        0.85,
        figure(1 << 28, 1 << 38).prop_map(|b| MemoryBudget {
            bytes: Bytes(b),
            source: BudgetSource::Flag,
        }),
    )
}

fn request() -> impl Strategy<Value = PlanRequest> {
    (
        (
            prop::bool::ANY,
            prop::option::weighted(0.7, figure(0, 1 << 18)),
            figure(0, 8),
            prop::option::weighted(0.8, figure(0, 4096)),
            prop::option::of(figure(0, 1 << 14)),
            prop::bool::ANY,
        ),
        (
            0u8..3,
            prop::option::weighted(0.15, figure(0, 1 << 20)),
            figure(0, 1024),
            figure(0, 1 << 30),
            budget(),
            budget(),
        ),
    )
        .prop_map(
            |(
                (cpu, context, lanes, prompt, frames, cfg),
                (reply, pool, chunk, cache, device, host),
            )| PlanRequest {
                backend: if cpu { Backend::Cpu } else { Backend::Cuda },
                context: context.map(Window),
                lanes: Lanes(lanes),
                prompt_rows: prompt.map(PromptRows),
                frames: frames.map_or(FrameCap::Default, |f| FrameCap::Explicit(Frames(f))),
                cfg,
                reply: match reply {
                    0 => ReplyMode::Streamed,
                    1 => ReplyMode::Whole {
                        redraw_buffer: false,
                    },
                    _ => ReplyMode::Whole {
                        redraw_buffer: true,
                    },
                },
                pool_rows: pool.map(Rows),
                prefill_chunk_rows: Rows(chunk),
                prompt_cache: Bytes(cache),
                device_budget: device,
                host_budget: host,
                ..PlanRequest::new(Backend::Cuda)
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn plan_admits_consistently_or_refuses_with_a_reason(g in geometry(), req in request()) {
        let r = plan(&g, &req);
        let _ = r.render_table();
        prop_assert!(serde_json::to_string(&r).is_ok());
        match &r.verdict {
            Verdict::Admitted { unchecked_budgets } => {
                let a = r.budgets.admission.expect("admitted plans carry the admission");
                prop_assert!(a.prompt_rows.0 >= 2);
                prop_assert!(a.frames.0 >= 1);
                prop_assert!(a.rows().0 <= r.budgets.window.0);
                prop_assert!(r.budgets.window.0 <= g.max_position_embeddings);
                if let FrameCap::Explicit(f) = req.frames {
                    prop_assert_eq!(a.frames, f);
                }
                let pool = r.budgets.pool_rows.unwrap();
                prop_assert!(pool.0 >= r.budgets.window.0);
                for t in &r.totals {
                    let sum: u128 = r.classes.iter()
                        .filter(|c| c.memory == t.memory)
                        .map(|c| u128::from(c.bytes.0))
                        .sum();
                    prop_assert_eq!(sum, u128::from(t.needed.0));
                    match t.budget {
                        Some(b) => {
                            prop_assert!(t.needed <= b.bytes);
                            prop_assert_eq!(t.fits, Some(true));
                        }
                        None => prop_assert!(unchecked_budgets.contains(&t.memory)),
                    }
                }
                if req.backend == Backend::Cpu {
                    prop_assert!(r.classes.iter().all(|c| c.memory == Memory::Host));
                }
                let row = r.state_per_row.unwrap();
                prop_assert_eq!(
                    u128::from(row.total.0),
                    u128::from(row.backbone_kv.0)
                        + u128::from(row.backbone_kv_cfg.0)
                        + u128::from(row.tower_kv.0)
                );
            }
            Verdict::Refused { code, message, does_not_fit } => {
                prop_assert!(!code.is_empty());
                prop_assert!(!message.is_empty());
                if let Some(d) = does_not_fit {
                    prop_assert!(d.needed > d.budget);
                    prop_assert!(r.classes.iter().any(|c| c.class == d.class));
                    if let Some(c) = d.largest_context {
                        prop_assert!(c < r.budgets.window);
                        let smaller = PlanRequest { context: Some(c), ..req.clone() };
                        prop_assert!(plan(&g, &smaller).is_admitted());
                    }
                    if let Some(n) = d.largest_lanes {
                        prop_assert!(n < req.lanes);
                        let fewer = PlanRequest { lanes: n, ..req.clone() };
                        prop_assert!(plan(&g, &fewer).is_admitted());
                    }
                }
            }
        }
    }

    #[test]
    fn contract_is_exactly_the_inequalities(
        c in figure(0, 1 << 20),
        p in figure(0, 1 << 20),
        f in prop::option::of(figure(0, 1 << 20)),
    ) {
        let max = Window(u64::MAX);
        let Ok(k) = WindowContract::new(Window(c), max, Frames(1024)) else {
            prop_assert!(c < 4);
            return Ok(());
        };
        let cap = f.map_or(FrameCap::Default, |f| FrameCap::Explicit(Frames(f)));
        let got = k.admit(PromptRows(p), cap);
        let (c, p) = (u128::from(c), u128::from(p));
        match f {
            Some(f) => {
                // P + F + 1 <= C, as the contract reads.
                let rows = p + u128::from(f) + 1;
                let ok = p >= 2 && f >= 1 && rows <= c;
                prop_assert_eq!(got.is_ok(), ok);
                if let Ok(a) = got {
                    prop_assert_eq!(a.frames, Frames(f));
                }
            }
            None => {
                let ok = p >= 2 && p + 2 <= c;
                prop_assert_eq!(got.is_ok(), ok);
                if let Ok(a) = got {
                    prop_assert_eq!(u128::from(a.frames.0), (c - p - 1).min(1024));
                }
            }
        }
    }

    #[test]
    fn pool_rows_are_conserved(
        capacity in 1u64..10_000,
        lanes in 1u64..8,
        ops in prop::collection::vec((prop::bool::ANY, 0u64..12_000), 0..64),
    ) {
        let pool = KvPool::new(Rows(capacity), Lanes(lanes)).unwrap();
        let mut held = Vec::new();
        for (take, rows) in ops {
            if take || held.is_empty() {
                match pool.reserve(Rows(rows)) {
                    Ok(r) => held.push(r),
                    Err(e) => {
                        let code = e.code();
                        if rows == 0 {
                            prop_assert_eq!(code, "pool_empty_reservation");
                        } else if rows > capacity {
                            prop_assert_eq!(code, "pool_too_small");
                        } else {
                            prop_assert_eq!(code, "pool_busy");
                        }
                    }
                }
            } else {
                let i = usize::try_from(rows).unwrap() % held.len();
                held.swap_remove(i);
            }
            let used: u64 = held.iter().map(|r| r.rows().0).sum();
            let u = pool.usage();
            prop_assert_eq!(u.free.0 + used, capacity);
            prop_assert_eq!(u.lanes_free.0 + u64::try_from(held.len()).unwrap(), lanes);
        }
        drop(held);
        prop_assert_eq!(pool.usage().free, Rows(capacity));
    }
}

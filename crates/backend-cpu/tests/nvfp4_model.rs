//! The pruned NVFP4 checkpoint end to end on the tiny geometry: slots mapped back to original
//! expert IDs, packed weights on the mmap, deterministic generation, slot order irrelevant when
//! every expert is kept, and a loose agreement with the FP8 checkpoint of the same seed.

use backend_cpu::{Bytes, CpuBackend, CpuWeight, Format};
use checkpoint::fixture::{self, FixtureExperts, FixtureOptions, FixtureSummary};
use checkpoint::geometry::Geometry;
use checkpoint::manifest::{expected_tensors, tally};
use checkpoint::{Checkpoint, ExpertFormat, Store};
use model::{FrameOut, LaneState, LaneStep, Model, Row, SamplingParams, StepTrace};
use std::path::Path;

const PREFIX: &str = "model.language_model.layers";

fn golden_rows(name: &str) -> Vec<Row> {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny");
    let store = Store::open_file(&fixture.join("golden/golden.safetensors")).unwrap();
    let v = store.get(name).unwrap().to_i64();
    v.chunks_exact(11).map(|c| c.try_into().unwrap()).collect()
}

fn write(dir: &Path, seed: u64, experts: FixtureExperts) -> FixtureSummary {
    fixture::write(
        &FixtureOptions {
            geometry: Geometry::Tiny,
            seed,
            out: dir.to_path_buf(),
            experts,
            codec: None,
        },
        &|_, _| {},
    )
    .unwrap()
}

fn load(dir: &Path) -> (Checkpoint, Model<CpuBackend>) {
    let ck = Checkpoint::open(dir).unwrap();
    let m = Model::load(&ck, CpuBackend::new()).unwrap();
    (ck, m)
}

fn kept(s: &FixtureSummary) -> Vec<Vec<u32>> {
    match &s.expert_format {
        ExpertFormat::Nvfp4Pruned { kept } => kept.clone(),
        f => panic!("not NVFP4: {f:?}"),
    }
}

fn sampled() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 30,
        top_p: 0.9,
        ras: true,
    }
}

/// Prefills the golden prompt and runs up to `n` frames solo with traces.
fn run(
    m: &Model<CpuBackend>,
    params: &SamplingParams,
    n: u64,
    seed: u64,
) -> Vec<(FrameOut, StepTrace)> {
    let p = golden_rows("prompt_rows");
    let mut lane = m.new_lane(p.len() + n as usize + 1).unwrap();
    m.prefill(&mut lane, &p).unwrap();
    let mut out = Vec::new();
    for step in 0..n {
        let r = m.step_frame_traced(&mut lane, params, seed, step).unwrap();
        let eos = r.0 == FrameOut::Eos;
        out.push(r);
        if eos {
            break;
        }
    }
    out
}

/// The first seed whose `keep: 1.0` fixture keeps every expert in every layer (the writer's
/// per-layer jitter can drop one: see `keep_one_fixture_loads_and_runs`).
fn all_kept_seed() -> u64 {
    let ne = Geometry::Tiny.config().text_config.num_experts;
    (1..200u64)
        .find(|&s| {
            let f = fixture::resolve_experts(
                Geometry::Tiny,
                &FixtureExperts::Nvfp4Pruned { keep: 1.0 },
                s,
            )
            .unwrap();
            matches!(&f, ExpertFormat::Nvfp4Pruned { kept } if kept.iter().all(|k| k.len() == ne))
        })
        .expect("a seed keeping every expert")
}

/// An expert's three matrices dequantised to f32, `[gate ; up ; down]` flattened.
fn expert_f32(e: &model::Expert<CpuWeight>) -> Vec<f32> {
    let mut v = Vec::new();
    for w in [&e.gate, &e.up, &e.down] {
        let mut row = vec![0f32; w.cols];
        for r in 0..w.rows {
            w.row_f32(r, &mut row);
            v.extend_from_slice(&row);
        }
    }
    v
}

/// ‖a − b‖ / ‖b‖ in f64.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let (mut d, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        d += (f64::from(*x) - f64::from(*y)).powi(2);
        n += f64::from(*y).powi(2);
    }
    (d / n).sqrt()
}

#[test]
fn pruned_checkpoint_loads_maps_slots_and_generates_deterministically() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), 7, FixtureExperts::Nvfp4Pruned { keep: 0.6 });
    let kept = kept(&s);
    let (ck, m) = load(dir.path());
    let ne = ck.config.text_config.num_experts;
    let counts: Vec<usize> = kept.iter().map(Vec::len).collect();
    assert!(
        counts.iter().all(|&c| c < ne),
        "keep 0.6 prunes every layer: {counts:?}"
    );
    for (l, ids) in kept.iter().enumerate() {
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(m.expert_ids(l).unwrap(), sorted, "layer {l}");
        let mask = m.keep_mask(l).unwrap();
        assert_eq!(mask.iter().filter(|&&b| b).count(), ids.len());
        let experts = m.experts(l).unwrap();
        for (slot, &id) in ids.iter().enumerate() {
            assert!(mask[id as usize]);
            let e = experts[id as usize].as_ref().unwrap();
            // Slot `slot`'s tensors, read in place: same bytes, on the mmap, never expanded.
            let name = format!("{PREFIX}.{l}.mlp.experts.{slot}.down_proj.weight");
            let stored = ck.tensor(&name).unwrap();
            assert_eq!(e.down.bytes.get(), stored.bytes, "{name}");
            assert_eq!(e.down.bytes.get().as_ptr(), stored.bytes.as_ptr(), "{name}");
            for w in [&e.gate, &e.up, &e.down] {
                assert!(matches!(w.bytes, Bytes::Mapped { .. }));
                assert!(matches!(
                    w.format,
                    Format::Nvfp4 {
                        scale: Bytes::Mapped { .. },
                        ..
                    }
                ));
                assert_eq!(w.owned_bytes(), 0);
            }
        }
        for (id, e) in experts.iter().enumerate() {
            assert_eq!(e.is_some(), mask[id]);
        }
    }
    // Generation: a routed pruned expert would be an error in moe_experts, so running at all
    // shows none was chosen; the same seed gives the same frames and logits.
    let a = run(&m, &sampled(), 8, 3);
    let b = run(&m, &sampled(), 8, 3);
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.0, y.0);
        assert_eq!(x.1.main_logits, y.1.main_logits);
        assert_eq!(x.1.head_logits, y.1.head_logits);
    }
    let g1 = run(&m, &SamplingParams::greedy(), 6, 0);
    let g2 = run(&m, &SamplingParams::greedy(), 6, 0);
    assert_eq!(
        g1.iter().map(|x| x.0).collect::<Vec<_>>(),
        g2.iter().map(|x| x.0).collect::<Vec<_>>()
    );
    // A batched round equals the solo runs bit for bit.
    let p = golden_rows("prompt_rows");
    let prompts: [&[Row]; 2] = [&p, &p[..60]];
    let mut lanes: Vec<LaneState<CpuBackend>> = prompts
        .iter()
        .map(|r| {
            let mut l = m.new_lane(r.len() + 4).unwrap();
            m.prefill(&mut l, r).unwrap();
            l
        })
        .collect();
    let mut solo_lane = m.new_lane(60 + 4).unwrap();
    m.prefill(&mut solo_lane, &p[..60]).unwrap();
    for step in 0..3 {
        let mut refs: Vec<&mut LaneState<CpuBackend>> = lanes.iter_mut().collect();
        let steps: Vec<LaneStep> = [3u64, 5]
            .iter()
            .map(|&seed| LaneStep {
                params: sampled(),
                seed,
                step,
            })
            .collect();
        let mut tr = Vec::new();
        let outs = m
            .step_frames(&mut refs, &steps, None, Some(&mut tr))
            .unwrap();
        assert_eq!(outs[0], a[step as usize].0, "lane 0 step {step}");
        assert_eq!(tr[0].main_logits, a[step as usize].1.main_logits);
        let (o, t) = m
            .step_frame_traced(&mut solo_lane, &sampled(), 5, step)
            .unwrap();
        assert_eq!(outs[1], o, "lane 1 step {step}");
        assert_eq!(tr[1].main_logits, t.main_logits);
        if outs.contains(&FrameOut::Eos) {
            break;
        }
    }
}

#[test]
fn keep_one_fixture_loads_and_runs() {
    let dir = tempfile::tempdir().unwrap();
    let s = write(dir.path(), 7, FixtureExperts::Nvfp4Pruned { keep: 1.0 });
    let counts: Vec<usize> = kept(&s).iter().map(Vec::len).collect();
    // The writer keeps round(E · keep) ± E/16 per layer, clamped to E: keep 1.0 may drop one
    // expert in a layer (this seed's counts are printed for the report).
    println!("keep 1.0, seed 7: kept per layer {counts:?}");
    let (_, m) = load(dir.path());
    for (l, &c) in counts.iter().enumerate() {
        assert_eq!(m.expert_ids(l).unwrap().len(), c);
    }
    let a = run(&m, &sampled(), 4, 9);
    let b = run(&m, &sampled(), 4, 9);
    assert_eq!(
        a.iter().map(|x| x.0).collect::<Vec<_>>(),
        b.iter().map(|x| x.0).collect::<Vec<_>>()
    );
}

/// Copies an all-kept NVFP4 checkpoint (slot s = expert s) into `dst` with slot order `perm`
/// (`perm[l][t]` = original ID in new slot t): tensors renamed in the shard headers and the
/// index, `metadata.drama_experts` rewritten. With `relabel` false the tensors move but the
/// metadata keeps the identity (a checkpoint that lies about its slots: the control).
fn permute_slots(src: &Path, dst: &Path, perm: &[Vec<u32>], relabel: bool) {
    let rename = |name: &str| -> String {
        let parts: Vec<&str> = name.split('.').collect();
        if let [_, _, "layers", l, "mlp", "experts", j, ..] = parts.as_slice() {
            let (l, j): (usize, u32) = (l.parse().unwrap(), j.parse().unwrap());
            let t = perm[l].iter().position(|&x| x == j).unwrap();
            let mut p: Vec<String> = parts.iter().map(|s| s.to_string()).collect();
            p[6] = t.to_string();
            return p.join(".");
        }
        name.to_string()
    };
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let e = entry.unwrap();
        let name = e.file_name().into_string().unwrap();
        let bytes = std::fs::read(e.path()).unwrap();
        let out = if name.ends_with(".safetensors") {
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let h: serde_json::Map<String, serde_json::Value> =
                serde_json::from_slice(&bytes[8..8 + n]).unwrap();
            let h: serde_json::Map<String, serde_json::Value> =
                h.into_iter().map(|(k, v)| (rename(&k), v)).collect();
            let mut hb = serde_json::to_vec(&h).unwrap();
            while !hb.len().is_multiple_of(8) {
                hb.push(b' ');
            }
            let mut out = (hb.len() as u64).to_le_bytes().to_vec();
            out.extend_from_slice(&hb);
            out.extend_from_slice(&bytes[8 + n..]);
            out
        } else if name == "model.safetensors.index.json" {
            let mut idx: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            let wm = idx["weight_map"].as_object().unwrap().clone();
            idx["weight_map"] = wm.into_iter().map(|(k, v)| (rename(&k), v)).collect();
            if relabel {
                let de: serde_json::Map<String, serde_json::Value> = perm
                    .iter()
                    .enumerate()
                    .map(|(l, p)| (l.to_string(), serde_json::json!(p)))
                    .collect();
                idx["metadata"]["drama_experts"] = serde_json::to_string(&de).unwrap().into();
            }
            serde_json::to_vec_pretty(&idx).unwrap()
        } else {
            bytes
        };
        std::fs::write(dst.join(&name), out).unwrap();
    }
}

#[test]
fn all_kept_in_any_slot_order_equals_the_identity_order_bit_for_bit() {
    let seed = all_kept_seed();
    let root = tempfile::tempdir().unwrap();
    let (id_dir, perm_dir, lie_dir) = (
        root.path().join("identity"),
        root.path().join("permuted"),
        root.path().join("mislabelled"),
    );
    let s = write(&id_dir, seed, FixtureExperts::Nvfp4Pruned { keep: 1.0 });
    let ne = 16u32;
    for k in kept(&s) {
        assert_eq!(k, (0..ne).collect::<Vec<_>>());
    }
    // A different permutation per layer: t -> (a·t + b) mod 16 with odd a.
    let perm: Vec<Vec<u32>> = (0..4u32)
        .map(|l| {
            (0..ne)
                .map(|t| (t * (2 * l + 3) + 5 * l + 1) % ne)
                .collect()
        })
        .collect();
    permute_slots(&id_dir, &perm_dir, &perm, true);
    permute_slots(&id_dir, &lie_dir, &perm, false);
    let (_, a) = load(&id_dir);
    let (ck_b, b) = load(&perm_dir);
    assert!(matches!(&ck_b.expert_format, ExpertFormat::Nvfp4Pruned { kept } if *kept == perm));
    // Slot 0 of layer 0 now holds expert perm[0][0], which is not expert 0.
    assert_ne!(perm[0][0], 0);
    let p = golden_rows("prompt_rows");
    // Prefill path (Rows::Bulk), every layer.
    let ta = a.backbone_teacher_forced(&p).unwrap();
    let tb = b.backbone_teacher_forced(&p).unwrap();
    assert_eq!(ta.layer_outputs, tb.layer_outputs);
    assert_eq!(ta.candidate_logits, tb.candidate_logits);
    assert_eq!(ta.full_logits, tb.full_logits);
    // Decode path (Rows::Exact), sampled frames with their logits.
    let ga = run(&a, &sampled(), 8, 4);
    let gb = run(&b, &sampled(), 8, 4);
    assert_eq!(ga.len(), gb.len());
    for (x, y) in ga.iter().zip(&gb) {
        assert_eq!(x.0, y.0);
        assert_eq!(x.1.main_logits, y.1.main_logits);
        assert_eq!(x.1.head_logits, y.1.head_logits);
    }
    // Control: the same moved tensors read as if slot = ID give other logits, so the equality
    // above depends on the slot -> ID mapping.
    let (_, c) = load(&lie_dir);
    let tc = c.backbone_teacher_forced(&p).unwrap();
    assert_ne!(ta.candidate_logits, tc.candidate_logits);
}

#[test]
fn nvfp4_agrees_loosely_with_fp8_of_the_same_seed() {
    let seed = all_kept_seed();
    let root = tempfile::tempdir().unwrap();
    let (d8, d4, dp) = (
        root.path().join("fp8"),
        root.path().join("nvfp4"),
        root.path().join("pruned"),
    );
    write(&d8, seed, FixtureExperts::Fp8);
    write(&d4, seed, FixtureExperts::Nvfp4Pruned { keep: 1.0 });
    let sp = write(&dp, seed, FixtureExperts::Nvfp4Pruned { keep: 0.6 });
    let (_, m8) = load(&d8);
    let (_, m4) = load(&d4);
    let (_, mp) = load(&dp);
    // Weights: each NVFP4 expert against the FP8 expert of its original ID, and (control)
    // against a different one. In the pruned checkpoint the same holds through the slot map.
    let (mut own, mut other) = (0f64, f64::INFINITY);
    for l in 0..4 {
        let e8 = m8.experts(l).unwrap();
        let e4 = m4.experts(l).unwrap();
        let ep = mp.experts(l).unwrap();
        for id in 0..16 {
            let w8 = expert_f32(e8[id].as_ref().unwrap());
            let w4 = expert_f32(e4[id].as_ref().unwrap());
            own = own.max(rel_l2(&w4, &w8));
            other = other.min(rel_l2(
                &w4,
                &expert_f32(e8[(id + 1) % 16].as_ref().unwrap()),
            ));
            if let Some(e) = &ep[id] {
                assert_eq!(
                    expert_f32(e),
                    w4,
                    "layer {l} expert {id}: pruned slot vs full"
                );
            }
        }
        assert_eq!(
            ep.iter().filter(|e| e.is_some()).count(),
            kept(&sp)[l].len()
        );
    }
    println!("expert weights, relative L2 NVFP4 vs FP8: worst own {own:.4}, best other {other:.4}");
    // E2M1 has 3 magnitude bits: ~0.1 relative RMS on Gaussian weights; unrelated experts ~1.4.
    assert!(own < 0.2 && other > 1.0, "own {own}, other {other}");

    // Logits over the golden prompt (teacher-forced) and greedy frames.
    let p = golden_rows("prompt_rows");
    let t8 = m8.backbone_teacher_forced(&p).unwrap();
    let t4 = m4.backbone_teacher_forced(&p).unwrap();
    let cand = rel_l2(&t4.candidate_logits, &t8.candidate_logits);
    let hid = rel_l2(&t4.final_hidden, &t8.final_hidden);
    let c = m8.candidates().len();
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0
    };
    let same_top = t8
        .candidate_logits
        .chunks_exact(c)
        .zip(t4.candidate_logits.chunks_exact(c))
        .filter(|(a, b)| argmax(a) == argmax(b))
        .count();
    let rows = p.len();
    let g8: Vec<FrameOut> = run(&m8, &SamplingParams::greedy(), 8, 0)
        .into_iter()
        .map(|x| x.0)
        .collect();
    let g4: Vec<FrameOut> = run(&m4, &SamplingParams::greedy(), 8, 0)
        .into_iter()
        .map(|x| x.0)
        .collect();
    let same_frames = g8.iter().zip(&g4).filter(|(a, b)| a == b).count();
    println!(
        "NVFP4 vs FP8 (seed {seed}, tiny): final hidden rel L2 {hid:.4}, candidate logits rel L2 \
         {cand:.4}, same argmax on {same_top}/{rows} positions, greedy frames equal {same_frames}/{}",
        g8.len()
    );
    // Control for the bound below: an FP8 model of another seed (unrelated weights) is far
    // outside it, so the bound separates "same model, coarser experts" from "another model".
    let du = root.path().join("fp8-other-seed");
    write(&du, seed + 1000, FixtureExperts::Fp8);
    let (_, mu) = load(&du);
    let tu = mu.backbone_teacher_forced(&p).unwrap();
    let (cand_u, hid_u) = (
        rel_l2(&tu.candidate_logits, &t8.candidate_logits),
        rel_l2(&tu.final_hidden, &t8.final_hidden),
    );
    println!(
        "control, FP8 of seed {}: hidden rel L2 {hid_u:.4}, logits {cand_u:.4}",
        seed + 1000
    );
    // Loose, stated bounds only: they differ (a different quantisation really ran), by less
    // than half of an unrelated model's distance. The figure itself is the evidence; the tiny
    // random model amplifies the ~0.1 expert weight error through four layers.
    assert!(cand > 0.0 && hid > 0.0);
    assert!(cand_u > 1.0 && hid_u > 1.0, "control {hid_u} {cand_u}");
    assert!(cand < 0.5 && hid < 0.5, "hidden {hid}, logits {cand}");
}

#[test]
fn packed_sizes_per_expert_tiny_and_drama3() {
    let seed = all_kept_seed();
    let root = tempfile::tempdir().unwrap();
    let (d8, d4) = (root.path().join("fp8"), root.path().join("nvfp4"));
    write(&d8, seed, FixtureExperts::Fp8);
    write(&d4, seed, FixtureExperts::Nvfp4Pruned { keep: 1.0 });
    let (_, m8) = load(&d8);
    let (_, m4) = load(&d4);
    let size = |e: &model::Expert<CpuWeight>| -> (usize, usize) {
        let w = [&e.gate, &e.up, &e.down];
        (
            w.iter().map(|w| w.stored_bytes()).sum(),
            w.iter().map(|w| w.owned_bytes()).sum(),
        )
    };
    let (b8, o8) = size(m8.experts(0).unwrap()[0].as_ref().unwrap());
    let (b4, o4) = size(m4.experts(0).unwrap()[0].as_ref().unwrap());
    // Tiny: hidden 128, expert width 256: three 32768-value matrices.
    let values = 3 * 128 * 256;
    assert_eq!(b4, values / 2 + values / 16 + 3 * 4);
    assert_eq!(b8, values + 3 * 2 * 4);
    assert_eq!(o4, 0, "NVFP4 codes and scales stay on the mmap");
    println!(
        "tiny, bytes per expert: NVFP4 {b4} (resident copies {o4}), FP8 {b8} (resident copies \
         {o8}); ratio {:.4}",
        b4 as f64 / b8 as f64
    );
    // Drama 3 geometry from the manifest (no files): bytes per expert and for the checkpoint.
    let cfg = Geometry::Drama3.config();
    let t = &cfg.text_config;
    let (ne, layers) = (t.num_experts, t.num_hidden_layers);
    let full = ExpertFormat::Nvfp4Pruned {
        kept: vec![(0..ne as u32).collect(); layers],
    };
    for (what, fmt) in [("FP8", ExpertFormat::Fp8Block128), ("NVFP4", full)] {
        let tl = tally(&expected_tensors(&cfg, &fmt).unwrap());
        let bytes = tl.bytes_by_class["experts"] + tl.bytes_by_class["expert_scales"];
        println!(
            "drama3 {what}: {} bytes per expert, {bytes} bytes for all {} experts",
            bytes / (ne * layers) as u64,
            ne * layers
        );
    }
}

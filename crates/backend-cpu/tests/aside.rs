//! The model's side-branch path (`Backend::aside_begin`: the MoE's shared expert beside its
//! router and routed experts) gives the frames, hiddens and logits of the in-order path bit
//! for bit, for one lane and a batched round. Its own test binary: the hook is process-wide.

use backend_cpu::{CpuBackend, ASIDES_OPENED, ASIDE_FOR_TESTS};
use checkpoint::{Checkpoint, Store};
use model::{FrameOut, LaneState, LaneStep, Model, Row, SamplingParams, StepTrace};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

fn prompt() -> Vec<Row> {
    let store = Store::open_file(&fixture().join("golden/golden.safetensors")).unwrap();
    let v = store.get("prompt_rows").unwrap().to_i64();
    v.chunks_exact(11).map(|c| c.try_into().unwrap()).collect()
}

/// Frames and traces of three lanes (prompts of 40, 60 and all rows) over `steps` rounds:
/// the first lane alone, then all three batched.
fn run(m: &Model<CpuBackend>, steps: u64) -> Vec<(Vec<FrameOut>, Vec<StepTrace>)> {
    let p = prompt();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 30,
        top_p: 0.9,
        ras: true,
    };
    let prompts: [&[Row]; 3] = [&p[..40], &p[..60], &p];
    let mut lanes: Vec<LaneState<CpuBackend>> = prompts
        .iter()
        .map(|r| {
            let mut l = m.new_lane(r.len() + 2 * steps as usize + 1).unwrap();
            m.prefill(&mut l, r).unwrap();
            l
        })
        .collect();
    let mut got = vec![(Vec::new(), Vec::new()); 4];
    for step in 0..steps {
        let (f, t) = m
            .step_frame_traced(&mut lanes[0], &params, 5, step)
            .unwrap();
        got[0].0.push(f);
        got[0].1.push(t);
    }
    let mut refs: Vec<&mut LaneState<CpuBackend>> = lanes.iter_mut().collect();
    for step in 0..steps {
        let settings: Vec<LaneStep> = (0..3)
            .map(|i| LaneStep {
                params,
                seed: 7 + i as u64,
                step,
            })
            .collect();
        let mut tr = Vec::new();
        let outs = m
            .step_frames(&mut refs, &settings, None, Some(&mut tr))
            .unwrap();
        for (i, (o, t)) in outs.into_iter().zip(tr).enumerate() {
            got[1 + i].0.push(o);
            got[1 + i].1.push(t);
        }
    }
    got
}

#[test]
fn side_branch_equals_in_order_bit_for_bit() {
    let ck = Checkpoint::open(&fixture()).unwrap();
    let m = Model::load(&ck, CpuBackend::new()).unwrap();
    ASIDE_FOR_TESTS.store(false, Ordering::Relaxed);
    let plain = run(&m, 4);
    assert_eq!(
        ASIDES_OPENED.load(Ordering::Relaxed),
        0,
        "no branch without the hook"
    );
    ASIDE_FOR_TESTS.store(true, Ordering::Relaxed);
    let branched = run(&m, 4);
    ASIDE_FOR_TESTS.store(false, Ordering::Relaxed);
    // per frame and lane set: a MoE, a query/key and (in the tower) a gate/value branch a layer
    let opened = ASIDES_OPENED.load(Ordering::Relaxed);
    assert!(opened >= 8 * 3, "{opened} side branches opened");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (lane, (a, b)) in plain.iter().zip(&branched).enumerate() {
        assert_eq!(a.0, b.0, "lane {lane}: frames");
        assert_eq!(a.1.len(), b.1.len());
        for (s, (ta, tb)) in a.1.iter().zip(&b.1).enumerate() {
            assert!(!ta.hidden.is_empty(), "lane {lane} step {s}: traced");
            assert_eq!(
                bits(&ta.hidden),
                bits(&tb.hidden),
                "lane {lane} step {s}: hidden"
            );
            assert_eq!(
                bits(&ta.main_logits),
                bits(&tb.main_logits),
                "lane {lane} step {s}: main logits"
            );
            for (r, (ha, hb)) in ta.head_logits.iter().zip(&tb.head_logits).enumerate() {
                assert_eq!(bits(ha), bits(hb), "lane {lane} step {s}: head {r}");
            }
        }
    }
}

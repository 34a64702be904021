//! The frame loop on the tiny fixture: seeds, batching, capacity, split prefill and the
//! `mtp_shared_pre` placement.

use backend_cpu::CpuBackend;
use checkpoint::{Checkpoint, Store};
use model::{
    Backend, FrameOut, LaneState, LaneStep, Model, ModelError, Row, SamplingParams, StepTrace,
};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

fn golden_rows(name: &str) -> Vec<Row> {
    let store = Store::open_file(&fixture().join("golden/golden.safetensors")).unwrap();
    let v = store.get(name).unwrap().to_i64();
    v.chunks_exact(11).map(|c| c.try_into().unwrap()).collect()
}

fn prompt() -> &'static [Row] {
    static P: OnceLock<Vec<Row>> = OnceLock::new();
    P.get_or_init(|| golden_rows("prompt_rows"))
}

fn model() -> &'static Model<CpuBackend> {
    static M: OnceLock<Model<CpuBackend>> = OnceLock::new();
    M.get_or_init(|| {
        let ck = Checkpoint::open(&fixture()).unwrap();
        Model::load(&ck, CpuBackend::new()).unwrap()
    })
}

fn sampled() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: 30,
        top_p: 0.9,
        ras: true,
    }
}

/// Prefills `rows` and runs up to `n` frames solo; stops at EOS.
fn run_solo(rows: &[Row], n: u64, seed: u64) -> (Vec<FrameOut>, Vec<StepTrace>) {
    let m = model();
    let mut lane = m.new_lane(rows.len() + n as usize + 1).unwrap();
    m.prefill(&mut lane, rows).unwrap();
    let (mut out, mut tr) = (Vec::new(), Vec::new());
    for step in 0..n {
        let (f, t) = m
            .step_frame_traced(&mut lane, &sampled(), seed, step)
            .unwrap();
        out.push(f);
        tr.push(t);
        if f == FrameOut::Eos {
            break;
        }
    }
    (out, tr)
}

#[test]
fn same_seed_same_frames_other_seed_other_frames() {
    let (a, _) = run_solo(prompt(), 8, 11);
    let (b, _) = run_solo(prompt(), 8, 11);
    let (c, _) = run_solo(prompt(), 8, 12);
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn batched_round_equals_solo_runs_bit_for_bit() {
    let m = model();
    let p = prompt();
    // Lane B's prompt ends inside the reference frames, so it differs in length and content.
    let prompts: [&[Row]; 3] = [p, &p[..60], &p[..40]];
    let seeds = [3u64, 4, 3];
    let steps = 6u64;
    let solo: Vec<_> = prompts
        .iter()
        .zip(seeds)
        .map(|(r, s)| run_solo(r, steps, s))
        .collect();
    let mut lanes: Vec<LaneState<CpuBackend>> = prompts
        .iter()
        .map(|r| {
            let mut l = m.new_lane(r.len() + steps as usize + 1).unwrap();
            m.prefill(&mut l, r).unwrap();
            l
        })
        .collect();
    let mut done = [false; 3];
    for step in 0..steps {
        let idx: Vec<usize> = (0..3).filter(|&i| !done[i]).collect();
        if idx.is_empty() {
            break;
        }
        let mut refs: Vec<&mut LaneState<CpuBackend>> = lanes
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| !done[*i])
            .map(|(_, l)| l)
            .collect();
        let settings: Vec<LaneStep> = idx
            .iter()
            .map(|&i| LaneStep {
                params: sampled(),
                seed: seeds[i],
                step,
            })
            .collect();
        let mut tr = Vec::new();
        let outs = m
            .step_frames(&mut refs, &settings, None, Some(&mut tr))
            .unwrap();
        for (j, &i) in idx.iter().enumerate() {
            let s = step as usize;
            assert_eq!(outs[j], solo[i].0[s], "lane {i} step {step}");
            assert_eq!(
                tr[j].main_logits, solo[i].1[s].main_logits,
                "lane {i} step {step}"
            );
            assert_eq!(tr[j].hidden, solo[i].1[s].hidden, "lane {i} step {step}");
            assert_eq!(
                tr[j].head_logits, solo[i].1[s].head_logits,
                "lane {i} step {step}"
            );
            if outs[j] == FrameOut::Eos {
                done[i] = true;
            }
        }
    }
}

/// Greedy frames and their traces from a prefilled lane.
fn frames_after(lane: &mut LaneState<CpuBackend>, n: u64) -> Vec<(FrameOut, StepTrace)> {
    let m = model();
    (0..n)
        .map(|step| {
            m.step_frame_traced(lane, &SamplingParams::greedy(), 5, step)
                .unwrap()
        })
        .collect()
}

#[test]
fn joined_prefill_equals_solo_prefills_bit_for_bit() {
    let m = model();
    let p = prompt();
    let most = m.backend.joined_rows();
    assert!(most >= 6, "the CPU joins prompts of up to {most} rows");
    // fresh lanes of 6, 5 and 1 rows (no tower position), and a lane continuing a 30-row
    // prefill (its last row and hidden feed the tower)
    let pieces: [(&[Row], &[Row]); 4] = [
        (&[], &p[..6]),
        (&[], &p[10..15]),
        (&[], &p[..1]),
        (&p[..30], &p[30..36]),
    ];
    let cap = 60;
    let mut solo = Vec::new();
    let mut joined = Vec::new();
    for (before, rows) in pieces {
        let mut a = m.new_lane(cap).unwrap();
        let mut b = m.new_lane(cap).unwrap();
        if !before.is_empty() {
            m.prefill(&mut a, before).unwrap();
            m.prefill(&mut b, before).unwrap();
        }
        m.prefill(&mut a, rows).unwrap();
        solo.push(a);
        joined.push(b);
    }
    let prompts: Vec<&[Row]> = pieces.iter().map(|(_, r)| *r).collect();
    let mut refs: Vec<&mut LaneState<CpuBackend>> = joined.iter_mut().collect();
    m.prefill_joined(&mut refs, &prompts).unwrap();
    for (i, (a, b)) in solo.iter_mut().zip(joined.iter_mut()).enumerate() {
        assert_eq!(a.rows(), b.rows(), "lane {i}");
        let (fa, fb) = (frames_after(a, 3), frames_after(b, 3));
        for (s, ((oa, ta), (ob, tb))) in fa.iter().zip(&fb).enumerate() {
            assert_eq!(oa, ob, "lane {i} step {s}");
            assert_eq!(ta.main_logits, tb.main_logits, "lane {i} step {s}");
            assert_eq!(ta.hidden, tb.hidden, "lane {i} step {s}");
            assert_eq!(ta.head_logits, tb.head_logits, "lane {i} step {s}");
        }
    }
}

#[test]
fn joined_prefill_checks_every_prompt_first_and_falls_back_over_its_limit() {
    let m = model();
    let p = prompt();
    let mut bad = p[..3].to_vec();
    bad[2][0] = 100_000;
    let mut lanes = [m.new_lane(40).unwrap(), m.new_lane(40).unwrap()];
    let mut refs: Vec<&mut LaneState<CpuBackend>> = lanes.iter_mut().collect();
    assert!(m.prefill_joined(&mut refs, &[&p[..4], &bad]).is_err());
    // nothing ran: both lanes are still empty
    assert_eq!((lanes[0].rows(), lanes[1].rows()), (0, 0));
    // a prompt over the backend's limit: each prompt is prefilled alone, with its own bits
    let long = &p[..m.backend.joined_rows() + 5];
    let mut refs: Vec<&mut LaneState<CpuBackend>> = lanes.iter_mut().collect();
    m.prefill_joined(&mut refs, &[&p[..4], long]).unwrap();
    let mut solo = m.new_lane(40).unwrap();
    m.prefill(&mut solo, long).unwrap();
    assert_eq!(lanes[1].rows(), solo.rows());
    let (fa, fb) = (frames_after(&mut lanes[1], 2), frames_after(&mut solo, 2));
    assert_eq!(
        fa.iter().map(|f| &f.1.main_logits).collect::<Vec<_>>(),
        fb.iter().map(|f| &f.1.main_logits).collect::<Vec<_>>()
    );
}

#[test]
fn split_prefill_gives_the_golden_greedy_frames() {
    let m = model();
    let p = prompt();
    let want = golden_rows("gen_frames");
    let mut lane = m.new_lane(p.len() + want.len() + 1).unwrap();
    // 70 rows cross the 64-row GDN chunk; the tower picks up row 69's label from the next call.
    m.prefill(&mut lane, &p[..70]).unwrap();
    m.prefill(&mut lane, &p[70..]).unwrap();
    let mut got = Vec::new();
    for step in 0..want.len() as u64 {
        match m
            .step_frame(&mut lane, &SamplingParams::greedy(), 0, step)
            .unwrap()
        {
            FrameOut::Frame(f) => got.push(f),
            FrameOut::Eos => panic!("EOS at {step}"),
        }
    }
    assert_eq!(got, want);
}

#[test]
fn capacity_is_refused_with_figures() {
    let m = model();
    let p = prompt();
    let mut small = m.new_lane(50).unwrap();
    let e = m.prefill(&mut small, p).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::Capacity {
                rows: 0,
                add: 99,
                capacity: 50
            }
        ),
        "{e}"
    );
    let mut exact = m.new_lane(p.len()).unwrap();
    m.prefill(&mut exact, p).unwrap();
    let e = m.step_frame(&mut exact, &sampled(), 0, 0).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("99") && msg.contains("capacity"), "{msg}");
    assert!(matches!(
        m.new_lane(262_145),
        Err(ModelError::LaneSize {
            requested: 262_145,
            max: 262_144
        })
    ));
    let mut fresh = m.new_lane(10).unwrap();
    assert!(matches!(
        m.step_frame(&mut fresh, &sampled(), 0, 0),
        Err(ModelError::NotPrefilled)
    ));
}

#[test]
fn bad_rows_are_refused() {
    let m = model();
    let mut lane = m.new_lane(4).unwrap();
    let mut r = [0i64; 11];
    r[0] = 100_000;
    assert!(matches!(
        m.prefill(&mut lane, &[r]),
        Err(ModelError::BadRow { index: 0, .. })
    ));
    // A semantic row whose c0 disagrees with its token.
    let mut s = prompt()[53];
    s[1] = (s[1] + 1) % 64;
    assert!(matches!(
        m.prefill(&mut lane, &[s]),
        Err(ModelError::BadRow { .. })
    ));
}

/// The same checkpoint declared `mtp_shared_pre`: semantic rows enter the backbone as E[tok]
/// alone and all nine residual codes go to tower layer 0.
#[test]
fn mtp_shared_pre_placement() {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture()).unwrap() {
        let e = entry.unwrap();
        if e.file_name() != "config.json" && e.file_type().unwrap().is_file() {
            std::os::unix::fs::symlink(e.path(), dir.path().join(e.file_name())).unwrap();
        }
    }
    let cfg = std::fs::read_to_string(fixture().join("config.json")).unwrap();
    let cfg = cfg
        .replace("\"backbone_partial\"", "\"mtp_shared_pre\"")
        .replace(
            "\"vq_backbone_codebooks\": 2",
            "\"vq_backbone_codebooks\": 0",
        );
    std::fs::write(dir.path().join("config.json"), cfg).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let pre = Model::load(&ck, CpuBackend::new()).unwrap();
    assert_eq!(pre.geometry.backbone_codebooks, 0);
    let p = prompt();
    let sem = p[53];
    let emb = pre
        .backend
        .download(&pre.embed_rows(&[sem]).unwrap())
        .unwrap();
    let table = ck
        .tensor("model.language_model.embed_tokens.weight")
        .unwrap()
        .to_f32();
    let tok = sem[0] as usize;
    assert_eq!(emb, table[tok * 128..(tok + 1) * 128]);
    // Text-only rows: both placements agree; with frames they differ.
    let text = &p[..40];
    let a = model().backbone_teacher_forced(text).unwrap();
    let b = pre.backbone_teacher_forced(text).unwrap();
    assert_eq!(a.final_hidden, b.final_hidden);
    let a = model().backbone_teacher_forced(p).unwrap();
    let b = pre.backbone_teacher_forced(p).unwrap();
    assert_ne!(a.final_hidden, b.final_hidden);
    // The tower reads codes 1..=9 of semantic input rows at layer 0 (vs 3..=9 before).
    let ta = model().tower_teacher_forced(p, &a.final_hidden).unwrap();
    let tb = pre.tower_teacher_forced(p, &a.final_hidden).unwrap();
    let d = 128;
    // Position 60 has a semantic input row; position 10 a text one.
    assert_ne!(
        ta.layer_outputs[0][60 * d..61 * d],
        tb.layer_outputs[0][60 * d..61 * d]
    );
    assert_eq!(
        ta.layer_outputs[0][10 * d..11 * d],
        tb.layer_outputs[0][10 * d..11 * d]
    );
    // And it generates.
    let mut lane = pre.new_lane(p.len() + 3).unwrap();
    pre.prefill(&mut lane, p).unwrap();
    pre.step_frame(&mut lane, &sampled(), 1, 0).unwrap();
}

/// The round kept on the backend (draws by the backend's round ops, embeddings from the
/// round's frames, lengths and positions from its counters) gives each lane the frames of the
/// host-drawn round bit for bit, including EOS, over lanes of different prompts and settings;
/// the lane counters and caches end where the host round leaves them.
#[test]
fn kept_round_equals_host_round_bit_for_bit() {
    let m = model();
    let p = prompt();
    let prompts: [&[Row]; 3] = [p, &p[..60], &p[..40]];
    let params = [
        sampled(),
        // nearly uniform over the candidates: EOS comes within a few dozen frames
        SamplingParams {
            temperature: 50.0,
            top_k: 0,
            top_p: 1.0,
            ras: true,
        },
        SamplingParams::greedy(),
    ];
    let steps_n = 40u64;
    let mk = || -> Vec<LaneState<CpuBackend>> {
        prompts
            .iter()
            .map(|r| {
                let mut l = m.new_lane(r.len() + steps_n as usize + 1).unwrap();
                m.prefill(&mut l, r).unwrap();
                l
            })
            .collect()
    };
    let (mut host, mut kept) = (mk(), mk());
    let mut live: Vec<usize> = (0..3).collect();
    let (mut frames_seen, mut eos_seen) = (0, 0);
    for step in 0..steps_n {
        if live.is_empty() {
            break;
        }
        let steps: Vec<LaneStep> = live
            .iter()
            .map(|&i| LaneStep {
                params: params[i],
                seed: 40 + i as u64,
                step,
            })
            .collect();
        let a = {
            let mut ls: Vec<&mut LaneState<CpuBackend>> = host
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| live.contains(i))
                .map(|(_, l)| l)
                .collect();
            m.step_frames(&mut ls, &steps, None, None).unwrap()
        };
        let b = {
            let mut ls: Vec<&mut LaneState<CpuBackend>> = kept
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| live.contains(i))
                .map(|(_, l)| l)
                .collect();
            m.step_frames_kept(&mut ls, &steps).unwrap()
        };
        assert_eq!(a, b, "step {step}");
        frames_seen += a.iter().filter(|f| matches!(f, FrameOut::Frame(_))).count();
        let mut next = Vec::new();
        for (j, &i) in live.iter().enumerate() {
            if a[j] == FrameOut::Eos {
                // the kept lane is spent and refuses another round
                eos_seen += 1;
                let mut one = [&mut kept[i]];
                let s = [steps[j]];
                assert!(m.step_frames_kept(&mut one, &s).is_err());
            } else {
                assert_eq!(host[i].rows(), kept[i].rows());
                next.push(i);
            }
        }
        live = next;
    }
    assert!(frames_seen >= 40, "only {frames_seen} frames drawn");
    assert!(eos_seen >= 1, "no lane drew EOS");
    // The caches hold the same rows: one more host round on each live lane still agrees.
    for &i in &live {
        let s = [LaneStep {
            params: params[i],
            seed: 9,
            step: 99,
        }];
        let a = m.step_frames(&mut [&mut host[i]], &s, None, None).unwrap();
        let b = m.step_frames(&mut [&mut kept[i]], &s, None, None).unwrap();
        assert_eq!(a, b, "lane {i} after the kept rounds");
    }
}

/// Ghost slots (`Model::retire`): a finished lane keeps its slot while ghosts are no more than
/// the lanes left, so no new lane set is built; the round is dropped once ghosts would
/// outnumber them; a lane that is not one round past its slot is not taken; the lane that is
/// left draws what it draws solo on the host path.
#[test]
fn retired_lanes_keep_their_slots_until_they_outnumber_the_rest() {
    // its own model: the round statistics and the kept round are per model
    let ck = Checkpoint::open(&fixture()).unwrap();
    let m = Model::load(&ck, CpuBackend::new()).unwrap();
    let p = prompt();
    let prompts: [&[Row]; 4] = [p, &p[..80], &p[..60], &p[..40]];
    let greedy = SamplingParams::greedy();
    let cap = 16usize;
    let mk = |r: &[Row]| {
        let mut l = m.new_lane(r.len() + cap).unwrap();
        m.prefill(&mut l, r).unwrap();
        l
    };
    // lane 0 alone on the host path: the reference for its frames
    let mut solo = mk(prompts[0]);
    let want: Vec<FrameOut> = (0..6)
        .map(|t| m.step_frame(&mut solo, &greedy, 9, t).unwrap())
        .collect();
    let mut lanes: Vec<Option<LaneState<CpuBackend>>> =
        prompts.iter().map(|r| Some(mk(r))).collect();
    let sets = |m: &Model<CpuBackend>| m.round_stats().counts().set_changes;
    let mut got = Vec::new();
    let mut built = Vec::new();
    for t in 0..6u64 {
        // rounds 0-2: four lanes; then lanes 3, 2 and 1 finish one after another
        if t >= 3 {
            let leaving = 6 - t as usize;
            let l = lanes[leaving].take().unwrap();
            m.retire(l);
        }
        let live: Vec<usize> = (0..4).filter(|&i| lanes[i].is_some()).collect();
        let steps = vec![
            LaneStep {
                params: greedy,
                seed: 9,
                step: t,
            };
            live.len()
        ];
        let mut ls: Vec<&mut LaneState<CpuBackend>> = lanes.iter_mut().flatten().collect();
        let out = m.step_frames_kept(&mut ls, &steps).unwrap();
        assert!(
            out.iter().all(|f| matches!(f, FrameOut::Frame(_))),
            "EOS at round {t}"
        );
        got.push(out[0]);
        built.push(sets(&m));
    }
    assert_eq!(got, want, "lane 0 beside ghosts = lane 0 alone");
    // one set for four lanes, kept with 1 ghost (3 left) and 2 ghosts (2 left); the third
    // ghost outnumbers the one lane left: the round is dropped and a new set built
    assert_eq!(
        built,
        [1, 1, 1, 1, 1, 2],
        "lane sets built after each round"
    );
    // a lane that is not one round past its slot's inputs is not taken as a ghost: lane 0
    // stepped once more on the host path no longer matches its slot, so the set is rebuilt
    let mut l0 = lanes[0].take().unwrap();
    let mut extra = mk(prompts[1]);
    let s = [LaneStep {
        params: greedy,
        seed: 9,
        step: 6,
    }; 2];
    m.step_frames_kept(&mut [&mut l0, &mut extra], &s).unwrap();
    let before = sets(&m);
    m.step_frames_host(&mut [&mut l0], &s[..1], None, None, None)
        .unwrap();
    m.retire(l0);
    m.step_frames_kept(&mut [&mut extra], &s[..1]).unwrap();
    assert_eq!(sets(&m), before + 1, "a stale lane kept its slot");
}

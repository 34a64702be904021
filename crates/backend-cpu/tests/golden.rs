//! The vendored tiny fixture's goldens (testdata/drama3-tiny/README.md) on the CPU backend:
//! hidden states and logits within atol 1e-3 + rtol 1e-3, greedy frames exactly equal.

use backend_cpu::CpuBackend;
use checkpoint::{Checkpoint, Store};
use model::{FrameOut, Model, Row, SamplingParams};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

struct Golden {
    store: Store,
}

impl Golden {
    fn f32(&self, name: &str) -> Vec<f32> {
        self.store.get(name).unwrap().to_f32()
    }
    fn rows(&self, name: &str) -> Vec<Row> {
        let v = self.store.get(name).unwrap().to_i64();
        v.chunks_exact(11).map(|c| c.try_into().unwrap()).collect()
    }
}

fn golden() -> &'static Golden {
    static G: OnceLock<Golden> = OnceLock::new();
    G.get_or_init(|| {
        let store = Store::open_file(&fixture().join("golden/golden.safetensors")).unwrap();
        Golden { store }
    })
}

fn model() -> &'static Model<CpuBackend> {
    static M: OnceLock<(Checkpoint, Model<CpuBackend>)> = OnceLock::new();
    &M.get_or_init(|| {
        let ck = Checkpoint::open(&fixture()).unwrap();
        let m = Model::load(&ck, CpuBackend::new()).unwrap();
        (ck, m)
    })
    .1
}

/// max |a-b| and whether every element is within atol + rtol·|want|.
fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (mut worst, mut at) = (0f32, 0usize);
    let mut ok = true;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        // NaN fails too.
        let within = d <= 1e-3 + 1e-3 * w.abs();
        if !within {
            ok = false;
        }
        if d > worst || d.is_nan() {
            worst = d;
            at = i;
        }
    }
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    eprintln!(
        "{what}: max |diff| {worst:.3e} at {at} (want {:.4}, max |want| {scale:.3})",
        want[at]
    );
    assert!(
        ok,
        "{what}: max |diff| {worst} at {at} (got {}, want {})",
        got[at], want[at]
    );
}

#[test]
fn prompt_backbone_goldens() {
    let g = golden();
    let m = model();
    let rows = g.rows("prompt_rows");
    let t = m.backbone_teacher_forced(&rows).unwrap();
    close(
        "prompt_input_embeds",
        &t.input_embeds,
        &g.f32("prompt_input_embeds"),
    );
    let want = g.f32("prompt_layer_outputs");
    let per = want.len() / t.layer_outputs.len();
    for (l, got) in t.layer_outputs.iter().enumerate() {
        close(
            &format!("prompt_layer_outputs[{l}]"),
            got,
            &want[l * per..(l + 1) * per],
        );
    }
    close(
        "prompt_final_hidden",
        &t.final_hidden,
        &g.f32("prompt_final_hidden"),
    );
    close(
        "prompt_full_logits",
        &t.full_logits,
        &g.f32("prompt_full_logits"),
    );
    close(
        "prompt_semantic_logits",
        &t.candidate_logits,
        &g.f32("prompt_semantic_logits"),
    );
    let cand: Vec<u32> = g
        .store
        .get("candidate_token_ids")
        .unwrap()
        .to_i64()
        .iter()
        .map(|&v| v as u32)
        .collect();
    assert_eq!(m.candidates(), cand.as_slice());
}

#[test]
fn teacher_forced_backbone_and_tower_goldens() {
    let g = golden();
    let m = model();
    let rows = g.rows("tf_sequence");
    let t = m.backbone_teacher_forced(&rows).unwrap();
    close(
        "tf_final_hidden",
        &t.final_hidden,
        &g.f32("tf_final_hidden"),
    );
    close(
        "tf_semantic_logits",
        &t.candidate_logits,
        &g.f32("tf_semantic_logits"),
    );
    // Feed the golden hidden so the tower is checked on its own.
    let tower = m
        .tower_teacher_forced(&rows, &g.f32("tf_final_hidden"))
        .unwrap();
    close(
        "tf_shared_out",
        &tower.layer_outputs[3],
        &g.f32("tf_shared_out"),
    );
    close(
        "tf_tower_layer_outputs",
        &tower.layer_outputs.concat(),
        &g.f32("tf_tower_layer_outputs"),
    );
    close(
        "tf_codebook_logits",
        &tower.codebook_logits,
        &g.f32("tf_codebook_logits"),
    );
}

#[test]
fn greedy_generation_matches_golden_frames() {
    let g = golden();
    let m = model();
    let prompt = g.rows("prompt_rows");
    let want = g.rows("gen_frames");
    let mut lane = m.new_lane(prompt.len() + want.len() + 1).unwrap();
    m.prefill(&mut lane, &prompt).unwrap();
    let (mut frames, mut hidden, mut sem, mut heads) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for step in 0..want.len() as u64 {
        let (out, tr) = m
            .step_frame_traced(&mut lane, &SamplingParams::greedy(), 0, step)
            .unwrap();
        match out {
            FrameOut::Frame(f) => frames.push(f),
            FrameOut::Eos => panic!("EOS at step {step}"),
        }
        hidden.extend(tr.hidden);
        sem.extend(tr.main_logits);
        heads.extend(tr.head_logits.concat());
    }
    close("gen_hidden", &hidden, &g.f32("gen_hidden"));
    close("gen_semantic_logits", &sem, &g.f32("gen_semantic_logits"));
    close("gen_codebook_logits", &heads, &g.f32("gen_codebook_logits"));
    assert_eq!(frames, want, "greedy frames differ from the golden");
}

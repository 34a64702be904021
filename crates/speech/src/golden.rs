//! `dramatis golden DIR`: every golden case of a fixture folder laid out like
//! `testdata/drama3-tiny` (`golden/golden.safetensors`, `golden/golden_long.safetensors`,
//! `golden/meta.json`), each compared with its tolerance from the fixture README.

use std::path::Path;

use checkpoint::{Checkpoint, Store};
use codec::{Codec, Codes};
use model::{Backend, FrameOut, LaneStep, Model, Row, SamplingParams, ROW_WIDTH};

/// Hidden states and logits: |a − g| ≤ atol + rtol·|g|.
pub const ATOL: f64 = 1e-3;
pub const RTOL: f64 = 1e-3;
/// PCM against the f64 golden.
pub const PCM_ATOL: f64 = 1e-4;

pub struct GoldenReport {
    pub lines: Vec<String>,
    pub cases: usize,
    pub failures: usize,
}

impl GoldenReport {
    fn push(&mut self, name: &str, ok: bool, detail: String) {
        self.cases += 1;
        if !ok {
            self.failures += 1;
        }
        self.lines.push(format!(
            "{} {name:<28} {detail}",
            if ok { "PASS" } else { "FAIL" }
        ));
    }

    fn close(&mut self, name: &str, got: &[f32], want: &[f64], atol: f64, rtol: f64) {
        if got.len() != want.len() {
            self.push(
                name,
                false,
                format!("length {} but golden has {}", got.len(), want.len()),
            );
            return;
        }
        let (mut max_abs, mut max_rel, mut ok) = (0f64, 0f64, true);
        for (&g, &w) in got.iter().zip(want) {
            let d = (f64::from(g) - w).abs();
            if !d.is_finite() || d > atol + rtol * w.abs() {
                ok = false;
            }
            max_abs = max_abs.max(d);
            if w.abs() > 1e-6 {
                max_rel = max_rel.max(d / w.abs());
            }
        }
        self.push(
            name,
            ok,
            format!("max abs {max_abs:.3e}  max rel {max_rel:.3e}  (atol {atol:.0e}, rtol {rtol:.0e}, n {})", got.len()),
        );
    }

    fn exact(&mut self, name: &str, got: &[i64], want: &[i64]) {
        let diff =
            got.iter().zip(want).filter(|(a, b)| a != b).count() + got.len().abs_diff(want.len());
        self.push(
            name,
            diff == 0,
            format!(
                "{} of {} values differ (exact match required)",
                diff,
                want.len()
            ),
        );
    }
}

struct Goldens {
    short: Store,
    long: Option<Store>,
}

impl Goldens {
    fn f64(&self, name: &str) -> Option<Vec<f64>> {
        self.get(name).map(|v| v.to_f64())
    }
    fn i64(&self, name: &str) -> Option<Vec<i64>> {
        self.get(name).map(|v| v.to_i64())
    }
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.get(name).map(|v| v.shape().to_vec())
    }
    fn get(&self, name: &str) -> Option<checkpoint::TensorView<'_>> {
        self.short
            .get(name)
            .ok()
            .or_else(|| self.long.as_ref().and_then(|l| l.get(name).ok()))
    }
}

/// Columns of a `[rows, columns]` golden, or an error naming it.
fn width(shape: &[usize], name: &str) -> Result<usize, String> {
    match shape {
        [_, w] => Ok(*w),
        s => Err(format!(
            "golden {name} has shape {s:?}, expected [rows, columns]"
        )),
    }
}

fn rows_of(flat: &[i64], width: usize) -> Result<Vec<Row>, String> {
    if width != ROW_WIDTH {
        return Err(format!(
            "rows have {width} columns, the model expects {ROW_WIDTH}"
        ));
    }
    Ok(flat
        .chunks_exact(width)
        .map(|c| {
            let mut r = [0i64; ROW_WIDTH];
            r.copy_from_slice(c);
            r
        })
        .collect())
}

/// Codes `[codebooks, frames]` row-major as the goldens store them.
fn codes_of(flat: &[i64], shape: &[usize]) -> Result<Codes, String> {
    if shape.len() != 2 {
        return Err(format!("codes shape {shape:?} is not [codebooks, frames]"));
    }
    Codes::from_i64(shape[0], shape[1], flat).map_err(|e| e.to_string())
}

/// Runs every case on the CPU backend.
pub fn run(dir: &Path) -> Result<GoldenReport, String> {
    run_with(dir, backend_cpu::CpuBackend::new())
}

/// Runs every case with the model on `backend` (the codec runs on the CPU).
pub fn run_with<B: Backend>(dir: &Path, backend: B) -> Result<GoldenReport, String> {
    let gdir = dir.join("golden");
    let open = |p: &Path| Store::open_file(p).map_err(|e| e.to_string());
    let short = open(&gdir.join("golden.safetensors"))?;
    let long_path = gdir.join("golden_long.safetensors");
    let long = if long_path.exists() {
        Some(open(&long_path)?)
    } else {
        None
    };
    let g = Goldens { short, long };
    let mut r = GoldenReport {
        lines: Vec::new(),
        cases: 0,
        failures: 0,
    };
    let ck = Checkpoint::open(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    r.push(
        "manifest",
        ck.report.ok(),
        format!("{} tensors match the config", ck.report.expected),
    );
    let model = Model::load(&ck, backend).map_err(|e| e.to_string())?;
    backbone_cases(&mut r, &g, &model)?;
    generation_cases(&mut r, &g, &model)?;
    kept_round_cases(&mut r, &g, &model)?;
    prompt_case(&mut r, &g, dir, &ck)?;
    codec_cases(&mut r, &g, dir)?;
    Ok(r)
}

/// Runs every case with the model on the CUDA backend, then the GPU codec encoder's cases
/// (`codec_encode*` on codec-cuda; the other codec cases run on the CPU as in [`run_with`]).
#[cfg(feature = "cuda")]
pub fn run_cuda(dir: &Path, backend: backend_cuda::CudaBackend) -> Result<GoldenReport, String> {
    let mut r = run_with(dir, backend)?;
    gpu_encoder_cases(&mut r, dir)?;
    Ok(r)
}

/// The GPU encoder against the encode goldens: codes exactly, from one call and from one-frame
/// pushes.
#[cfg(feature = "cuda")]
fn gpu_encoder_cases(r: &mut GoldenReport, dir: &Path) -> Result<(), String> {
    let codec = Codec::load(dir, None).map_err(|e| e.to_string())?;
    let enc = codec_cuda::CudaEncoder::load(dir, &codec)
        .map_err(|e| format!("GPU codec encoder: {e}"))?;
    let wide = |c: &Codes| c.data().iter().map(|&v| i64::from(v)).collect::<Vec<_>>();
    for (case, pcm, want) in codec_cuda::fixture_encode_goldens(dir)? {
        let name = format!("{case} (GPU)");
        let got = enc.encode(&pcm).map_err(|e| e.to_string())?;
        r.exact(&name, &wide(&got), &wide(&want));
        let fl = enc.frame_length();
        let mut padded = pcm;
        padded.resize(got.frames() * fl, 0.0);
        let mut st = enc.state().map_err(|e| e.to_string())?;
        let mut same = true;
        for (f, frame) in padded.chunks(fl).enumerate() {
            let c = st.push(frame).map_err(|e| e.to_string())?;
            same &= (0..c.num_codebooks()).all(|q| c.get(q, 0) == got.get(q, f));
        }
        r.push(
            &format!("{name} streamed"),
            same,
            format!("{} one-frame pushes vs one call, codes equal", got.frames()),
        );
    }
    Ok(())
}

fn backbone_cases<B: Backend>(
    r: &mut GoldenReport,
    g: &Goldens,
    m: &Model<B>,
) -> Result<(), String> {
    let cands: Vec<i64> = m.candidates().iter().map(|&c| i64::from(c)).collect();
    match g.i64("candidate_token_ids") {
        Some(want) => r.exact("candidate_token_ids", &cands, &want),
        None => r.push("candidate_token_ids", false, "golden tensor missing".into()),
    }
    let Some(shape) = g.shape("prompt_rows") else {
        r.push("prompt_rows", false, "golden tensor missing".into());
        return Ok(());
    };
    let rows = rows_of(
        &g.i64("prompt_rows").unwrap_or_default(),
        width(&shape, "prompt_rows")?,
    )?;
    let tr = m
        .backbone_teacher_forced(&rows)
        .map_err(|e| e.to_string())?;
    let case = |r: &mut GoldenReport, name: &str, got: &[f32]| match g.f64(name) {
        Some(w) => r.close(name, got, &w, ATOL, RTOL),
        None => r.push(name, false, "golden tensor missing".into()),
    };
    case(r, "prompt_input_embeds", &tr.input_embeds);
    let layers: Vec<f32> = tr.layer_outputs.concat();
    case(r, "prompt_layer_outputs", &layers);
    case(r, "prompt_final_hidden", &tr.final_hidden);
    case(r, "prompt_full_logits", &tr.full_logits);
    case(r, "prompt_semantic_logits", &tr.candidate_logits);

    let Some(tshape) = g.shape("tf_sequence") else {
        r.push("tf_sequence", false, "golden tensor missing".into());
        return Ok(());
    };
    let tf = rows_of(
        &g.i64("tf_sequence").unwrap_or_default(),
        width(&tshape, "tf_sequence")?,
    )?;
    let tt = m.backbone_teacher_forced(&tf).map_err(|e| e.to_string())?;
    case(r, "tf_final_hidden", &tt.final_hidden);
    case(r, "tf_semantic_logits", &tt.candidate_logits);
    let tower = m
        .tower_teacher_forced(&tf, &tt.final_hidden)
        .map_err(|e| e.to_string())?;
    let shared = m.geometry.tower_shared;
    match tower.layer_outputs.get(shared.saturating_sub(1)) {
        Some(s) => case(r, "tf_shared_out", s),
        None => r.push(
            "tf_shared_out",
            false,
            "the tower has no shared layers".into(),
        ),
    }
    case(r, "tf_tower_layer_outputs", &tower.layer_outputs.concat());
    case(r, "tf_codebook_logits", &tower.codebook_logits);
    Ok(())
}

/// A generation golden: the prompt rows, the greedy frames flattened, and how many frames.
type GenerationGolden = (Vec<Row>, Vec<i64>, usize);

/// The greedy generation golden; `None` when a tensor is missing.
fn generation_golden(g: &Goldens) -> Result<Option<GenerationGolden>, String> {
    let (Some(pshape), Some(fshape)) = (g.shape("prompt_rows"), g.shape("gen_frames")) else {
        return Ok(None);
    };
    let rows = rows_of(
        &g.i64("prompt_rows").unwrap_or_default(),
        width(&pshape, "prompt_rows")?,
    )?;
    let want = g.i64("gen_frames").unwrap_or_default();
    let n = *fshape.first().ok_or("gen_frames has no dimensions")?;
    Ok(Some((rows, want, n)))
}

fn generation_cases<B: Backend>(
    r: &mut GoldenReport,
    g: &Goldens,
    m: &Model<B>,
) -> Result<(), String> {
    let Some((rows, want, n)) = generation_golden(g)? else {
        r.push("gen_frames", false, "golden tensor missing".into());
        return Ok(());
    };
    let mut lane = m.new_lane(rows.len() + n + 1).map_err(|e| e.to_string())?;
    m.prefill(&mut lane, &rows).map_err(|e| e.to_string())?;
    let (mut frames, mut hidden, mut sem, mut heads) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let params = SamplingParams::greedy();
    for step in 0..n {
        let (out, tr) = m
            .step_frame_traced(&mut lane, &params, 0, step as u64)
            .map_err(|e| e.to_string())?;
        hidden.extend_from_slice(&tr.hidden);
        sem.extend_from_slice(&tr.main_logits);
        for h in &tr.head_logits {
            heads.extend_from_slice(h);
        }
        match out {
            FrameOut::Frame(f) => frames.extend_from_slice(&f),
            FrameOut::Eos => break,
        }
    }
    r.exact("gen_frames (greedy, cached)", &frames, &want);
    for (name, got) in [
        ("gen_hidden", &hidden),
        ("gen_semantic_logits", &sem),
        ("gen_codebook_logits", &heads),
    ] {
        match g.f64(name) {
            Some(w) => r.close(name, got, &w, ATOL, RTOL),
            None => r.push(name, false, "golden tensor missing".into()),
        }
    }
    Ok(())
}

/// Frame rounds kept on the backend (draws there, the round recorded and replayed where the
/// backend records): greedy frames equal the golden's, and sampled rounds over three lanes equal
/// host-drawn rounds frame for frame while the lane set changes (a lane leaves after round 3, a
/// new lane joins after round 5), so recording, replay and re-keying all run.
fn kept_round_cases<B: Backend>(
    r: &mut GoldenReport,
    g: &Goldens,
    m: &Model<B>,
) -> Result<(), String> {
    let Some((rows, want, n)) = generation_golden(g)? else {
        r.push("kept rounds", false, "golden tensor missing".into());
        return Ok(());
    };
    let e = |e: model::ModelError| e.to_string();
    let mut lane = m.new_lane(rows.len() + n + 1).map_err(e)?;
    m.prefill(&mut lane, &rows).map_err(e)?;
    let mut frames = Vec::new();
    for step in 0..n {
        let s = [LaneStep {
            params: SamplingParams::greedy(),
            seed: 0,
            step: step as u64,
        }];
        match m.step_frames_kept(&mut [&mut lane], &s).map_err(e)?[0] {
            FrameOut::Frame(f) => frames.extend_from_slice(&f),
            FrameOut::Eos => break,
        }
    }
    r.exact("gen_frames (greedy, kept rounds)", &frames, &want);

    let prompts: [&[Row]; 4] = [
        &rows,
        &rows[..rows.len() * 2 / 3],
        &rows[..rows.len() / 2],
        &rows,
    ];
    let params = SamplingParams::default();
    let rounds = 10usize;
    let mk = |p: &[Row]| -> Result<model::LaneState<B>, String> {
        let mut l = m.new_lane(p.len() + rounds + 1).map_err(e)?;
        m.prefill(&mut l, p).map_err(e)?;
        Ok(l)
    };
    // which lanes step in round t: 0..3 first, lane 2 leaves after round `leave` - 1, lane 3
    // joins at 6
    let live = |t: usize, i: usize, leave: usize| match i {
        2 => t < leave,
        3 => t >= 6,
        _ => true,
    };
    // kept: 0 host-drawn, 1 kept, 2 kept with lanes that are done handed back (`retire`)
    let run =
        |mode: u8, leave: usize| -> Result<(Vec<Vec<FrameOut>>, model::RoundCounts), String> {
            let before = m.round_stats().counts();
            let mut lanes: Vec<Option<model::LaneState<B>>> = Vec::new();
            for p in &prompts[..3] {
                lanes.push(Some(mk(p)?));
            }
            lanes.push(None);
            let mut out = vec![Vec::new(); prompts.len()];
            for t in 0..rounds {
                if t == 6 {
                    lanes[3] = Some(mk(prompts[3])?);
                }
                let idx: Vec<usize> = (0..prompts.len())
                    .filter(|&i| live(t, i, leave) && !matches!(out[i].last(), Some(FrameOut::Eos)))
                    .collect();
                if mode == 2 {
                    // lanes that left or ended go back to the model (ghosts of the kept round)
                    for (i, l) in lanes.iter_mut().enumerate() {
                        if !idx.contains(&i) {
                            if let Some(l) = l.take() {
                                m.retire(l);
                            }
                        }
                    }
                }
                let steps: Vec<LaneStep> = idx
                    .iter()
                    .map(|&i| LaneStep {
                        params,
                        seed: 100 + i as u64,
                        step: t as u64,
                    })
                    .collect();
                let mut ls: Vec<&mut model::LaneState<B>> = lanes
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| idx.contains(i))
                    .filter_map(|(_, l)| l.as_mut())
                    .collect();
                let f = if mode > 0 {
                    m.step_frames_kept(&mut ls, &steps)
                } else {
                    m.step_frames_host(&mut ls, &steps, None, None, None)
                }
                .map_err(e)?;
                for (&i, fo) in idx.iter().zip(f) {
                    out[i].push(fo);
                }
            }
            Ok((out, m.round_stats().counts().since(&before)))
        };
    let (host, _) = run(0, 4)?;
    let (kept, plain) = run(1, 4)?;
    let (ghosted, ghost) = run(2, 4)?;
    let drawn: usize = host.iter().map(Vec::len).sum();
    r.push(
        "kept rounds = host rounds (sampled, lane set changing)",
        host == kept,
        format!(
            "{drawn} lane-rounds over 4 lanes, frames equal: {}",
            host == kept
        ),
    );
    // a lane handed back keeps its slot: fewer new lane sets, the same frames
    let ok = host == ghosted && ghost.set_changes < plain.set_changes;
    // lane 2 leaving after round 0: its ghost runs in the issued rounds and in the recording
    // too (above it only ever replays), where the round ops check each slot's counters
    let (early_host, _) = run(0, 1)?;
    let (_, early_plain) = run(1, 1)?;
    let (early_ghosted, early) = run(2, 1)?;
    // seated from round 1 on: a lane set saved against the same schedule without retire
    let ok = ok && early_host == early_ghosted && early.set_changes < early_plain.set_changes;
    r.push(
        "kept rounds with finished lanes retired (ghost slots) = host rounds",
        ok,
        format!(
            "frames equal: {}; lane sets built: {} with retired lanes as ghosts, {} without; \
             a ghost from round 1 (issued and recorded beside it): frames equal: {}",
            host == ghosted,
            ghost.set_changes,
            plain.set_changes,
            early_host == early_ghosted
        ),
    );
    guided_kept_case(r, m, &prompts, rounds)
}

/// Classifier-free guidance in kept rounds: three lanes, two guided (γ 1.5 and 3; their
/// unconditional branches prefilled from shorter prompts) and one not, sampled; kept rounds
/// equal host rounds frame for frame (the host mixes with `sampling::cfg_mix`).
fn guided_kept_case<B: Backend>(
    r: &mut GoldenReport,
    m: &Model<B>,
    prompts: &[&[Row]],
    rounds: usize,
) -> Result<(), String> {
    let e = |e: model::ModelError| e.to_string();
    let params = SamplingParams::default();
    let gamma = [1.5f32, 0.0, 3.0];
    // ghosts: lanes that drew EOS (and their branches) are handed back to the model
    let run = |kept: bool, ghosts: bool| -> Result<Vec<Vec<FrameOut>>, String> {
        let mut lanes: Vec<Option<model::LaneState<B>>> = Vec::new();
        let mut unconds: Vec<Option<model::LaneState<B>>> = Vec::new();
        for (i, p) in prompts[..3].iter().enumerate() {
            let mut l = m.new_lane(p.len() + rounds + 1).map_err(e)?;
            m.prefill(&mut l, p).map_err(e)?;
            lanes.push(Some(l));
            unconds.push(if gamma[i] != 0.0 {
                let up = &prompts[2][..prompts[2].len() - i];
                let mut u = m.new_backbone_lane(up.len() + rounds + 1).map_err(e)?;
                m.prefill(&mut u, up).map_err(e)?;
                Some(u)
            } else {
                None
            });
        }
        let mut out = vec![Vec::new(); 3];
        for t in 0..rounds {
            let idx: Vec<usize> = (0..3)
                .filter(|&i| !matches!(out[i].last(), Some(FrameOut::Eos)))
                .collect();
            if idx.is_empty() {
                break;
            }
            if ghosts {
                for i in (0..3).filter(|i| !idx.contains(i)) {
                    for l in [lanes[i].take(), unconds[i].take()].into_iter().flatten() {
                        m.retire(l);
                    }
                }
            }
            let steps: Vec<LaneStep> = idx
                .iter()
                .map(|&i| LaneStep {
                    params,
                    seed: 200 + i as u64,
                    step: t as u64,
                })
                .collect();
            let mut ls: Vec<&mut model::LaneState<B>> = lanes
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| idx.contains(i))
                .filter_map(|(_, l)| l.as_mut())
                .collect();
            let mut g = model::Guidance {
                uncond: unconds
                    .iter_mut()
                    .enumerate()
                    .filter(|(i, _)| idx.contains(i))
                    .map(|(_, u)| u.as_mut())
                    .collect(),
                gamma: idx.iter().map(|&i| gamma[i]).collect(),
                batched: true,
            };
            let f = if kept {
                m.step_frames_kept_guided(&mut ls, &steps, Some(&mut g))
            } else {
                m.step_frames_host(&mut ls, &steps, Some(&mut g), None, None)
            }
            .map_err(e)?;
            for (&i, fo) in idx.iter().zip(f) {
                out[i].push(fo);
            }
        }
        Ok(out)
    };
    let host = run(false, false)?;
    let c0 = m.round_stats().counts();
    let kept = run(true, false)?;
    let c1 = m.round_stats().counts();
    let ghosted = run(true, true)?;
    let (plain, ghost) = (
        c1.since(&c0).set_changes,
        m.round_stats().counts().since(&c1).set_changes,
    );
    let drawn: usize = host.iter().map(Vec::len).sum();
    r.push(
        "kept rounds (ended lanes as ghosts or not) = host rounds (guided, sampled)",
        // the ghosts must have saved a lane set, or the case did not run them
        host == kept && host == ghosted && ghost < plain,
        format!(
            "{drawn} lane-rounds over 3 lanes (2 guided), frames equal: {} / {} with ghosts \
             (lane sets built: {plain} / {ghost})",
            host == kept,
            host == ghosted
        ),
    );
    Ok(())
}

/// The prompt builder against `prompt_rows`, when meta.json names the prompt (its reference audio
/// is the fixture's encoded chirp, `codec_encode_codes`).
fn prompt_case(
    r: &mut GoldenReport,
    g: &Goldens,
    dir: &Path,
    ck: &Checkpoint,
) -> Result<(), String> {
    let Ok(meta) = std::fs::read_to_string(dir.join("golden/meta.json")) else {
        return Ok(());
    };
    let meta: serde_json::Value = serde_json::from_str(&meta).map_err(|e| e.to_string())?;
    let (Some(text), Some(tr)) = (
        meta["prompt_text"].as_str(),
        meta["reference_transcript"].as_str(),
    ) else {
        return Ok(());
    };
    let (Some(codes), Some(cs), Some(want)) = (
        g.i64("codec_encode_codes"),
        g.shape("codec_encode_codes"),
        g.i64("prompt_rows"),
    ) else {
        return Ok(());
    };
    if cs.len() != 2 || codes.len() != cs[0] * cs[1] {
        r.push(
            "prompt_rows (builder)",
            false,
            format!("codec_encode_codes has shape {cs:?}, not [codebooks, frames]"),
        );
        return Ok(());
    }
    let frames = cs[1];
    let refcodes: Vec<Vec<i64>> = (0..frames)
        .map(|f| (0..cs[0]).map(|c| codes[c * frames + f]).collect())
        .collect();
    let tok = tokenizers::Tokenizer::from_file(ck.tokenizer_path()).map_err(|e| e.to_string())?;
    let codec_cfg = Codec::load(dir, None).map_err(|e| e.to_string())?;
    let b = crate::prompt::PromptBuilder {
        tokenizer: &tok,
        spec: crate::prompt::PromptSpec {
            semantic_start: ck.config.semantic_start_token_id,
            num_codebooks: ck.config.num_codebooks(),
            semantic_codebook_size: codec_cfg.config().semantic_codebook_size,
            residual_codebook_size: codec_cfg.config().codebook_size,
        },
    };
    let p = b
        .build(
            text,
            &[crate::prompt::Reference {
                transcript: tr.into(),
                codes: refcodes,
            }],
        )
        .map_err(|e| e.to_string())?;
    let got: Vec<i64> = p.rows.concat();
    r.exact("prompt_rows (builder)", &got, &want);
    Ok(())
}

fn codec_cases(r: &mut GoldenReport, g: &Goldens, dir: &Path) -> Result<(), String> {
    let codec = Codec::load(dir, None).map_err(|e| e.to_string())?;
    let dec =
        |r: &mut GoldenReport, name: &str, codes_key: &str, pcm_key: &str| -> Result<(), String> {
            let (Some(c), Some(s), Some(w)) =
                (g.i64(codes_key), g.shape(codes_key), g.f64(pcm_key))
            else {
                r.push(name, false, "golden tensor missing".into());
                return Ok(());
            };
            let codes = codes_of(&c, &s)?;
            let pcm = codec.decode(&codes).map_err(|e| e.to_string())?;
            r.close(name, &pcm, &w, PCM_ATOL, 0.0);
            // Streaming: frame-by-frame pushes equal the whole decode bit for bit.
            let mut st = codec.decoder_state();
            let mut streamed = Vec::with_capacity(pcm.len());
            for f in 0..codes.frames() {
                streamed.extend(st.push(&codes.slice(f, f + 1)).map_err(|e| e.to_string())?);
            }
            let same = streamed.len() == pcm.len()
                && streamed
                    .iter()
                    .zip(&pcm)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            r.push(
                &format!("{name} streamed"),
                same,
                "1-frame chunks vs whole decode, bit for bit".into(),
            );
            Ok(())
        };
    dec(
        r,
        "codec_decode",
        "codec_decode_codes",
        "codec_decode_pcm_f64",
    )?;
    let enc =
        |r: &mut GoldenReport, name: &str, in_key: &str, codes_key: &str| -> Result<(), String> {
            let (Some(x), Some(c)) = (g.f64(in_key), g.i64(codes_key)) else {
                r.push(name, false, "golden tensor missing".into());
                return Ok(());
            };
            let pcm: Vec<f32> = x.iter().map(|&v| v as f32).collect();
            let codes = codec.encode(&pcm).map_err(|e| e.to_string())?;
            let got: Vec<i64> = codes.data().iter().map(|&v| i64::from(v)).collect();
            r.exact(name, &got, &c);
            Ok(())
        };
    enc(
        r,
        "codec_encode",
        "codec_encode_input_chirp",
        "codec_encode_codes",
    )?;
    if g.long.is_some() {
        dec(
            r,
            "codec_long_decode",
            "codec_long_decode_codes",
            "codec_long_decode_pcm_f64",
        )?;
        enc(
            r,
            "codec_long_encode",
            "codec_long_encode_input",
            "codec_long_encode_codes",
        )?;
    }
    Ok(())
}

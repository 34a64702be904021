//! Window qualification (ADMISSION.md "Evidence for a window claim"): a run that fills a window of
//! C rows, prompt P = C - 2 rows then one generated frame (P + F + 1 = C), checking the state and
//! the logits at the last admitted position. Text rows cycle through ordinary vocabulary tokens.

use std::time::Instant;

use checkpoint::Checkpoint;
use model::{Backend, FrameOut, Model, Row, SamplingParams, ROW_WIDTH};
use serde::Serialize;

#[derive(Debug, Serialize)]
pub struct WindowRun {
    pub window_rows: usize,
    pub prompt_rows: usize,
    pub frames: usize,
    pub backend: String,
    pub prefill_seconds: f64,
    pub frame_seconds: f64,
    /// Candidate logits at the last prompt position (the one the frame is drawn from).
    pub last_logits: Vec<f32>,
    pub last_logits_finite: bool,
    pub frame: Option<Vec<i64>>,
    pub rows_used: usize,
}

/// Prompt rows of `n` ordinary text tokens (ids below the first special id), deterministic.
pub fn filler_rows(ck: &Checkpoint, n: usize) -> Vec<Row> {
    let first_special = ck
        .config
        .eos_token_id
        .min(ck.config.semantic_start_token_id)
        .max(2) as i64;
    let ordinary = (first_special - 1).max(1);
    (0..n)
        .map(|i| {
            let mut r = [0i64; ROW_WIDTH];
            // A stride coprime with most vocabulary sizes walks all ordinary ids.
            r[0] = 1 + ((i as i64 * 7919) % ordinary);
            r
        })
        .collect()
}

/// `rows` prefilled on a fresh lane of `capacity` rows in `chunk`-row pieces: the lane and the
/// seconds the prefill took.
fn timed_prefill<B: Backend>(
    m: &Model<B>,
    rows: &[Row],
    capacity: usize,
    chunk: usize,
) -> Result<(model::LaneState<B>, f64), String> {
    let mut lane = m.new_lane(capacity).map_err(|e| e.to_string())?;
    let t = Instant::now();
    m.prefill_chunked(&mut lane, rows, chunk)
        .map_err(|e| e.to_string())?;
    Ok((lane, t.elapsed().as_secs_f64()))
}

/// Prefill timings: the model loaded once, then for each prompt length `runs` prompts of that
/// many filler rows, each on a fresh lane, in `chunk`-row pieces; per length, the seconds of
/// each run in order (the first includes the kernels' first use on a GPU).
pub fn prefill_runs<B: Backend>(
    ck: &Checkpoint,
    backend: B,
    lengths: &[usize],
    chunk: usize,
    runs: usize,
) -> Result<Vec<Vec<f64>>, String> {
    if let Some(&n) = lengths.iter().find(|&&n| n == 0) {
        return Err(format!(
            "a prefill timing needs a prompt of at least 1 row, not {n}"
        ));
    }
    let m = Model::load(ck, backend).map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(lengths.len());
    for &prompt_rows in lengths {
        let rows = filler_rows(ck, prompt_rows);
        let mut seconds = Vec::with_capacity(runs);
        for _ in 0..runs.max(1) {
            let (lane, secs) = timed_prefill(&m, &rows, prompt_rows + 2, chunk)?;
            seconds.push(secs);
            if lane.rows() != prompt_rows {
                return Err(format!(
                    "the prefill took {} rows of a {prompt_rows}-row prompt",
                    lane.rows()
                ));
            }
        }
        out.push(seconds);
    }
    Ok(out)
}

/// Fills a window of `window` rows on `backend`, prefilling in `chunk`-row pieces.
pub fn fill_window<B: Backend>(
    ck: &Checkpoint,
    backend: B,
    window: usize,
    chunk: usize,
) -> Result<WindowRun, String> {
    if window < 4 {
        return Err(format!(
            "a window of {window} rows is below the minimum of 4 rows"
        ));
    }
    let name = backend.name().to_string();
    let m = Model::load(ck, backend).map_err(|e| e.to_string())?;
    let p = window - 2;
    let rows = filler_rows(ck, p);
    let (mut lane, prefill_seconds) = timed_prefill(&m, &rows, window, chunk)?;
    let last_logits = m
        .main_logits(&[&mut lane])
        .map_err(|e| e.to_string())?
        .remove(0);
    let t = Instant::now();
    let out = m
        .step_frame(&mut lane, &SamplingParams::greedy(), 0, 0)
        .map_err(|e| e.to_string())?;
    let frame_seconds = t.elapsed().as_secs_f64();
    Ok(WindowRun {
        window_rows: window,
        prompt_rows: p,
        frames: 1,
        backend: name,
        prefill_seconds,
        frame_seconds,
        last_logits_finite: last_logits.iter().all(|v| v.is_finite()),
        last_logits,
        frame: match out {
            FrameOut::Frame(f) => Some(f.to_vec()),
            FrameOut::Eos => None,
        },
        rows_used: lane.rows(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Checkpoint {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny");
        Checkpoint::open(&dir).expect("the tiny fixture")
    }

    /// One timing per run and length, each a whole prompt on a fresh lane; a zero-row prompt
    /// is refused.
    #[test]
    fn prefill_runs_times_each_run_on_a_fresh_lane() {
        let ck = tiny();
        let s = prefill_runs(&ck, backend_cpu::CpuBackend::new(), &[40, 7], 16, 3).unwrap();
        assert_eq!(s.len(), 2);
        assert!(s.iter().all(|r| r.len() == 3));
        assert!(s.iter().flatten().all(|&t| t > 0.0 && t.is_finite()));
        let e = prefill_runs(&ck, backend_cpu::CpuBackend::new(), &[8, 0], 16, 1).unwrap_err();
        assert!(e.contains("at least 1 row"), "{e}");
    }
}

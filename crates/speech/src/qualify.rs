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
    let mut lane = m.new_lane(window).map_err(|e| e.to_string())?;
    let t = Instant::now();
    m.prefill_chunked(&mut lane, &rows, chunk)
        .map_err(|e| e.to_string())?;
    let prefill_seconds = t.elapsed().as_secs_f64();
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

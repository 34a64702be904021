//! CPU decode speed on a checkpoint: prefill the fixture's 99-row golden prompt, then time
//! `FRAMES` sampled frames (T 1, top-k 30, top-p 0.9, RAS on). An EOS restarts the lane from
//! the prompt; only `step_frame` calls are timed.
//!
//! `cargo run --release -p backend-cpu --example frames_per_sec [-- DIR [FRAMES]]`

use backend_cpu::CpuBackend;
use checkpoint::{Checkpoint, Store};
use model::{FrameOut, Model, Row, SamplingParams};
use std::path::PathBuf;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny");
    let mut args = std::env::args().skip(1);
    let dir = args.next().map(PathBuf::from).unwrap_or(fixture.clone());
    let frames: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(500);
    let prompt: Vec<Row> = Store::open_file(&fixture.join("golden/golden.safetensors"))?
        .get("prompt_rows")?
        .to_i64()
        .chunks_exact(11)
        .map(|c| c.try_into().expect("11 columns"))
        .collect();
    let ck = Checkpoint::open(&dir)?;
    let m = Model::load(&ck, CpuBackend::new())?;
    let params = SamplingParams::default();
    let cap = prompt.len() + frames as usize + 1;
    let t0 = Instant::now();
    let mut lane = m.new_lane(cap)?;
    m.prefill(&mut lane, &prompt)?;
    let prefill = t0.elapsed();
    let (mut made, mut eos) = (0u64, 0u64);
    let mut stepping = std::time::Duration::ZERO;
    while made < frames {
        let t1 = Instant::now();
        let out = m.step_frame(&mut lane, &params, 7 + eos, made)?;
        stepping += t1.elapsed();
        match out {
            FrameOut::Frame(_) => made += 1,
            FrameOut::Eos => {
                // Restart the lane so the timed loop always makes `frames` frames.
                eos += 1;
                lane = m.new_lane(cap)?;
                m.prefill(&mut lane, &prompt)?;
            }
        }
    }
    let dt = stepping.as_secs_f64();
    println!(
        "prefill {} rows: {:.1} ms; {made} frames in {dt:.3} s = {:.1} frames/s ({eos} EOS restarts, threads {})",
        prompt.len(),
        prefill.as_secs_f64() * 1e3,
        made as f64 / dt,
        rayon::current_num_threads()
    );
    Ok(())
}

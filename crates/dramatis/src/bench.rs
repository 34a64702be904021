//! `dramatis bench`: throughput and latency receipts as JSON (median of several runs), never a
//! timed test. One run = `lanes` concurrent requests of the same text with distinct seeds.

use anyhow::{anyhow, Context, Result};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use speech::{Engine, EngineOptions, JobEvent, ReferenceAudio, ReferenceInput, SynthesisRequest};

#[derive(clap::Args)]
pub struct BenchArgs {
    #[arg(long)]
    pub model: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: crate::cli::BackendArg,
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Frame cap per request.
    #[arg(long, default_value_t = 64)]
    pub frames: u64,
    /// Lane counts to measure, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub lanes: Vec<usize>,
    #[arg(
        long,
        default_value = "A quick benchmark sentence for the engine, read once."
    )]
    pub text: String,
    /// Attach a synthetic reference of this many frames to every request (0 = none): with the
    /// prefill cache on, every run after the warm-up restores it.
    #[arg(long, default_value_t = 0)]
    pub reference_frames: usize,
    /// Reference prefill cache budget (0 measures without the cache).
    #[arg(long, default_value_t = 1.0)]
    pub prompt_cache_gib: f64,
    /// Guidance strength (only requests with a reference are guided).
    #[arg(long, default_value_t = 0.0)]
    pub cfg_gamma: f32,
    #[arg(long)]
    pub cfg_batched: bool,
    /// Also measure prefill rows/s at these prompt lengths (comma separated).
    #[arg(long, value_delimiter = ',')]
    pub prefill_rows: Vec<usize>,
    /// Receipt path (JSON); without it the receipt goes to stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Deterministic reference codes in every codebook's range (the codec clamps nothing here).
fn synthetic_reference(frames: usize) -> ReferenceInput {
    ReferenceInput {
        audio: ReferenceAudio::Codes(
            (0..frames)
                .map(|f| (0..10).map(|c| ((f * 7 + c * 3) % 16) as i64).collect())
                .collect(),
        ),
        transcript: "A synthetic reference passage for the benchmark.".into(),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

struct RunResult {
    wall: f64,
    frames: u64,
    first_audio: Vec<f64>,
    audio_seconds: f64,
}

fn one_run(eng: &Arc<Engine>, lanes: usize, a: &BenchArgs, run: usize) -> Result<RunResult> {
    let (frames, text) = (a.frames, a.text.as_str());
    let t0 = Instant::now();
    let handles = (0..lanes)
        .map(|i| {
            eng.submit(SynthesisRequest {
                text: text.to_string(),
                seed: Some((run * 1000 + i) as u64),
                max_frames: Some(frames),
                split: speech::Split::None,
                references: if a.reference_frames > 0 {
                    vec![synthetic_reference(a.reference_frames)]
                } else {
                    vec![]
                },
                ..Default::default()
            })
            .map_err(|e| anyhow!("refused: {}", e.message))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut total = 0u64;
    let mut first = Vec::new();
    let mut secs = 0.0;
    for mut h in handles {
        loop {
            match h.events.blocking_recv() {
                Some(JobEvent::Done(s)) => {
                    total += s.frames;
                    secs += s.audio_seconds;
                    if let Some(f) = s.first_audio_seconds {
                        first.push(f);
                    }
                    break;
                }
                Some(JobEvent::Failed(e)) => return Err(anyhow!("job failed: {e}")),
                Some(_) => {}
                None => return Err(anyhow!("engine stopped")),
            }
        }
    }
    Ok(RunResult {
        wall: t0.elapsed().as_secs_f64(),
        frames: total,
        first_audio: first,
        audio_seconds: secs,
    })
}

pub fn run(a: BenchArgs) -> Result<()> {
    let max_lanes = a.lanes.iter().copied().max().unwrap_or(1).max(1);
    let opts = EngineOptions {
        model_dir: a.model.clone(),
        backend: match a.backend {
            crate::cli::BackendArg::Cpu => speech::BackendChoice::Cpu,
            crate::cli::BackendArg::Cuda => speech::BackendChoice::Cuda,
        },
        prompt_cache_gib: a.prompt_cache_gib,
        cfg: speech::CfgOptions {
            gamma: a.cfg_gamma,
            batched: a.cfg_batched,
            ..Default::default()
        },
        parallel: max_lanes,
        queue: Some(max_lanes),
        context: Some(4096),
        ..Default::default()
    };
    let t_load = Instant::now();
    let eng = Engine::load(opts).map_err(|e| anyhow!("{e}"))?;
    let load_s = t_load.elapsed().as_secs_f64();
    let mut results = Vec::new();
    for &lanes in &a.lanes {
        // One warm-up run, then the measured ones.
        one_run(&eng, lanes, &a, 999)?;
        let mut fps = Vec::new();
        let mut ttfa = Vec::new();
        let mut rtf = Vec::new();
        let mut frames = Vec::new();
        for r in 0..a.runs {
            let res = one_run(&eng, lanes, &a, r)?;
            fps.push(res.frames as f64 / res.wall);
            ttfa.push(median(res.first_audio.clone()));
            rtf.push(res.wall / (res.audio_seconds / lanes as f64).max(1e-9));
            frames.push(res.frames as f64);
        }
        results.push(json!({
            "lanes": lanes,
            "runs": a.runs,
            "frames_cap_per_request": a.frames,
            "frames_generated_median": median(frames),
            "aggregate_frames_per_s_median": median(fps.clone()),
            "per_lane_frames_per_s_median": median(fps) / lanes as f64,
            "time_to_first_audio_s_median": median(ttfa),
            "real_time_factor_median": median(rtf),
        }));
        eprintln!(
            "lanes {lanes}: {}",
            results.last().map(|v| v.to_string()).unwrap_or_default()
        );
    }
    // Prefill throughput: one lane, a prompt of n rows (then one frame), in 4096-row pieces.
    let mut prefill = Vec::new();
    if !a.prefill_rows.is_empty() {
        let dir = match &a.model {
            Some(d) => d.clone(),
            None => speech::builtin::ensure_builtin().map_err(|e| anyhow!(e))?,
        };
        let ck = checkpoint::Checkpoint::open(&dir)?;
        let cuda = matches!(a.backend, crate::cli::BackendArg::Cuda);
        for &n in &a.prefill_rows {
            // One run per length: each loads the model afresh (weights dominate the time otherwise).
            let r = crate::gpu::fill_window_on(&ck, cuda, n + 2, 4096)?;
            let m = r.prefill_seconds;
            prefill.push(json!({"prompt_rows": n, "prefill_seconds": m, "runs": 1, "rows_per_s": n as f64 / m}));
            eprintln!("prefill {n} rows: {m:.3} s");
        }
    }
    let facts = eng.facts();
    let receipt = json!({
        "kind": "dramatis-bench",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": env!("DRAMATIS_GIT"),
        "version": env!("CARGO_PKG_VERSION"),
        "unix_time": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "machine": machine(),
        "backend": facts.backend,
        "model": eng.model_id(),
        "expert_format": facts.expert_format,
        "load_seconds": load_s,
        "settings": {"text": a.text, "frames": a.frames, "runs": a.runs, "lanes": a.lanes, "context": 4096,
                      "reference_frames": a.reference_frames, "prompt_cache_gib": a.prompt_cache_gib,
                      "cfg_gamma": a.cfg_gamma, "cfg_batched": a.cfg_batched,
                      "note": "random-weight checkpoints may end early on EOS; frames/s counts frames generated"},
        "results": results,
        "prefill": prefill,
    });
    let text = serde_json::to_string_pretty(&receipt)?;
    match &a.out {
        Some(p) => {
            if let Some(d) = p.parent() {
                std::fs::create_dir_all(d).ok();
            }
            std::fs::write(p, &text).with_context(|| format!("writing {}", p.display()))?;
            eprintln!("receipt written to {}", p.display());
        }
        None => println!("{text}"),
    }
    println!("| lanes | frames/s (all lanes) | frames/s per lane | first audio (s) | RTF |");
    println!("| ---: | ---: | ---: | ---: | ---: |");
    for r in &receipt["results"].as_array().cloned().unwrap_or_default() {
        println!(
            "| {} | {:.1} | {:.1} | {:.4} | {:.4} |",
            r["lanes"],
            r["aggregate_frames_per_s_median"].as_f64().unwrap_or(0.0),
            r["per_lane_frames_per_s_median"].as_f64().unwrap_or(0.0),
            r["time_to_first_audio_s_median"].as_f64().unwrap_or(0.0),
            r["real_time_factor_median"].as_f64().unwrap_or(0.0)
        );
    }
    eng.shutdown();
    Ok(())
}

fn machine() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    json!({
        "cpu": cpu,
        "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
    })
}

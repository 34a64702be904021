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
    /// Waiting requests started between two frame rounds, at most (0: no cap on their count;
    /// the engine's `starts_per_round`).
    #[arg(long, default_value_t = 0)]
    pub starts_per_round: usize,
    /// Prompt rows to prefill started between two frame rounds, at most (the engine's
    /// `start_rows_per_round`; default the plan's prefill chunk, 0: no limit).
    #[arg(long)]
    pub start_rows_per_round: Option<usize>,
    /// Decode audio (and encode reference clips) on the host (the GPU runs the model alone):
    /// measures what the GPU codec costs the frame rounds.
    #[arg(long)]
    pub codec_on_host: bool,
    /// Frames one codec call gathers for a job whose audio is well ahead of real time (the
    /// engine's `codec_min_chunk`; 1: every frame as it comes).
    #[arg(long, default_value_t = speech::DEFAULT_CODEC_MIN_CHUNK)]
    pub codec_min_chunk: usize,
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
    /// The run's earliest first audio, from the start of the run.
    first_audio_in_run: f64,
    /// When the run's last frame was made (seconds from the run's start), before the codec
    /// finished its audio.
    last_frame_in_run: f64,
    audio_seconds: f64,
}

/// The request every lane of a run submits (`seed` differs).
fn bench_request(a: &BenchArgs, seed: u64) -> SynthesisRequest {
    SynthesisRequest {
        text: a.text.clone(),
        seed: Some(seed),
        max_frames: Some(a.frames),
        split: speech::Split::None,
        references: if a.reference_frames > 0 {
            vec![synthetic_reference(a.reference_frames)]
        } else {
            vec![]
        },
        ..Default::default()
    }
}

fn one_run(eng: &Arc<Engine>, lanes: usize, a: &BenchArgs, run: usize) -> Result<RunResult> {
    let t0 = Instant::now();
    let handles = (0..lanes)
        .map(|i| {
            let at = t0.elapsed().as_secs_f64();
            eng.submit(bench_request(a, (run * 1000 + i) as u64))
                .map(|h| (at, h))
                .map_err(|e| anyhow!("refused: {}", e.message))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut total = 0u64;
    let mut first = Vec::new();
    let mut first_in_run = f64::INFINITY;
    let mut last_frame: f64 = 0.0;
    let mut secs = 0.0;
    for (at, mut h) in handles {
        loop {
            match h.blocking_recv() {
                Some(JobEvent::Done(s)) => {
                    total += s.frames;
                    secs += s.audio_seconds;
                    last_frame = last_frame.max(at + s.generated_seconds);
                    if let Some(f) = s.first_audio_seconds {
                        first.push(f);
                        // the job's clock starts at its submission
                        first_in_run = first_in_run.min(at + f);
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
        first_audio_in_run: first_in_run,
        last_frame_in_run: last_frame,
        audio_seconds: secs,
    })
}

/// Issue 6's target: the engine's peak device memory within this many percent of the plan.
const PLAN_TOLERANCE_PERCENT: u64 = 2;

/// What the receipt says the device-memory figures are, and what they are not.
const DEVICE_MEMORY_NOTE: &str = "device-wide cuMemGetInfo (total - free) on device 0, polled on \
its own thread during the load and every decode run; peak_engine_bytes = peak_used_bytes - \
baseline_used_bytes (the baseline, taken before the load, holds this process's CUDA context and \
other processes); allocations shorter than the interval can be missed, so the peak is a lower \
bound; planned_device_bytes includes ceilings that fill only under load (reference_cache, the \
KV pool at every lane's full window: see planned_device_classes), and the engine reserves those \
(every device class but the weights, reserved_device_bytes) from the stream-ordered pool at \
start-up, so peak_engine_bytes meets the plan by construction and a peak above it is state or \
overhead (modules, graphs, recorded rounds' own buffers) the plan does not count; \
state_used_peak_bytes is the pool's high-water mark of allocated state during the decode runs, \
against state_planned_bytes; the prefill section loads a second model copy beside the engine \
and is sampled apart (prefill_peak_used_bytes), never compared with the plan";

/// Device memory over one bench: figures in bytes, all device-wide (every process counts).
struct DeviceMemory {
    /// In use before `Engine::load`.
    baseline_used: u64,
    /// The highest figure during the load and the decode runs.
    peak: speech::DevicePeak,
    /// The plan's device total (`None`: a plan without a device side).
    planned: Option<u64>,
    /// The plan's device byte classes, to say where a gap comes from.
    planned_classes: Vec<(&'static str, u64)>,
    /// The highest figure during the prefill section, when it ran.
    prefill_peak: Option<speech::DevicePeak>,
    /// What the pool kept reserved at start-up for the plan's state beyond the weights.
    reserved: u64,
    /// The plan's state beyond the weights (what start-up asked to reserve).
    state_planned: u64,
    /// The most state the engine had allocated at once during the decode runs (the pool's
    /// high-water mark above what it held allocated once loaded), when the driver reports it.
    state_used: Option<u64>,
}

impl DeviceMemory {
    /// Bytes the engine added on the device at its peak (0 if others freed more than it took).
    fn engine_bytes(&self) -> u64 {
        self.peak.used_bytes.saturating_sub(self.baseline_used)
    }

    /// The engine's peak as a fraction of the plan; `None` without a (non-zero) plan.
    fn over_plan(&self) -> Option<f64> {
        let planned = self.planned.filter(|&p| p > 0)?;
        Some(self.engine_bytes() as f64 / planned as f64)
    }
}

/// Whether `engine` bytes lie within [`PLAN_TOLERANCE_PERCENT`] of `planned`, either side: above
/// it the plan under-reserves (the device can run out after admission said yes), below it the
/// plan refuses work that would fit. Integer arithmetic, so the boundary is exact. `None` when
/// nothing is planned.
fn within_plan(engine: u64, planned: u64) -> Option<bool> {
    if planned == 0 {
        return None;
    }
    let gap = u128::from(engine.abs_diff(planned));
    Some(gap * 100 <= u128::from(planned) * u128::from(PLAN_TOLERANCE_PERCENT))
}

/// The receipt's `device_memory` object.
fn device_memory_json(m: &DeviceMemory) -> serde_json::Value {
    let classes: serde_json::Map<String, serde_json::Value> = m
        .planned_classes
        .iter()
        .map(|&(class, bytes)| (class.to_string(), json!(bytes)))
        .collect();
    json!({
        "baseline_used_bytes": m.baseline_used,
        "peak_used_bytes": m.peak.used_bytes,
        "peak_engine_bytes": m.engine_bytes(),
        "planned_device_bytes": m.planned,
        "peak_over_plan": m.over_plan(),
        "within_2_percent": m.planned.and_then(|p| within_plan(m.engine_bytes(), p)),
        "planned_device_classes": classes,
        "samples": m.peak.samples,
        "sample_interval_ms": m.peak.interval_ms,
        "prefill_peak_used_bytes": m.prefill_peak.map(|p| p.used_bytes),
        "reserved_device_bytes": m.reserved,
        "state_planned_bytes": m.state_planned,
        "state_used_peak_bytes": m.state_used,
        "state_used_of_planned": m
            .state_used
            .filter(|_| m.state_planned > 0)
            .map(|u| u as f64 / m.state_planned as f64),
        "note": DEVICE_MEMORY_NOTE,
    })
}

fn gib(bytes: u64) -> String {
    format!("{} GiB", admission::Bytes(bytes).gib_string())
}

/// One line for the terminal: the engine's peak against the plan.
fn device_memory_line(m: &DeviceMemory) -> String {
    let measured = format!(
        "device memory: peak {} engine ({} in use, {} before load)",
        gib(m.engine_bytes()),
        gib(m.peak.used_bytes),
        gib(m.baseline_used)
    );
    match (m.planned, m.over_plan()) {
        (Some(p), Some(r)) => {
            let verdict = match within_plan(m.engine_bytes(), p) {
                Some(true) => "within",
                _ => "outside",
            };
            format!(
                "{measured}, plan {} ({:.1}% of plan, {verdict} {PLAN_TOLERANCE_PERCENT}%)",
                gib(p),
                r * 100.0
            )
        }
        _ => format!("{measured}, no device plan"),
    }
}

/// One line for the terminal: the state the runs used against the state the plan reserves.
fn device_state_line(m: &DeviceMemory) -> Option<String> {
    let used = m.state_used?;
    (m.state_planned > 0).then(|| {
        format!(
            "device state: used at most {} of the {} the plan reserves ({:.1}%; the plan counts every lane's full window)",
            gib(used),
            gib(m.state_planned),
            used as f64 * 100.0 / m.state_planned as f64
        )
    })
}

use admission::geometry::H200_COPY_BYTES_PER_S as H200_BYTES_PER_S;

/// The weight-read floor of one lane count (DRAMA3.md section 5): `lanes` frames per round over
/// the bytes a round reads at `bytes_per_s`; `None` when the geometry gives no figure.
fn floor_frames_per_s(
    geom: &admission::geometry::ModelGeometry,
    lanes: usize,
    bytes_per_s: f64,
) -> Option<f64> {
    let b = geom.frame_read_bytes(lanes as u64).ok()?;
    (b.total() > 0.0).then(|| lanes as f64 * bytes_per_s / b.total())
}

/// Each of the two buffers the bench's copy-rate measure copies between (far past the L2), and
/// how many timed copies it takes the median of.
const COPY_BUFFER_BYTES: usize = 512 << 20;
const COPY_REPS: usize = 9;

/// The receipt's `floor` section and, per lane count, the floor and the fraction of it that the
/// decode frames/s reached (written into each result). The bandwidth is GPU.md's figure on the
/// H200 and the copy rate measured at the bench's start (`copy`) on any other device; with
/// neither, the section says so and the results carry no fraction. A measured rate is always
/// recorded beside the figure used.
fn add_floor(
    geom: &admission::geometry::ModelGeometry,
    gpu: Option<&serde_json::Value>,
    copy: Option<&serde_json::Value>,
    guided: bool,
    results: &mut [serde_json::Value],
) -> serde_json::Value {
    if guided {
        return json!({"note": "no floor with guidance: each lane runs a second backbone branch, \
                               which the per-round bytes do not count"});
    }
    let name = gpu
        .and_then(|g| g["name"].as_str())
        .unwrap_or_default()
        .to_string();
    let measured = copy
        .and_then(|c| c["bytes_per_s"].as_f64())
        .filter(|r| *r > 0.0);
    let (rate, source) = if name.contains("H200") {
        (
            H200_BYTES_PER_S,
            "GPU.md: H200 device-to-device copy rate".to_string(),
        )
    } else if let Some(r) = measured {
        let buf = copy.and_then(|c| c["buffer_bytes"].as_u64()).unwrap_or(0);
        (
            r,
            format!(
                "measured here at the bench's start: device-to-device copies between two {} MiB \
                 buffers, bytes read + written, median (GPU.md has no figure for {name})",
                buf >> 20
            ),
        )
    } else {
        return json!({"note": format!(
            "no bandwidth figure for this device ({}): GPU.md measures the H200 only, and the \
             copy rate could not be measured here",
            if name.is_empty() { "host memory" } else { name.as_str() }),
            "measured_copy": copy});
    };
    for r in results.iter_mut() {
        let lanes = r["lanes"].as_u64().unwrap_or(1) as usize;
        if let Some(f) = floor_frames_per_s(geom, lanes, rate) {
            r["floor_frames_per_s"] = json!(f);
            if let Some(d) = r["decode_frames_per_s_median"].as_f64() {
                r["decode_fraction_of_floor"] = json!(d / f);
            }
        }
    }
    let one = geom.frame_read_bytes(1).ok();
    json!({
        "bandwidth_bytes_per_s": rate,
        "bandwidth_source": source,
        "measured_copy": copy,
        "frame_bytes_one_lane": one.map(|b| b.total()),
        "one_lane_bytes": one,
        "method": "DRAMA3.md section 5: dense BF16 weights once per round, plus the routed experts \
                   the round's lanes hit (k per layer for one lane; for several the expected \
                   distinct count under independent uniform routing, so an estimate, not a \
                   bound), plus every lane's Gated DeltaNet state read and written back; K/V \
                   reads (growing with the context) and embedding gathers left out. A ceiling \
                   on frames/s; decode frames/s can include prompt prefills of later lanes",
    })
}

/// How the measured runs' frame rounds ran: counts, and the mean time of a kept round and of
/// a recording (what a round costs beyond its kernels shows here: set changes, issued rounds).
fn rounds_field(r: &model::RoundCounts) -> serde_json::Value {
    let per = |ns: u64, n: u64| (n > 0).then(|| ns as f64 / n as f64 / 1e6);
    json!({
        "host": r.host,
        "kept": r.kept,
        "replayed": r.replayed,
        "recorded": r.recorded,
        "issued": r.issued,
        "lane_set_changes": r.set_changes,
        "kept_round_ms_mean": per(r.kept_ns, r.kept),
        "recording_ms_mean": per(r.record_ns, r.recorded),
    })
}

/// The backend and GPU codec options set in the environment (`DRAMATIS_CUDA_*`,
/// `DRAMATIS_CODEC_*`), so that A/B receipts say which path they measured.
fn backend_env() -> serde_json::Map<String, serde_json::Value> {
    let mut v: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| k.starts_with("DRAMATIS_CUDA_") || k.starts_with("DRAMATIS_CODEC_"))
        .collect();
    v.sort();
    v.into_iter()
        .map(|(k, x)| (k, serde_json::Value::String(x)))
        .collect()
}

/// The codec thread over the measured runs: decoder calls, frames, seconds inside the calls and
/// their share of the runs' wall time (near 1: the codec paces the audio, not the rounds), and
/// the frames it decoded per second inside its calls (with a share near 1, the most frames/s the
/// runs could reach with the codec as it is, sharing the device with the rounds).
fn codec_field(
    now: &speech::CodecCounts,
    before: &speech::CodecCounts,
    walls: f64,
) -> serde_json::Value {
    let calls = now.calls - before.calls;
    let frames = now.frames - before.frames;
    let busy = now.busy_seconds - before.busy_seconds;
    json!({
        "calls": calls,
        "frames": frames,
        "frames_per_call": (calls > 0).then(|| frames as f64 / calls as f64),
        "busy_seconds": busy,
        "busy_fraction_of_runs": (walls > 0.0).then(|| busy / walls),
        "frames_per_busy_second": (busy > 0.0).then(|| frames as f64 / busy),
    })
}

/// The plan's device-side classes (empty on the CPU backend).
fn planned_device_classes(eng: &Engine) -> Vec<(&'static str, u64)> {
    eng.memory_plan()
        .classes
        .iter()
        .filter(|c| c.memory == admission::Memory::Device)
        .map(|c| (c.class, c.bytes.0))
        .collect()
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
        starts_per_round: a.starts_per_round,
        start_rows_per_round: a.start_rows_per_round,
        codec_on_host: a.codec_on_host,
        codec_min_chunk: a.codec_min_chunk,
        cfg: speech::CfgOptions {
            gamma: a.cfg_gamma,
            batched: a.cfg_batched,
            ..Default::default()
        },
        parallel: max_lanes,
        queue: Some(max_lanes),
        context: Some(4096),
        // the runs read their handles one after another: a waiting handle must not pause its
        // job, or the figures would measure the backpressure instead of the engine
        max_unread_audio_seconds: 1e8,
        ..Default::default()
    };
    let cuda = matches!(a.backend, crate::cli::BackendArg::Cuda);
    // The copy rate first (its buffers are freed before the baseline): the floor of a device
    // GPU.md has no figure for.
    let copy = if cuda {
        match speech::device_copy_rate(COPY_BUFFER_BYTES, COPY_REPS) {
            Ok(c) => {
                if let Some(r) = c["bytes_per_s"].as_f64() {
                    eprintln!("device copy rate: {:.2} TB/s (read + written)", r / 1e12);
                }
                Some(c)
            }
            Err(e) => {
                eprintln!("device copy rate not measured: {e}");
                Some(json!({ "error": e }))
            }
        }
    } else {
        None
    };
    // Taken before the engine exists, so the engine's share is what the peak adds to it.
    let baseline = if cuda {
        speech::device_memory_used()
    } else {
        None
    };
    let sampler = baseline.and_then(|_| speech::DevicePeakSampler::start());
    let t_load = Instant::now();
    let eng = Engine::load(opts).map_err(|e| anyhow!("{e}"))?;
    let load_s = t_load.elapsed().as_secs_f64();
    // the pool's allocated bytes once loaded (weights; the reservation is free again): the
    // state the runs allocate is the high-water mark above it
    let pool_base = (cuda && speech::reset_device_pool_high())
        .then(speech::device_pool_used)
        .flatten()
        .map(|(_, used)| used);
    // the measured request's prompt rows per segment (refused here, before any run, if at all)
    let prompt_rows = eng
        .prompt_rows(&bench_request(&a, 0))
        .map_err(|e| anyhow!("refused: {}", e.message))?;
    let mut results = Vec::new();
    for &lanes in &a.lanes {
        // One warm-up run, then the measured ones.
        one_run(&eng, lanes, &a, 999)?;
        let mut fps = Vec::new();
        let mut decode_fps = Vec::new();
        let mut ttfa = Vec::new();
        let mut rtf = Vec::new();
        let mut frames = Vec::new();
        let mut after_last = Vec::new();
        let rounds0 = eng.stats().rounds;
        let deferred0 = eng.stats().starts_deferred;
        let joined0 = eng.stats().prefills_joined;
        let codec0 = eng.stats().codec;
        let mut walls = 0.0;
        for r in 0..a.runs {
            let res = one_run(&eng, lanes, &a, r)?;
            walls += res.wall;
            fps.push(res.frames as f64 / res.wall);
            // from the first audio of the run on: the prompt prefills before it are left out
            // (later lanes' prefills still interleave with decode rounds)
            let t0 = res.first_audio_in_run;
            if t0.is_finite() && res.wall > t0 {
                decode_fps.push(res.frames as f64 / (res.wall - t0));
            }
            ttfa.push(median(res.first_audio.clone()));
            rtf.push(res.wall / (res.audio_seconds / lanes as f64).max(1e-9));
            frames.push(res.frames as f64);
            after_last.push((res.wall - res.last_frame_in_run).max(0.0));
        }
        results.push(json!({
            "lanes": lanes,
            "runs": a.runs,
            "frames_cap_per_request": a.frames,
            "frames_generated_median": median(frames),
            "aggregate_frames_per_s_median": median(fps.clone()),
            "per_lane_frames_per_s_median": median(fps) / lanes as f64,
            "decode_frames_per_s_median": median(decode_fps),
            "time_to_first_audio_s_median": median(ttfa),
            "real_time_factor_median": median(rtf),
            "rounds": rounds_field(&eng.stats().rounds.since(&rounds0)),
            "starts_deferred": eng.stats().starts_deferred - deferred0,
            "prefills_joined": eng.stats().prefills_joined - joined0,
            "codec": codec_field(&eng.stats().codec, &codec0, walls),
            // the run's wall time after its last frame was made: the codec catching up
            "after_last_frame_s_median": median(after_last),
        }));
        // the rate while the lanes are in kept rounds (no prefill between): lanes over the mean
        // kept round; an estimate, since a round can hold finished lanes' ghost slots
        if let Some(last) = results.last_mut() {
            let ms = last["rounds"]["kept_round_ms_mean"].as_f64();
            last["round_frames_per_s_estimate"] = json!(ms.map(|m| lanes as f64 * 1e3 / m));
        }
        eprintln!(
            "lanes {lanes}: {}",
            results.last().map(|v| v.to_string()).unwrap_or_default()
        );
    }
    let decode_peak = sampler.map(speech::DevicePeakSampler::stop);
    let state_used = pool_base
        .and_then(|base| speech::device_pool_used().map(|(high, _)| high.saturating_sub(base)));
    // Prefill throughput: one lane, a prompt of n rows (then one frame), in 4096-row pieces.
    let mut prefill = Vec::new();
    let prefill_sampler = if cuda && !a.prefill_rows.is_empty() {
        speech::DevicePeakSampler::start()
    } else {
        None
    };
    if !a.prefill_rows.is_empty() {
        let dir = match &a.model {
            Some(d) => d.clone(),
            None => speech::builtin::ensure_builtin().map_err(|e| anyhow!(e))?,
        };
        let ck = checkpoint::Checkpoint::open(&dir)?;
        // The model loaded once (outside the timing), then --runs prompts of each length on
        // fresh lanes: the median, and every run (the first includes the kernels' first use)
        let runs = a.runs.max(1);
        let timed = crate::gpu::prefill_runs_on(&ck, cuda, &a.prefill_rows, 4096, runs)?;
        for (&n, all) in a.prefill_rows.iter().zip(timed) {
            let m = median(all.clone());
            prefill.push(
                json!({"prompt_rows": n, "prefill_seconds": m, "prefill_seconds_runs": all,
                                "runs": runs, "rows_per_s": n as f64 / m}),
            );
            eprintln!("prefill {n} rows: {m:.3} s (median of {runs})");
        }
    }
    let prefill_peak = prefill_sampler.map(speech::DevicePeakSampler::stop);
    let device_memory = match (baseline, decode_peak) {
        (Some(baseline_used), Some(peak)) => Some(DeviceMemory {
            baseline_used,
            peak,
            planned: eng.planned_device_bytes(),
            planned_classes: planned_device_classes(&eng),
            prefill_peak,
            reserved: eng.reserved_device_bytes(),
            state_planned: eng.planned_device_state_bytes(),
            state_used,
        }),
        _ => None,
    };
    let device_memory_field = match (&device_memory, cuda) {
        (Some(m), _) => device_memory_json(m),
        (None, false) => serde_json::Value::Null,
        (None, true) => {
            json!({"note": "not measured: the CUDA driver's memory figures could not be read"})
        }
    };
    let facts = eng.facts();
    let gpu = if cuda { speech::device_facts() } else { None };
    let floor = if cuda {
        add_floor(
            eng.geometry(),
            gpu.as_ref(),
            copy.as_ref(),
            a.cfg_gamma != 0.0,
            &mut results,
        )
    } else {
        json!({"note": "no floor on the CPU backend: host memory bandwidth is not measured"})
    };
    let receipt = json!({
        "kind": "dramatis-bench",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": env!("DRAMATIS_GIT"),
        "version": env!("CARGO_PKG_VERSION"),
        "unix_time": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "machine": machine(),
        "gpu": gpu,
        "geometry": serde_json::to_value(eng.geometry()).unwrap_or_default(),
        "floor": floor,
        "backend": facts.backend,
        "model": eng.model_id(),
        "expert_format": facts.expert_format,
        "load_seconds": load_s,
        "settings": {"text": a.text, "frames": a.frames, "runs": a.runs, "lanes": a.lanes, "context": 4096,
                      "reference_frames": a.reference_frames, "prompt_cache_gib": a.prompt_cache_gib,
                      "starts_per_round": a.starts_per_round,
                      "start_rows_per_round": a.start_rows_per_round, "codec_on_host": a.codec_on_host,
                      "codec_min_chunk": a.codec_min_chunk,
                      "cfg_gamma": a.cfg_gamma, "cfg_batched": a.cfg_batched,
                      "backend_env": backend_env(),
                      "prompt_rows": prompt_rows,
                      "note": "random-weight checkpoints may end early on EOS; frames/s counts frames generated"},
        "results": results,
        "prefill": prefill,
        "device_memory": device_memory_field,
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
    println!("| lanes | frames/s (all lanes) | decode frames/s | frames/s per lane | first audio (s) | RTF | of floor | in rounds (est.) | codec busy |");
    println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &receipt["results"].as_array().cloned().unwrap_or_default() {
        let of_floor = r["decode_fraction_of_floor"]
            .as_f64()
            .map(|f| {
                format!(
                    "{:.1}% of {:.0}",
                    100.0 * f,
                    r["floor_frames_per_s"].as_f64().unwrap_or(0.0)
                )
            })
            .unwrap_or_else(|| "-".into());
        let in_rounds = r["round_frames_per_s_estimate"]
            .as_f64()
            .map_or_else(|| "-".to_string(), |v| format!("{v:.0}"));
        let codec = r["codec"]["busy_fraction_of_runs"].as_f64().map_or_else(
            || "-".to_string(),
            |f| {
                format!(
                    "{:.0}% ({:.1} frames a call, {:.0} frames/s busy)",
                    100.0 * f,
                    r["codec"]["frames_per_call"].as_f64().unwrap_or(0.0),
                    r["codec"]["frames_per_busy_second"].as_f64().unwrap_or(0.0)
                )
            },
        );
        println!(
            "| {} | {:.1} | {:.1} | {:.1} | {:.4} | {:.4} | {of_floor} | {in_rounds} | {codec} |",
            r["lanes"],
            r["aggregate_frames_per_s_median"].as_f64().unwrap_or(0.0),
            r["decode_frames_per_s_median"].as_f64().unwrap_or(0.0),
            r["per_lane_frames_per_s_median"].as_f64().unwrap_or(0.0),
            r["time_to_first_audio_s_median"].as_f64().unwrap_or(0.0),
            r["real_time_factor_median"].as_f64().unwrap_or(0.0)
        );
    }
    if let Some(m) = &device_memory {
        println!("{}", device_memory_line(m));
        if let Some(l) = device_state_line(m) {
            println!("{l}");
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_codec_field_counts_the_runs_only() {
        let before = speech::CodecCounts {
            calls: 5,
            frames: 40,
            busy_seconds: 1.0,
        };
        let now = speech::CodecCounts {
            calls: 105,
            frames: 1240,
            busy_seconds: 2.5,
        };
        let f = codec_field(&now, &before, 2.0);
        assert_eq!(f["calls"], 100);
        assert_eq!(f["frames"], 1200);
        assert_eq!(f["frames_per_call"].as_f64(), Some(12.0));
        assert_eq!(f["busy_fraction_of_runs"].as_f64(), Some(0.75));
        assert_eq!(f["frames_per_busy_second"].as_f64(), Some(800.0));
        // no time inside the codec: no rate, rather than a division by zero
        let idle = codec_field(&before, &before, 2.0);
        assert!(idle["frames_per_busy_second"].is_null());
        assert!(idle["frames_per_call"].is_null());
    }

    #[test]
    fn the_floor_is_the_section_5_bytes_over_the_copy_rate() {
        let g = admission::geometry::ModelGeometry::drama3();
        let gpu = json!({"name": "NVIDIA H200", "cuda_driver": "13.0"});
        let mut results = vec![
            json!({"lanes": 1, "decode_frames_per_s_median": 72.3}),
            json!({"lanes": 32, "decode_frames_per_s_median": 350.0}),
        ];
        let floor = add_floor(&g, Some(&gpu), None, false, &mut results);
        // 5.95 GB of weights and 0.13 GB of state at 4.3 TB/s: about 707 frames/s for one stream
        let one = results[0]["floor_frames_per_s"].as_f64().unwrap();
        assert!((one - 707.5).abs() < 2.0, "{one}");
        let frac = results[0]["decode_fraction_of_floor"].as_f64().unwrap();
        assert!((frac - 0.1022).abs() < 0.0005, "{frac}");
        // 32 lanes share the dense weights: far more frames per second, far less than 32x
        let many = results[1]["floor_frames_per_s"].as_f64().unwrap();
        assert!(many > 5.0 * one && many < 32.0 * one, "{many}");
        // 5.9458 GB of weights + 0.1317 GB of state
        let bytes = floor["frame_bytes_one_lane"].as_f64().unwrap();
        assert!((bytes / 1e9 - 6.0775).abs() < 0.001, "{bytes}");
        // the H200 keeps GPU.md's figure; a measured rate is recorded beside it
        let copy = json!({"bytes_per_s": 2.0e12, "buffer_bytes": 512u64 << 20, "runs_s": [1e-3]});
        let mut again = vec![json!({"lanes": 1, "decode_frames_per_s_median": 72.3})];
        let f = add_floor(&g, Some(&gpu), Some(&copy), false, &mut again);
        assert_eq!(f["bandwidth_bytes_per_s"].as_f64(), Some(4.3e12));
        assert_eq!(f["measured_copy"]["bytes_per_s"].as_f64(), Some(2.0e12));
        assert_eq!(
            again[0]["floor_frames_per_s"],
            results[0]["floor_frames_per_s"]
        );
        // another device: the floor from the measured rate, in proportion to it
        let l4 = json!({"name": "NVIDIA L4"});
        let mut other = vec![json!({"lanes": 1, "decode_frames_per_s_median": 10.0})];
        let f = add_floor(&g, Some(&l4), Some(&copy), false, &mut other);
        assert_eq!(f["bandwidth_bytes_per_s"].as_f64(), Some(2.0e12));
        assert!(f["bandwidth_source"].as_str().unwrap().contains("512 MiB"));
        let measured = other[0]["floor_frames_per_s"].as_f64().unwrap();
        assert!((measured / one - 2.0 / 4.3).abs() < 1e-9, "{measured}");
        assert!(
            (other[0]["decode_fraction_of_floor"].as_f64().unwrap() - 10.0 / measured).abs()
                < 1e-12
        );
        // no bandwidth figure and no measure, no floor
        let mut other = vec![json!({"lanes": 1, "decode_frames_per_s_median": 10.0})];
        let f = add_floor(&g, Some(&l4), None, false, &mut other);
        assert!(f["note"].as_str().unwrap().contains("L4"));
        assert!(other[0].get("floor_frames_per_s").is_none());
        // a zero rate is no measure
        let zero = json!({"bytes_per_s": 0.0, "buffer_bytes": 1});
        let f = add_floor(&g, Some(&l4), Some(&zero), false, &mut other);
        assert!(f["note"]
            .as_str()
            .unwrap()
            .contains("could not be measured"));
        // guidance doubles the backbone rows: no floor rather than a wrong one
        let f = add_floor(&g, Some(&gpu), Some(&copy), true, &mut other);
        assert!(f["note"].as_str().unwrap().contains("guidance"));
        assert!(other[0].get("floor_frames_per_s").is_none());
    }

    fn memory(baseline: u64, peak: u64, planned: Option<u64>) -> DeviceMemory {
        DeviceMemory {
            baseline_used: baseline,
            peak: speech::DevicePeak {
                used_bytes: peak,
                samples: 40,
                interval_ms: 5,
            },
            planned,
            planned_classes: vec![("weights_backbone_bf16", 60_000), ("backbone_kv", 40_000)],
            prefill_peak: None,
            reserved: 40_000,
            state_planned: 40_000,
            state_used: Some(10_000),
        }
    }

    #[test]
    fn two_percent_boundary_is_exact_on_both_sides() {
        assert_eq!(within_plan(102_000, 100_000), Some(true));
        assert_eq!(within_plan(102_001, 100_000), Some(false));
        assert_eq!(within_plan(98_000, 100_000), Some(true));
        assert_eq!(within_plan(97_999, 100_000), Some(false));
        assert_eq!(within_plan(0, 0), None);
        // No overflow at the top of the range.
        assert_eq!(within_plan(u64::MAX, u64::MAX), Some(true));
        assert_eq!(within_plan(0, u64::MAX), Some(false));
    }

    #[test]
    fn receipt_field_subtracts_the_baseline_and_judges_against_the_plan() {
        let v = device_memory_json(&memory(1_000, 103_000, Some(100_000)));
        assert_eq!(v["baseline_used_bytes"], 1_000);
        assert_eq!(v["peak_used_bytes"], 103_000);
        assert_eq!(v["peak_engine_bytes"], 102_000);
        assert_eq!(v["planned_device_bytes"], 100_000);
        assert!((v["peak_over_plan"].as_f64().unwrap() - 1.02).abs() < 1e-12);
        assert_eq!(v["within_2_percent"], true);
        assert_eq!(v["planned_device_classes"]["backbone_kv"], 40_000);
        assert_eq!(v["samples"], 40);
        assert!(v["prefill_peak_used_bytes"].is_null());
        assert!(v["note"].as_str().unwrap().contains("baseline"));
        // the state used is reported against the state planned, apart from the peak
        assert_eq!(v["state_planned_bytes"], 40_000);
        assert_eq!(v["state_used_peak_bytes"], 10_000);
        assert!((v["state_used_of_planned"].as_f64().unwrap() - 0.25).abs() < 1e-12);
        let m = memory(1_000, 103_000, Some(100_000));
        assert!(device_state_line(&m).unwrap().contains("(25.0%"));

        let over = device_memory_json(&memory(1_000, 103_001, Some(100_000)));
        assert_eq!(over["within_2_percent"], false);
        let under = device_memory_json(&memory(1_000, 98_999, Some(100_000)));
        assert_eq!(under["peak_engine_bytes"], 97_999);
        assert_eq!(under["within_2_percent"], false);
    }

    #[test]
    fn receipt_field_without_a_plan_or_below_the_baseline() {
        let v = device_memory_json(&memory(5_000, 4_000, None));
        assert_eq!(v["peak_engine_bytes"], 0);
        assert!(v["planned_device_bytes"].is_null());
        assert!(v["peak_over_plan"].is_null());
        assert!(v["within_2_percent"].is_null());
        let mut m = memory(0, 10, Some(10));
        m.prefill_peak = Some(m.peak);
        assert_eq!(device_memory_json(&m)["prefill_peak_used_bytes"], 10);
    }

    #[test]
    fn human_line_names_units_share_and_verdict() {
        const GIB: u64 = 1 << 30;
        let m = memory(4 * GIB, 42 * GIB, Some(40 * GIB));
        assert_eq!(
            device_memory_line(&m),
            "device memory: peak 38.000 GiB engine (42.000 GiB in use, 4.000 GiB before load), \
             plan 40.000 GiB (95.0% of plan, outside 2%)"
        );
        assert!(device_memory_line(&memory(0, 10, None)).ends_with("no device plan"));
    }
}

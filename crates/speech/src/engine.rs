//! The engine: a loaded model, codec and tokenizer; requests validated and admitted before any
//! work; lanes advancing together in shared frame rounds on one worker thread.
//!
//! Each request's output depends only on the request (seed, text, references, settings): the
//! model's batched round is row-exact, the RNG is keyed by (seed, stream, step), and a lane's
//! state is fresh for every request.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use admission::{
    Admission, FrameCap, Frames, KvPool, Lanes, Limits, PromptRows, Rows, Window, WindowContract,
};
use checkpoint::Checkpoint;
use codec::{Codec, Codes, DecoderState};
use model::{Backend, FrameOut, LaneState, LaneStep, Model, SamplingParams};
use tokenizers::Tokenizer;
use tokio::sync::mpsc;

use crate::api::*;
use crate::pcm::PcmHasher;
use crate::prompt::{Prompt, PromptBuilder, PromptSpec, Reference};
use crate::voices::VoiceCatalog;
use crate::SpeechError;

/// Classifier-free guidance settings (DRAMA3.md section 7).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CfgOptions {
    pub gamma: f32,
    pub batched: bool,
    pub force_guided: bool,
    pub allow_request_gamma: bool,
}

#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// `None`: the built-in tiny synthetic checkpoint (random weights: noise).
    pub model_dir: Option<PathBuf>,
    pub parallel: usize,
    /// Waiting requests beyond the lanes; default 4 x lanes.
    pub queue: Option<usize>,
    /// Window C in rows; default the model maximum.
    pub context: Option<u64>,
    pub voices_dir: Option<PathBuf>,
    pub prompt_cache_gib: f64,
    pub cfg: CfgOptions,
    pub limits: Limits,
    /// Host memory budget override (GiB); default `MemAvailable`.
    pub host_gib: Option<f64>,
    /// Device memory budget override (GiB) for the CUDA backend; default the device's free
    /// memory at start-up.
    pub device_gib: Option<f64>,
    pub backend: BackendChoice,
    /// Decoded audio a job may hold that its caller has not read yet (seconds): beyond it the
    /// job's lane sits out frame rounds until the caller reads (a slow streaming client slows
    /// its own job; the engine's memory stays bounded and nothing is dropped).
    pub max_unread_audio_seconds: f64,
    /// How long a job may stay paused for a caller that reads nothing before it is stopped
    /// (its caller then gets a `Failed` event naming the figures), so a stalled client cannot
    /// hold a lane and its KV rows for ever.
    pub max_pause_seconds: f64,
    /// Waiting jobs started (prefilled) between two frame rounds, at most; 0: no cap on their
    /// count (`start_rows_per_round` still bounds their rows). A limit lets the lanes already
    /// started get their first audio out while a burst of prompts is still being prefilled; a
    /// lane's frames do not depend on the lanes beside it, so no output changes.
    pub starts_per_round: usize,
    /// Prompt rows to prefill (`Worker::prefill_rows`: a cached reference prefix not counted, a
    /// guided request's second prompt counted) started between two frame rounds, at most:
    /// `None` is the plan's prefill chunk (one joined prefill a round), `Some(0)` no limit. At
    /// least one waiting job starts each time whatever its rows, so none waits for ever. A
    /// burst of requests is started a joined prefill at a time, each group's lanes decoding
    /// while the next prefills (32 requests of 64 rows on the H200: median first audio 0.92 ->
    /// 0.53 s, frames/s no lower); a lane's frames do not depend on the lanes beside it, so no
    /// output changes.
    pub start_rows_per_round: Option<usize>,
    /// Decode audio (and encode reference clips) on the host even when the model runs on CUDA,
    /// so the GPU runs the model alone: for measuring what the GPU codec costs the frame rounds.
    /// The host codec is far slower at Drama 3 geometry. The memory plan is unchanged (it
    /// still counts the codec on the device).
    pub codec_on_host: bool,
    /// Frames one decoder call gathers for a job whose audio is well ahead of real time (held
    /// at most 100 ms, and never while the job's audio is less than 0.25 s ahead, so a
    /// streaming caller never waits on it); 1 decodes every frame as it comes. The first audio
    /// always goes out at once.
    pub codec_min_chunk: usize,
}

/// Which compute backend runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendChoice {
    #[default]
    Cpu,
    Cuda,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            model_dir: None,
            parallel: 1,
            queue: None,
            context: None,
            voices_dir: None,
            prompt_cache_gib: 1.0,
            cfg: CfgOptions::default(),
            limits: Limits::default(),
            host_gib: None,
            device_gib: None,
            backend: BackendChoice::Cpu,
            max_unread_audio_seconds: DEFAULT_MAX_UNREAD_AUDIO_SECONDS,
            max_pause_seconds: DEFAULT_MAX_PAUSE_SECONDS,
            starts_per_round: 0,
            start_rows_per_round: None,
            codec_on_host: false,
            codec_min_chunk: DEFAULT_CODEC_MIN_CHUNK,
        }
    }
}

/// Default of [`EngineOptions::max_unread_audio_seconds`]: 30 s is about 5.3 MB of f32 PCM at
/// 44.1 kHz per job, and well ahead of any caller that plays the stream as it arrives.
pub const DEFAULT_MAX_UNREAD_AUDIO_SECONDS: f64 = 30.0;

/// Default of [`EngineOptions::max_pause_seconds`].
pub const DEFAULT_MAX_PAUSE_SECONDS: f64 = 120.0;

#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct EngineStats {
    pub prompt_cache_hits: u64,
    pub prompt_cache_misses: u64,
    pub lanes: usize,
    pub lanes_busy: usize,
    pub queued: usize,
    pub frames_total: u64,
    /// Jobs that `starts_per_round` or `start_rows_per_round` left waiting for a later round
    /// while a lane was free for them (each counted once).
    pub starts_deferred: u64,
    /// The most jobs started between two frame rounds.
    pub starts_most: u64,
    /// Lanes prefilled in a joined prefill (`Model::prefill_joined`) with at least one other.
    pub prefills_joined: u64,
    /// How the frame rounds ran (host-drawn, kept: replayed, recorded or issued).
    pub rounds: model::RoundCounts,
    /// The codec thread's decoder calls, the frames they decoded and the seconds spent in them.
    pub codec: CodecCounts,
}

/// What the codec thread has done: decoder calls (one job's backlog each), frames decoded and
/// the wall time inside the calls. Busy seconds near the elapsed time mean the codec, not the
/// frame rounds, paces the audio.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct CodecCounts {
    pub calls: u64,
    pub frames: u64,
    pub busy_seconds: f64,
}

/// The codec thread's counters, shared with `Engine::stats`.
#[derive(Default)]
struct CodecMeter {
    calls: AtomicU64,
    frames: AtomicU64,
    busy_ns: AtomicU64,
}

impl CodecMeter {
    /// Runs one decoder call of `frames` frames: its time counts either way (the thread was
    /// busy), the call and its frames only when it decoded.
    fn call<T>(&self, frames: usize, f: impl FnOnce() -> Result<T, String>) -> Result<T, String> {
        let t0 = Instant::now();
        let out = f();
        self.busy_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if out.is_ok() {
            self.calls.fetch_add(1, Ordering::Relaxed);
            self.frames.fetch_add(frames as u64, Ordering::Relaxed);
        }
        out
    }

    fn counts(&self) -> CodecCounts {
        CodecCounts {
            calls: self.calls.load(Ordering::Relaxed),
            frames: self.frames.load(Ordering::Relaxed),
            busy_seconds: self.busy_ns.load(Ordering::Relaxed) as f64 * 1e-9,
        }
    }
}

/// Sampling defaults from `generation_config.json`, else SPEC.md's.
#[derive(Debug, Clone, Copy)]
struct Defaults {
    temperature: f32,
    top_p: f32,
    top_k: u32,
}

/// A request ready to run: every segment's prompt built and admitted.
struct Job {
    seed: u64,
    params: SamplingParams,
    segments: Vec<(Prompt, Admission)>,
    /// The reference prefix every segment's prompt starts with (segments hold only their own rows).
    prefix: Vec<crate::prompt::Row>,
    /// The prompt cache's key of `prefix` (none without one), made once at submission.
    prefix_key: Option<[u8; 32]>,
    /// Guidance: γ and, per segment, the unconditional prompt (the same text, no references).
    guidance: Option<(f32, Vec<Prompt>)>,
    /// Largest P + F + 1 over the segments: the rows the conditional lane is sized for.
    lane_rows: u64,
    /// KV rows reserved from the pool: `lane_rows`, plus the unconditional branch's when guided.
    rows: u64,
    cap: CapApplied,
    frame_cap: u64,
    events: mpsc::UnboundedSender<JobEvent>,
    cancel: Arc<AtomicBool>,
    /// Samples of the frames made for this job (decoded or not) that its caller has not yet
    /// received.
    unread: Arc<AtomicU64>,
    submitted: Instant,
    /// Whether `starts_per_round` has held this job back once (counted once in
    /// `EngineStats::starts_deferred`).
    deferred: bool,
}

impl Job {
    /// The prompt cache's key of the prefix's first `p` rows: the one made at submission when
    /// `p` is the whole prefix (every segment with references starts with all of it).
    fn prefix_key_of(&self, p: usize) -> [u8; 32] {
        match self.prefix_key {
            Some(k) if p == self.prefix.len() => k,
            _ => prefix_key(&to_rows(&self.prefix[..p])),
        }
    }
}

/// The caller's side of a running job. Dropping it cancels the job at its next frame. Events
/// are read through [`JobHandle::recv`] or [`JobHandle::blocking_recv`], which count the audio
/// read so that a caller that falls behind pauses its own job instead of piling up audio.
pub struct JobHandle {
    events: mpsc::UnboundedReceiver<JobEvent>,
    seed: u64,
    cancel: Arc<AtomicBool>,
    unread: Arc<AtomicU64>,
}

impl JobHandle {
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The job's next event (`None` once the engine has dropped the job's sender).
    pub async fn recv(&mut self) -> Option<JobEvent> {
        let ev = self.events.recv().await;
        self.read(&ev);
        ev
    }

    /// As [`JobHandle::recv`], blocking the thread (not for use inside an async runtime).
    pub fn blocking_recv(&mut self) -> Option<JobEvent> {
        let ev = self.events.blocking_recv();
        self.read(&ev);
        ev
    }

    /// Samples of this job's frames generated so far and not read yet (decoded or waiting for
    /// the codec).
    pub fn unread_samples(&self) -> u64 {
        self.unread.load(Ordering::SeqCst)
    }

    fn read(&self, ev: &Option<JobEvent>) {
        if let Some(JobEvent::Audio(a)) = ev {
            let n = a.len() as u64;
            // never below zero, whatever the order of the two sides
            let _ = self
                .unread
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                    Some(u.saturating_sub(n))
                });
        }
    }
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::SeqCst);
    }

    /// Blocks until the job ends, collecting its PCM (for `say` and tests).
    pub fn wait(mut self) -> Result<(Vec<f32>, JobSummary), String> {
        let mut pcm = Vec::new();
        while let Some(ev) = self.blocking_recv() {
            match ev {
                JobEvent::Started { .. } => {}
                JobEvent::Audio(a) => pcm.extend_from_slice(&a),
                JobEvent::Done(s) => return Ok((pcm, s)),
                JobEvent::Failed(e) => return Err(e),
            }
        }
        Err("the engine stopped before the job finished".into())
    }
}

impl Drop for JobHandle {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::SeqCst);
    }
}

struct Shared {
    queue: VecDeque<Job>,
    busy: usize,
    shutdown: bool,
    /// The worker has stopped (after shutdown, everything settled).
    stopped: bool,
}

pub struct Engine {
    model_id: String,
    backend_name: String,
    expert_format: String,
    contract: WindowContract,
    /// Bytes one whole reply may hold (see `load`).
    whole_reply_budget: u64,
    /// The memory plan start-up admitted, kept so receipts can set measured memory against it.
    plan: admission::Plan,
    /// The checkpoint's geometry as admission sees it (receipts compute floors from it).
    geometry: admission::geometry::ModelGeometry,
    limits: Limits,
    lanes: usize,
    queue_cap: usize,
    pool: KvPool,
    defaults: Defaults,
    cfg: CfgOptions,
    tokenizer: Tokenizer,
    spec: PromptSpec,
    codec: Codec,
    /// The reference-clip encoder on the GPU when the engine runs on CUDA (the CPU codec
    /// encodes otherwise).
    #[cfg(feature = "cuda")]
    gpu_encoder: Option<codec_cuda::CudaEncoder>,
    voices: VoiceCatalog,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    frames_total: Arc<AtomicU64>,
    starts_deferred: Arc<AtomicU64>,
    starts_most: Arc<AtomicU64>,
    prefills_joined: Arc<AtomicU64>,
    codec_meter: Arc<CodecMeter>,
    /// The model's frame-round counters (shared with the worker's model).
    round_stats: Arc<model::RoundStats>,
    /// Device bytes the backend reserved at start-up for the plan's state (0 on the CPU).
    device_reserved: u64,
    cache_hits: Arc<AtomicU64>,
    cache_misses: Arc<AtomicU64>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn err(e: impl std::fmt::Display) -> SpeechError {
    SpeechError::Engine(e.to_string())
}

/// Sentence groups per request: each is its own prompt (and prefill), so their number is bounded.
pub const MAX_SEGMENTS: usize = 4096;

/// The K/V precision the engine runs with: f32 on both backends (BF16 K/V is opt-in on CUDA,
/// `DRAMATIS_CUDA_KV=bf16`: it fails the fixture's 1e-3 logits tolerance, as the CPU does with
/// K/V rounded to BF16; NOTES.md).
pub fn kv_dtype(cuda: bool) -> admission::KvDtype {
    let bf16 = std::env::var("DRAMATIS_CUDA_KV").is_ok_and(|v| v.eq_ignore_ascii_case("bf16"));
    if cuda && bf16 {
        admission::KvDtype::Bf16
    } else {
        admission::KvDtype::F32
    }
}

fn limit_err(e: admission::LimitError) -> RequestError {
    let code = e.code();
    match e.kind() {
        admission::RefusalKind::InvalidRequest => RequestError::invalid(code, None, e.to_string()),
        admission::RefusalKind::LimitExceeded => RequestError::limit(code, None, e.to_string()),
        admission::RefusalKind::Overloaded => RequestError {
            kind: RequestErrorKind::Overloaded,
            code: code.into(),
            param: None,
            message: e.to_string(),
        },
    }
}

fn with_param(mut e: RequestError, p: &str) -> RequestError {
    e.param = Some(p.to_string());
    e
}

impl Engine {
    /// Loads everything and starts the worker; failures release what was taken (RAII).
    pub fn load(opts: EngineOptions) -> Result<Arc<Engine>, SpeechError> {
        let g = opts.cfg.gamma;
        if !(g.is_finite() && (0.0..=10.0).contains(&g)) {
            return Err(SpeechError::Engine(format!(
                "--cfg-gamma must be a finite number in [0, 10], got {g}"
            )));
        }
        for (what, v) in [
            ("max unread audio", opts.max_unread_audio_seconds),
            ("max pause", opts.max_pause_seconds),
        ] {
            if !(v.is_finite() && v > 0.0 && v < 1e9) {
                return Err(SpeechError::Engine(format!(
                    "{what} must be a positive number of seconds below 1e9, got {v}"
                )));
            }
        }
        for (flag, v) in [
            ("--host-gib", opts.host_gib),
            ("--device-gib", opts.device_gib),
            ("--prompt-cache-gib", Some(opts.prompt_cache_gib)),
        ] {
            if let Some(v) = v {
                if admission::Bytes::from_gib_f64(v).is_none() {
                    return Err(SpeechError::Engine(format!(
                        "{flag} {v}: must be a finite, non-negative number of GiB below 2^64 bytes"
                    )));
                }
            }
        }
        let dir = match &opts.model_dir {
            Some(d) => d.clone(),
            None => crate::builtin::ensure_builtin().map_err(err)?,
        };
        let ck = Checkpoint::open(&dir)
            .map_err(|e| SpeechError::Engine(format!("{}: {e}", dir.display())))?;
        let tokenizer = Tokenizer::from_file(ck.tokenizer_path()).map_err(|e| {
            SpeechError::Tokenizer(format!("{}: {e}", ck.tokenizer_path().display()))
        })?;
        let codec =
            Codec::load(&dir, None).map_err(|e| SpeechError::Engine(format!("codec: {e}")))?;
        let cfg = &ck.config;
        let spec = PromptSpec {
            semantic_start: cfg.semantic_start_token_id,
            num_codebooks: cfg.num_codebooks(),
            semantic_codebook_size: codec.config().semantic_codebook_size,
            residual_codebook_size: codec.config().codebook_size,
        };
        if codec.num_codebooks() != cfg.num_codebooks() {
            return Err(SpeechError::Engine(format!(
                "codec has {} codebooks but config.json says {}",
                codec.num_codebooks(),
                cfg.num_codebooks()
            )));
        }
        let max = cfg.text_config.max_position_embeddings as u64;
        let window = opts.context.unwrap_or(max);
        let contract =
            WindowContract::new(Window(window), Window(max), opts.limits.default_frame_cap)
                .map_err(|e| SpeechError::Engine(e.to_string()))?;
        let lanes = opts.parallel.max(1);
        let queue_cap = opts.queue.unwrap_or(4 * lanes);
        // The memory plan of ADMISSION.md, before anything else is allocated: weights, per-lane
        // state, KV pool (C rows per lane), codec, PCM, caches, against the host budget.
        let mut geom = crate::builtin::admission_geometry(&ck).map_err(err)?;
        geom.codec.sample_rate = u64::from(codec.sample_rate());
        geom.codec.frame_length = codec.frame_length() as u64;
        geom.codec.state_bytes_per_lane = codec.decoder_state_bytes() as u64;
        // each lane's share of the decoder workspace: one frame, or more where one lane's
        // share of `codec_min_chunk` frames needs it (a call for one job takes at most
        // `codec_job_frames`)
        let codec_min_chunk = opts.codec_min_chunk.clamp(1, CODEC_MAX_CHUNK);
        let codec_lane_frames = codec_min_chunk.div_ceil(lanes);
        let codec_job_frames = lanes * codec_lane_frames;
        let codec_on_gpu =
            cfg!(feature = "cuda") && opts.backend == BackendChoice::Cuda && !opts.codec_on_host;
        // the GPU decoder's step: its largest call for one job, one step (its fixed cost paid
        // once); each stream's KV ring holds one step beyond the window
        let codec_step = codec_step_frames(
            std::env::var("DRAMATIS_CODEC_STEP").ok().as_deref(),
            codec_job_frames,
        );
        // the GPU decoder also decodes several jobs in one call, of up to
        // CODEC_TOGETHER_LANE_FRAMES frames a lane in all, and a step set above the largest
        // call (`DRAMATIS_CODEC_STEP`) takes its share of the workspace too
        let workspace_lane_frames = if codec_on_gpu {
            codec_lane_frames
                .max(CODEC_TOGETHER_LANE_FRAMES)
                .max(codec_step.div_ceil(lanes))
        } else {
            codec_lane_frames
        };
        geom.codec.workspace_bytes_per_lane =
            codec.decoder_workspace_bytes(workspace_lane_frames) as u64;
        if codec_on_gpu {
            geom.codec.state_bytes_per_lane +=
                (codec_step * codec.decoder_ring_bytes_per_step_frame()) as u64;
        }
        // The codec's weights as stored (f32 in codec.pth): an upper bound on what the codec
        // keeps resident, on the host (CPU codec) or the device (GPU decoder and encoder).
        geom.codec.weight_bytes = std::fs::metadata(dir.join("codec.pth"))
            .map(|m| m.len())
            .unwrap_or(0);
        let kv = kv_dtype(opts.backend == BackendChoice::Cuda);
        let kv_bytes = kv.bytes();
        let per_row = geom
            .backbone_kv_bytes_per_row(kv_bytes)
            .and_then(|a| geom.tower_kv_bytes_per_row(kv_bytes).map(|b| a + b))
            .map_err(|e| SpeechError::Engine(e.to_string()))?;
        // With guidance possible, each lane may hold a second (unconditional) window of rows.
        let cfg_possible =
            opts.cfg.gamma > 0.0 || opts.cfg.force_guided || opts.cfg.allow_request_gamma;
        let pool_rows = window
            .checked_mul(lanes as u64)
            .and_then(|r| r.checked_mul(if cfg_possible { 2 } else { 1 }))
            .ok_or_else(|| SpeechError::Engine("window x lanes overflows".into()))?;
        let mut req = admission::PlanRequest::new(match opts.backend {
            BackendChoice::Cpu => admission::Backend::Cpu,
            BackendChoice::Cuda => admission::Backend::Cuda,
        });
        req.context = Some(Window(window));
        req.kv = Some(kv);
        req.lanes = Lanes(lanes as u64);
        req.cfg = cfg_possible;
        req.prompt_cache =
            admission::Bytes::from_gib_f64(opts.prompt_cache_gib).unwrap_or(admission::Bytes(0));
        req.limits = opts.limits;
        // Replies are streamed to their caller chunk by chunk; the engine keeps no whole buffer.
        req.reply = admission::ReplyMode::Streamed;
        let host_flag = opts.host_gib.and_then(admission::Bytes::from_gib_f64);
        req.host_budget =
            admission::MemoryBudget::choose(host_flag, admission::host_mem_available());
        // the device side is checked against the device (or --device-gib) before anything is
        // loaded; what the plan admits is then reserved once the weights are in
        if opts.backend == BackendChoice::Cuda {
            req.device_budget = crate::device_memory::device_budget(
                opts.device_gib.and_then(admission::Bytes::from_gib_f64),
            );
        }
        let plan = admission::plan(&geom, &req);
        // What the host has beyond the plan, shared by every request that may be in flight, is
        // what one whole (not streamed) reply may hold.
        let whole_reply_budget = plan
            .total(admission::Memory::Host)
            .and_then(|t| t.budget.map(|b| b.bytes.0.saturating_sub(t.needed.0)))
            .map(|free| free / (lanes as u64 + queue_cap as u64).max(1))
            .unwrap_or(u64::MAX);
        if !plan.is_admitted() {
            return Err(SpeechError::Engine(format!(
                "start-up refused by the memory plan (use --context, --parallel, --host-gib or --device-gib):\n{}",
                plan.render_table()
            )));
        }
        let pool = KvPool::new(Rows(pool_rows), Lanes(lanes as u64))
            .ok_or_else(|| SpeechError::Engine("cannot size the KV pool".into()))?;
        let gen = read_generation_defaults(&dir);
        let voices_dir = opts
            .voices_dir
            .clone()
            .unwrap_or_else(VoiceCatalog::default_dir);
        let frame_seconds = codec.frame_length() as f64 / codec.sample_rate() as f64;
        let voices = VoiceCatalog::open(&voices_dir, frame_seconds)
            .map_err(|e| SpeechError::Engine(format!("voices {}: {e}", voices_dir.display())))?;
        let shared = Arc::new((
            Mutex::new(Shared {
                queue: VecDeque::new(),
                busy: 0,
                shutdown: false,
                stopped: false,
            }),
            Condvar::new(),
        ));
        let frames_total = Arc::new(AtomicU64::new(0));
        let starts_deferred = Arc::new(AtomicU64::new(0));
        let starts_most = Arc::new(AtomicU64::new(0));
        let prefills_joined = Arc::new(AtomicU64::new(0));
        let codec_meter = Arc::new(CodecMeter::default());
        let cache_hits = Arc::new(AtomicU64::new(0));
        let cache_misses = Arc::new(AtomicU64::new(0));
        #[cfg(feature = "cuda")]
        let mut gpu_encoder = None;
        // the host codec: the CPU engine's, or `--codec-on-host`'s
        let host_decoders = || -> DecoderFactory {
            let c = codec.clone();
            Box::new(move || Ok(Box::new(c.decoder_state()) as Box<dyn StreamDecoder>))
        };
        #[allow(unused_mut)] // set by the CUDA build's GPU decoder
        let mut together = None;
        let decoders: DecoderFactory = match opts.backend {
            _ if opts.codec_on_host => host_decoders(),
            BackendChoice::Cpu => host_decoders(),
            #[cfg(feature = "cuda")]
            BackendChoice::Cuda => {
                // The streaming decoder on the GPU, on its own stream (overlaps the model's), and
                // the reference-clip encoder beside it on that device and stream (codec.pth is
                // read once for both).
                let gpu_err =
                    |e: codec_cuda::CudaCodecError| SpeechError::Engine(format!("GPU codec: {e}"));
                let sd = checkpoint::pth::read_pth(&codec_cuda::pth_path(&dir))
                    .map_err(|e| gpu_err(e.into()))?;
                let gpu = Arc::new(backend_cuda::Gpu::new(0).map_err(|e| gpu_err(e.into()))?);
                let gpu_codec =
                    codec_cuda::CudaDecoder::from_state_dict(gpu.clone(), &sd, codec.config())
                        .map_err(gpu_err)?;
                // its step: the largest call of one job (a call over several jobs takes each
                // job's frames in one step too; the scratch grows to the plan's workspace)
                gpu_codec.set_step_frames(codec_step);
                gpu_encoder = Some(
                    codec_cuda::CudaEncoder::from_state_dict(gpu, &sd, codec.config())
                        .map_err(gpu_err)?,
                );
                // several jobs' frames in one call (`DRAMATIS_CODEC_TOGETHER=0`: a call a job)
                if codec_together_from(std::env::var("DRAMATIS_CODEC_TOGETHER").ok().as_deref()) {
                    let dec = gpu_codec.clone();
                    together = Some(Together {
                        decode: Box::new(move |states, codes| {
                            let mut sts = Vec::with_capacity(states.len());
                            for s in states.iter_mut() {
                                sts.push(
                                    s.as_any()
                                        .downcast_mut::<codec_cuda::CudaDecoderState>()
                                        .ok_or("a decoder state of another kind")?,
                                );
                            }
                            let refs: Vec<&Codes> = codes.iter().collect();
                            dec.push_many(&mut sts, &refs).map_err(|e| e.to_string())
                        }),
                        frames: lanes * workspace_lane_frames,
                    });
                }
                Box::new(move || {
                    gpu_codec
                        .state()
                        .map(|s| Box::new(s) as Box<dyn StreamDecoder>)
                        .map_err(|e| e.to_string())
                })
            }
            #[cfg(not(feature = "cuda"))]
            BackendChoice::Cuda => Box::new(|| Err("no CUDA in this build".to_string())),
        };
        let ctx = WorkerCtx {
            decoders,
            together,
            cache_budget: admission::Bytes::from_gib_f64(opts.prompt_cache_gib)
                .map(|b| b.0)
                .unwrap_or(0),
            cache_per_row: per_row,
            cache_fixed: geom.gdn_state_bytes().unwrap_or(0),
            cache_hits: Arc::clone(&cache_hits),
            cache_misses: Arc::clone(&cache_misses),
            cfg_batched: opts.cfg.batched,
            codec: codec.clone(),
            pool: pool.clone(),
            lanes,
            shared: Arc::clone(&shared),
            frames_total: Arc::clone(&frames_total),
            starts_per_round: opts.starts_per_round,
            start_rows: match opts.start_rows_per_round {
                None => usize::try_from(req.prefill_chunk_rows.0).unwrap_or(usize::MAX),
                Some(0) => usize::MAX,
                Some(r) => r,
            },
            starts_deferred: Arc::clone(&starts_deferred),
            starts_most: Arc::clone(&starts_most),
            prefills_joined: Arc::clone(&prefills_joined),
            codec_meter: Arc::clone(&codec_meter),
            codec_chunks: CodecChunks {
                max: codec_job_frames,
                min: codec_min_chunk,
                max_hold: CODEC_MAX_HOLD,
            },
            // at least one frame, so a tiny limit still lets every job advance
            max_unread_samples: ((opts.max_unread_audio_seconds * f64::from(codec.sample_rate()))
                as u64)
                .max(codec.frame_length() as u64),
            max_pause: std::time::Duration::from_secs_f64(opts.max_pause_seconds),
            prefill_chunk: usize::try_from(req.prefill_chunk_rows.0).unwrap_or(usize::MAX),
            device_reserve: plan.device_state_bytes().0,
        };
        let (handle, backend_name, round_stats, device_reserved) = match opts.backend {
            BackendChoice::Cpu => spawn_worker(&ck, backend_cpu::CpuBackend::new(), ctx)?,
            #[cfg(feature = "cuda")]
            BackendChoice::Cuda => {
                let be = backend_cuda::CudaBackend::new()
                    .map_err(|e| SpeechError::Engine(format!("CUDA: {e}")))?;
                spawn_worker(&ck, be, ctx)?
            }
            #[cfg(not(feature = "cuda"))]
            BackendChoice::Cuda => {
                return Err(SpeechError::Engine(
                    "this build has no CUDA backend: rebuild with --features cuda".into(),
                ))
            }
        };
        Ok(Arc::new(Engine {
            model_id: model_id(&dir, opts.model_dir.is_none()),
            backend_name,
            expert_format: ck.expert_format.name().to_string(),
            contract,
            whole_reply_budget,
            plan,
            geometry: geom,
            limits: opts.limits,
            lanes,
            queue_cap,
            pool,
            defaults: gen,
            cfg: opts.cfg,
            tokenizer,
            spec,
            codec,
            #[cfg(feature = "cuda")]
            gpu_encoder,
            voices,
            shared,
            frames_total,
            starts_deferred,
            starts_most,
            prefills_joined,
            codec_meter,
            round_stats,
            device_reserved,
            cache_hits,
            cache_misses,
            worker: Mutex::new(Some(handle)),
        }))
    }

    pub fn model_id(&self) -> String {
        self.model_id.clone()
    }
    pub fn limits(&self) -> &Limits {
        &self.limits
    }
    pub fn voices(&self) -> &VoiceCatalog {
        &self.voices
    }
    pub fn codec(&self) -> &Codec {
        &self.codec
    }
    pub fn contract(&self) -> &WindowContract {
        &self.contract
    }

    /// The memory plan start-up admitted (ADMISSION.md); `render_table` prints it.
    pub fn memory_plan(&self) -> &admission::Plan {
        &self.plan
    }

    /// The checkpoint's geometry as admission sees it.
    pub fn geometry(&self) -> &admission::geometry::ModelGeometry {
        &self.geometry
    }

    /// Device bytes the plan accounts for (weights, KV pool, state, codec, staging); `None` on
    /// the CPU backend, whose plan has no device side.
    pub fn planned_device_bytes(&self) -> Option<u64> {
        self.plan
            .total(admission::Memory::Device)
            .map(|t| t.needed.0)
    }

    /// Device bytes the pool kept reserved at start-up for the plan's state beyond the weights
    /// (KV pool, lane state, scratch, codec state, caches), as the driver reports it: 0 on the
    /// CPU backend.
    pub fn reserved_device_bytes(&self) -> u64 {
        self.device_reserved
    }

    /// The plan's device state beyond the weights: what start-up asked the backend to reserve.
    pub fn planned_device_state_bytes(&self) -> u64 {
        self.plan.device_state_bytes().0
    }

    pub fn facts(&self) -> SpeechFacts {
        SpeechFacts {
            window_rows: self.contract.window.0,
            prompt_rows_max: self.contract.prompt_rows_max().0,
            frames_default: self.limits.default_frame_cap.0,
            frames_max: self.contract.frames_max().0,
            sample_rate: self.codec.sample_rate(),
            frame_length: self.codec.frame_length() as u32,
            codebooks: self.codec.num_codebooks() as u32,
            input_policy: serde_json::to_value(self.limits.input_policy).unwrap_or_default(),
            reference_limits: serde_json::to_value(self.limits.reference_limits)
                .unwrap_or_default(),
            lanes: self.lanes as u32,
            backend: self.backend_name.clone(),
            expert_format: self.expert_format.clone(),
        }
    }

    pub fn stats(&self) -> EngineStats {
        let s = self.shared.0.lock().unwrap_or_else(|e| e.into_inner());
        EngineStats {
            prompt_cache_hits: self.cache_hits.load(Ordering::Relaxed),
            prompt_cache_misses: self.cache_misses.load(Ordering::Relaxed),
            lanes: self.lanes,
            lanes_busy: s.busy,
            queued: s.queue.len(),
            frames_total: self.frames_total.load(Ordering::Relaxed),
            starts_deferred: self.starts_deferred.load(Ordering::Relaxed),
            starts_most: self.starts_most.load(Ordering::Relaxed),
            prefills_joined: self.prefills_joined.load(Ordering::Relaxed),
            rounds: self.round_stats.counts(),
            codec: self.codec_meter.counts(),
        }
    }

    /// Encodes a WAV clip into reference codes (frame-major). The clip's length is checked
    /// against the per-passage frame limit before any resampling or encoding.
    pub fn encode_clip(
        &self,
        wav: &[u8],
        index: u64,
        param: &str,
    ) -> Result<Vec<Vec<i64>>, RequestError> {
        let bad =
            |e: SpeechError| RequestError::invalid("invalid_audio", Some(param), e.to_string());
        let (mono, rate) = crate::pcm::decode_wav(wav).map_err(bad)?;
        let target = u64::from(self.codec.sample_rate());
        let samples = (mono.len() as u64).saturating_mul(target) / u64::from(rate);
        let frames = samples.div_ceil(self.codec.frame_length() as u64);
        self.limits
            .check_reference_frames(index, admission::ReferenceFrames(frames))
            .map_err(|e| with_param(limit_err(e), param))?;
        let pcm = crate::pcm::resample(&mono, rate, self.codec.sample_rate()).map_err(bad)?;
        let codes = self.encode_pcm(&pcm, param)?;
        Ok((0..codes.frames())
            .map(|f| {
                (0..codes.num_codebooks())
                    .map(|c| i64::from(codes.get(c, f)))
                    .collect()
            })
            .collect())
    }

    /// 44.1 kHz reference PCM to codes: on the GPU when the engine runs on CUDA, else with the
    /// CPU codec (the same codes, the same errors for bad audio).
    fn encode_pcm(&self, pcm: &[f32], param: &str) -> Result<Codes, RequestError> {
        let bad = |m: String| {
            RequestError::invalid(
                "invalid_audio",
                Some(param),
                SpeechError::Audio(m).to_string(),
            )
        };
        #[cfg(feature = "cuda")]
        if let Some(enc) = &self.gpu_encoder {
            match enc.encode(pcm) {
                Ok(codes) => return Ok(codes),
                Err(codec_cuda::CudaCodecError::Codec(e)) => return Err(bad(e.to_string())),
                // a device fault does not fail the request: the CPU codec gives the same codes
                Err(e) => tracing::warn!("GPU codec encoder failed, encoding on the CPU: {e}"),
            }
        }
        self.codec.encode(pcm).map_err(|e| bad(e.to_string()))
    }

    /// Adds a voice: the clip is encoded once and stored with its transcript.
    pub fn add_voice(
        &self,
        name: &str,
        wav: &[u8],
        transcript: &str,
    ) -> Result<crate::voices::VoiceInfo, RequestError> {
        if transcript.trim().is_empty() {
            return Err(RequestError::invalid(
                "empty_transcript",
                Some("text"),
                "a voice needs the transcript of its clip",
            ));
        }
        self.limits
            .check_transcript(1, transcript)
            .map_err(|e| with_param(limit_err(e), "text"))?;
        crate::prompt::validate_text(transcript, "voice transcript")
            .map_err(|e| RequestError::invalid(speech_code(&e), Some("text"), e.to_string()))?;
        let codes = self.encode_clip(wav, 1, "audio")?;
        self.limits
            .check_reference_frames(1, admission::ReferenceFrames(codes.len() as u64))
            .map_err(|e| with_param(limit_err(e), "audio"))?;
        let voice = crate::voices::Voice {
            name: name.to_string(),
            transcript: transcript.to_string(),
            frames: codes.len(),
            codes,
            clip_sha256: hex::encode(<sha2::Sha256 as sha2::Digest>::digest(wav)),
            created_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
        };
        self.voices.put(&voice)
    }

    /// Validates, admits and enqueues. Every refusal happens here, before any audio exists.
    pub fn submit(self: &Arc<Self>, req: SynthesisRequest) -> Result<JobHandle, RequestError> {
        let job_parts = self.prepare(&req)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let unread = Arc::new(AtomicU64::new(0));
        let seed = job_parts.seed;
        let job = Job {
            seed,
            params: job_parts.params,
            rows: job_parts.rows,
            lane_rows: job_parts.lane_rows,
            cap: job_parts.cap,
            frame_cap: job_parts.frame_cap,
            segments: job_parts.segments,
            guidance: job_parts.guidance,
            prefix_key: (!job_parts.prefix.is_empty())
                .then(|| prefix_key(&to_rows(&job_parts.prefix))),
            prefix: job_parts.prefix,
            events: tx,
            cancel: Arc::clone(&cancel),
            deferred: false,
            unread: Arc::clone(&unread),
            submitted: Instant::now(),
        };
        {
            let (m, cv) = &*self.shared;
            let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
            if s.stopped {
                return Err(RequestError {
                    kind: RequestErrorKind::Server,
                    code: "engine_stopped".into(),
                    param: None,
                    message: "the engine has stopped and takes no more requests".into(),
                });
            }
            if s.shutdown {
                return Err(RequestError {
                    kind: RequestErrorKind::Overloaded,
                    code: "shutting_down".into(),
                    param: None,
                    message: "the server is shutting down".into(),
                });
            }
            let waiting = s.queue.len() + s.busy;
            if waiting >= self.lanes + self.queue_cap {
                return Err(RequestError {
                    kind: RequestErrorKind::Overloaded,
                    code: "overloaded".into(),
                    param: None,
                    message: format!(
                        "all {} lanes are busy and the queue holds its limit of {} requests; retry shortly",
                        self.lanes, self.queue_cap
                    ),
                });
            }
            s.queue.push_back(job);
            cv.notify_all();
        }
        Ok(JobHandle {
            events: rx,
            seed,
            cancel,
            unread,
        })
    }

    /// The assembled prompt rows P of each segment of `req`, exactly as admission counts them.
    pub fn prompt_rows(&self, req: &SynthesisRequest) -> Result<Vec<u64>, RequestError> {
        let mut probe = req.clone();
        // Any admissible cap: only P is wanted here.
        probe.max_frames = None;
        let p = self.prepare(&probe)?;
        Ok(p.segments
            .iter()
            .map(|s| (s.0.prefix_rows + s.0.rows.len()) as u64)
            .collect())
    }

    fn prepare(&self, req: &SynthesisRequest) -> Result<Prepared, RequestError> {
        self.limits
            .check_text(&req.text)
            .map_err(|e| with_param(limit_err(e), "input"))?;
        if req.text.trim().is_empty() {
            return Err(RequestError::invalid(
                "empty_input",
                Some("input"),
                "input text is empty",
            ));
        }
        let params = self.sampling(req)?;
        if let Some(g) = req.cfg_gamma {
            if !self.cfg.allow_request_gamma {
                return Err(RequestError::invalid(
                    "cfg_gamma_not_allowed",
                    Some("cfg_gamma"),
                    "per-request cfg_gamma needs the server flag --cfg-allow-request-gamma",
                ));
            }
            if !g.is_finite() || !(0.0..=10.0).contains(&g) {
                return Err(RequestError::invalid(
                    "invalid_cfg_gamma",
                    Some("cfg_gamma"),
                    format!("cfg_gamma must be a finite number in [0, 10], got {g}"),
                ));
            }
        }
        // References: a catalog voice's first, then inline ones.
        let mut refs: Vec<Reference> = Vec::new();
        if let Some(v) = &req.voice {
            if !(v.is_empty() || v == "default" || v == "builtin") {
                let voice = self.voices.get(v)?;
                refs.push(Reference {
                    transcript: voice.transcript,
                    codes: voice.codes,
                });
            }
        }
        let passages = refs.len() + req.references.len();
        self.limits
            .check_passages(admission::ReferencePassages(passages as u64))
            .map_err(|e| with_param(limit_err(e), "references"))?;
        for (i, r) in req.references.iter().enumerate() {
            let idx = refs.len();
            let p = format!("references[{i}]");
            if r.transcript.trim().is_empty() {
                return Err(RequestError::invalid(
                    "empty_transcript",
                    Some(&format!("{p}.text")),
                    format!(
                        "reference {} has no transcript; every reference clip needs its text",
                        idx + 1
                    ),
                ));
            }
            self.limits
                .check_transcript(idx as u64 + 1, &r.transcript)
                .map_err(|e| with_param(limit_err(e), &format!("{p}.text")))?;
            let codes = match &r.audio {
                ReferenceAudio::Codes(c) => c.clone(),
                ReferenceAudio::Wav(bytes) => {
                    self.encode_clip(bytes, idx as u64 + 1, &format!("{p}.audio"))?
                }
            };
            self.limits
                .check_reference_frames(
                    idx as u64 + 1,
                    admission::ReferenceFrames(codes.len() as u64),
                )
                .map_err(|e| with_param(limit_err(e), &format!("{p}.audio")))?;
            refs.push(Reference {
                transcript: r.transcript.clone(),
                codes,
            });
        }
        let texts = match req.split {
            Split::None => vec![req.text.clone()],
            Split::Sentence => {
                crate::split::segments(&req.text, req.chunk_length.unwrap_or(200).max(1))
            }
        };
        let builder = PromptBuilder {
            tokenizer: &self.tokenizer,
            spec: self.spec.clone(),
        };
        let cap = match req.max_frames {
            Some(f) => FrameCap::Explicit(Frames(f)),
            None => FrameCap::Default,
        };
        if texts.len() > MAX_SEGMENTS {
            return Err(RequestError::limit(
                "too_many_segments",
                Some("input"),
                format!(
                    "the text splits into {} sentence groups, more than the limit of {MAX_SEGMENTS} groups per request; \
                     raise chunk_length or send fewer sentences",
                    texts.len()
                ),
            ));
        }
        let mut segments = Vec::with_capacity(texts.len());
        let mut prefix: Vec<crate::prompt::Row> = Vec::new();
        let mut rows = 0u64;
        for t in &texts {
            let mut p = builder.build(t, &refs).map_err(|e| {
                RequestError::invalid(speech_code(&e), Some("input"), e.to_string())
            })?;
            let a = self
                .contract
                .admit(PromptRows(p.rows.len() as u64), cap)
                .map_err(|e| {
                    with_param(
                        limit_err(e),
                        if req.max_frames.is_some() {
                            "max_frames"
                        } else {
                            "input"
                        },
                    )
                })?;
            rows = rows.max(a.rows().0);
            // Every segment shares the reference prefix: keep one copy, and only each segment's
            // own rows.
            if prefix.is_empty() {
                prefix = p.rows[..p.prefix_rows].to_vec();
            }
            p.rows.drain(..p.prefix_rows);
            segments.push((p, a));
        }
        if segments.is_empty() {
            return Err(RequestError::invalid(
                "empty_input",
                Some("input"),
                "input text is empty",
            ));
        }
        // Report the loosest cap kind: shrunk if any segment's default cap shrank.
        let kinds: Vec<admission::CapKind> = segments.iter().map(|s| s.1.cap).collect();
        let cap_applied = if kinds.contains(&admission::CapKind::Explicit) {
            CapApplied::Explicit
        } else if kinds.contains(&admission::CapKind::DefaultShrunk) {
            CapApplied::DefaultShrunk
        } else {
            CapApplied::Default
        };
        let frame_cap = segments.iter().map(|s| s.1.frames.0).min().unwrap_or(0);
        if req.whole_reply {
            // s16 samples plus the encoded body: 4 bytes per sample of every segment's cap.
            let frames: u64 = segments
                .iter()
                .map(|s| s.1.frames.0)
                .fold(0, u64::saturating_add);
            let bytes = frames
                .saturating_mul(self.codec.frame_length() as u64)
                .saturating_mul(4);
            if bytes > self.whole_reply_budget {
                return Err(RequestError::limit(
                    "whole_reply_too_large",
                    Some("max_frames"),
                    format!(
                        "a whole reply of up to {frames} frames needs {bytes} bytes of host memory, more than the \
                         {} bytes one reply may hold here; stream it (stream: true) or ask for fewer frames",
                        self.whole_reply_budget
                    ),
                ));
            }
        }
        let seed = req.seed.unwrap_or_else(draw_seed);
        // Guided only with a reference (the builtin voice never is), and only when γ > 0 or the
        // guided path is forced for qualification.
        let gamma = req.cfg_gamma.unwrap_or(self.cfg.gamma);
        let guidance = if !refs.is_empty() && (gamma > 0.0 || self.cfg.force_guided) {
            let mut un = Vec::with_capacity(texts.len());
            for t in &texts {
                let p = builder.build(t, &[]).map_err(|e| {
                    RequestError::invalid(speech_code(&e), Some("input"), e.to_string())
                })?;
                un.push(p);
            }
            Some((gamma, un))
        } else {
            None
        };
        let lane_rows = rows;
        // The unconditional branch keeps its own backbone state: reserve its rows too.
        if let Some((_, un)) = &guidance {
            let extra = un
                .iter()
                .zip(&segments)
                .map(|(p, s)| (p.prefix_rows + p.rows.len()) as u64 + s.1.frames.0 + 1)
                .max()
                .unwrap_or(0);
            rows = rows.saturating_add(extra);
        }
        if Rows(rows) > self.pool.capacity() {
            return Err(RequestError::limit(
                "pool_exceeded",
                None,
                format!(
                    "the request needs {rows} KV rows (both branches when guided), more than the pool's {} rows",
                    self.pool.capacity().0
                ),
            ));
        }
        Ok(Prepared {
            prefix,
            lane_rows,
            guidance,
            seed,
            params,
            segments,
            rows,
            cap: cap_applied,
            frame_cap,
        })
    }

    fn sampling(&self, req: &SynthesisRequest) -> Result<SamplingParams, RequestError> {
        let t = req.temperature.unwrap_or(self.defaults.temperature);
        if !t.is_finite() || !(0.0..=2.0).contains(&t) {
            return Err(RequestError::invalid(
                "invalid_temperature",
                Some("temperature"),
                format!("temperature must be a finite number in [0, 2], got {t}"),
            ));
        }
        let p = req.top_p.unwrap_or(self.defaults.top_p);
        if !(p.is_finite() && p > 0.0 && p <= 1.0) {
            return Err(RequestError::invalid(
                "invalid_top_p",
                Some("top_p"),
                format!("top_p must be a finite number in (0, 1], got {p}"),
            ));
        }
        let k = req.top_k.unwrap_or(self.defaults.top_k);
        if k > 4096 {
            return Err(RequestError::invalid(
                "invalid_top_k",
                Some("top_k"),
                format!("top_k must be in 0..=4096 (0 = off), got {k}"),
            ));
        }
        Ok(SamplingParams {
            temperature: t,
            top_k: k as usize,
            top_p: p,
            ras: true,
        })
    }

    /// Cancels everything and waits until the worker has settled.
    pub fn shutdown(&self) {
        {
            let (m, cv) = &*self.shared;
            let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
            s.shutdown = true;
            cv.notify_all();
        }
        if let Some(h) = self.worker.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Prepared {
    prefix: Vec<crate::prompt::Row>,
    lane_rows: u64,
    guidance: Option<(f32, Vec<Prompt>)>,
    seed: u64,
    params: SamplingParams,
    segments: Vec<(Prompt, Admission)>,
    rows: u64,
    cap: CapApplied,
    frame_cap: u64,
}

pub(crate) fn speech_code(e: &SpeechError) -> &'static str {
    match e {
        SpeechError::EmptyText => "empty_input",
        SpeechError::StructuralToken { .. } => "structural_token",
        SpeechError::BadSpeakerTag { .. } => "invalid_speaker_tag",
        SpeechError::EmptyTranscript { .. } => "empty_transcript",
        SpeechError::EmptyReferenceAudio { .. } => "empty_reference_audio",
        SpeechError::BadReferenceCodes { .. } => "invalid_reference_codes",
        SpeechError::Tokenizer(_) => "tokenizer_error",
        SpeechError::Audio(_) => "invalid_audio",
        SpeechError::Engine(_) => "engine_error",
    }
}

fn draw_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

fn model_id(dir: &Path, builtin: bool) -> String {
    if builtin {
        return "drama3-builtin-tiny".into();
    }
    dir.file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_else(|| "drama3".into())
}

fn read_generation_defaults(dir: &Path) -> Defaults {
    let mut d = Defaults {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 30,
    };
    if let Ok(text) = std::fs::read_to_string(dir.join("generation_config.json")) {
        if let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) {
            if let Some(t) = v["temperature"].as_f64() {
                d.temperature = t as f32;
            }
            if let Some(p) = v["top_p"].as_f64() {
                d.top_p = p as f32;
            }
            if let Some(k) = v["top_k"].as_u64() {
                d.top_k = k as u32;
            }
        }
    }
    d
}

fn prefix_key(rows: &[model::Row]) -> [u8; 32] {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for r in rows {
        for v in r {
            h.update(v.to_le_bytes());
        }
    }
    h.finalize().into()
}

/// The reference prefill cache: lane snapshots after their reference prefix, LRU within a
/// byte budget. Keys hash the prefix rows themselves, so changed references never hit.
struct PrefixCache<B: Backend> {
    entries: std::collections::HashMap<[u8; 32], (LaneState<B>, u64, u64)>,
    bytes: u64,
    budget: u64,
    per_row: u64,
    fixed: u64,
    tick: u64,
    hits: Arc<AtomicU64>,
    misses: Arc<AtomicU64>,
}

impl<B: Backend> PrefixCache<B> {
    /// Whether `key` is cached (no hit or miss counted, no recency changed).
    fn contains(&self, key: &[u8; 32]) -> bool {
        self.entries.contains_key(key)
    }

    fn get(&mut self, key: &[u8; 32]) -> Option<&LaneState<B>> {
        self.tick += 1;
        let tick = self.tick;
        match self.entries.get_mut(key) {
            Some(e) => {
                e.2 = tick;
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(&e.0)
            }
            None => {
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    fn insert(&mut self, key: [u8; 32], lane: LaneState<B>, rows: usize) {
        let size = (rows as u64)
            .saturating_mul(self.per_row)
            .saturating_add(self.fixed);
        if size > self.budget {
            return;
        }
        while self.bytes + size > self.budget {
            let Some(oldest) = self.entries.iter().min_by_key(|e| (e.1).2).map(|e| *e.0) else {
                break;
            };
            if let Some(e) = self.entries.remove(&oldest) {
                self.bytes -= e.1;
            }
        }
        self.tick += 1;
        self.bytes += size;
        self.entries.insert(key, (lane, size, self.tick));
    }
}

fn to_rows(rows: &[crate::prompt::Row]) -> Vec<model::Row> {
    rows.iter()
        .map(|r| {
            let mut row = [0i64; model::ROW_WIDTH];
            row.copy_from_slice(&r[..model::ROW_WIDTH]);
            row
        })
        .collect()
}

/// A streaming codec decoder of one job (CPU, or GPU when the engine runs on CUDA).
pub(crate) trait StreamDecoder: Send {
    fn push(&mut self, codes: &Codes) -> Result<Vec<f32>, String>;
    /// The state itself, for a [`Together`] call to find its own kind of state.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn as_any(&mut self) -> &mut dyn std::any::Any;
}

impl StreamDecoder for DecoderState {
    fn push(&mut self, codes: &Codes) -> Result<Vec<f32>, String> {
        DecoderState::push(self, codes).map_err(|e| e.to_string())
    }
    fn as_any(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

#[cfg(feature = "cuda")]
impl StreamDecoder for codec_cuda::CudaDecoderState {
    fn push(&mut self, codes: &Codes) -> Result<Vec<f32>, String> {
        codec_cuda::CudaDecoderState::push(self, codes).map_err(|e| e.to_string())
    }
    fn as_any(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// Makes a fresh decoder state for each job.
pub(crate) type DecoderFactory = Box<dyn Fn() -> Result<Box<dyn StreamDecoder>, String> + Send>;

/// Decodes several jobs' next frames in one decoder call (`codes[b]` for the state `states[b]`,
/// each made by the same [`DecoderFactory`]): each job's samples are bit for bit what its own
/// call would give.
pub(crate) type TogetherFn = Box<
    dyn Fn(&mut [&mut Box<dyn StreamDecoder>], &[Codes]) -> Result<Vec<Vec<f32>>, String> + Send,
>;

/// How the codec thread decodes several jobs in one call, where the decoder can (the GPU's).
pub(crate) struct Together {
    pub(crate) decode: TogetherFn,
    /// The most frames one such call takes in all (the plan's decoder workspace).
    pub(crate) frames: usize,
}

/// Work for the codec thread, per job key, in frame order.
enum CodecMsg {
    Start {
        key: u64,
        events: mpsc::UnboundedSender<JobEvent>,
        submitted: Instant,
    },
    Frame {
        key: u64,
        codes: Vec<u32>,
    },
    /// Model work is done and its lane released: complete the summary and send it.
    Finish {
        key: u64,
        summary: JobSummary,
    },
    Fail {
        key: u64,
        message: String,
    },
    /// Cancelled: drop the state, send nothing.
    Drop {
        key: u64,
    },
}

impl CodecMsg {
    /// The job the message is about.
    fn key(&self) -> u64 {
        match self {
            CodecMsg::Start { key, .. }
            | CodecMsg::Frame { key, .. }
            | CodecMsg::Finish { key, .. }
            | CodecMsg::Fail { key, .. }
            | CodecMsg::Drop { key } => *key,
        }
    }
}

struct CodecJob {
    events: mpsc::UnboundedSender<JobEvent>,
    submitted: Instant,
    decoder: Box<dyn StreamDecoder>,
    hasher: PcmHasher,
    samples: u64,
    first_audio: Option<f64>,
    /// When the first audio was sent (the holding's real-time clock starts there).
    first_audio_at: Option<Instant>,
    failed: bool,
}

/// Most frames one job's decoder call takes when a backlog is coalesced. The engine caps it
/// further at lanes x ceil(`codec_min_chunk` / lanes) (at least one a lane), inside the decoder
/// workspace its plan reserves; a GPU call over several jobs takes up to
/// [`CODEC_TOGETHER_LANE_FRAMES`] a lane in all, also inside it.
const CODEC_MAX_CHUNK: usize = 64;
// a call of the most frames is one GPU decoder step
#[cfg(feature = "cuda")]
const _: () = assert!(CODEC_MAX_CHUNK <= codec_cuda::MAX_STEP_FRAMES);

/// Frames a lane in the GPU decoder's calls over several jobs (the codec thread's due jobs in
/// one call, up to this many frames a lane in all): the plan's decoder workspace a lane.
const CODEC_TOGETHER_LANE_FRAMES: usize = 8;

/// Whether the GPU decoder decodes several jobs in one call: `DRAMATIS_CODEC_TOGETHER`, on
/// unless `0` (the same samples either way; for measuring one against the other).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn codec_together_from(setting: Option<&str>) -> bool {
    setting.is_none_or(|v| v.trim() != "0")
}

/// The GPU decoder's step (frames): the most frames of one job in a call (`largest`, at most
/// [`CODEC_MAX_CHUNK`]; a call over several jobs takes each job's in one step), or `DRAMATIS_CODEC_STEP` (1 to [`CODEC_MAX_CHUNK`]) for measuring one
/// step against another; the same samples either way.
fn codec_step_frames(setting: Option<&str>, largest: usize) -> usize {
    setting
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(largest)
        .clamp(1, CODEC_MAX_CHUNK)
}

/// Default of [`EngineOptions::codec_min_chunk`]: a decoder call has a fixed cost (about 150
/// launches and a read-back on the GPU, ~2 ms of the codec thread for one frame against ~0.4 ms
/// a frame more in a 16-frame call), and the GPU codec's kernels share the device with the
/// frame rounds, so one call a frame at one lane took about a tenth of each round.
pub const DEFAULT_CODEC_MIN_CHUNK: usize = 8;

/// A job's frames wait for company only while the audio it has been sent is at least this far
/// ahead of real time since its first audio (seconds): a caller playing the stream as it
/// arrives never runs dry because of the wait.
const CODEC_HOLD_AHEAD_S: f64 = 0.25;

/// The longest a frame waits for company.
const CODEC_MAX_HOLD: std::time::Duration = std::time::Duration::from_millis(100);

/// How the codec thread sizes its decoder calls (`codec_loop`).
#[derive(Debug, Clone, Copy)]
struct CodecChunks {
    /// The most frames a call for one job takes (inside the plan's decoder workspace).
    max: usize,
    /// The frames a call gathers for a job well ahead of real time (1: no holding).
    min: usize,
    /// The longest a frame is held for company.
    max_hold: std::time::Duration,
}

/// One job's frames waiting for the decoder.
struct Pending {
    key: u64,
    frames: Vec<Vec<u32>>,
    /// When the oldest of them arrived.
    since: Instant,
    /// Held for company until then (set after each batch), else decoded after the batch.
    until: Option<Instant>,
}

/// Until when a job's waiting frames may wait for more (`None`: decode them now). A job's
/// first audio goes out at once, and so do frames whose job's audio is less than
/// `CODEC_HOLD_AHEAD_S` ahead of real time; the rest wait until `chunks.min` frames have come,
/// `chunks.max_hold` has passed, or the audio ahead would fall to that margin.
fn hold_until(
    jobs: &std::collections::HashMap<u64, CodecJob>,
    p: &Pending,
    chunks: &CodecChunks,
    rate: f64,
    now: Instant,
) -> Option<Instant> {
    if p.frames.len() >= chunks.min {
        return None;
    }
    let j = jobs.get(&p.key)?;
    let first = j.first_audio_at?;
    let ahead =
        j.samples as f64 / rate - now.duration_since(first).as_secs_f64() - CODEC_HOLD_AHEAD_S;
    if j.failed || ahead <= 0.0 {
        return None;
    }
    let until = (p.since + chunks.max_hold).min(now + std::time::Duration::from_secs_f64(ahead));
    (until > now).then_some(until)
}

/// Streams every job's frames through its own decoder state (so streamed PCM equals a whole
/// decode), hashes the s16 samples and sends audio and final events in order.
///
/// When the thread falls behind (many lanes), the frames waiting for one job are decoded as one
/// chunk: streamed decoding is bit-identical whatever the chunking, and one call over several
/// frames costs far less than one call per frame. When it keeps up (few lanes), a job whose
/// audio is well ahead of real time has its frames held until `chunks.min` of them have come
/// (`hold_until`), for the same saving. A job's messages keep their order; its end or failure
/// first decodes what it holds, its drop (no reader) discards it, and so does the engine's end
/// (a job still holding frames then never finished: its caller was told it failed).
fn codec_loop(
    new_decoder: DecoderFactory,
    together: Option<Together>,
    rate: u32,
    chunks: CodecChunks,
    rx: std::sync::mpsc::Receiver<CodecMsg>,
    meter: &CodecMeter,
) {
    let max_chunk = chunks.max.clamp(1, CODEC_MAX_CHUNK);
    let chunks = CodecChunks {
        max: max_chunk,
        min: chunks.min.clamp(1, max_chunk),
        ..chunks
    };
    let mut jobs: std::collections::HashMap<u64, CodecJob> = std::collections::HashMap::new();
    let rate = f64::from(rate);
    // frames waiting per job, in arrival order of the jobs
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        let wake = pending.iter().filter_map(|p| p.until).min();
        let first = match wake {
            None => match rx.recv() {
                Ok(m) => Some(m),
                Err(_) => break,
            },
            Some(t) => match rx.recv_timeout(t.saturating_duration_since(Instant::now())) {
                Ok(m) => Some(m),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            },
        };
        let mut batch: Vec<CodecMsg> = first.into_iter().collect();
        while batch.len() < 4096 {
            match rx.try_recv() {
                Ok(m) => batch.push(m),
                Err(_) => break,
            }
        }
        for msg in batch {
            let key = msg.key();
            if let CodecMsg::Frame { codes, .. } = msg {
                match pending.iter_mut().find(|p| p.key == key) {
                    Some(p) if p.frames.len() < max_chunk => p.frames.push(codes),
                    Some(p) => {
                        let full = std::mem::replace(&mut p.frames, vec![codes]);
                        p.since = Instant::now();
                        decode_frames(&mut jobs, key, full, meter);
                    }
                    None => pending.push(Pending {
                        key,
                        frames: vec![codes],
                        since: Instant::now(),
                        until: None,
                    }),
                }
                continue;
            }
            // this job's earlier frames go first (a dropped job's have no reader)
            if let Some(i) = pending.iter().position(|p| p.key == key) {
                let p = pending.remove(i);
                if !matches!(msg, CodecMsg::Drop { .. }) {
                    decode_frames(&mut jobs, key, p.frames, meter);
                }
            }
            codec_event(&mut jobs, &new_decoder, rate, msg, meter);
        }
        // decode what is due, in arrival order (several jobs in one call where the decoder
        // can); hold the rest
        let mut held = Vec::with_capacity(pending.len());
        let mut due = Vec::new();
        for mut p in pending.drain(..) {
            p.until = hold_until(&jobs, &p, &chunks, rate, Instant::now());
            if p.until.is_some() {
                held.push(p);
            } else {
                due.push((p.key, p.frames));
            }
        }
        decode_due(&mut jobs, due, together.as_ref(), meter);
        pending = held;
    }
}

/// Decodes the due jobs' frames: with `together`, in calls over several jobs (in arrival
/// order, as many as fit its frames), else one call a job.
fn decode_due(
    jobs: &mut std::collections::HashMap<u64, CodecJob>,
    due: Vec<(u64, Vec<Vec<u32>>)>,
    together: Option<&Together>,
    meter: &CodecMeter,
) {
    let Some(tg) = together else {
        for (key, frames) in due {
            decode_frames(jobs, key, frames, meter);
        }
        return;
    };
    // the jobs still decoding, with frames to decode
    let mut due = due;
    due.retain(|(k, f)| !f.is_empty() && jobs.get(k).is_some_and(|j| !j.failed));
    let mut group: Vec<(u64, Vec<Vec<u32>>)> = Vec::new();
    let mut held = 0;
    for (key, frames) in due {
        if !group.is_empty() && held + frames.len() > tg.frames {
            decode_together(jobs, std::mem::take(&mut group), tg, meter);
            held = 0;
        }
        held += frames.len();
        group.push((key, frames));
    }
    decode_together(jobs, group, tg, meter);
}

/// Decodes several jobs' frames (each job's still decoding, with frames) in one call (one job:
/// its own call) and sends each its audio. A job whose frames do not form codes fails alone;
/// a failed call, or one that returns audio for other than its jobs, fails each of them.
fn decode_together(
    jobs: &mut std::collections::HashMap<u64, CodecJob>,
    group: Vec<(u64, Vec<Vec<u32>>)>,
    tg: &Together,
    meter: &CodecMeter,
) {
    if group.len() < 2 {
        for (key, frames) in group {
            decode_frames(jobs, key, frames, meter);
        }
        return;
    }
    // the group's jobs out of the table for the call (distinct keys: one job a key)
    let (mut keys, mut taken, mut codes) = (Vec::new(), Vec::new(), Vec::new());
    let mut frames = 0;
    for (key, f) in group {
        let Some(mut j) = jobs.remove(&key) else {
            continue;
        };
        match codes_of(&f) {
            Ok(c) => {
                frames += f.len();
                keys.push(key);
                taken.push(j);
                codes.push(c);
            }
            Err(e) => {
                deliver(&mut j, Err(e));
                jobs.insert(key, j);
            }
        }
    }
    let mut decs: Vec<&mut Box<dyn StreamDecoder>> =
        taken.iter_mut().map(|j| &mut j.decoder).collect();
    let n = decs.len();
    let pcm = meter.call(frames, || {
        (tg.decode)(&mut decs, &codes).and_then(|p| {
            if p.len() == n {
                Ok(p)
            } else {
                Err(format!(
                    "a decoder call over {n} streams returned audio for {}",
                    p.len()
                ))
            }
        })
    });
    match pcm {
        Ok(pcm) => {
            for (j, p) in taken.iter_mut().zip(pcm) {
                deliver(j, Ok(p));
            }
        }
        Err(e) => {
            for j in taken.iter_mut() {
                deliver(j, Err(e.clone()));
            }
        }
    }
    jobs.extend(keys.into_iter().zip(taken));
}

/// A chunk's codes from its frames (`[codebooks]` each; at least one).
fn codes_of(frames: &[Vec<u32>]) -> Result<Codes, String> {
    Codes::from_frames(frames[0].len(), frames).map_err(|e| e.to_string())
}

/// Decodes one job's consecutive frames (`[codebooks]` each) as one chunk and sends the audio.
fn decode_frames(
    jobs: &mut std::collections::HashMap<u64, CodecJob>,
    key: u64,
    frames: Vec<Vec<u32>>,
    meter: &CodecMeter,
) {
    let Some(j) = jobs.get_mut(&key) else {
        return;
    };
    if j.failed || frames.is_empty() {
        return;
    }
    let pcm = meter.call(frames.len(), || {
        codes_of(&frames).and_then(|c| j.decoder.push(&c))
    });
    deliver(j, pcm);
}

/// Sends a job the audio of one decoder call (its first audio times the job), or fails it.
fn deliver(j: &mut CodecJob, pcm: Result<Vec<f32>, String>) {
    match pcm {
        Ok(pcm) => {
            if j.first_audio.is_none() {
                j.first_audio = Some(j.submitted.elapsed().as_secs_f64());
                j.first_audio_at = Some(Instant::now());
            }
            j.hasher.update_s16(&crate::pcm::to_s16_vec(&pcm));
            j.samples += pcm.len() as u64;
            let _ = j.events.send(JobEvent::Audio(pcm));
        }
        Err(e) => {
            j.failed = true;
            let _ = j.events.send(JobEvent::Failed(format!("codec: {e}")));
        }
    }
}

/// A codec-thread message other than a frame.
fn codec_event(
    jobs: &mut std::collections::HashMap<u64, CodecJob>,
    new_decoder: &DecoderFactory,
    rate: f64,
    msg: CodecMsg,
    meter: &CodecMeter,
) {
    match msg {
        CodecMsg::Start {
            key,
            events,
            submitted,
        } => {
            let (decoder, failed): (Box<dyn StreamDecoder>, bool) = match new_decoder() {
                Ok(d) => (d, false),
                Err(e) => {
                    let _ = events.send(JobEvent::Failed(format!("codec: {e}")));
                    (Box::new(NoDecoder), true)
                }
            };
            jobs.insert(
                key,
                CodecJob {
                    events,
                    submitted,
                    decoder,
                    hasher: PcmHasher::new(),
                    samples: 0,
                    first_audio: None,
                    first_audio_at: None,
                    failed,
                },
            );
        }
        CodecMsg::Frame { key, codes } => decode_frames(jobs, key, vec![codes], meter),
        CodecMsg::Finish { key, mut summary } => {
            let Some(j) = jobs.remove(&key) else { return };
            if j.failed {
                return;
            }
            summary.samples = j.samples;
            summary.audio_seconds = j.samples as f64 / rate;
            summary.pcm_sha256 = j.hasher.finish();
            summary.first_audio_seconds = j.first_audio;
            summary.elapsed_seconds = j.submitted.elapsed().as_secs_f64();
            let _ = j.events.send(JobEvent::Done(summary));
        }
        CodecMsg::Fail { key, message } => {
            if let Some(j) = jobs.remove(&key) {
                if !j.failed {
                    let _ = j.events.send(JobEvent::Failed(message));
                }
            }
        }
        CodecMsg::Drop { key } => {
            jobs.remove(&key);
        }
    }
}

/// Stands in for a decoder that could not be made (the job has already failed).
struct NoDecoder;

impl StreamDecoder for NoDecoder {
    fn push(&mut self, _codes: &Codes) -> Result<Vec<f32>, String> {
        Err("no decoder".into())
    }
    fn as_any(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// One job occupying a lane.
struct Active<B: Backend> {
    job: Job,
    lane: LaneState<B>,
    /// The unconditional branch of a guided job.
    uncond: Option<LaneState<B>>,
    _reservation: admission::Reservation,
    segment: usize,
    seg_frames: u64,
    frames: u64,
    step: u64,
    capped: u32,
    /// This job's key on the codec thread.
    key: u64,
    /// Since when the job has sat out rounds for a caller that does not read.
    paused_since: Option<Instant>,
    /// Unread samples when the paused job was last looked at.
    paused_unread: Option<u64>,
}

/// Everything the worker needs besides the model.
struct WorkerCtx {
    decoders: DecoderFactory,
    together: Option<Together>,
    cache_budget: u64,
    cache_per_row: u64,
    cache_fixed: u64,
    cache_hits: Arc<AtomicU64>,
    cache_misses: Arc<AtomicU64>,
    cfg_batched: bool,
    codec: Codec,
    pool: KvPool,
    lanes: usize,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    frames_total: Arc<AtomicU64>,
    starts_per_round: usize,
    /// Rows to prefill started between two rounds, at most
    /// ([`EngineOptions::start_rows_per_round`] resolved; `usize::MAX`: no limit).
    start_rows: usize,
    starts_deferred: Arc<AtomicU64>,
    starts_most: Arc<AtomicU64>,
    prefills_joined: Arc<AtomicU64>,
    codec_meter: Arc<CodecMeter>,
    /// How the codec thread sizes its decoder calls (`codec_loop`).
    codec_chunks: CodecChunks,
    max_unread_samples: u64,
    max_pause: std::time::Duration,
    prefill_chunk: usize,
    /// The plan's device state beyond the weights, reserved once the model is loaded.
    device_reserve: u64,
}

/// Loads the model on `backend` and starts the frame-round thread.
fn spawn_worker<B: Backend + 'static>(
    ck: &Checkpoint,
    backend: B,
    ctx: WorkerCtx,
) -> Result<
    (
        std::thread::JoinHandle<()>,
        String,
        Arc<model::RoundStats>,
        u64,
    ),
    SpeechError,
> {
    let name = backend.name().to_string();
    let model = Model::load(ck, backend).map_err(err)?;
    // The KV pool, lane state, scratch, codec state and caches the plan admitted, taken now so
    // that nothing admitted later fails for want of device memory (ADMISSION.md).
    let reserved = model
        .backend
        .reserve(ctx.device_reserve)
        .map_err(|e| SpeechError::Engine(format!("start-up: {e}")))?;
    if reserved > 0 && reserved < ctx.device_reserve {
        tracing::warn!(
            "the device pool kept {reserved} of the plan's {} bytes of state reserved; the rest \
             is allocated as it is needed",
            ctx.device_reserve
        );
    }
    let round_stats = model.round_stats();
    let (codec_tx, codec_rx) = std::sync::mpsc::channel();
    let rate = ctx.codec.sample_rate();
    let factory = ctx.decoders;
    let together = ctx.together;
    let chunks = ctx.codec_chunks;
    let meter = ctx.codec_meter;
    let codec_thread = std::thread::Builder::new()
        .name("dramatis-codec".into())
        .spawn(move || codec_loop(factory, together, rate, chunks, codec_rx, &meter))
        .map_err(|e| SpeechError::Engine(format!("cannot start the codec thread: {e}")))?;
    let worker = Worker {
        codec_tx,
        next_key: std::cell::Cell::new(0),
        cache: std::cell::RefCell::new(PrefixCache {
            entries: Default::default(),
            bytes: 0,
            budget: ctx.cache_budget,
            per_row: ctx.cache_per_row,
            fixed: ctx.cache_fixed,
            tick: 0,
            hits: Arc::clone(&ctx.cache_hits),
            misses: Arc::clone(&ctx.cache_misses),
        }),
        model,
        cfg_batched: ctx.cfg_batched,
        pool: ctx.pool,
        lanes: ctx.lanes,
        shared: ctx.shared,
        frames_total: ctx.frames_total,
        starts_per_round: ctx.starts_per_round,
        start_rows: ctx.start_rows,
        starts_deferred: ctx.starts_deferred,
        starts_most: ctx.starts_most,
        prefills_joined: ctx.prefills_joined,
        max_unread_samples: ctx.max_unread_samples,
        max_pause: ctx.max_pause,
        sample_rate: f64::from(rate),
        frame_length: ctx.codec.frame_length() as u64,
        prefill_chunk: ctx.prefill_chunk,
    };
    let h = std::thread::Builder::new()
        .name("dramatis-frames".into())
        .spawn(move || {
            let shared = Arc::clone(&worker.shared);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| worker.run()));
            if let Err(p) = outcome {
                // A bug must not leave callers waiting: stop taking work and fail what waits.
                let why = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                let (m, cv) = &*shared;
                let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
                s.shutdown = true;
                s.stopped = true;
                s.busy = 0;
                for job in s.queue.drain(..) {
                    let _ = job
                        .events
                        .send(JobEvent::Failed(format!("the engine stopped: {why}")));
                }
                cv.notify_all();
            }
            // The worker held the only sender: the codec thread drains and ends.
            let _ = codec_thread.join();
        })
        .map_err(|e| SpeechError::Engine(format!("cannot start the worker thread: {e}")))?;
    Ok((h, name, round_stats, reserved))
}

struct Worker<B: Backend> {
    codec_tx: std::sync::mpsc::Sender<CodecMsg>,
    next_key: std::cell::Cell<u64>,
    cache: std::cell::RefCell<PrefixCache<B>>,
    model: Model<B>,
    cfg_batched: bool,
    pool: KvPool,
    lanes: usize,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    frames_total: Arc<AtomicU64>,
    /// [`EngineOptions::starts_per_round`] (0: no limit).
    starts_per_round: usize,
    /// Rows to prefill started between two rounds, at most (`usize::MAX`: no limit).
    start_rows: usize,
    starts_deferred: Arc<AtomicU64>,
    starts_most: Arc<AtomicU64>,
    prefills_joined: Arc<AtomicU64>,
    /// [`EngineOptions::max_unread_audio_seconds`] in samples.
    max_unread_samples: u64,
    /// [`EngineOptions::max_pause_seconds`].
    max_pause: std::time::Duration,
    sample_rate: f64,
    /// PCM samples per frame.
    frame_length: u64,
    /// Prompt rows per prefill call (the plan's prefill chunk).
    prefill_chunk: usize,
}

impl<B: Backend> Worker<B> {
    fn run(self) {
        let mut active: Vec<Active<B>> = Vec::new();
        loop {
            let mut fresh = Vec::new();
            let mut fresh_rows = 0usize;
            {
                let (m, cv) = &*self.shared;
                let mut s = m.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    if s.shutdown {
                        break;
                    }
                    while active.len() + fresh.len() < self.lanes {
                        let Some(front) = s.queue.front() else { break };
                        if front.cancel.load(Ordering::SeqCst) {
                            s.queue.pop_front();
                            continue;
                        }
                        let front_rows = self.prefill_rows(front);
                        let over_rows = !fresh.is_empty()
                            && fresh_rows.saturating_add(front_rows) > self.start_rows;
                        if over_rows
                            || (self.starts_per_round > 0 && fresh.len() >= self.starts_per_round)
                        {
                            // a free lane and a live job, left for the next round: each waiting
                            // job counted the first time
                            let mut newly = 0;
                            for j in s.queue.iter_mut().filter(|j| !j.deferred) {
                                j.deferred = true;
                                newly += 1;
                            }
                            self.starts_deferred.fetch_add(newly, Ordering::Relaxed);
                            break;
                        }
                        match self.pool.reserve(Rows(front.rows)) {
                            Ok(r) => {
                                let job = s.queue.pop_front().expect("front exists");
                                fresh_rows = fresh_rows.saturating_add(front_rows);
                                fresh.push((job, r));
                            }
                            Err(_) => break,
                        }
                    }
                    s.busy = active.len() + fresh.len();
                    self.starts_most
                        .fetch_max(fresh.len() as u64, Ordering::Relaxed);
                    if !active.is_empty() || !fresh.is_empty() {
                        break;
                    }
                    s = cv.wait(s).unwrap_or_else(|e| e.into_inner());
                }
                if s.shutdown {
                    for job in s.queue.drain(..) {
                        let _ = job
                            .events
                            .send(JobEvent::Failed("the server is shutting down".into()));
                    }
                    for a in active.drain(..) {
                        let _ = a
                            .job
                            .events
                            .send(JobEvent::Failed("the server is shutting down".into()));
                    }
                    for (job, _) in fresh.drain(..) {
                        let _ = job
                            .events
                            .send(JobEvent::Failed("the server is shutting down".into()));
                    }
                    s.busy = 0;
                    s.stopped = true;
                    cv.notify_all();
                    return;
                }
            }
            active.extend(self.start_all(fresh));
            // Cancelled jobs leave before the round; their lanes go back to the model (settled:
            // no round is in flight here), which may keep them as ghosts of the kept round.
            let mut left = Vec::with_capacity(active.len());
            for a in active.drain(..) {
                if a.job.cancel.load(Ordering::SeqCst) {
                    let _ = self.codec_tx.send(CodecMsg::Drop { key: a.key });
                    self.retire(a);
                } else {
                    left.push(a);
                }
            }
            active = left;
            if active.is_empty() {
                continue;
            }
            // Lanes whose callers have fallen behind sit this round out (a lane's frames do not
            // depend on the lanes beside it, so pausing one changes none of its bits). A caller
            // that reads nothing for `max_pause` loses its job, so it cannot hold a lane forever.
            let now = Instant::now();
            let mut paused = Vec::new();
            let mut ready = Vec::new();
            for mut a in active.drain(..) {
                // A paused lane resumes once half the limit is left unread, so a caller
                // reading at playback speed makes its lane leave and rejoin rounds (a new lane
                // set each time) every few seconds of audio, not every frame.
                let unread = a.job.unread.load(Ordering::SeqCst);
                let limit = if a.paused_since.is_some() {
                    self.max_unread_samples / 2
                } else {
                    self.max_unread_samples
                };
                if unread <= limit {
                    a.paused_since = None;
                    a.paused_unread = None;
                    ready.push(a);
                    continue;
                }
                // the pause clock restarts whenever the caller has read since the last look
                if a.paused_unread.is_some_and(|u| unread < u) {
                    a.paused_since = Some(now);
                }
                a.paused_unread = Some(unread);
                let since = *a.paused_since.get_or_insert(now);
                if now.duration_since(since) > self.max_pause {
                    let _ = self.codec_tx.send(CodecMsg::Fail {
                        key: a.key,
                        message: format!(
                            "stopped: the caller read no audio for {:.2} s with {:.2} s of audio \
                             unread (limit {:.2} s)",
                            self.max_pause.as_secs_f64(),
                            a.job.unread.load(Ordering::SeqCst) as f64 / self.sample_rate,
                            self.max_unread_samples as f64 / self.sample_rate
                        ),
                    });
                    continue;
                }
                paused.push(a);
            }
            if ready.is_empty() {
                active = paused;
                std::thread::sleep(std::time::Duration::from_millis(2));
                continue;
            }
            let ended = self.round(&mut ready);
            active = ready;
            active.extend(paused);
            // Finished lanes' KV reservations are free before a caller sees their last event
            // (their device memory may stay a while as ghosts of the kept round; a new lane
            // drops them before it takes its own).
            let (m, _) = &*self.shared;
            m.lock().unwrap_or_else(|e| e.into_inner()).busy = active.len();
            for msg in ended {
                let _ = self.codec_tx.send(msg);
            }
        }
    }

    /// The rows a job's first segment will prefill (`segment_rows`): its own rows, the
    /// reference prefix unless the cache holds it, and the guidance prompt's rows; what the
    /// start budget (`start_rows`) counts.
    fn prefill_rows(&self, job: &Job) -> usize {
        let Some((seg, _)) = job.segments.first() else {
            return 0;
        };
        let p = seg.prefix_rows.min(job.prefix.len());
        let cached =
            p > 0 && !seg.rows.is_empty() && self.cache.borrow().contains(&job.prefix_key_of(p));
        let guide = job
            .guidance
            .as_ref()
            .and_then(|(_, un)| un.first())
            .map_or(0, |u| u.rows.len());
        seg.rows.len() + if cached { 0 } else { p } + guide
    }

    /// Takes a lane for each job and prefills their first segments together
    /// (`prefill_segments`); a job that fails is told why and leaves no state behind.
    fn start_all(&self, fresh: Vec<(Job, admission::Reservation)>) -> Vec<Active<B>> {
        let mut opened = Vec::with_capacity(fresh.len());
        for (job, reservation) in fresh {
            match self.open(job, reservation) {
                Ok(a) => opened.push(a),
                Err((tx, e)) => {
                    let _ = tx.send(JobEvent::Failed(e));
                }
            }
        }
        let results = self.prefill_segments(&mut opened);
        let mut started = Vec::with_capacity(opened.len());
        for (a, r) in opened.into_iter().zip(results) {
            match r {
                Ok(()) => started.push(a),
                Err(e) => {
                    let _ = self.codec_tx.send(CodecMsg::Drop { key: a.key });
                    let _ = a.job.events.send(JobEvent::Failed(e));
                }
            }
        }
        started
    }

    /// Takes a lane and tells the codec thread and the caller that the job started; on failure
    /// the job's sender and the reason.
    fn open(
        &self,
        job: Job,
        reservation: admission::Reservation,
    ) -> Result<Active<B>, (mpsc::UnboundedSender<JobEvent>, String)> {
        let lane = match self.model.new_lane(job.lane_rows as usize) {
            Ok(l) => l,
            Err(e) => return Err((job.events, e.to_string())),
        };
        let a = Active {
            lane,
            uncond: None,
            _reservation: reservation,
            segment: 0,
            seg_frames: 0,
            frames: 0,
            step: 0,
            capped: 0,
            key: self.next_key.get(),
            paused_since: None,
            paused_unread: None,
            job,
        };
        self.next_key.set(a.key + 1);
        let _ = self.codec_tx.send(CodecMsg::Start {
            key: a.key,
            events: a.job.events.clone(),
            submitted: a.job.submitted,
        });
        let _ = a.job.events.send(JobEvent::Started {
            seed: a.job.seed,
            frame_cap: a.job.frame_cap,
            cap: a.job.cap,
            prompt_rows: a.job.segments[0].1.prompt_rows.0,
        });
        Ok(a)
    }

    /// A prompt's rows in chunks of the plan's prefill chunk (`PlanRequest::prefill_chunk_rows`),
    /// so a long prompt's prefill uses the scratch the plan reserved. Chunks restart at each call,
    /// so a prefix restored from the cache continues exactly as a prefilled one would.
    fn prefill(&self, lane: &mut LaneState<B>, rows: &[model::Row]) -> Result<(), String> {
        self.model
            .prefill_chunked(lane, rows, self.prefill_chunk)
            .map_err(|e| e.to_string())
    }

    /// Prefills one job's current segment (`prefill_segments` of one job).
    fn prefill_segment(&self, a: &mut Active<B>) -> Result<(), String> {
        self.prefill_segments(std::slice::from_mut(a))
            .pop()
            .unwrap_or(Ok(()))
    }

    /// Prefills each job's current segment, one result per job. What each job does alone (a
    /// new lane for a later segment, the reference prefix from the cache or prefilled and
    /// cached) comes first; then the rows left, the conditional lanes' and the guidance
    /// branches', run as joined prefills (`Model::prefill_joined`: each weight read once for
    /// all of them, every lane with the bits of its own prefill) in groups of at most the
    /// plan's prefill chunk, and longer prompts alone in chunks.
    fn prefill_segments(&self, jobs: &mut [Active<B>]) -> Vec<Result<(), String>> {
        let mut results: Vec<Result<(), String>> = Vec::with_capacity(jobs.len());
        // (job, guidance branch, rows)
        let mut items: Vec<(usize, bool, Vec<model::Row>)> = Vec::new();
        for (i, a) in jobs.iter_mut().enumerate() {
            results.push(match self.segment_rows(a) {
                Ok((rows, un)) => {
                    items.push((i, false, rows));
                    if let Some(u) = un {
                        items.push((i, true, u));
                    }
                    Ok(())
                }
                Err(e) => Err(e),
            });
        }
        let most = self.model.backend.joined_rows().min(self.prefill_chunk);
        // each job's lanes, taken out as its items run
        // (conditional lane, guidance branch) of each job
        type Lanes<'a, B> = (Option<&'a mut LaneState<B>>, Option<&'a mut LaneState<B>>);
        let mut lanes: Vec<Lanes<'_, B>> = jobs
            .iter_mut()
            .map(|a| (Some(&mut a.lane), a.uncond.as_mut()))
            .collect();
        let mut take = |i: usize, un: bool| {
            let l = &mut lanes[i];
            if un {
                l.1.take()
            } else {
                l.0.take()
            }
        };
        let mut group: Vec<(usize, &mut LaneState<B>, &[model::Row])> = Vec::new();
        let mut group_rows = 0;
        for (i, un, rows) in &items {
            let Some(lane) = take(*i, *un) else { continue };
            if results[*i].is_err() {
                continue;
            }
            if rows.len() > most {
                if let Err(e) = self.prefill(lane, rows) {
                    results[*i] = Err(e);
                }
                continue;
            }
            if group_rows + rows.len() > self.prefill_chunk {
                self.prefill_group(std::mem::take(&mut group), &mut results);
                group_rows = 0;
            }
            group_rows += rows.len();
            group.push((*i, lane, rows));
        }
        self.prefill_group(group, &mut results);
        results
    }

    /// One joined prefill of `group`'s lanes. Each prompt is checked on its own first
    /// (`Model::check_prompt`: rows, room), so a refused one fails only its job; an error of
    /// the joined work itself (the device) fails every job of the group, whose lanes may be
    /// part way through it.
    fn prefill_group(
        &self,
        group: Vec<(usize, &mut LaneState<B>, &[model::Row])>,
        results: &mut [Result<(), String>],
    ) {
        let (mut owners, mut lanes, mut prompts) = (Vec::new(), Vec::new(), Vec::new());
        for (i, lane, rows) in group {
            if results[i].is_err() {
                continue;
            }
            if let Err(e) = self.model.check_prompt(lane, rows) {
                results[i] = Err(e.to_string());
                continue;
            }
            owners.push(i);
            lanes.push(lane);
            prompts.push(rows);
        }
        if lanes.is_empty() {
            return;
        }
        match self.model.prefill_joined(&mut lanes, &prompts) {
            Ok(()) if lanes.len() > 1 => {
                self.prefills_joined
                    .fetch_add(lanes.len() as u64, Ordering::Relaxed);
            }
            Ok(()) => {}
            Err(e) => {
                for i in owners {
                    results[i] = Err(e.to_string());
                }
            }
        }
    }

    /// The state a job's current segment starts from (a fresh lane for a later segment, the
    /// reference prefix restored or prefilled, the guidance branch's lane) and the rows then
    /// left to prefill: the conditional lane's, and the guidance branch's.
    #[allow(clippy::type_complexity)]
    fn segment_rows(
        &self,
        a: &mut Active<B>,
    ) -> Result<(Vec<model::Row>, Option<Vec<model::Row>>), String> {
        if a.segment > 0 {
            a.lane = self
                .model
                .new_lane(a.job.lane_rows as usize)
                .map_err(|e| e.to_string())?;
        }
        let seg = &a.job.segments[a.segment].0;
        let p = seg.prefix_rows;
        let rows: Vec<model::Row> = to_rows(&a.job.prefix[..p])
            .into_iter()
            .chain(to_rows(&seg.rows))
            .collect();
        if p > 0 && p < rows.len() {
            // The reference prefix: restored from the cache or prefilled (and then cached).
            let capacity = a.lane.capacity();
            let key = a.job.prefix_key_of(p);
            let mut cache = self.cache.borrow_mut();
            match cache.get(&key) {
                Some(lane) => {
                    a.lane = lane
                        .fork(&self.model, capacity)
                        .map_err(|e| e.to_string())?
                }
                None => {
                    self.prefill(&mut a.lane, &rows[..p])?;
                    if let Ok(copy) = a.lane.fork(&self.model, p) {
                        cache.insert(key, copy, p);
                    }
                }
            }
            drop(cache);
        }
        let main = if p > 0 && p < rows.len() {
            rows[p..].to_vec()
        } else {
            rows
        };
        let mut un_rows = None;
        a.uncond = None;
        if let Some((_, un)) = &a.job.guidance {
            let seg = &a.job.segments[a.segment];
            let urows = to_rows(&un[a.segment].rows);
            let cap = urows.len() + seg.1.frames.0 as usize + 1;
            let lane = self
                .model
                .new_backbone_lane(cap)
                .map_err(|e| e.to_string())?;
            a.uncond = Some(lane);
            un_rows = Some(urows);
        }
        a.seg_frames = 0;
        Ok((main, un_rows))
    }

    /// One shared frame round; returns the final messages of lanes that ended, for the codec
    /// thread once their model state is released.
    fn round(&self, active: &mut Vec<Active<B>>) -> Vec<CodecMsg> {
        let mut ended = Vec::new();
        let steps: Vec<LaneStep> = active
            .iter()
            .map(|a| LaneStep {
                params: a.job.params,
                seed: a.job.seed,
                step: a.step,
            })
            .collect();
        let outs = {
            let guided = active.iter().any(|a| a.uncond.is_some());
            let gammas: Vec<f32> = active
                .iter()
                .map(|a| a.job.guidance.as_ref().map(|g| g.0).unwrap_or(0.0))
                .collect();
            let (mut lanes, uncond): (Vec<&mut LaneState<B>>, Vec<Option<&mut LaneState<B>>>) =
                active
                    .iter_mut()
                    .map(|a| (&mut a.lane, a.uncond.as_mut()))
                    .unzip();
            if guided {
                let mut g = model::Guidance {
                    uncond,
                    gamma: gammas,
                    batched: self.cfg_batched,
                };
                self.model
                    .step_frames_guided(&mut lanes, &steps, Some(&mut g), None, None)
            } else {
                self.model.step_frames(&mut lanes, &steps, None, None)
            }
        };
        let outs = match outs {
            Ok(o) => o,
            Err(e) => {
                for a in active.drain(..) {
                    ended.push(CodecMsg::Fail {
                        key: a.key,
                        message: format!("model: {e}"),
                    });
                }
                return ended;
            }
        };
        let mut finished = vec![false; active.len()];
        for (i, (a, out)) in active.iter_mut().zip(outs).enumerate() {
            a.step += 1;
            let seg_done = match out {
                FrameOut::Eos => true,
                FrameOut::Frame(f) => {
                    a.frames += 1;
                    a.seg_frames += 1;
                    self.frames_total.fetch_add(1, Ordering::Relaxed);
                    let codes: Vec<u32> = f[1..].iter().map(|&c| c.max(0) as u32).collect();
                    // Decoded on the codec thread, overlapped with the next frame round.
                    // counted as unread from the moment it is made, so the pause does not
                    // depend on how far the codec thread lags
                    a.job.unread.fetch_add(self.frame_length, Ordering::SeqCst);
                    let _ = self.codec_tx.send(CodecMsg::Frame { key: a.key, codes });
                    let cap = a.job.segments[a.segment].1.frames.0;
                    if a.seg_frames >= cap {
                        a.capped += 1;
                        true
                    } else {
                        false
                    }
                }
            };
            if seg_done {
                a.segment += 1;
                if a.segment < a.job.segments.len() {
                    if let Err(e) = self.prefill_segment(a) {
                        ended.push(CodecMsg::Fail {
                            key: a.key,
                            message: e,
                        });
                        finished[i] = true;
                    }
                } else {
                    // The codec thread completes the audio figures and the hash.
                    let summary = JobSummary {
                        seed: a.job.seed,
                        frames: a.frames,
                        samples: 0,
                        audio_seconds: 0.0,
                        pcm_sha256: String::new(),
                        capped_segments: a.capped,
                        segments: a.job.segments.len() as u32,
                        elapsed_seconds: 0.0,
                        generated_seconds: a.job.submitted.elapsed().as_secs_f64(),
                        first_audio_seconds: None,
                        cap: a.job.cap,
                        frame_cap: a.job.frame_cap,
                        guided: a.uncond.is_some(),
                    };
                    ended.push(CodecMsg::Finish {
                        key: a.key,
                        summary,
                    });
                    finished[i] = true;
                }
            }
        }
        // finished jobs hand their lanes back to the model, which may keep them in the kept
        // round's slots (ghosts) so the lanes left keep replaying the same recording
        let mut left = Vec::with_capacity(active.len());
        for (a, done) in active.drain(..).zip(finished) {
            if done {
                self.retire(a);
            } else {
                left.push(a);
            }
        }
        *active = left;
        ended
    }

    /// A job's lanes back to the model (its reservation is released with the rest of it).
    fn retire(&self, a: Active<B>) {
        let Active { lane, uncond, .. } = a;
        self.model.retire(lane);
        if let Some(u) = uncond {
            self.model.retire(u);
        }
    }
}

#[cfg(test)]
mod codec_thread_tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// One sample per frame identifying it (`1000 · c0 + c1`), and a record of chunk sizes.
    struct Fake(Arc<Mutex<Vec<usize>>>);

    impl StreamDecoder for Fake {
        fn push(&mut self, codes: &Codes) -> Result<Vec<f32>, String> {
            self.0.lock().unwrap().push(codes.frames());
            Ok((0..codes.frames())
                .map(|f| (1000 * codes.get(0, f) + codes.get(1, f)) as f32)
                .collect())
        }
        fn as_any(&mut self) -> &mut dyn std::any::Any {
            self
        }
    }

    /// `n` started jobs (keys 0..n) on fake decoders recording their calls in `calls`, those
    /// `failed` says already failed, and their event receivers.
    #[allow(clippy::type_complexity)]
    fn fake_jobs(
        n: u64,
        calls: &Arc<Mutex<Vec<usize>>>,
        failed: impl Fn(u64) -> bool,
    ) -> (
        std::collections::HashMap<u64, CodecJob>,
        Vec<mpsc::UnboundedReceiver<JobEvent>>,
    ) {
        let mut jobs = std::collections::HashMap::new();
        let mut rxs = Vec::new();
        for key in 0..n {
            let (etx, erx) = mpsc::unbounded_channel();
            rxs.push(erx);
            let job = CodecJob {
                events: etx,
                submitted: Instant::now(),
                decoder: Box::new(Fake(calls.clone())),
                hasher: PcmHasher::new(),
                samples: 0,
                first_audio: None,
                first_audio_at: None,
                failed: failed(key),
            };
            jobs.insert(key, job);
        }
        (jobs, rxs)
    }

    /// Job `key`'s next event is its failure, with a message holding `needle`, and it is marked
    /// failed.
    fn expect_failed(
        jobs: &std::collections::HashMap<u64, CodecJob>,
        rxs: &mut [mpsc::UnboundedReceiver<JobEvent>],
        key: usize,
        needle: &str,
    ) {
        match rxs[key].try_recv() {
            Ok(JobEvent::Failed(msg)) => assert!(msg.contains(needle), "job {key}: {msg}"),
            other => panic!("job {key}: {other:?}"),
        }
        assert!(jobs[&(key as u64)].failed, "job {key}");
    }

    /// Due jobs go to the decoder together, as many a call as its frames allow, each job's
    /// audio its own and in order; a job alone in its group gets its own call; jobs that have
    /// failed or ended are left out.
    #[test]
    fn due_jobs_decode_together() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let groups = Arc::new(Mutex::new(Vec::new()));
        let g2 = groups.clone();
        let tg = Together {
            decode: Box::new(move |states, codes| {
                g2.lock()
                    .unwrap()
                    .push(codes.iter().map(|c| c.frames()).collect::<Vec<_>>());
                states
                    .iter_mut()
                    .zip(codes)
                    .map(|(s, c)| {
                        s.as_any()
                            .downcast_mut::<Fake>()
                            .ok_or_else(|| "not a fake".to_string())?
                            .push(c)
                    })
                    .collect()
            }),
            frames: 10,
        };
        let (mut jobs, mut rxs) = fake_jobs(5, &calls, |key| key == 3);
        let frames = |key: u32, n: u32| (0..n).map(|f| vec![key, f]).collect::<Vec<_>>();
        // 4 + 5 frames fit 10; job 2's 3 more do not: a new group, with job 3 (failed, left
        // out) and job 4's 6 frames; job 9 is not a job
        let due = vec![
            (0, frames(0, 4)),
            (1, frames(1, 5)),
            (2, frames(2, 3)),
            (3, frames(3, 2)),
            (9, frames(9, 1)),
            (4, frames(4, 6)),
        ];
        decode_due(&mut jobs, due, Some(&tg), &CodecMeter::default());
        assert_eq!(*groups.lock().unwrap(), vec![vec![4, 5], vec![3, 6]]);
        for (key, n) in [(0u32, 4u32), (1, 5), (2, 3), (4, 6)] {
            let mut audio = Vec::new();
            while let Ok(ev) = rxs[key as usize].try_recv() {
                match ev {
                    JobEvent::Audio(p) => audio.extend(p),
                    other => panic!("job {key}: unexpected {other:?}"),
                }
            }
            let want: Vec<f32> = (0..n).map(|f| (1000 * key + f) as f32).collect();
            assert_eq!(audio, want, "job {key}");
        }
        assert!(rxs[3].try_recv().is_err(), "a failed job gets nothing");
        // one job due: its own call, not the together one
        let before = calls.lock().unwrap().len();
        decode_due(
            &mut jobs,
            vec![(0, frames(0, 2))],
            Some(&tg),
            &CodecMeter::default(),
        );
        assert_eq!(groups.lock().unwrap().len(), 2);
        assert_eq!(calls.lock().unwrap().len(), before + 1);
    }

    /// In a call over several jobs, a job whose frames do not form codes fails alone (the others
    /// decode together); a call that returns audio for fewer streams than it took fails each
    /// of its jobs instead of leaving one without audio or failure.
    #[test]
    fn bad_frames_fail_their_job_alone_and_short_audio_fails_each() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let groups = Arc::new(Mutex::new(Vec::new()));
        let g2 = groups.clone();
        let short = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s2 = short.clone();
        let tg = Together {
            decode: Box::new(move |states, codes| {
                g2.lock().unwrap().push(codes.len());
                let mut pcm: Vec<Vec<f32>> = states
                    .iter_mut()
                    .zip(codes)
                    .map(|(s, c)| s.push(c))
                    .collect::<Result<_, _>>()?;
                if s2.load(Ordering::SeqCst) {
                    pcm.pop();
                }
                Ok(pcm)
            }),
            frames: 64,
        };
        let (mut jobs, mut rxs) = fake_jobs(5, &calls, |_| false);
        let frames = |key: u32| vec![vec![key, 0], vec![key, 1]];
        let m = CodecMeter::default();
        // job 0's second frame has one code of two
        decode_due(
            &mut jobs,
            vec![
                (0, vec![vec![0, 0], vec![0]]),
                (1, frames(1)),
                (2, frames(2)),
            ],
            Some(&tg),
            &m,
        );
        expect_failed(&jobs, &mut rxs, 0, "codes");
        assert_eq!(*groups.lock().unwrap(), vec![2], "jobs 1 and 2 in one call");
        for key in 1..3u32 {
            match rxs[key as usize].try_recv() {
                Ok(JobEvent::Audio(p)) => {
                    assert_eq!(p, vec![(1000 * key) as f32, (1000 * key + 1) as f32])
                }
                other => panic!("job {key}: {other:?}"),
            }
        }
        // a call returning audio for one stream of two fails both
        short.store(true, Ordering::SeqCst);
        decode_due(
            &mut jobs,
            vec![(3, frames(3)), (4, frames(4))],
            Some(&tg),
            &m,
        );
        for key in 3..5 {
            expect_failed(&jobs, &mut rxs, key, "returned audio");
        }
        assert_eq!(m.counts().calls, 1, "only the good call is counted");
        assert_eq!(jobs.len(), 5, "every job is back in the table");
    }

    /// A call over several jobs that fails fails each of its jobs with the decoder's message;
    /// the next call (other jobs) is unaffected.
    #[test]
    fn a_failed_call_over_several_jobs_fails_each() {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let fail = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let f2 = fail.clone();
        let tg = Together {
            decode: Box::new(move |states, codes| {
                if f2.swap(false, Ordering::SeqCst) {
                    return Err("device lost".into());
                }
                states
                    .iter_mut()
                    .zip(codes)
                    .map(|(s, c)| s.push(c))
                    .collect()
            }),
            frames: 64,
        };
        let (mut jobs, mut rxs) = fake_jobs(4, &calls, |_| false);
        let frames = |key: u32| vec![vec![key, 0], vec![key, 1]];
        let m = CodecMeter::default();
        decode_due(
            &mut jobs,
            vec![(0, frames(0)), (1, frames(1))],
            Some(&tg),
            &m,
        );
        decode_due(
            &mut jobs,
            vec![(2, frames(2)), (3, frames(3))],
            Some(&tg),
            &m,
        );
        for key in 0..2 {
            expect_failed(&jobs, &mut rxs, key, "device lost");
        }
        for key in 2..4u32 {
            match rxs[key as usize].try_recv() {
                Ok(JobEvent::Audio(p)) => {
                    assert_eq!(p, vec![(1000 * key) as f32, (1000 * key + 1) as f32])
                }
                other => panic!("job {key}: {other:?}"),
            }
        }
        assert_eq!(m.counts().calls, 1, "the failed call is not counted");
        // a failed job's later frames are left out
        decode_due(
            &mut jobs,
            vec![(0, frames(0)), (2, frames(2))],
            Some(&tg),
            &m,
        );
        assert!(rxs[0].try_recv().is_err());
    }

    /// The GPU decoder's step: the engine's largest call unless `DRAMATIS_CODEC_STEP` says,
    /// always 1 to `CODEC_MAX_CHUNK`.
    #[test]
    fn codec_step_setting() {
        assert_eq!(codec_step_frames(None, 32), 32);
        assert_eq!(codec_step_frames(None, 0), 1);
        assert_eq!(codec_step_frames(None, 4096), CODEC_MAX_CHUNK);
        assert_eq!(codec_step_frames(Some(" 16"), 32), 16);
        assert_eq!(codec_step_frames(Some("500"), 32), CODEC_MAX_CHUNK);
        assert_eq!(codec_step_frames(Some("x"), 32), 32);
    }

    fn summary() -> JobSummary {
        JobSummary {
            seed: 0,
            frames: 0,
            samples: 0,
            audio_seconds: 0.0,
            pcm_sha256: String::new(),
            capped_segments: 0,
            segments: 1,
            elapsed_seconds: 0.0,
            generated_seconds: 0.0,
            first_audio_seconds: None,
            cap: CapApplied::Default,
            frame_cap: 0,
            guided: false,
        }
    }

    /// Starts jobs 0..n on the codec loop's channel; their event receivers.
    fn start_jobs(
        tx: &std::sync::mpsc::Sender<CodecMsg>,
        n: u64,
    ) -> Vec<mpsc::UnboundedReceiver<JobEvent>> {
        (0..n)
            .map(|key| {
                let (etx, erx) = mpsc::unbounded_channel();
                tx.send(CodecMsg::Start {
                    key,
                    events: etx,
                    submitted: Instant::now(),
                })
                .unwrap();
                erx
            })
            .collect()
    }

    /// Through the loop: the frames two jobs have waiting after a batch of messages are
    /// decoded in one call over both (where the decoder can), each job's audio its own and in
    /// frame order.
    #[test]
    fn the_loop_decodes_due_jobs_together() {
        let chunks = Arc::new(Mutex::new(Vec::new()));
        let c2 = chunks.clone();
        let factory: DecoderFactory =
            Box::new(move || Ok(Box::new(Fake(c2.clone())) as Box<dyn StreamDecoder>));
        let groups = Arc::new(Mutex::new(Vec::new()));
        let g2 = groups.clone();
        let tg = Together {
            decode: Box::new(move |states, codes| {
                g2.lock().unwrap().push(codes.len());
                states
                    .iter_mut()
                    .zip(codes)
                    .map(|(s, c)| s.push(c))
                    .collect()
            }),
            frames: 8,
        };
        let (tx, rx) = std::sync::mpsc::channel();
        let mut streams = start_jobs(&tx, 2);
        for f in 0..3u32 {
            for key in 0..2u64 {
                let codes = vec![key as u32, f, 7, 7];
                tx.send(CodecMsg::Frame { key, codes }).unwrap();
            }
        }
        drop(tx);
        let chunks_at = CodecChunks {
            max: 5,
            min: 1,
            max_hold: CODEC_MAX_HOLD,
        };
        codec_loop(
            factory,
            Some(tg),
            44_100,
            chunks_at,
            rx,
            &CodecMeter::default(),
        );
        assert_eq!(*groups.lock().unwrap(), vec![2], "one call over both jobs");
        for (key, erx) in streams.iter_mut().enumerate() {
            let mut audio = Vec::new();
            while let Ok(ev) = erx.try_recv() {
                match ev {
                    JobEvent::Audio(p) => audio.extend(p),
                    other => panic!("job {key}: unexpected {other:?}"),
                }
            }
            let want: Vec<f32> = (0..3).map(|f| (1000 * key + f) as f32).collect();
            assert_eq!(audio, want, "job {key}");
        }
    }

    /// A backlog of two interleaved jobs is decoded in chunks, each job's audio in frame order,
    /// its summary after all of its audio; a dropped job sends nothing after the drop.
    #[test]
    fn a_backlog_is_coalesced_in_order() {
        let chunks = Arc::new(Mutex::new(Vec::new()));
        let c2 = chunks.clone();
        let factory: DecoderFactory =
            Box::new(move || Ok(Box::new(Fake(c2.clone())) as Box<dyn StreamDecoder>));
        let (tx, rx) = std::sync::mpsc::channel();
        let mut streams = start_jobs(&tx, 3);
        // 150 frames per job, interleaved (more than one chunk's worth)
        for f in 0..150u32 {
            for key in 0..3u64 {
                let codes = vec![key as u32, f, 7, 7];
                tx.send(CodecMsg::Frame { key, codes }).unwrap();
            }
            if f == 20 {
                tx.send(CodecMsg::Drop { key: 2 }).unwrap();
            }
        }
        for key in 0..2u64 {
            tx.send(CodecMsg::Finish {
                key,
                summary: summary(),
            })
            .unwrap();
        }
        drop(tx);
        // a cap below the backlog, as the engine's workspace cap is; no holding
        let cap = 5;
        let chunks_at = CodecChunks {
            max: cap,
            min: 1,
            max_hold: CODEC_MAX_HOLD,
        };
        codec_loop(factory, None, 44_100, chunks_at, rx, &CodecMeter::default());
        for (key, erx) in streams.iter_mut().enumerate() {
            let mut audio = Vec::new();
            let mut done = None;
            while let Ok(ev) = erx.try_recv() {
                assert!(done.is_none(), "job {key}: an event after Done");
                match ev {
                    JobEvent::Audio(p) => audio.extend(p),
                    JobEvent::Done(s) => done = Some(s),
                    other => panic!("job {key}: unexpected {other:?}"),
                }
            }
            let frames = if key == 2 { 21 } else { 150 };
            let want: Vec<f32> = (0..frames).map(|f| (1000 * key + f) as f32).collect();
            if key == 2 {
                // every message was queued before the loop ran: the full chunks before the drop
                // are decoded (frames 0-19), the one still waiting at the drop (frame 20) has
                // no reader and is discarded, and nothing after it is decoded
                assert_eq!(audio, want[..20], "job 2: the chunks before its drop");
                assert!(done.is_none());
            } else {
                assert_eq!(audio, want, "job {key}: audio in frame order");
                let s = done.expect("a summary");
                assert_eq!(s.samples, 150);
            }
        }
        let sizes = chunks.lock().unwrap().clone();
        assert!(sizes.iter().all(|&n| n <= cap), "{sizes:?}");
        assert!(
            sizes.iter().any(|&n| n > 1),
            "the backlog was coalesced: {sizes:?}"
        );
    }

    /// The codec loop on its own thread (`rate` samples a second: the fake decoder makes one
    /// sample a frame), one started job, its event receiver and the decoder's chunk sizes.
    #[allow(clippy::type_complexity)]
    fn spawn_loop(
        rate: u32,
        max_chunk: usize,
        min_chunk: usize,
        max_hold: std::time::Duration,
    ) -> (
        std::sync::mpsc::Sender<CodecMsg>,
        mpsc::UnboundedReceiver<JobEvent>,
        Arc<Mutex<Vec<usize>>>,
        std::thread::JoinHandle<()>,
    ) {
        let chunks = Arc::new(Mutex::new(Vec::new()));
        let c2 = chunks.clone();
        let factory: DecoderFactory =
            Box::new(move || Ok(Box::new(Fake(c2.clone())) as Box<dyn StreamDecoder>));
        let (tx, rx) = std::sync::mpsc::channel();
        let (etx, erx) = mpsc::unbounded_channel();
        tx.send(CodecMsg::Start {
            key: 0,
            events: etx,
            submitted: Instant::now(),
        })
        .unwrap();
        let h = std::thread::spawn(move || {
            let chunks = CodecChunks {
                max: max_chunk,
                min: min_chunk,
                max_hold,
            };
            codec_loop(factory, None, rate, chunks, rx, &CodecMeter::default())
        });
        (tx, erx, chunks, h)
    }

    fn frame(tx: &std::sync::mpsc::Sender<CodecMsg>, f: u32) {
        tx.send(CodecMsg::Frame {
            key: 0,
            codes: vec![0, f, 7, 7],
        })
        .unwrap();
    }

    /// The audio events received so far, flattened (one sample a frame).
    fn audio_so_far(erx: &mut mpsc::UnboundedReceiver<JobEvent>, audio: &mut Vec<f32>) {
        while let Ok(ev) = erx.try_recv() {
            if let JobEvent::Audio(p) = ev {
                audio.extend(p);
            }
        }
    }

    /// Frame 0, and its audio back (so the next frames find the first audio out).
    fn first_audio(
        tx: &std::sync::mpsc::Sender<CodecMsg>,
        erx: &mut mpsc::UnboundedReceiver<JobEvent>,
        audio: &mut Vec<f32>,
    ) {
        frame(tx, 0);
        let t0 = Instant::now();
        while audio.is_empty() && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(1));
            audio_so_far(erx, audio);
        }
        assert_eq!(*audio, vec![0.0], "the first audio at once");
    }

    /// A hold no test waits out: only `min` frames or the job's end release held frames.
    const LONG_HOLD: std::time::Duration = std::time::Duration::from_secs(60);

    /// A job whose audio is far ahead of real time (one second a frame) has its first frame
    /// decoded at once and the next ones gathered at least `min` to a call, every frame in
    /// order and the rest decoded at its end.
    #[test]
    fn frames_ahead_of_real_time_are_gathered() {
        let (tx, mut erx, chunks, h) = spawn_loop(1, 8, 4, LONG_HOLD);
        let mut audio = Vec::new();
        first_audio(&tx, &mut erx, &mut audio);
        for f in 1..14u32 {
            frame(&tx, f);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        tx.send(CodecMsg::Finish {
            key: 0,
            summary: summary(),
        })
        .unwrap();
        drop(tx);
        h.join().unwrap();
        audio_so_far(&mut erx, &mut audio);
        let want: Vec<f32> = (0..14).map(|f| f as f32).collect();
        assert_eq!(audio, want, "every frame, in order");
        let sizes = chunks.lock().unwrap().clone();
        assert_eq!(sizes[0], 1, "the first audio goes out alone: {sizes:?}");
        assert!(sizes.iter().all(|&n| n <= 8), "{sizes:?}");
        // between the first audio and the end, a call waits for four frames (more if the
        // thread woke late and found more)
        let middle = &sizes[1..sizes.len() - 1];
        assert!(
            !middle.is_empty() && middle.iter().all(|&n| n >= 4),
            "frames gathered 4 or more a call: {sizes:?}"
        );
    }

    /// A held frame goes out once the hold's limit has passed, with no further frame and no
    /// end to push it.
    #[test]
    fn a_held_frame_goes_out_after_the_hold() {
        let (tx, mut erx, chunks, h) = spawn_loop(1, 8, 4, CODEC_MAX_HOLD);
        let mut audio = Vec::new();
        first_audio(&tx, &mut erx, &mut audio);
        frame(&tx, 1);
        let t0 = Instant::now();
        while audio.len() < 2 && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(5));
            audio_so_far(&mut erx, &mut audio);
        }
        assert_eq!(audio, vec![0.0, 1.0], "both frames out before the job ends");
        assert!(
            t0.elapsed() >= CODEC_MAX_HOLD / 2,
            "the second frame was held ({:?})",
            t0.elapsed()
        );
        drop(tx);
        h.join().unwrap();
        assert_eq!(chunks.lock().unwrap().clone(), vec![1, 1]);
    }

    /// A job whose audio is behind real time (one sample a frame at 44.1 kHz) is never held:
    /// each frame's audio comes out on its own, not at the end of a 60 s hold.
    #[test]
    fn frames_behind_real_time_are_not_held() {
        let (tx, mut erx, _chunks, h) = spawn_loop(44_100, 8, 4, LONG_HOLD);
        let mut audio = Vec::new();
        for f in 0..3u32 {
            frame(&tx, f);
            let t0 = Instant::now();
            while audio.len() <= f as usize && t0.elapsed() < std::time::Duration::from_secs(5) {
                std::thread::sleep(std::time::Duration::from_millis(1));
                audio_so_far(&mut erx, &mut audio);
            }
            assert!(
                audio.len() > f as usize,
                "frame {f} not out after {:?}",
                t0.elapsed()
            );
        }
        drop(tx);
        h.join().unwrap();
        assert_eq!(audio, vec![0.0, 1.0, 2.0]);
    }
}

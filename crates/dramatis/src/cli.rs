use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use speech::{
    Engine, EngineOptions, JobEvent, ReferenceAudio, ReferenceInput, Split, SynthesisRequest,
};

#[derive(Parser)]
#[command(
    name = "dramatis",
    version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("DRAMATIS_GIT"), ")"),
    about = "Native inference engine and server for Fish Audio's Drama 3 text-to-speech model",
    long_about = "Native inference engine and server for Fish Audio's Drama 3 text-to-speech model.\n\
                  Without --model, `say` and `serve` use a built-in tiny synthetic checkpoint with random \
                  weights: every stage runs, but the audio is noise."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum BackendArg {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum KvArg {
    F32,
    Bf16,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum GeometryArg {
    Tiny,
    Drama3,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum ExpertsArg {
    Fp8,
    Nvfp4Pruned,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum SplitArg {
    Sentence,
    None,
}

/// Model and engine settings shared by `say` and `serve`.
#[derive(Args, Clone)]
struct EngineArgs {
    /// Checkpoint folder; without it, the built-in tiny synthetic checkpoint (noise).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Compute backend.
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    /// Window C in rows (default: the model's max_position_embeddings).
    #[arg(long)]
    context: Option<u64>,
    /// Voice catalog folder (default: $XDG_DATA_HOME/dramatis/voices).
    #[arg(long)]
    voices: Option<PathBuf>,
    /// Host memory budget in GiB (default: MemAvailable).
    #[arg(long)]
    host_gib: Option<f64>,
    /// Device memory budget in GiB for --backend cuda (default: the device's free memory at start-up).
    #[arg(long)]
    device_gib: Option<f64>,
    /// Classifier-free guidance strength on the semantic logits (0 = off).
    #[arg(long, default_value_t = 0.0)]
    cfg_gamma: f32,
    /// Run both CFG branches in one batched step.
    #[arg(long)]
    cfg_batched: bool,
    /// Run the guided path even at gamma 0 (its output must equal the unguided output).
    #[arg(long)]
    cfg_force_guided: bool,
    /// Accept per-request `cfg_gamma` in [0, 10].
    #[arg(long)]
    cfg_allow_request_gamma: bool,
    /// Decode audio and encode reference clips on the host even with --backend cuda (the GPU
    /// then runs the model alone, for measuring what the GPU codec costs; the host codec is far
    /// slower at Drama 3 geometry).
    #[arg(long)]
    codec_on_host: bool,
    /// Frames one codec call gathers for a job whose audio is well ahead of real time (1:
    /// every frame as it comes; the first audio always goes out at once).
    #[arg(long, default_value_t = speech::DEFAULT_CODEC_MIN_CHUNK)]
    codec_min_chunk: usize,
}

#[derive(Subcommand)]
enum VoicesCmd {
    /// Encode a clip once and store it with its transcript.
    Add {
        name: String,
        clip: PathBuf,
        #[arg(long)]
        text: String,
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long)]
        voices: Option<PathBuf>,
    },
    /// List the catalog.
    List {
        #[arg(long)]
        voices: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Remove a voice.
    Remove {
        name: String,
        #[arg(long)]
        voices: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum Cmd {
    /// Synthesize TEXT to a 16-bit 44.1 kHz WAV.
    Say(SayArgs),
    /// The HTTP server (OpenAI- and Fish-compatible).
    Serve {
        #[command(flatten)]
        engine: EngineArgs,
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Lanes advancing together in shared frame rounds.
        #[arg(long, default_value_t = 1)]
        parallel: usize,
        /// Waiting requests beyond the lanes (default 4 x lanes).
        #[arg(long)]
        queue: Option<usize>,
        /// Reference prefill cache budget in GiB.
        #[arg(long, default_value_t = 1.0)]
        prompt_cache_gib: f64,
        /// Seconds of decoded audio a streaming client may leave unread before its job pauses
        /// (resuming as it reads): bounds memory per request; nothing is dropped.
        #[arg(long, default_value_t = speech::DEFAULT_MAX_UNREAD_AUDIO_SECONDS)]
        max_unread_audio_seconds: f64,
        /// Seconds a job may stay paused for a client that reads nothing before it is stopped
        /// (the client gets an error naming the figures; its lane is freed).
        #[arg(long, default_value_t = speech::DEFAULT_MAX_PAUSE_SECONDS)]
        max_pause_seconds: f64,
        /// Waiting requests started (prefilled) between two frame rounds, at most (0: no cap on
        /// their count; --start-rows-per-round still bounds their rows). Outputs are the same
        /// either way.
        #[arg(long, default_value_t = 0)]
        starts_per_round: usize,
        /// Prompt rows to prefill (a cached reference prefix not counted) started between two
        /// frame rounds, at most (default: the plan's prefill chunk, one joined prefill a
        /// round; 0: no limit). At least one waiting request starts each time. Outputs are the
        /// same either way.
        #[arg(long)]
        start_rows_per_round: Option<usize>,
        /// Bearer key(s) required on every route but /health.
        #[arg(long = "api-key")]
        api_keys: Vec<String>,
    },
    /// Report a checkpoint: geometry, tensors per dtype, bytes per class, the manifest verdict.
    Inspect {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// The admission and memory plan, without weights or GPU.
    Plan(PlanArgs),
    /// The voice catalog.
    Voices {
        #[command(subcommand)]
        cmd: VoicesCmd,
    },
    /// Write a synthetic checkpoint in the real on-disk format.
    Fixture {
        #[arg(long, value_enum)]
        geometry: GeometryArg,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long, required_unless_present = "manifest_only")]
        out: Option<PathBuf>,
        #[arg(long, value_enum, default_value = "fp8")]
        experts: ExpertsArg,
        /// Fraction of experts kept per layer (nvfp4-pruned).
        #[arg(long, default_value_t = 0.5)]
        keep: f64,
        /// Print the tensor list without writing weights.
        #[arg(long)]
        manifest_only: bool,
    },
    /// Run every golden case of a fixture folder; non-zero exit on any failure.
    Golden {
        dir: PathBuf,
        #[arg(long, value_enum, default_value = "cpu")]
        backend: BackendArg,
    },
    /// Every registered CUDA kernel against its FP64 reference, with planted controls.
    KernelContract {
        /// Only kernels whose name contains this (or one of its comma-separated parts).
        #[arg(long)]
        only: Option<String>,
    },
    /// Throughput and latency receipts (JSON, median of several runs).
    Bench(crate::bench::BenchArgs),
    /// Fill a window of C rows (P = C - 2 prompt rows, one frame) and check the last position;
    /// writes a receipt. With --compare-cpu, the same run on the CPU is the reference.
    QualifyWindow {
        #[arg(long)]
        model: Option<PathBuf>,
        #[arg(long, value_enum, default_value = "cpu")]
        backend: BackendArg,
        #[arg(long)]
        context: usize,
        /// Prefill piece size in rows.
        #[arg(long, default_value_t = 4096)]
        chunk: usize,
        #[arg(long)]
        compare_cpu: bool,
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Static facts about this build. Needs no GPU and no model.
    Capabilities {
        #[arg(long)]
        json: bool,
    },
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DRAMATIS_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn choice(b: BackendArg) -> speech::BackendChoice {
    match b {
        BackendArg::Cpu => speech::BackendChoice::Cpu,
        BackendArg::Cuda => speech::BackendChoice::Cuda,
    }
}

fn engine_options(a: &EngineArgs) -> Result<EngineOptions> {
    Ok(EngineOptions {
        backend: choice(a.backend),
        model_dir: a.model.clone(),
        context: a.context,
        voices_dir: a.voices.clone(),
        host_gib: a.host_gib,
        device_gib: a.device_gib,
        codec_on_host: a.codec_on_host,
        codec_min_chunk: a.codec_min_chunk,
        cfg: speech::CfgOptions {
            gamma: a.cfg_gamma,
            batched: a.cfg_batched,
            force_guided: a.cfg_force_guided,
            allow_request_gamma: a.cfg_allow_request_gamma,
        },
        ..EngineOptions::default()
    })
}

fn run(cli: Cli) -> Result<ExitCode> {
    match cli.cmd {
        Cmd::Say(a) => say(a),
        Cmd::Serve {
            engine,
            host,
            port,
            parallel,
            queue,
            prompt_cache_gib,
            max_unread_audio_seconds,
            max_pause_seconds,
            starts_per_round,
            start_rows_per_round,
            api_keys,
        } => {
            let mut opts = engine_options(&engine)?;
            opts.parallel = parallel;
            opts.queue = queue;
            opts.prompt_cache_gib = prompt_cache_gib;
            opts.max_unread_audio_seconds = max_unread_audio_seconds;
            opts.max_pause_seconds = max_pause_seconds;
            opts.starts_per_round = starts_per_round;
            opts.start_rows_per_round = start_rows_per_round;
            let eng = Engine::load(opts).map_err(|e| anyhow!("start-up failed: {e}"))?;
            let rt = tokio::runtime::Runtime::new()?;
            let so = server::ServeOptions {
                host,
                port,
                api_keys,
                ..Default::default()
            };
            rt.block_on(server::serve(Arc::clone(&eng), so))
                .map_err(|e| anyhow!("{e}"))?;
            eng.shutdown();
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Inspect { dir, json } => {
            let r = checkpoint::inspect::inspect(&dir)
                .with_context(|| format!("inspecting {}", dir.display()))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                print!("{}", checkpoint::inspect::render(&r));
            }
            Ok(if r.admitted() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::Plan(a) => plan(a),
        Cmd::Voices { cmd } => voices(cmd),
        Cmd::Fixture {
            geometry,
            seed,
            out,
            experts,
            keep,
            manifest_only,
        } => crate::fixture::run(
            match geometry {
                GeometryArg::Tiny => checkpoint::geometry::Geometry::Tiny,
                GeometryArg::Drama3 => checkpoint::geometry::Geometry::Drama3,
            },
            seed,
            out,
            match experts {
                ExpertsArg::Fp8 => checkpoint::fixture::FixtureExperts::Fp8,
                ExpertsArg::Nvfp4Pruned => {
                    checkpoint::fixture::FixtureExperts::Nvfp4Pruned { keep }
                }
            },
            manifest_only,
        ),
        Cmd::KernelContract { only } => crate::gpu::kernel_contract(only.as_deref()),
        Cmd::Golden { dir, backend } => {
            let report = match backend {
                BackendArg::Cpu => speech::golden::run(&dir),
                BackendArg::Cuda => crate::gpu::golden_cuda(&dir),
            }
            .map_err(|e| anyhow!("{e}"))?;
            for line in &report.lines {
                println!("{line}");
            }
            println!(
                "GOLDEN {} cases: {} pass, {} fail",
                report.cases,
                report.cases - report.failures,
                report.failures
            );
            Ok(if report.failures == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Cmd::Bench(mut a) => {
            a.runs = a.runs.max(1);
            crate::bench::run(a)?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::QualifyWindow {
            model,
            backend,
            context,
            chunk,
            compare_cpu,
            out,
        } => crate::gpu::qualify_window(
            model,
            backend == BackendArg::Cuda,
            context,
            chunk,
            compare_cpu,
            out,
        ),
        Cmd::Capabilities { json } => {
            let c = crate::caps::capabilities();
            if json {
                println!("{}", serde_json::to_string_pretty(&c)?);
            } else {
                print!("{}", crate::caps::render(&c));
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

#[derive(Args)]
struct SayArgs {
    text: String,
    #[command(flatten)]
    engine: EngineArgs,
    /// A catalog voice.
    #[arg(long)]
    voice: Option<String>,
    /// Reference clip (WAV, any rate); repeat for several, each with its --ref-text.
    #[arg(long = "ref")]
    refs: Vec<PathBuf>,
    /// Transcript of the matching --ref clip.
    #[arg(long = "ref-text")]
    ref_texts: Vec<String>,
    #[arg(long, short, default_value = "out.wav")]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Frame cap (honoured exactly or refused); default 1024.
    #[arg(long)]
    frames: Option<u64>,
    #[arg(long)]
    temperature: Option<f32>,
    #[arg(long)]
    top_p: Option<f32>,
    #[arg(long)]
    top_k: Option<u32>,
    #[arg(long, value_enum, default_value = "sentence")]
    split: SplitArg,
}

fn say(a: SayArgs) -> Result<ExitCode> {
    if a.refs.len() != a.ref_texts.len() {
        bail!(
            "{} --ref clip(s) but {} --ref-text transcript(s): every reference clip needs its transcript",
            a.refs.len(),
            a.ref_texts.len()
        );
    }
    let mut references = Vec::new();
    for (clip, text) in a.refs.iter().zip(&a.ref_texts) {
        let bytes = std::fs::read(clip).with_context(|| format!("reading {}", clip.display()))?;
        references.push(ReferenceInput {
            audio: ReferenceAudio::Wav(bytes),
            transcript: text.clone(),
        });
    }
    let opts = engine_options(&a.engine)?;
    let builtin = opts.model_dir.is_none();
    if builtin {
        eprintln!("note: no --model given: using the built-in tiny synthetic checkpoint (random weights, the audio is noise)");
    }
    let eng = Engine::load(opts).map_err(|e| anyhow!("{e}"))?;
    let req = SynthesisRequest {
        text: a.text,
        voice: a.voice,
        references,
        seed: Some(a.seed),
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        max_frames: a.frames,
        split: match a.split {
            SplitArg::Sentence => Split::Sentence,
            SplitArg::None => Split::None,
        },
        // `say` writes one WAV: the whole reply is held.
        whole_reply: true,
        ..Default::default()
    };
    let mut h = eng
        .submit(req)
        .map_err(|e| anyhow!("refused ({}): {}", e.code, e.message))?;
    let frame_len = eng.codec().frame_length() as u64;
    let rate = eng.codec().sample_rate();
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} frames {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut pcm: Vec<f32> = Vec::new();
    let summary = loop {
        match h.blocking_recv() {
            Some(JobEvent::Started { frame_cap, .. }) => bar.set_length(frame_cap),
            Some(JobEvent::Audio(chunk)) => {
                pcm.extend_from_slice(&chunk);
                bar.set_position(pcm.len() as u64 / frame_len);
            }
            Some(JobEvent::Done(s)) => break s,
            Some(JobEvent::Failed(e)) => {
                bar.abandon();
                bail!("synthesis failed: {e}");
            }
            None => bail!("the engine stopped"),
        }
    };
    bar.finish_and_clear();
    let s16 = speech::pcm::to_s16_vec(&pcm);
    let wav = speech::pcm::wav_bytes(&s16, rate);
    std::fs::write(&a.out, wav).with_context(|| format!("writing {}", a.out.display()))?;
    let rtf = if summary.audio_seconds > 0.0 {
        summary.elapsed_seconds / summary.audio_seconds
    } else {
        f64::INFINITY
    };
    let mut out = std::io::stdout();
    writeln!(
        out,
        "wrote {}: {} frames, {:.3} s audio, real-time factor {:.3} ({:.1} frames/s), seed {}, cap {} ({:?}){}, pcm_sha256 {}",
        a.out.display(),
        summary.frames,
        summary.audio_seconds,
        rtf,
        summary.frames as f64 / summary.elapsed_seconds.max(1e-9),
        summary.seed,
        summary.frame_cap,
        summary.cap,
        if summary.capped_segments > 0 {
            format!(", {} segment(s) reached the cap without end of speech", summary.capped_segments)
        } else {
            String::new()
        },
        summary.pcm_sha256
    )?;
    eng.shutdown();
    Ok(ExitCode::SUCCESS)
}

#[derive(Args)]
struct PlanArgs {
    #[arg(long, conflicts_with = "geometry")]
    model: Option<PathBuf>,
    #[arg(long, value_enum)]
    geometry: Option<GeometryArg>,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendArg,
    #[arg(long)]
    context: Option<u64>,
    #[arg(long, default_value_t = 1)]
    parallel: u64,
    #[arg(long)]
    prompt_rows: Option<u64>,
    #[arg(long)]
    frames: Option<u64>,
    #[arg(long)]
    cfg: bool,
    /// Device memory budget in GiB (default for --backend cuda: the device's free memory, where
    /// this build has CUDA and a driver; otherwise none, and the device side is not checked).
    #[arg(long)]
    device_gib: Option<f64>,
    #[arg(long)]
    host_gib: Option<f64>,
    #[arg(long, default_value_t = 1.0)]
    prompt_cache_gib: f64,
    /// KV cache precision (default: what the engine uses: f32 on both backends; CUDA BF16 with
    /// DRAMATIS_CUDA_KV=bf16).
    #[arg(long, value_enum)]
    kv: Option<KvArg>,
    /// Plan for streamed replies (no whole-reply PCM buffer).
    #[arg(long)]
    streamed: bool,
    #[arg(long)]
    json: bool,
}

fn gib(flag: &str, v: Option<f64>) -> Result<Option<admission::Bytes>> {
    match v {
        None => Ok(None),
        Some(g) => admission::Bytes::from_gib_f64(g).map(Some).ok_or_else(|| {
            anyhow!("{flag} {g}: must be a finite, non-negative number of GiB below 2^64 bytes")
        }),
    }
}

fn plan(a: PlanArgs) -> Result<ExitCode> {
    let geom = match (&a.model, a.geometry) {
        (Some(dir), _) => {
            let cfg = checkpoint::Config::from_file(&dir.join("config.json"))?;
            let store = checkpoint::Store::open(dir).ok();
            let experts = match &store {
                Some(s) => checkpoint::manifest::detect_expert_format(&cfg, s)?,
                None => checkpoint::ExpertFormat::Fp8Block128,
            };
            speech::builtin::geometry_from_config(&cfg, &experts, &dir.display().to_string())
                .map_err(|e| anyhow!(e))?
        }
        (None, Some(GeometryArg::Tiny)) => admission::ModelGeometry::tiny(),
        (None, Some(GeometryArg::Drama3)) | (None, None) => admission::ModelGeometry::drama3(),
    };
    let mut req = admission::PlanRequest::new(match a.backend {
        BackendArg::Cpu => admission::Backend::Cpu,
        BackendArg::Cuda => admission::Backend::Cuda,
    });
    req.context = a.context.map(admission::Window);
    req.lanes = admission::Lanes(a.parallel);
    req.prompt_rows = a.prompt_rows.map(admission::PromptRows);
    req.frames = match a.frames {
        Some(f) => admission::FrameCap::Explicit(admission::Frames(f)),
        None => admission::FrameCap::Default,
    };
    req.cfg = a.cfg;
    req.kv = Some(match a.kv {
        Some(KvArg::Bf16) => admission::KvDtype::Bf16,
        Some(KvArg::F32) => admission::KvDtype::F32,
        None => speech::engine::kv_dtype(a.backend == BackendArg::Cuda),
    });
    if a.streamed {
        req.reply = admission::ReplyMode::Streamed;
    }
    req.prompt_cache =
        gib("--prompt-cache-gib", Some(a.prompt_cache_gib))?.unwrap_or(admission::Bytes(0));
    let detected_host = admission::host_mem_available();
    req.host_budget =
        admission::MemoryBudget::choose(gib("--host-gib", a.host_gib)?, detected_host);
    // the CUDA plan is checked against the device's free memory, as the engine's start-up is
    // (none detected on a build without CUDA or a machine without a driver)
    let flag = gib("--device-gib", a.device_gib)?;
    req.device_budget = match a.backend {
        BackendArg::Cuda => speech::device_memory::device_budget(flag),
        BackendArg::Cpu => admission::MemoryBudget::choose(flag, None),
    };
    let p = admission::plan(&geom, &req);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        print!("{}", p.render_table());
    }
    Ok(if p.is_admitted() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn voices(cmd: VoicesCmd) -> Result<ExitCode> {
    let open = |dir: Option<PathBuf>| {
        let d = dir.unwrap_or_else(speech::voices::VoiceCatalog::default_dir);
        speech::voices::VoiceCatalog::open(&d, 2048.0 / 44100.0)
            .with_context(|| format!("voice catalog {}", d.display()))
    };
    match cmd {
        VoicesCmd::Add {
            name,
            clip,
            text,
            model,
            voices,
        } => {
            let eng = Engine::load(EngineOptions {
                model_dir: model,
                voices_dir: voices,
                ..Default::default()
            })
            .map_err(|e| anyhow!("{e}"))?;
            let bytes =
                std::fs::read(&clip).with_context(|| format!("reading {}", clip.display()))?;
            let info = eng
                .add_voice(&name, &bytes, &text)
                .map_err(|e| anyhow!("{}", e.message))?;
            println!(
                "added voice {:?}: {} frames ({:.2} s) in {}",
                info.name,
                info.frames,
                info.audio_seconds,
                eng.voices().dir().display()
            );
            eng.shutdown();
        }
        VoicesCmd::List { voices, json } => {
            let c = open(voices)?;
            let list = c.list();
            if json {
                println!("{}", serde_json::to_string_pretty(&list)?);
            } else if list.is_empty() {
                println!("no voices in {}", c.dir().display());
            } else {
                for v in list {
                    println!(
                        "{:<24} {:>5} frames {:>7.2} s  {}",
                        v.name, v.frames, v.audio_seconds, v.transcript
                    );
                }
            }
        }
        VoicesCmd::Remove { name, voices } => {
            let c = open(voices)?;
            if c.remove(&name).map_err(|e| anyhow!("{}", e.message))? {
                println!("removed voice {name:?}");
            } else {
                bail!("voice {name:?} is not in {}", c.dir().display());
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

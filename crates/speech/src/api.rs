//! The request and event types every entry point (`say`, `serve`, `bench`) shares with the engine.

use serde::Serialize;

/// Audio of a reference passage as the caller gives it.
#[derive(Debug, Clone)]
pub enum ReferenceAudio {
    /// A WAV file's bytes (any rate; resampled to the codec's).
    Wav(Vec<u8>),
    /// Already-encoded codes, frame-major `[frames][codebooks]` (voice catalog entries).
    Codes(Vec<Vec<i64>>),
}

#[derive(Debug, Clone)]
pub struct ReferenceInput {
    pub audio: ReferenceAudio,
    pub transcript: String,
}

/// How long text is turned into prompts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Split {
    /// Sentence by sentence (groups up to `chunk_length` bytes), carrying voice and speaker.
    #[default]
    Sentence,
    /// One prompt up to the window.
    None,
}

/// One synthesis request, before validation. `None` fields take the engine's defaults.
#[derive(Debug, Clone, Default)]
pub struct SynthesisRequest {
    pub text: String,
    /// A catalog voice; its references are used as if given inline (and count for CFG).
    pub voice: Option<String>,
    pub references: Vec<ReferenceInput>,
    pub seed: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    /// Explicit frame cap (honoured exactly or refused); `None` = the default cap.
    pub max_frames: Option<u64>,
    pub split: Split,
    /// Sentence-group size in UTF-8 bytes for `Split::Sentence`.
    pub chunk_length: Option<usize>,
    /// Per-request guidance strength (only with `--cfg-allow-request-gamma`).
    pub cfg_gamma: Option<f32>,
    /// The caller keeps the whole reply in memory (not streamed): its PCM is checked against the
    /// host budget before the request is admitted.
    pub whole_reply: bool,
}

/// Which frame cap applied to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CapApplied {
    Explicit,
    Default,
    DefaultShrunk,
}

/// Events of one running job, in order: `Started`, zero or more `Audio`, then `Done` or `Failed`.
#[derive(Debug, Clone)]
pub enum JobEvent {
    Started {
        seed: u64,
        frame_cap: u64,
        cap: CapApplied,
        prompt_rows: u64,
    },
    /// PCM samples at the codec rate, f32 in [-1, 1] before the s16 rule.
    Audio(Vec<f32>),
    Done(JobSummary),
    Failed(String),
}

#[derive(Debug, Clone, Serialize)]
pub struct JobSummary {
    pub seed: u64,
    pub frames: u64,
    pub samples: u64,
    pub audio_seconds: f64,
    pub pcm_sha256: String,
    /// Segments (sentences) that reached their frame cap without end of speech.
    pub capped_segments: u32,
    pub segments: u32,
    pub elapsed_seconds: f64,
    /// Seconds from submission to the job's last frame (before its audio is decoded):
    /// `elapsed_seconds` minus this is how long the codec took to catch up.
    pub generated_seconds: f64,
    pub first_audio_seconds: Option<f64>,
    pub cap: CapApplied,
    pub frame_cap: u64,
    /// Whether classifier-free guidance ran.
    pub guided: bool,
}

/// A refusal before any work: `invalid` maps to HTTP 400, `limit` to 413, `overloaded` to 503.
#[derive(Debug, Clone, Serialize)]
pub struct RequestError {
    pub kind: RequestErrorKind,
    /// Stable snake_case name (`structural_token`, `window_exceeded`, ...).
    pub code: String,
    /// The offending field where known (`input`, `voice`, `references[0].text`, ...).
    pub param: Option<String>,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestErrorKind {
    Invalid,
    Limit,
    Overloaded,
    Server,
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for RequestError {}

impl RequestError {
    pub fn invalid(code: &str, param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            kind: RequestErrorKind::Invalid,
            code: code.into(),
            param: param.map(Into::into),
            message: message.into(),
        }
    }
    pub fn limit(code: &str, param: Option<&str>, message: impl Into<String>) -> Self {
        Self {
            kind: RequestErrorKind::Limit,
            code: code.into(),
            param: param.map(Into::into),
            message: message.into(),
        }
    }
}

/// The speech facts `/v1/models` and `capabilities` report.
#[derive(Debug, Clone, Serialize)]
pub struct SpeechFacts {
    pub window_rows: u64,
    pub prompt_rows_max: u64,
    pub frames_default: u64,
    pub frames_max: u64,
    pub sample_rate: u32,
    pub frame_length: u32,
    pub codebooks: u32,
    pub input_policy: serde_json::Value,
    pub reference_limits: serde_json::Value,
    pub lanes: u32,
    pub backend: String,
    pub expert_format: String,
}

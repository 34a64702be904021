//! speech: everything between a request and the model: tokenizer, the prompt builder, sentence
//! splitting, reference clips, the voice catalog, PCM output and hashing, and the engine that
//! admits requests and runs lanes in shared frame rounds.

pub mod api;
pub mod builtin;
pub mod device_memory;
pub mod engine;
pub mod golden;
pub mod pcm;
pub mod prompt;
pub mod qualify;
pub mod split;
pub mod voices;

pub use api::*;
pub use device_memory::{
    device_copy_rate, device_facts, device_memory_used, device_pool_used, reset_device_pool_high,
    DevicePeak, DevicePeakSampler,
};
pub use engine::{
    BackendChoice, CfgOptions, CodecCounts, Engine, EngineOptions, EngineStats, JobHandle,
    DEFAULT_CODEC_MIN_CHUNK, DEFAULT_MAX_PAUSE_SECONDS, DEFAULT_MAX_UNREAD_AUDIO_SECONDS,
};

#[derive(Debug, thiserror::Error)]
pub enum SpeechError {
    #[error("input text is empty")]
    EmptyText,
    #[error(
        "{what} contains the structural token {token:?}, which only the prompt template may use"
    )]
    StructuralToken { what: String, token: String },
    #[error("{what} has speaker tag {tag:?}; speaker tags are <|speaker:0|> to <|speaker:15|>")]
    BadSpeakerTag { what: String, tag: String },
    #[error("reference {index} has no transcript; every reference clip needs its text")]
    EmptyTranscript { index: usize },
    #[error("reference {index} has no audio frames")]
    EmptyReferenceAudio { index: usize },
    #[error("reference {index}: {why}")]
    BadReferenceCodes { index: usize, why: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("audio: {0}")]
    Audio(String),
    #[error("{0}")]
    Engine(String),
}

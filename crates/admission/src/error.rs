//! Refusals. Every limit message names its unit, the limit and the request's figure; every error
//! has a stable snake_case `code()` and a `kind()` the HTTP layer maps to a status.

use crate::units::{
    CodePoints, Frames, InputBytes, Lanes, PromptRows, ReferenceFrames, ReferencePassages, Rows,
    TranscriptBytes, Window,
};
use serde::Serialize;

/// How the HTTP layer should answer a refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusalKind {
    /// The request is malformed for the contract (400).
    InvalidRequest,
    /// The request is over a stated limit (413).
    LimitExceeded,
    /// The request fits, but not right now (503; retry later).
    Overloaded,
}

impl RefusalKind {
    pub const fn http_status(self) -> u16 {
        match self {
            Self::InvalidRequest => 400,
            Self::LimitExceeded => 413,
            Self::Overloaded => 503,
        }
    }
}

/// A request (or a configuration) refused by the window contract or an input limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum LimitError {
    #[error("a frame budget of 0 frames was requested; at least 1 frame is required")]
    FramesZero,

    #[error("the prompt has {prompt_rows}; at least {min} are required")]
    PromptTooShort {
        prompt_rows: PromptRows,
        min: PromptRows,
    },

    #[error(
        "the prompt has {prompt_rows} but the window of {window} holds at most {prompt_rows_max} \
         (P + F + 1 <= C with at least 1 frame)"
    )]
    WindowExceeded {
        prompt_rows: PromptRows,
        window: Window,
        prompt_rows_max: PromptRows,
    },

    #[error(
        "an explicit cap of {frames} with a prompt of {prompt_rows} needs P + F + 1 rows, more than \
         the window of {window}; the largest cap that fits is {largest_frames}"
    )]
    FramesExceeded {
        prompt_rows: PromptRows,
        frames: Frames,
        window: Window,
        largest_frames: Frames,
    },

    #[error("a window of {window} is over the model's max_position_embeddings of {max}")]
    ContextOverModelMax { window: Window, max: Window },

    #[error("a window of {window} is below the smallest usable window of {min} (P >= 2, F >= 1, one reserved row)")]
    WindowTooSmall { window: Window, min: Window },

    #[error("the request body is {body}; the limit is {limit}")]
    BodyTooLarge { body: InputBytes, limit: InputBytes },

    #[error("the request text is {text}; the limit is {limit}")]
    TextTooLongBytes { text: InputBytes, limit: InputBytes },

    #[error("the request text is {text}; the limit is {limit}")]
    TextTooLongCodePoints { text: CodePoints, limit: CodePoints },

    #[error("the request has {passages}; the limit is {limit}")]
    TooManyReferences {
        passages: ReferencePassages,
        limit: ReferencePassages,
    },

    #[error("reference passage {index} has a transcript of {transcript}; the limit is {limit}")]
    TranscriptTooLong {
        index: u64,
        transcript: TranscriptBytes,
        limit: TranscriptBytes,
    },

    #[error("reference passage {index} has {frames}; the limit is {limit}")]
    ReferenceTooLong {
        index: u64,
        frames: ReferenceFrames,
        limit: ReferenceFrames,
    },

    #[error("size arithmetic overflowed while computing {what}")]
    Overflow { what: &'static str },
}

impl LimitError {
    /// Stable snake_case name (the HTTP `error.code`, the metrics label).
    pub const fn code(&self) -> &'static str {
        match self {
            Self::FramesZero => "frames_zero",
            Self::PromptTooShort { .. } => "prompt_too_short",
            Self::WindowExceeded { .. } => "window_exceeded",
            Self::FramesExceeded { .. } => "frames_exceeded",
            Self::ContextOverModelMax { .. } => "context_over_model_max",
            Self::WindowTooSmall { .. } => "window_too_small",
            Self::BodyTooLarge { .. } => "body_too_large",
            Self::TextTooLongBytes { .. } => "text_too_long_bytes",
            Self::TextTooLongCodePoints { .. } => "text_too_long_code_points",
            Self::TooManyReferences { .. } => "too_many_references",
            Self::TranscriptTooLong { .. } => "transcript_too_long_bytes",
            Self::ReferenceTooLong { .. } => "reference_too_long_frames",
            Self::Overflow { .. } => "size_overflow",
        }
    }

    pub const fn kind(&self) -> RefusalKind {
        match self {
            Self::FramesZero
            | Self::PromptTooShort { .. }
            | Self::ContextOverModelMax { .. }
            | Self::WindowTooSmall { .. } => RefusalKind::InvalidRequest,
            Self::WindowExceeded { .. }
            | Self::FramesExceeded { .. }
            | Self::BodyTooLarge { .. }
            | Self::TextTooLongBytes { .. }
            | Self::TextTooLongCodePoints { .. }
            | Self::TooManyReferences { .. }
            | Self::TranscriptTooLong { .. }
            | Self::ReferenceTooLong { .. }
            | Self::Overflow { .. } => RefusalKind::LimitExceeded,
        }
    }
}

/// A KV-pool reservation that was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
#[serde(tag = "code", rename_all = "snake_case")]
pub enum PoolError {
    /// The pool could hold this request, but other requests hold the rows or lanes now.
    #[error(
        "the KV pool is busy: {requested} requested, {free} of {capacity} free, {lanes_free} of \
         {lanes} free"
    )]
    Busy {
        requested: Rows,
        free: Rows,
        capacity: Rows,
        lanes_free: Lanes,
        lanes: Lanes,
    },
    /// The pool can never hold this request, even when idle.
    #[error("the request needs {requested} but the KV pool holds {capacity} in all")]
    NeverFits { requested: Rows, capacity: Rows },
    /// A reservation of 0 rows is a caller bug, not a request.
    #[error("a reservation of 0 KV rows was requested")]
    Empty,
}

impl PoolError {
    pub const fn code(&self) -> &'static str {
        match self {
            Self::Busy { .. } => "pool_busy",
            Self::NeverFits { .. } => "pool_too_small",
            Self::Empty => "pool_empty_reservation",
        }
    }

    pub const fn kind(&self) -> RefusalKind {
        match self {
            Self::Busy { .. } => RefusalKind::Overloaded,
            Self::NeverFits { .. } => RefusalKind::LimitExceeded,
            Self::Empty => RefusalKind::InvalidRequest,
        }
    }
}

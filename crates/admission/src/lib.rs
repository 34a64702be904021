//! Admission: one truthful contract for the speech window and every budget (ADMISSION.md).
//!
//! What it owns:
//! - units as types ([`units`]): bytes, code points, tokens, reference frames, prompt rows P,
//!   generated frames F, window C, KV rows, lanes; each prints its own unit;
//! - the window contract ([`contract`]): `P >= 2`, `F >= 1`, `P + F + 1 <= C`,
//!   `C <= max_position_embeddings`; explicit frame caps honoured exactly or refused, only the
//!   default cap shrinks;
//! - the KV pool ([`pool`]): rows sized at start-up, reserved per request for P + F + 1 rows;
//! - input and reference limits ([`limits`]), separate from the window;
//! - the memory plan ([`plan`]): every byte class from a [`ModelGeometry`] with checked `u64`
//!   arithmetic, against separate device and host budgets, rendered by `dramatis plan`.
//!
//! What it is not: it allocates nothing, loads no weights and touches no device. Its only I/O is
//! [`host_mem_available`]. Every size derived from a request or configuration is checked; an
//! overflow is a refusal, never a panic or a wrap.

pub mod contract;
pub mod error;
pub mod geometry;
pub mod host;
pub mod limits;
pub mod plan;
pub mod pool;
mod render;
pub mod units;

pub use contract::{Admission, CapKind, FrameCap, WindowContract, MIN_WINDOW, RESERVED_ROWS};
pub use error::{LimitError, PoolError, RefusalKind};
pub use geometry::{
    CodecGeometry, ExpertFormat, GeometryError, LayerKind, ModelGeometry, WeightBytes,
};
pub use host::{host_mem_available, parse_mem_available};
pub use limits::{InputPolicy, Limits, ReferenceLimits};
pub use plan::{
    plan, Backend, BudgetSource, Budgets, ByteClass, DoesNotFit, KvDtype, Memory, MemoryBudget,
    MemoryTotal, PcmFormat, Plan, PlanError, PlanReport, PlanRequest, ReplyMode, StatePerLane,
    StatePerRow, Verdict, DEFAULT_PREFILL_CHUNK_ROWS,
};
pub use pool::{KvPool, PoolUsage, Reservation};
pub use units::{
    Bytes, CodePoints, Frames, InputBytes, Lanes, PromptComposition, PromptRows, ReferenceFrames,
    ReferencePassages, Rows, Samples, StructuralTokens, TextTokens, TranscriptBytes,
    TranscriptTokens, Window,
};

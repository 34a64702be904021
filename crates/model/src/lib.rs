//! model: the Drama 3 forward pass and frame loop, written once over the [`Backend`] trait.
//!
//! It owns the math of DRAMA3.md §4 (backbone, tower, main head), sampling (§7) and per-lane
//! state; it does not own kernels (the backend crates do), tokenization, prompts or the codec.
//!
//! Driving it: [`Model::load`], [`Model::new_lane`], [`Model::prefill`], then
//! [`Model::step_frame`] (or [`Model::step_frames`] for a batched round) until
//! [`FrameOut::Eos`] or the frame cap.

pub mod backend;
pub mod check;
pub mod generate;
pub mod lane;
pub mod model;
pub mod prof;
pub mod sampling;
pub mod stored;
mod trace;

pub use backend::{AttnDims, Backend, BackendError, Expert, GatherRow, GdnDims, Rope, Route, Rows};
pub use generate::{FrameOut, Guidance, LaneStep, LogitsHook, RoundCounts, RoundStats, StepTrace};
pub use lane::{LaneState, RAS_WINDOW};
pub use model::{BackboneTrace, Geometry, Model, Row, TowerTrace, ROW_WIDTH};
pub use sampling::SamplingParams;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("lane holds {rows} rows; {add} more would exceed its capacity of {capacity} rows")]
    Capacity {
        rows: usize,
        add: usize,
        capacity: usize,
    },
    #[error("a lane of {requested} rows was asked for; the model's window is 1..={max} rows")]
    LaneSize { requested: usize, max: usize },
    #[error("row {index}: {why}")]
    BadRow { index: usize, why: String },
    #[error("the lane has no rows yet: prefill it before stepping")]
    NotPrefilled,
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
}

/// `f(0..n)` in lane order: on the rayon pool when there are several lanes (each lane's draw
/// depends on its own logits and counters only), in place for one.
pub(crate) fn lanes_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync + Send) -> Vec<T> {
    if n > 1 {
        use rayon::prelude::*;
        (0..n).into_par_iter().map(f).collect()
    } else {
        (0..n).map(f).collect()
    }
}

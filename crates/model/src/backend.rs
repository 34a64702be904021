//! The op-level interface every backend (CPU, CUDA, Metal) implements.
//!
//! Activations are 2-D row-major matrices `[rows, cols]` of f32 (or the backend's own precision);
//! weights stay in stored precision (BF16, FP8 with 128x128 block scales, NVFP4) and are dequantised
//! inside the op. Every op is row-independent: output row i depends only on input row i (and on
//! the lane state paired with row i), never on how many rows share the call, when the call asks
//! for [`Rows::Exact`]. That is what makes a batched frame round equal each lane's solo run.

use checkpoint::Checkpoint;

use crate::lane::RAS_WINDOW;
use crate::model::Row;
use crate::sampling::SamplingParams;

/// How a linear op may treat its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rows {
    /// Each row's arithmetic is identical whatever the row count (decode, batched lanes).
    Exact,
    /// One lane's prompt: the backend may pick a GEMM whose rounding depends on the row count.
    Bulk,
    /// Several lanes' prompts one after another, each of at most [`Backend::joined_rows`] rows:
    /// every row's arithmetic is that of a `Bulk` call holding only its own lane's rows, so a
    /// prompt's bits do not depend on the prompts it was joined with.
    Joined,
}

/// Rotary layout of the first `rot_dims` dims of each head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rope {
    /// Rotate-half (NeoX): pairs (i, i + rot/2). The backbone's.
    Neox,
    /// GPT-J pairs (2i, 2i + 1). The tower's.
    Interleaved,
}

/// Geometry of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnDims {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rot_dims: usize,
    pub theta: f64,
    pub rope: Rope,
}

/// Geometry of one Gated DeltaNet layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnDims {
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub conv_kernel: usize,
}

impl GdnDims {
    /// Channels of the causal conv: q, k and v concatenated.
    pub fn channels(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }
}

/// One output row of [`Backend::gather_sum`]: `scale · Σ tables[t][row]` over `picks`.
#[derive(Debug, Clone, PartialEq)]
pub struct GatherRow {
    /// (table index, row) pairs; empty gives a zero row.
    pub picks: Vec<(usize, u32)>,
    pub scale: f32,
}

/// The three matrices of one SwiGLU expert, `down(silu(gate x) ⊙ up x)`.
pub struct Expert<W> {
    pub gate: W,
    pub up: W,
    pub down: W,
}

/// Top-k routing decisions for a batch of rows (original expert ids, renormalised weights).
#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// `experts[i]` and `weights[i]` belong to row i, in rank order (highest probability first).
    pub experts: Vec<Vec<u32>>,
    pub weights: Vec<Vec<f32>>,
}

/// Which of a lane's counters a round op reads: the backbone's rows (the position of the
/// frame's backbone row and the length of every backbone K/V cache before it) or the tower's.
/// It also names the rows the op covers: every lane of the round for the backbone, the
/// drawing lanes (those before the first [`Branch::Uncond`]) for the tower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    Backbone,
    Tower,
}

/// [`Backend::norm_rope`] as the ops it fuses: the default body, and a backend's fallback for
/// shapes its fused kernel does not take.
#[allow(clippy::too_many_arguments)]
pub fn norm_rope_composed<B: Backend>(
    be: &B,
    x: &B::Buf,
    sel: (usize, usize, usize),
    w: &B::Vector,
    eps: f32,
    head_dim: usize,
    rot_dims: usize,
    theta: f64,
    style: Rope,
    at: RopeAt<'_, B::Round>,
) -> BResult<B::Buf> {
    let (group, offset, len) = sel;
    let picked;
    let src = if (group, offset, len) == (be.shape(x).1, 0, group) {
        x
    } else {
        picked = be.cols_grouped(x, group, offset, len)?;
        &picked
    };
    let n = be.rms_norm(src, w, head_dim, eps, true)?;
    match at {
        RopeAt::Host(p) => be.rope(&n, head_dim, rot_dims, theta, style, p),
        RopeAt::Round(r, c) => be.rope_round(&n, head_dim, rot_dims, theta, style, r, c),
    }
}

/// Where [`Backend::norm_rope`] takes each row's position: host positions, or lane i's counter
/// of a frame round kept on the backend.
#[derive(Debug)]
pub enum RopeAt<'a, R> {
    Host(&'a [usize]),
    Round(&'a R, Counter),
}

impl<R> Clone for RopeAt<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<R> Copy for RopeAt<'_, R> {}

/// One lane's inputs to a frame round kept on the backend ([`Backend::round_write`] before each
/// round), so that a captured round replays with new values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RoundLane {
    /// Backbone rows consumed (the frame row's position; each backbone K/V cache's length).
    pub rows: usize,
    /// Tower positions filled (each tower K/V cache's length).
    pub tower_rows: usize,
    /// The lane's newest backbone row (tower layer 0 embeds its residual codes).
    pub last: Row,
    pub params: SamplingParams,
    pub seed: u64,
    /// The RNG counter (frame index within the request).
    pub step: u64,
    /// The newest main tokens, oldest first; `recent[..n_recent]` are valid.
    pub recent: [i64; RAS_WINDOW],
    pub n_recent: usize,
    /// The lane's part in classifier-free guidance.
    pub branch: Branch,
}

/// A lane's part in a guided round (DRAMA3.md section 7). A round lists its drawing lanes
/// ([`Branch::Own`], [`Branch::Guided`]) first and the unconditional branches after them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Branch {
    /// Draws its frame from its own main logits.
    Own,
    /// Draws its main token from `l + γ (l − l_u)` (`sampling::cfg_mix`), `l_u` the main
    /// logits of round lane `uncond` (a [`Branch::Uncond`] of this lane).
    Guided { uncond: usize, gamma: f32 },
    /// An unconditional branch (backbone only): draws nothing, and its backbone row is round
    /// lane `of`'s frame.
    Uncond { of: usize },
}

/// The drawing lanes of a round (the first `n`), after checking that the branches pair up:
/// every [`Branch::Uncond`] after every drawing lane, each the branch of exactly the one
/// [`Branch::Guided`] lane that names it, and every γ finite.
pub fn round_leaders(lanes: &[RoundLane]) -> BResult<usize> {
    let bad = |why: String| BackendError::Shape {
        op: "round_write",
        why,
    };
    // the drawing lanes are those before the first unconditional one
    let n = lanes
        .iter()
        .position(|l| matches!(l.branch, Branch::Uncond { .. }))
        .unwrap_or(lanes.len());
    for (i, l) in lanes.iter().enumerate() {
        match l.branch {
            Branch::Own | Branch::Guided { .. } if i >= n => {
                return Err(bad(format!(
                    "lane {i} draws but comes after unconditional lane {n}"
                )));
            }
            Branch::Own => {}
            // the pairs name each other, so no branch serves two lanes
            Branch::Guided { uncond, gamma } => {
                if !gamma.is_finite() {
                    return Err(bad(format!(
                        "lane {i}'s guidance scale {gamma} is not finite"
                    )));
                }
                let named = lanes
                    .get(uncond)
                    .is_some_and(|u| u.branch == Branch::Uncond { of: i });
                if !named {
                    return Err(bad(format!(
                        "lane {i}'s unconditional branch {uncond} is not an unconditional \
                         lane of it ({} lanes)",
                        lanes.len()
                    )));
                }
            }
            Branch::Uncond { of } => {
                let named = lanes.get(of).is_some_and(
                    |g| matches!(g.branch, Branch::Guided { uncond, .. } if uncond == i),
                );
                if !named {
                    return Err(bad(format!(
                        "unconditional lane {i} follows lane {of}, which does not name it"
                    )));
                }
            }
        }
    }
    Ok(n)
}

/// Each lane's frame, an unconditional branch's being its drawing lane's.
pub fn round_frames_of(lanes: &[RoundLane], frames: &[Row]) -> Vec<Row> {
    lanes
        .iter()
        .enumerate()
        .map(|(i, l)| match l.branch {
            Branch::Uncond { of } => frames[of],
            _ => frames[i],
        })
        .collect()
}

/// What the round's draws need to know of the model, fixed when the round is made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundSpec {
    /// Token id of each main-head candidate (the main logits' columns).
    pub candidates: Vec<u32>,
    /// Semantic tokens are `semantic_start..=semantic_end`.
    pub semantic_start: u32,
    pub semantic_end: u32,
}

/// Where a round draw writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// The main token (frame column 0, with its semantic code in column 1), RAS per the lane.
    Main,
    /// Residual head r (frame column 2 + r).
    Head(usize),
}

/// Which frame of a lane a [`CodeTerm`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// The frame this round is drawing.
    Current,
    /// The lane's newest backbone row ([`RoundLane::last`]).
    Last,
}

/// One term of an embedding gathered from a round's frames: row `offset + frame[col]` of
/// table `table`, included only when that frame's main token (column 0) is semantic if
/// `guarded`; terms add in order from 0, as [`Backend::gather_sum`]'s picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CodeTerm {
    pub table: usize,
    pub frame: Frame,
    pub col: usize,
    pub offset: u32,
    pub guarded: bool,
}

impl RoundSpec {
    pub fn is_semantic(&self, tok: i64) -> bool {
        tok >= i64::from(self.semantic_start) && tok <= i64::from(self.semantic_end)
    }
}

/// The [`GatherRow`] that `terms` pick for a row whose drawn frame is `cur` and whose previous
/// row is `last`: what [`Backend::round_embed`] computes from a round's frames.
pub fn gather_row(
    terms: &[CodeTerm],
    scale: f32,
    cur: &Row,
    last: &Row,
    is_semantic: impl Fn(i64) -> bool,
) -> GatherRow {
    let mut picks = Vec::with_capacity(terms.len());
    for t in terms {
        let f = match t.frame {
            Frame::Current => cur,
            Frame::Last => last,
        };
        if !t.guarded || is_semantic(f[0]) {
            // a code outside the table wraps past its rows, which gather_sum refuses
            let row = i64::from(t.offset) + f.get(t.col).copied().unwrap_or(-1);
            picks.push((t.table, row as u32));
        }
    }
    GatherRow {
        picks,
        scale: if is_semantic(cur[0]) { scale } else { 1.0 },
    }
}

/// Every check of a `gdn_prefill_lanes` call, for a backend to make before any lane's history
/// or state moves: one row count a lane state, the lanes' rows in all = each input's rows, the
/// conv and GDN shapes, and every lane state a layer of `dims` (`Backend::gdn_fits`).
#[allow(clippy::too_many_arguments)]
pub fn check_gdn_lanes<B: Backend>(
    be: &B,
    qkv: &B::Buf,
    b: &B::Buf,
    a: &B::Buf,
    conv: &B::Vector,
    a_log: &B::Vector,
    dt_bias: &B::Vector,
    dims: &GdnDims,
    lens: &[usize],
    states: &[&mut B::Gdn],
) -> BResult<()> {
    let bad = |why: String| BackendError::Shape {
        op: "gdn_prefill_lanes",
        why,
    };
    if lens.len() != states.len() {
        return Err(bad(format!(
            "{} row counts for {} lane states",
            lens.len(),
            states.len()
        )));
    }
    let total: usize = lens.iter().sum();
    for (name, buf) in [("qkv", qkv), ("b", b), ("a", a)] {
        let (rows, _) = be.shape(buf);
        if rows != total {
            return Err(bad(format!(
                "lanes of {total} rows in all, {name} of {rows} rows"
            )));
        }
    }
    // (the conv output has qkv's shape)
    crate::check::conv(be.shape(qkv), be.vector_len(conv), dims)?;
    crate::check::gdn(
        be.shape(qkv),
        be.shape(b),
        be.shape(a),
        be.vector_len(a_log),
        be.vector_len(dt_bias),
        dims,
    )?;
    if let Some(i) = states.iter().position(|s| !be.gdn_fits(s, dims)) {
        return Err(bad(format!(
            "lane {i}'s state is not a layer of {} key / {} value heads of {} x {}, conv {}",
            dims.k_heads, dims.v_heads, dims.k_dim, dims.v_dim, dims.conv_kernel
        )));
    }
    Ok(())
}

/// `gdn_conv` then `gdn_prefill` (chunked) lane by lane over lanes' rows laid one after
/// another, every input checked first (`check_gdn_lanes`): `Backend::gdn_prefill_lanes`'s
/// default, and a backend's fallback to it.
#[allow(clippy::too_many_arguments)]
pub fn gdn_prefill_each<B: Backend>(
    be: &B,
    qkv: &B::Buf,
    b: &B::Buf,
    a: &B::Buf,
    conv: &B::Vector,
    a_log: &B::Vector,
    dt_bias: &B::Vector,
    dims: &GdnDims,
    lens: &[usize],
    states: &mut [&mut B::Gdn],
) -> BResult<B::Buf> {
    check_gdn_lanes(be, qkv, b, a, conv, a_log, dt_bias, dims, lens, states)?;
    let mut outs = Vec::with_capacity(lens.len());
    let mut off = 0;
    for (&n, state) in lens.iter().zip(states.iter_mut()) {
        let x = be.rows(qkv, off, n)?;
        let (bl, al) = (be.rows(b, off, n)?, be.rows(a, off, n)?);
        let u = be.gdn_conv(&x, conv, dims, state)?;
        outs.push(be.gdn_prefill(&u, &bl, &al, a_log, dt_bias, dims, state, true)?);
        off += n;
    }
    let refs: Vec<&B::Buf> = outs.iter().collect();
    be.concat_rows(&refs)
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("KV cache holds {len} rows and {add} more would need {need}, beyond its capacity of {capacity} rows")]
    KvFull {
        len: usize,
        add: usize,
        need: usize,
        capacity: usize,
    },
    #[error("tensor {name:?}: {why}")]
    Weight { name: String, why: String },
    #[error("{op}: {why}")]
    Shape { op: &'static str, why: String },
    #[error("backend: {0}")]
    Device(String),
    /// Non-finite values where an op has no defined result (e.g. a router row whose kept
    /// logits are all NaN or −∞).
    #[error("{op}: {why}")]
    NonFinite { op: &'static str, why: String },
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
}

pub type BResult<T> = Result<T, BackendError>;

/// Op granularity is one model equation (a norm, a linear, a mixer core); the model composes them.
pub trait Backend: Send + Sync + Sized {
    /// An activation matrix `[rows, cols]`.
    type Buf: Send + Sync;
    /// A matrix in stored precision (`[out, in]`, used as `y = x Wᵀ`), or an embedding table.
    type Weight: Send + Sync;
    /// A small 1-D tensor (norm weights, conv taps, `A_log`), held in f32.
    type Vector: Send + Sync;
    /// One layer's K/V cache of one lane, sized once for its capacity in rows.
    type Kv: Send + Sync;
    /// One Gated DeltaNet layer's state of one lane: conv history and the recurrent matrices.
    type Gdn: Send + Sync;
    /// Router decisions, kept where the backend computes them (see [`Route`] for the host form).
    type Route: Send + Sync;
    /// A frame round's per-lane inputs, frames and (where the backend records) its graph.
    type Round: Send;

    fn name(&self) -> &'static str;

    // ---- data movement ----
    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> BResult<Self::Buf>;
    fn download(&self, x: &Self::Buf) -> BResult<Vec<f32>>;
    /// `(rows, cols)`.
    fn shape(&self, x: &Self::Buf) -> (usize, usize);
    /// Columns `start..start+len` of every row.
    fn cols(&self, x: &Self::Buf, start: usize, len: usize) -> BResult<Self::Buf>;
    /// From each consecutive group of `group` cols, cols `offset..offset+len`, concatenated.
    fn cols_grouped(
        &self,
        x: &Self::Buf,
        group: usize,
        offset: usize,
        len: usize,
    ) -> BResult<Self::Buf>;
    /// Rows `start..start+len`.
    fn rows(&self, x: &Self::Buf, start: usize, len: usize) -> BResult<Self::Buf>;
    /// `[a | b]` row by row.
    fn concat_cols(&self, a: &Self::Buf, b: &Self::Buf) -> BResult<Self::Buf>;
    /// Parts stacked vertically.
    fn concat_rows(&self, parts: &[&Self::Buf]) -> BResult<Self::Buf>;

    // ---- weights (checked against the stored shape; stored precision kept) ----
    /// A BF16 matrix, or FP8 with its `<name>_scale_inv` when `name` is stored as F8_E4M3, or
    /// NVFP4 when `<stem>.weight` is stored as U8 `[out, in/2]` (two E2M1 codes per byte, low
    /// nibble = even column) beside `<stem>.weight_scale` (F8_E4M3 `[out, in/16]`) and
    /// `<stem>.weight_scale_2` (one F32): value = e2m1 · e4m3 · f32, kept packed. The weight's
    /// logical shape is `[out, in]`; a `<stem>.input_scale` is not read (activations stay in the
    /// backend's precision).
    fn weight(&self, ck: &Checkpoint, name: &str) -> BResult<Self::Weight>;
    /// Only the listed rows of a BF16 matrix, in that order (the candidate-restricted lm_head).
    fn weight_rows(&self, ck: &Checkpoint, name: &str, rows: &[u32]) -> BResult<Self::Weight>;
    /// A small tensor of any shape, flattened to f32.
    fn vector(&self, ck: &Checkpoint, name: &str) -> BResult<Self::Vector>;
    /// Elements of a vector.
    fn vector_len(&self, v: &Self::Vector) -> usize;

    // ---- state ----
    fn kv_new(&self, capacity: usize, kv_heads: usize, head_dim: usize) -> BResult<Self::Kv>;
    fn kv_len(&self, kv: &Self::Kv) -> usize;
    fn gdn_new(&self, dims: &GdnDims) -> BResult<Self::Gdn>;
    /// Whether a lane state is one layer of `dims`'s (what `gdn_new(dims)` makes): the joined
    /// prefill checks every lane's before any moves.
    fn gdn_fits(&self, st: &Self::Gdn, dims: &GdnDims) -> bool;
    /// Copies every row of `src` into `dst`, which must be empty with room for them (lane fork:
    /// the reference prefill cache).
    fn kv_copy(&self, src: &Self::Kv, dst: &mut Self::Kv) -> BResult<()>;
    /// Copies one Gated DeltaNet layer's conv history and recurrent state.
    fn gdn_copy(&self, src: &Self::Gdn, dst: &mut Self::Gdn) -> BResult<()>;

    // ---- ops ----
    /// Row i = `rows[i].scale · Σ tables[t][r]` (embedding gather with the codebook mix).
    fn gather_sum(&self, tables: &[&Self::Weight], rows: &[GatherRow]) -> BResult<Self::Buf>;
    /// RMSNorm over each group of `group` cols: `x / sqrt(mean(x²) + eps) · w'` with `w' = 1 + w`
    /// when `plus_one` (Qwen3.5 norms) else `w`; `w` has `group` entries.
    fn rms_norm(
        &self,
        x: &Self::Buf,
        w: &Self::Vector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<Self::Buf>;
    /// The residual add before a norm: `(s, rms_norm(s, ...))` with `s = a + b`. Bit for bit
    /// [`Backend::add`] then [`Backend::rms_norm`]; a backend may fuse them (one launch).
    fn add_rms_norm(
        &self,
        a: &Self::Buf,
        b: &Self::Buf,
        w: &Self::Vector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<(Self::Buf, Self::Buf)> {
        let s = self.add(a, b)?;
        let n = self.rms_norm(&s, w, group, eps, plus_one)?;
        Ok((s, n))
    }
    /// The MoE's end, the residual add and the next norm: `add_rms_norm(a, add_sigmoid_mul(a2,
    /// x, gate), ...)`, bit for bit; a backend may fuse them (one launch).
    #[allow(clippy::too_many_arguments)]
    fn add_gated_rms_norm(
        &self,
        a: &Self::Buf,
        a2: &Self::Buf,
        x: &Self::Buf,
        gate: &Self::Buf,
        w: &Self::Vector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<(Self::Buf, Self::Buf)> {
        let y = self.add_sigmoid_mul(a2, x, gate)?;
        self.add_rms_norm(a, &y, w, group, eps, plus_one)
    }
    /// The gated norm: `silu_mul(z, rms_norm(x, ...))`, bit for bit; a backend may fuse them.
    fn rms_norm_silu(
        &self,
        x: &Self::Buf,
        z: &Self::Buf,
        w: &Self::Vector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<Self::Buf> {
        self.silu_mul(z, &self.rms_norm(x, w, group, eps, plus_one)?)
    }
    /// `concat_cols(rms_norm(a, wa, ..), rms_norm(b, wb, ..))`, each normalised over its whole
    /// row, bit for bit; a backend may fuse them (one launch).
    fn rms_norm_concat(
        &self,
        a: &Self::Buf,
        wa: &Self::Vector,
        b: &Self::Buf,
        wb: &Self::Vector,
        eps: f32,
        plus_one: bool,
    ) -> BResult<Self::Buf> {
        let an = self.rms_norm(a, wa, self.shape(a).1, eps, plus_one)?;
        let bn = self.rms_norm(b, wb, self.shape(b).1, eps, plus_one)?;
        self.concat_cols(&an, &bn)
    }
    /// `y = x Wᵀ`: `[n, in] -> [n, out]`.
    fn linear(&self, x: &Self::Buf, w: &Self::Weight, rows: Rows) -> BResult<Self::Buf>;
    /// `linear(sigmoid_mul(x, gate), w)` with `gate` the shape of `x`, bit for bit; a backend may
    /// make the product as the linear loads its input.
    fn linear_sigmoid_mul(
        &self,
        x: &Self::Buf,
        gate: &Self::Buf,
        w: &Self::Weight,
        rows: Rows,
    ) -> BResult<Self::Buf> {
        self.linear(&self.sigmoid_mul(x, gate)?, w, rows)
    }
    /// `linear(silu_mul(gate, up), w)`, bit for bit; a backend may make the product as the
    /// linear loads its input.
    fn linear_silu_mul(
        &self,
        gate: &Self::Buf,
        up: &Self::Buf,
        w: &Self::Weight,
        rows: Rows,
    ) -> BResult<Self::Buf> {
        self.linear(&self.silu_mul(gate, up)?, w, rows)
    }
    /// Several linears of one input, `[x W_0ᵀ, x W_1ᵀ, …]`, each bit for bit its own
    /// [`Backend::linear`]; a backend may run them in one launch.
    fn linear_many(
        &self,
        x: &Self::Buf,
        ws: &[&Self::Weight],
        rows: Rows,
    ) -> BResult<Vec<Self::Buf>> {
        ws.iter().map(|w| self.linear(x, w, rows)).collect()
    }
    fn add(&self, a: &Self::Buf, b: &Self::Buf) -> BResult<Self::Buf>;
    /// `add(a, sigmoid_mul(x, gate))`, bit for bit (`gate` `[n, cols]` or `[n, 1]`); a backend
    /// may fuse it.
    fn add_sigmoid_mul(
        &self,
        a: &Self::Buf,
        x: &Self::Buf,
        gate: &Self::Buf,
    ) -> BResult<Self::Buf> {
        self.add(a, &self.sigmoid_mul(x, gate)?)
    }
    /// `silu(gate) ⊙ up`.
    fn silu_mul(&self, gate: &Self::Buf, up: &Self::Buf) -> BResult<Self::Buf>;
    /// `x ⊙ sigmoid(gate)`; `gate` is `[n, cols]` or `[n, 1]` (broadcast per row).
    fn sigmoid_mul(&self, x: &Self::Buf, gate: &Self::Buf) -> BResult<Self::Buf>;
    /// Rotary embedding on the first `rot_dims` dims of each `head_dim` head, row i at
    /// `positions[i]`.
    fn rope(
        &self,
        x: &Self::Buf,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        positions: &[usize],
    ) -> BResult<Self::Buf>;

    /// Appends `k`, `v` (`[t, kv_heads·hd]`) to one lane's cache and attends causally: query row i
    /// sees cache rows `0..=len_before + i`. `q` is already normed and roped. Returns
    /// `[t, q_heads·hd]`; head h uses kv head `h / (q_heads / kv_heads)`; scale `1/sqrt(hd)`.
    fn attn_prefill(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        dims: &AttnDims,
        cache: &mut Self::Kv,
    ) -> BResult<Self::Buf>;
    /// [`Backend::attn_prefill`] of a joined prefill's lanes in one call: lane i's `lens[i]`
    /// rows (the lanes one after another in `q`, `k`, `v` and the result) into `caches[i]`, each
    /// lane's rows with the bits of its own `attn_prefill`. `None` where the backend has no such
    /// form (the default) or does not take these lanes: the caller then runs `attn_prefill`
    /// lane by lane, and nothing has been appended.
    fn attn_prefill_lanes(
        &self,
        _q: &Self::Buf,
        _k: &Self::Buf,
        _v: &Self::Buf,
        _dims: &AttnDims,
        _caches: &mut [&mut Self::Kv],
        _lens: &[usize],
    ) -> BResult<Option<Self::Buf>> {
        Ok(None)
    }
    /// One row per lane: row i is appended to `caches[i]` and attends over all of it.
    fn attn_step(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        dims: &AttnDims,
        caches: &mut [&mut Self::Kv],
    ) -> BResult<Self::Buf>;

    /// Causal depthwise conv + SiLU over one lane's rows (`[t, C]`), continuing its history.
    /// `w` is `[C, K]`; tap K-1 hits the current row.
    fn gdn_conv(
        &self,
        x: &Self::Buf,
        w: &Self::Vector,
        dims: &GdnDims,
        state: &mut Self::Gdn,
    ) -> BResult<Self::Buf>;
    /// The same for one row per lane.
    fn gdn_conv_step(
        &self,
        x: &Self::Buf,
        w: &Self::Vector,
        dims: &GdnDims,
        states: &mut [&mut Self::Gdn],
    ) -> BResult<Self::Buf>;
    /// The gated delta rule over one lane's rows: `qkv` is the conv output `[t, C]`, `b`, `a`
    /// are `[t, v_heads]`. q/k are l2-normed (eps 1e-6), q scaled by `1/sqrt(dk)`,
    /// `β = σ(b)`, `g = −exp(A_log)·softplus(a + dt_bias)`. `chunked` picks the chunk-64 form;
    /// otherwise the per-token recurrence (the reference). Returns `o` `[t, v_heads·v_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn gdn_prefill(
        &self,
        qkv: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        dims: &GdnDims,
        state: &mut Self::Gdn,
        chunked: bool,
    ) -> BResult<Self::Buf>;
    /// `gdn_conv` then `gdn_prefill` (chunked) for several lanes' prompt rows at once: `qkv`,
    /// `b` and `a` hold lane i's `lens[i]` rows after the lanes before it, and so does the
    /// result. Each lane's rows and state come out bit for bit as its own two calls make them;
    /// this default makes those calls lane by lane (a backend may run the lanes in one launch).
    #[allow(clippy::too_many_arguments)]
    fn gdn_prefill_lanes(
        &self,
        qkv: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        conv: &Self::Vector,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        dims: &GdnDims,
        lens: &[usize],
        states: &mut [&mut Self::Gdn],
    ) -> BResult<Self::Buf> {
        gdn_prefill_each(self, qkv, b, a, conv, a_log, dt_bias, dims, lens, states)
    }
    /// The recurrence for one row per lane.
    #[allow(clippy::too_many_arguments)]
    fn gdn_step(
        &self,
        qkv: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        dims: &GdnDims,
        states: &mut [&mut Self::Gdn],
    ) -> BResult<Self::Buf>;

    /// [`Backend::gdn_step`] then [`Backend::rms_norm_silu`] of its output with `z` (plain `w`
    /// over each value head), bit for bit; a backend may fuse them (one launch).
    #[allow(clippy::too_many_arguments)]
    fn gdn_step_gated(
        &self,
        qkv: &Self::Buf,
        b: &Self::Buf,
        a: &Self::Buf,
        a_log: &Self::Vector,
        dt_bias: &Self::Vector,
        dims: &GdnDims,
        states: &mut [&mut Self::Gdn],
        z: &Self::Buf,
        w: &Self::Vector,
        eps: f32,
    ) -> BResult<Self::Buf> {
        let o = self.gdn_step(qkv, b, a, a_log, dt_bias, dims, states)?;
        self.rms_norm_silu(&o, z, w, dims.v_dim, eps, false)
    }

    /// Router: softmax over `logits` (`[n, E]`, f32, one column per original expert ID)
    /// restricted to `keep` (experts outside it get probability 0 before normalisation and are
    /// never chosen), top `k` by logit with ties to the lower ID, renormalised over the chosen k.
    /// Non-finite logits: NaN counts as −∞; a −∞ expert has weight 0 and ranks after every
    /// finite one; +∞ experts share the mass equally; a row whose kept logits are all NaN/−∞ is
    /// [`BackendError::NonFinite`]. `k` above the kept count is a shape error. The CPU backend's
    /// `route_row` is the reference.
    fn route(&self, logits: &Self::Buf, k: usize, keep: Option<&[bool]>) -> BResult<Self::Route>;
    /// The host form of a routing, for tests and traces.
    fn route_host(&self, route: &Self::Route) -> BResult<Route>;
    /// `Σ_j w_ij · expert_{e_ij}(x_i)`, summed in rank order; `experts[e]` is `None` for a pruned
    /// expert (never routed to).
    fn moe_experts(
        &self,
        x: &Self::Buf,
        route: &Self::Route,
        experts: &[Option<Expert<Self::Weight>>],
        rows: Rows,
    ) -> BResult<Self::Buf>;

    /// The most rows of one lane's prompt (or prompt piece) that a [`Rows::Joined`] call takes,
    /// giving each row the bits of a [`Rows::Bulk`] call of that lane alone; 0 (the default)
    /// when the backend cannot join prompts, and the model then prefills them one at a time.
    fn joined_rows(&self) -> usize {
        0
    }

    /// Waits for the work issued so far and returns an error that work raised but could not
    /// return when it was issued (a backend whose ops report errors as they return has nothing
    /// to do). The model settles after each prefill, so a prompt's error fails its own request,
    /// not the next shared round.
    fn settle(&self) -> BResult<()> {
        Ok(())
    }

    /// Takes `bytes` of memory for the state the plan admits (KV pool, lane state, scratch,
    /// codec state, caches) at start-up and keeps it for the process's later allocations, so
    /// what was admitted cannot fail for want of memory another process took (ADMISSION.md: a
    /// pool sized at start-up). Returns the bytes now held; a backend whose memory is the
    /// host's, budgeted by the plan, holds nothing (0).
    fn reserve(&self, bytes: u64) -> BResult<u64> {
        let _ = bytes;
        Ok(0)
    }

    // ---- frame rounds kept on the backend (no host round trip inside a frame) ----

    /// Whether the model should run frame rounds through the round ops below (draws on the
    /// backend, one download per round) rather than drawing on the host after each head.
    fn resident_rounds(&self) -> bool {
        false
    }
    /// Row `i` of `src` into `dst[i]` (each `[1, cols]`), in place: a round's outputs stay at
    /// the addresses a captured round wrote.
    fn write_rows(&self, src: &Self::Buf, dst: &mut [&mut Self::Buf]) -> BResult<()>;
    /// Records `rows` rows that a replayed round appended to `kv` (the host's copy of its
    /// length; the device already holds them).
    fn kv_note(&self, kv: &mut Self::Kv, rows: usize) -> BResult<()>;
    /// Per-lane round inputs and outputs for `lanes` lanes.
    fn round_new(&self, lanes: usize, spec: &RoundSpec) -> BResult<Self::Round>;
    /// Writes each lane's inputs (outside any capture).
    fn round_write(&self, round: &mut Self::Round, lanes: &[RoundLane]) -> BResult<()>;
    /// The frames the round drew, `[lanes]`, an unconditional branch's being its drawing
    /// lane's (one download: it waits for the round).
    fn round_frames(&self, round: &Self::Round) -> BResult<Vec<Row>>;
    /// One draw per drawing lane into `slot` of its frame, with the lane's settings, counters
    /// and RNG (`sampling::sample_main` / `sample_head`, bit for bit). Main: `logits` is
    /// `[lanes, n]`, every lane's row (a guided lane draws from its row mixed with its
    /// unconditional branch's; the backend may mix in place). Head: `[drawing lanes, n]`.
    fn round_sample(&self, logits: &Self::Buf, round: &mut Self::Round, slot: Slot) -> BResult<()>;
    /// Row i = `s · Σ tables[t.table][t.offset + frame_i[t.col]]` over the included `terms`,
    /// with `s = scale` when the current frame's main token is semantic, else 1; one row per
    /// lane that `lanes` covers ([`Counter`]), an unconditional branch reading its drawing
    /// lane's frame as its current one.
    fn round_embed(
        &self,
        tables: &[&Self::Weight],
        round: &Self::Round,
        terms: &[CodeTerm],
        scale: f32,
        lanes: Counter,
    ) -> BResult<Self::Buf>;
    /// Attention's q or k: the heads `cols_grouped(x, group, offset, len)` selects, each
    /// normalised (`rms_norm` over `head_dim`, `1 + w`) and rotated (`rope` at `at`'s positions,
    /// or `rope_round`), bit for bit those ops; a backend may fuse them (one launch).
    #[allow(clippy::too_many_arguments)]
    fn norm_rope(
        &self,
        x: &Self::Buf,
        sel: (usize, usize, usize),
        w: &Self::Vector,
        eps: f32,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        at: RopeAt<'_, Self::Round>,
    ) -> BResult<Self::Buf> {
        norm_rope_composed(self, x, sel, w, eps, head_dim, rot_dims, theta, style, at)
    }
    /// [`Backend::rope`] with row i at lane i's `counter`.
    #[allow(clippy::too_many_arguments)]
    fn rope_round(
        &self,
        x: &Self::Buf,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        round: &Self::Round,
        counter: Counter,
    ) -> BResult<Self::Buf>;
    /// [`Backend::attn_step`] with each cache's length taken from lane i's `counter`; the
    /// host's copy of the lengths is left to [`Backend::kv_note`].
    #[allow(clippy::too_many_arguments)]
    fn attn_step_round(
        &self,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        dims: &AttnDims,
        caches: &mut [&mut Self::Kv],
        round: &Self::Round,
        counter: Counter,
    ) -> BResult<Self::Buf>;
    /// Starts recording the work that follows into the round's graph instead of running it
    /// (`false`: this backend does not record; the work runs as it is issued).
    fn capture_begin(&self) -> BResult<bool> {
        Ok(false)
    }
    /// Ends a recording begun by [`Backend::capture_begin`] and keeps it in `round` (`keep`
    /// false discards it: the recorded body failed).
    fn capture_end(&self, _round: &mut Self::Round, _keep: bool) -> BResult<()> {
        Ok(())
    }
    /// Runs the round's recording once; `false` if it has none.
    fn round_replay(&self, _round: &Self::Round) -> BResult<bool> {
        Ok(false)
    }
    /// Starts a side branch for ops over `rows` rows: until [`Backend::aside_end`], the ops
    /// issued run after all the work issued before this call but beside the work issued after
    /// `aside_end`, which waits for them only at [`Backend::aside_join`]. Nothing an op of the
    /// branch reads or writes may be touched by the other work before the join. `false`: no
    /// branch (the ops run in order, as always; then end and join do nothing). The same
    /// operations either way, so the same bits.
    fn aside_begin(&self, _rows: usize) -> BResult<bool> {
        Ok(false)
    }
    /// Ends the side branch's ops (see [`Backend::aside_begin`]).
    fn aside_end(&self) -> BResult<()> {
        Ok(())
    }
    /// Makes the work issued from now on wait for the side branch's ops.
    fn aside_join(&self) -> BResult<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lanes(branches: &[Branch]) -> Vec<RoundLane> {
        branches
            .iter()
            .map(|&branch| RoundLane {
                rows: 1,
                tower_rows: 0,
                last: [0; crate::ROW_WIDTH],
                params: SamplingParams::greedy(),
                seed: 0,
                step: 0,
                recent: [0; RAS_WINDOW],
                n_recent: 0,
                branch,
            })
            .collect()
    }

    #[test]
    fn round_leaders_checks_the_guidance_pairs() {
        use Branch::*;
        let g = |uncond| Guided { uncond, gamma: 1.5 };
        assert_eq!(round_leaders(&lanes(&[Own, Own])).unwrap(), 2);
        assert_eq!(
            round_leaders(&lanes(&[
                g(4),
                Own,
                g(3),
                Uncond { of: 2 },
                Uncond { of: 0 }
            ]))
            .unwrap(),
            3
        );
        let refused = [
            // a drawing lane after an unconditional one
            vec![g(1), Uncond { of: 0 }, Own],
            // a guided lane naming a drawing lane, or a branch of another lane
            vec![g(1), Own],
            vec![g(3), g(2), Uncond { of: 1 }, Uncond { of: 1 }],
            // a branch no lane names, one out of range, a non-finite scale
            vec![Own, Uncond { of: 0 }],
            vec![g(1), Uncond { of: 7 }],
            vec![
                Guided {
                    uncond: 1,
                    gamma: f32::NAN,
                },
                Uncond { of: 0 },
            ],
        ];
        for r in refused {
            assert!(round_leaders(&lanes(&r)).is_err(), "{r:?}");
        }
    }
}

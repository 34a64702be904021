//! [`model::Backend`] on one NVIDIA GPU.
//!
//! Weights are uploaded once in stored precision (BF16 as is; FP8 E4M3 with its F32 128x128
//! block scales as is; NVFP4 packed as stored: the U8 E2M1 codes, the E4M3 `weight_scale` bytes
//! and the F32 `weight_scale_2`, dequantised in registers by the kernels); small vectors (norm weights, conv taps, `A_log`) as f32; activations are
//! f32 device buffers; the KV cache is f32 as on the CPU reference (`DRAMATIS_CUDA_KV=bf16`
//! halves it, at a precision cost measured in NOTES.md). Every op is one or a few kernel launches on the backend's one stream with no
//! host synchronisation except `download` and `route_host`. Device memory comes from the
//! driver's stream-ordered pool, whose release threshold is raised so that the per-op
//! allocations of a frame reuse memory instead of going back to the driver.
//!
//! `Rows::Exact` and `Rows::Bulk` run the same kernels: every linear is a warp-per-output GEMV
//! whose per-row arithmetic does not depend on the row count, so batched lanes equal solo lanes
//! bit for bit. The Gated DeltaNet prefill runs the per-token recurrence on the device (the
//! `chunked` flag is accepted and gives the same result up to rounding); lanes of at least
//! `CudaOptions::gdn_chunk_min` rows (default `GDN_CHUNK_MIN`, 512) run the chunk-64 form
//! (`gdn_chunk`) instead.

use std::sync::{Arc, Mutex};

use checkpoint::{Checkpoint, DType};
use cudarc::driver::{
    result as cu, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use model::backend::BResult;
use model::check;
use model::{AttnDims, Backend, BackendError, Expert, GatherRow, GdnDims, Rope, Route, Rows};

use crate::error::CudaError;
use crate::kernels;
use crate::runtime::{Gpu, Source, Variant};

/// Lanes one launch takes through a by-value pointer table (ops.cu `MAX_LANES`).
pub const MAX_LANES: usize = 32;
/// Row counts of a one-row-per-lane step (decode), sliced per call.
const ONE_ROW_EACH: [usize; MAX_LANES] = [1; MAX_LANES];
/// Largest head dim of the generic attention kernel (4 output dims per thread of 128).
const GENERIC_MAX_HD: usize = 512;
const FP8_BLOCK: usize = 128;
/// NVFP4 scale group: one E4M3 scale per 16 consecutive columns of a row.
use model::stored::NVFP4_GROUP;
/// Where the E4M3 scale bytes start in an NVFP4 weight's scale allocation: the f32 global
/// comes first, padded so that the scales stay 16-byte aligned.
const NVFP4_SCALE_AT: usize = 16;
/// Pointer-table entries per expert: FP8 (gate, up, down, 3 scales), NVFP4 (+ 3 globals).
const TAB_FP8: usize = 6;
const TAB_NVFP4: usize = 9;
/// Most rows of one grid.y.
const MAX_GRID_Y: usize = 65_535;
/// Rows from which a lane's GDN prefill call runs `gdn_chunk` by default, each lane of a call
/// by its own row count (so a prompt keeps its bits joined or alone).
/// Measured on an H100 (NOTES.md session 28): the 1024- and 8192-row prefills 3-4% faster;
/// 32 lanes of 64-row prompts chunked from 64 rows 2% slower in all (each lane adds 4 blocks
/// a value head of 158 KB of shared memory, one a multiprocessor at a time).
pub const GDN_CHUNK_MIN: usize = 512;

#[repr(C)]
#[derive(Clone, Copy)]
struct PtrTab {
    p: [u64; MAX_LANES],
}

/// The lanes' GDN state pointers (`pick`: the conv window or the recurrent state) for a
/// kernel, up to `MAX_LANES`; every state must have the call's dims.
fn gdn_tab(
    op: &'static str,
    states: &[&mut CudaGdn],
    d: &GdnDims,
    pick: impl Fn(&CudaGdn) -> u64,
) -> BResult<PtrTab> {
    if states.len() > MAX_LANES {
        return Err(shape_err(
            op,
            format!("{} lanes in one launch; at most {MAX_LANES}", states.len()),
        ));
    }
    let mut tab = PtrTab { p: [0; MAX_LANES] };
    for (i, s) in states.iter().enumerate() {
        if s.dims != *d {
            return Err(shape_err(op, "state of other dims".into()));
        }
        tab.p[i] = pick(s);
    }
    Ok(tab)
}

/// Lane i's rows of a GDN call: `start[i] .. start[i] + len[i]` (ops.cu `RowTab`).
#[repr(C)]
#[derive(Clone, Copy)]
struct RowTab {
    start: [i32; MAX_LANES],
    len: [i32; MAX_LANES],
}

impl PtrTab {
    /// The entries `idx` (indices into this table), in that order.
    fn pick(&self, idx: &[usize]) -> PtrTab {
        let mut t = PtrTab { p: [0; MAX_LANES] };
        for (k, &i) in idx.iter().enumerate() {
            t.p[k] = self.p[i];
        }
        t
    }
}

impl RowTab {
    /// The lanes `idx` (indices into this table) at their own starts and counts, in that order.
    fn pick(&self, idx: &[usize]) -> RowTab {
        let mut t = RowTab {
            start: [0; MAX_LANES],
            len: [0; MAX_LANES],
        };
        for (k, &i) in idx.iter().enumerate() {
            t.start[k] = self.start[i];
            t.len[k] = self.len[i];
        }
        t
    }

    /// Lanes' rows one after another, `lens[i]` (at least 1) each, at most `MAX_LANES` lanes.
    fn of(op: &'static str, lens: &[usize]) -> BResult<RowTab> {
        if lens.len() > MAX_LANES {
            return Err(shape_err(
                op,
                format!("{} lanes in one launch (at most {MAX_LANES})", lens.len()),
            ));
        }
        let mut t = RowTab {
            start: [0; MAX_LANES],
            len: [0; MAX_LANES],
        };
        let mut at = 0usize;
        for (i, &n) in lens.iter().enumerate() {
            if n == 0 {
                // the kernels take a lane's rows from 1 (callers skip empty calls first)
                return Err(shape_err(op, format!("lane {i} of 0 rows in a row table")));
            }
            t.start[i] = i32v(op, at)?;
            t.len[i] = i32v(op, n)?;
            at += n;
        }
        i32v(op, at)?;
        Ok(t)
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
struct KvTab {
    k: [u64; MAX_LANES],
    v: [u64; MAX_LANES],
    len: [i64; MAX_LANES],
    /// Each lane's capacity (its caches are `[kv heads, cap, head dim]`): lanes of one call may
    /// differ (a request's cache holds its P + F + 1 rows); the kernels' `cap` argument is the
    /// largest, for planning only.
    cap: [i64; MAX_LANES],
    /// When not 0, the kernels read lane i's length as `lenp[i · lstride] + ladd` (a recorded
    /// round's counters) instead of `len[i]`.
    lenp: u64,
    lstride: i64,
    ladd: i64,
}

impl KvTab {
    fn empty() -> Self {
        KvTab {
            k: [0; MAX_LANES],
            v: [0; MAX_LANES],
            len: [0; MAX_LANES],
            cap: [0; MAX_LANES],
            lenp: 0,
            lstride: 0,
            ladd: 0,
        }
    }
}

/// `model::backend::RoundLane` as round.cu's `LaneIn` reads it (280 bytes).
#[repr(C)]
#[derive(Clone, Copy)]
struct LaneIn {
    rows: i64,
    tower_rows: i64,
    seed: u64,
    step: u64,
    temperature: f32,
    top_k: i32,
    top_p: f32,
    ras: i32,
    n_recent: i32,
    /// An unconditional branch: the drawing lane whose frame it takes (else −1).
    follow: i32,
    /// A guided lane: the row of its unconditional branch's main logits (else −1), and γ.
    guide: i32,
    gamma: f32,
    last: [i64; model::ROW_WIDTH],
    recent: [i64; model::RAS_WINDOW],
}

/// i64 words per `LaneIn` (the stride of a round's counters).
const LANE_IN_WORDS: usize = std::mem::size_of::<LaneIn>() / 8;

/// Most terms of one `round_embed` (round.cu `MAX_TERMS`).
const MAX_TERMS: usize = 16;

#[repr(C)]
#[derive(Clone, Copy)]
struct Terms {
    table_rows: [i64; 8],
    n: i32,
    table: [i32; MAX_TERMS],
    last: [i32; MAX_TERMS],
    col: [i32; MAX_TERMS],
    offset: [u32; MAX_TERMS],
    guarded: [i32; MAX_TERMS],
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Tables {
    p: [u64; 8],
}

/// Most weights of one `linear_many` launch (gemv.cu `Multi`).
const MULTI_MAX: usize = 8;

#[repr(C)]
#[derive(Clone, Copy)]
struct Multi {
    w: [u64; MULTI_MAX],
    y: [u64; MULTI_MAX],
    n_out: [i32; MULTI_MAX],
    start: [i32; MULTI_MAX + 1],
    count: i32,
}

// SAFETY: plain integers in #[repr(C)] structs whose layout matches `PtrTab`, `KvTab` and
// `Tables` in kernels/ops.cu (u64 and i64 arrays, no padding); they are passed by value.
unsafe impl DeviceRepr for PtrTab {}
// SAFETY: as PtrTab: plain old data in ops.cu's layout.
unsafe impl DeviceRepr for RowTab {}
// SAFETY: as above.
unsafe impl DeviceRepr for KvTab {}
// SAFETY: as above.
unsafe impl DeviceRepr for Tables {}
// SAFETY: as above (`Multi` in kernels/gemv.cu: u64 arrays then i32 arrays, 200 bytes).
unsafe impl DeviceRepr for Multi {}
// SAFETY: as above (`Terms` in kernels/round.cu: an i64 array then i32/u32 arrays).
unsafe impl DeviceRepr for Terms {}

fn dev(e: impl std::fmt::Display) -> BackendError {
    BackendError::Device(e.to_string())
}

fn shape_err(op: &'static str, why: String) -> BackendError {
    BackendError::Shape { op, why }
}

fn cmul(op: &'static str, f: &[usize]) -> BResult<usize> {
    f.iter()
        .try_fold(1usize, |a, &b| a.checked_mul(b))
        .ok_or_else(|| shape_err(op, format!("size {f:?} overflows")))
}

fn i32v(op: &'static str, v: usize) -> BResult<i32> {
    i32::try_from(v).map_err(|_| shape_err(op, format!("{v} does not fit a 32-bit kernel index")))
}

fn i64v(op: &'static str, v: usize) -> BResult<i64> {
    i64::try_from(v).map_err(|_| shape_err(op, format!("{v} does not fit a 64-bit kernel index")))
}

fn u32v(op: &'static str, v: usize) -> BResult<u32> {
    u32::try_from(v).map_err(|_| shape_err(op, format!("grid of {v} blocks is too large")))
}

/// Rows of one grouped expert pass: at most 4096 (the slot buffers), and few enough that the
/// tile bound (ceil(slots / tm) + min(E, slots)) stays within grid.y.
fn group_chunk(rows: usize, e: usize, tm: usize, k: usize) -> usize {
    4096.min((MAX_GRID_Y.saturating_sub(e) * tm / k.max(1)).max(1))
        .min(rows.max(1))
}

/// Device scratch of one slot grouping (`CudaBackend::slot_groups`): pointers into `_ints`,
/// and the slot order.
struct SlotGroups {
    _ints: Mem,
    counts: u64,
    offsets: u64,
    tiles: u64,
    cursor: u64,
    order: Mem,
}

/// One pass of `CudaBackend::grouped_passes`: device pointers of its routed ids, input rows,
/// slot grouping (order, offsets, tiles), per-slot buffers, and its tile bound.
struct GroupPass {
    ids: u64,
    xp: u64,
    order: u64,
    offsets: u64,
    tiles: u64,
    hbuf: u64,
    obuf: u64,
    bound: usize,
}

/// Whether the tensor-core experts (`moe_tc_*`) take a layer's shape: H and I in whole
/// 128-key blocks, at most 32 of them per launch (the partials' shared memory), and a row's
/// down-projection pairs (k I / 128) within `moe_tc_down_rows`' 64.
fn tc_experts_fit(i: usize, h: usize, k: usize) -> bool {
    let fits = |d: usize| d > 0 && d.is_multiple_of(128) && d / 128 <= 32;
    fits(i) && fits(h) && (1..=64).contains(&(k * (i / 128)))
}

/// Threads a block of `moe_tc_gate_up` and of the grouped `moe_tc_down` (I, H multiples of
/// 128): a warp a key block up to `warps` (1 to 16); gate/up at least one thread for each of
/// the 2 H / 128 scales it stages.
pub(crate) fn tc_expert_blocks(warps: usize, i: usize, h: usize) -> (usize, usize) {
    let most = warps.clamp(1, 16);
    let (hk, ik) = (h / 128, i / 128);
    let gu = hk.clamp(1, most.max((2 * hk).div_ceil(32)));
    (32 * gu, 32 * ik.clamp(1, most))
}

/// Most 128-key blocks of I `moe_tc_down4` takes (moe.cu `XT_DN4_KB`, the size of its partials
/// in shared memory); larger I runs `moe_tc_down`.
const DN4_MAX_KB: usize = 8;

/// Grid for a grid-stride loop over `n` elements with 256-thread blocks.
fn stride_grid(n: usize) -> (u32, u32, u32) {
    let blocks = n.div_ceil(256).clamp(1, 1 << 20);
    (blocks as u32, 1, 1)
}

/// Largest allocation served from [`SmallPool`]: decode activations and workspaces; bigger ones
/// (weights, caches, prefill activations) come from the driver's stream-ordered pool.
const SMALL_MAX: usize = 4 << 20;
/// Smallest size class (bytes).
const SMALL_MIN: usize = 256;

/// Free lists of device blocks by power-of-two size class, kept by the backend. A frame makes
/// over a thousand short-lived buffers; taking them from a host-side list costs no driver call
/// (the driver's `cuMemAllocAsync` / `cuMemFreeAsync` pair does, per buffer). Reuse is safe
/// because every launch of the backend is ordered on its one stream: a block handed back is
/// only reused by work enqueued after all work that used it.
pub struct SmallPool {
    free: Mutex<Vec<Vec<u64>>>,
    /// Every block ever taken from the driver, released when the pool is dropped.
    backing: Mutex<Vec<CudaSlice<u8>>>,
    /// A recorded round's pool: blocks of any size from `cuMemAlloc` (a stream-ordered
    /// allocation would become a node of the graph being recorded), freed with the pool.
    raw: Option<(Arc<cudarc::driver::CudaContext>, Mutex<Vec<u64>>)>,
    /// While a side branch is open (`CudaBackend::aside_begin` .. `aside_join`): blocks handed
    /// back then, kept out of the free lists until the join, since work on the model's stream
    /// is not ordered after the branch's until then.
    held: Mutex<Option<Vec<(usize, u64)>>>,
}

impl Drop for SmallPool {
    fn drop(&mut self) {
        if let Some((ctx, blocks)) = &self.raw {
            if ctx.bind_to_thread().is_ok() {
                for &p in blocks.lock().unwrap_or_else(|p| p.into_inner()).iter() {
                    // SAFETY: p came from malloc_sync and is freed once; the graph that used it
                    // was dropped first and every replay was waited for (`round_frames`).
                    let _ = unsafe { cu::free_sync(p) };
                }
            }
        }
    }
}

impl SmallPool {
    fn new() -> Self {
        SmallPool {
            free: Mutex::new(vec![Vec::new(); 48]),
            backing: Mutex::new(Vec::new()),
            raw: None,
            held: Mutex::new(None),
        }
    }

    /// The private pool of one recorded round.
    fn for_graph(ctx: Arc<cudarc::driver::CudaContext>) -> Self {
        SmallPool {
            free: Mutex::new(vec![Vec::new(); 48]),
            backing: Mutex::new(Vec::new()),
            raw: Some((ctx, Mutex::new(Vec::new()))),
            held: Mutex::new(None),
        }
    }

    /// A block of size class `class` from the free list or, for a graph's pool, a new one.
    fn take_or_alloc_raw(&self, class: usize) -> BResult<u64> {
        if let Some(p) = self.take(class) {
            return Ok(p);
        }
        let Some((ctx, blocks)) = &self.raw else {
            return Err(dev("not a graph pool"));
        };
        ctx.bind_to_thread().map_err(dev)?;
        // SAFETY: a plain device allocation, freed in Drop.
        let p = unsafe { cu::malloc_sync(1usize << class) }.map_err(|e| {
            dev(format!(
                "a recorded round's buffer of {} bytes could not be allocated: {e}",
                1usize << class
            ))
        })?;
        blocks.lock().unwrap_or_else(|p| p.into_inner()).push(p);
        Ok(p)
    }

    /// The size class of `bytes` (block size `1 << class`).
    fn class(bytes: usize) -> usize {
        bytes.max(SMALL_MIN).next_power_of_two().trailing_zeros() as usize
    }

    fn take(&self, class: usize) -> Option<u64> {
        self.free.lock().unwrap_or_else(|p| p.into_inner())[class].pop()
    }

    fn give_back(&self, class: usize, ptr: u64) {
        if let Some(h) = self.held.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            h.push((class, ptr));
            return;
        }
        self.free.lock().unwrap_or_else(|p| p.into_inner())[class].push(ptr);
    }

    /// Keeps blocks handed back from now on out of the free lists (a side branch opens).
    fn hold(&self) {
        let mut h = self.held.lock().unwrap_or_else(|p| p.into_inner());
        if h.is_none() {
            *h = Some(Vec::new());
        }
    }

    /// Returns the held blocks to the free lists (the side branch was joined).
    fn release(&self) {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner()).take();
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        for (class, ptr) in held.into_iter().flatten() {
            free[class].push(ptr);
        }
    }
}

enum Owner {
    Driver(#[allow(dead_code)] CudaSlice<u8>),
    Pool(Arc<SmallPool>, usize),
}

/// Device memory of `bytes` bytes, returned on drop to the backend's small-block pool or to the
/// driver's stream-ordered pool.
pub struct Mem {
    owner: Owner,
    ptr: u64,
    bytes: usize,
    /// Unique for the process (addresses are reused after a free; ids are not).
    id: u64,
}

/// Source of [`Mem::id`].
static NEXT_MEM_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn next_mem_id() -> u64 {
    NEXT_MEM_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl Drop for Mem {
    fn drop(&mut self) {
        if let Owner::Pool(pool, class) = &self.owner {
            pool.give_back(*class, self.ptr);
        }
    }
}

impl Mem {
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn bytes(&self) -> usize {
        self.bytes
    }
    /// The address `offset` bytes in (checked against the allocation).
    fn at(&self, offset: usize) -> BResult<u64> {
        if offset > self.bytes {
            return Err(dev(format!(
                "offset {offset} past a {}-byte allocation",
                self.bytes
            )));
        }
        Ok(self.ptr + offset as u64)
    }
}

/// An activation matrix `[rows, cols]` of f32 on the device.
pub struct CudaBuf {
    rows: usize,
    cols: usize,
    mem: Mem,
}

impl CudaBuf {
    fn ptr(&self) -> u64 {
        self.mem.ptr
    }
    fn shape(&self) -> check::Shape {
        (self.rows, self.cols)
    }
    /// Address of row `r`.
    fn row_ptr(&self, r: usize) -> BResult<u64> {
        self.mem.at(cmul("row offset", &[r, self.cols, 4])?)
    }
}

/// A matrix `[rows, cols]` in stored precision.
pub enum CudaWeight {
    Bf16 {
        mem: Mem,
        rows: usize,
        cols: usize,
    },
    /// E4M3 bytes and one f32 multiplier per 128x128 block, `[ceil(rows/128), ceil(cols/128)]`.
    Fp8 {
        mem: Mem,
        scale: Mem,
        rows: usize,
        cols: usize,
    },
    /// NVFP4 as stored: `mem` holds the `[rows, cols/2]` E2M1 code bytes (low nibble = even
    /// column); `scale` holds the f32 global (`weight_scale_2`) at byte 0 and the `[rows,
    /// cols/16]` E4M3 `weight_scale` bytes from byte [`NVFP4_SCALE_AT`]. `cols` is logical.
    Nvfp4 {
        mem: Mem,
        scale: Mem,
        global: f32,
        rows: usize,
        cols: usize,
    },
}

impl CudaWeight {
    pub fn rows(&self) -> usize {
        match self {
            CudaWeight::Bf16 { rows, .. }
            | CudaWeight::Fp8 { rows, .. }
            | CudaWeight::Nvfp4 { rows, .. } => *rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            CudaWeight::Bf16 { cols, .. }
            | CudaWeight::Fp8 { cols, .. }
            | CudaWeight::Nvfp4 { cols, .. } => *cols,
        }
    }
    pub fn device_bytes(&self) -> usize {
        match self {
            CudaWeight::Bf16 { mem, .. } => mem.bytes,
            CudaWeight::Fp8 { mem, scale, .. } | CudaWeight::Nvfp4 { mem, scale, .. } => {
                mem.bytes + scale.bytes
            }
        }
    }

    /// The id of the weight's main allocation (unique for the process).
    fn id(&self) -> u64 {
        match self {
            CudaWeight::Bf16 { mem, .. }
            | CudaWeight::Fp8 { mem, .. }
            | CudaWeight::Nvfp4 { mem, .. } => mem.id,
        }
    }

    /// The stored format, for messages.
    pub fn format_name(&self) -> &'static str {
        match self {
            CudaWeight::Bf16 { .. } => "BF16",
            CudaWeight::Fp8 { .. } => "FP8",
            CudaWeight::Nvfp4 { .. } => "NVFP4",
        }
    }
}

/// A small f32 tensor.
pub struct CudaVector {
    mem: Mem,
    len: usize,
}

/// One layer's K/V of one lane: `[kv_heads, capacity, head_dim]` each, BF16 or f32.
pub struct CudaKv {
    k: Mem,
    v: Mem,
    len: usize,
    capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    f32: bool,
}

/// One lane's Gated DeltaNet state: conv history `[(K-1), C]` and S `[nv, dk, dv]`, f32.
pub struct CudaGdn {
    conv: Mem,
    s: Mem,
    dims: GdnDims,
}

/// Router decisions on the device: ids and weights `[rows, k]`.
pub struct CudaRoute {
    ids: Mem,
    wts: Mem,
    rows: usize,
    k: usize,
}

/// A frame round kept on the device: each lane's inputs (`LaneIn`, written before each round),
/// the frames it draws (`[lanes, 11]` i64), the candidate ids, and once recorded its graph with
/// the graph's private buffers.
pub struct CudaRound {
    /// Dropped before `pool`: the graph's nodes point into it.
    graph: Option<Graph>,
    pool: Option<Arc<SmallPool>>,
    lanes: usize,
    /// The drawing lanes (the first ones; the rest are unconditional branches).
    leaders: usize,
    lane_in: Mem,
    frames: Mem,
    cands: Mem,
    spec: model::backend::RoundSpec,
    /// The host copy of the inputs last written (the counters the ops check against).
    host: Vec<model::backend::RoundLane>,
}

/// A recorded round. Graph objects are used by one thread at a time: the model keeps its round
/// behind a mutex.
struct Graph(cudarc::driver::CudaGraph);
// SAFETY: the graph is only launched or dropped by the thread holding the model's round lock.
unsafe impl Send for Graph {}

impl CudaRound {
    fn counter_ptr(&self, c: model::backend::Counter, lane0: usize) -> u64 {
        let word = match c {
            model::backend::Counter::Backbone => 0,
            model::backend::Counter::Tower => 1,
        };
        self.lane_in.ptr + 8 * (lane0 * LANE_IN_WORDS + word) as u64
    }

    fn host_counter(&self, c: model::backend::Counter, i: usize) -> usize {
        match c {
            model::backend::Counter::Backbone => self.host[i].rows,
            model::backend::Counter::Tower => self.host[i].tower_rows,
        }
    }

    /// How many lanes `c` covers: all for the backbone, the drawing ones for the tower.
    fn covered(&self, c: model::backend::Counter) -> usize {
        match c {
            model::backend::Counter::Backbone => self.lanes,
            model::backend::Counter::Tower => self.leaders,
        }
    }

    /// Refuses `rows` rows unless the round's lanes are written and `rows` is what `c` covers.
    fn check_rows(&self, op: &'static str, rows: usize, c: model::backend::Counter) -> BResult<()> {
        if self.host.len() != self.lanes || rows != self.covered(c) {
            return Err(shape_err(
                op,
                format!(
                    "{rows} rows for a round of {} lanes ({} written, {} drawing; {c:?} rows \
                     wanted)",
                    self.lanes,
                    self.host.len(),
                    self.leaders
                ),
            ));
        }
        Ok(())
    }
}

/// The device pointer table of one layer's experts: per expert gate, up, down, their scales
/// and, for NVFP4, the addresses of their f32 globals (null entries for a pruned expert).
struct ExpertTable {
    nvfp4: bool,
    host: Vec<u64>,
    dev: Mem,
}

/// Identifies one expert list by the allocation ids of every expert's gate, up and down (0 for
/// a pruned expert). Allocation ids are never reused, so a list rebuilt from other weights,
/// even at the same address, gets another key.
type ExpertKey = Vec<u64>;

/// A layer's expert table on the device: its address, I, H, and whether the experts are NVFP4.
#[derive(Clone, Copy)]
struct TableRef {
    ptr: u64,
    i: usize,
    h: usize,
    nvfp4: bool,
}

/// Run-time choices of the backend.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// Keep the KV cache in f32 (the CPU reference's precision) instead of BF16.
    pub kv_f32: bool,
    /// From this many keys on, decode attention (one row per lane) runs the split-key kernel
    /// (`attn_decode_*`) instead of the generic one-block-per-head kernel. The choice follows
    /// the longest lane of a call, so only 1 (always split, the default) or a value above every
    /// window (never) keeps each lane's bits independent of its batch: `from_env` gives 1 or
    /// never.
    pub split_min_keys: usize,
    /// From this many query rows of one lane on (a prefill), attention runs the tiled
    /// flash-style kernel (head dims a multiple of 32 up to 256).
    pub flash_min_rows: usize,
    /// From this many rows of one lane (`Rows::Bulk`) on, BF16 linears run the tiled FMA GEMM
    /// and FP8 routed experts the grouped FMA tiles (gemm.cu) instead of the row-invariant
    /// tensor-core GEMVs and experts (`DRAMATIS_CUDA_GEMM_MIN=ROWS`). Never by default: on an
    /// H100 (session 29) the GEMVs' tiles prefilled 1024 rows in 0.297 s against the FMA
    /// tiles' 0.454, 8192 in 2.838 against 3.616 (the FMA tiles were faster below a few hundred
    /// rows only before the tensor-core tiles, NOTES.md). Every prompt then keeps the joined
    /// kernels' bits at any length, so prompts up to the prefill chunk can join.
    pub gemm_min_rows: usize,
    /// Routed experts of a `Rows::Bulk` call run grouped by expert from this many rows
    /// (`DRAMATIS_CUDA_GROUP_MIN`, default `gemm_min_rows`): apart from the dense threshold so
    /// parity can tell the two bulk paths apart.
    pub group_min_rows: usize,
    /// Routed experts of calls of at least this many rows (below the bulk tiles) run grouped
    /// by expert with the per-row arithmetic (`moe_slots_*`, the same bits; contract and
    /// goldens pass): `DRAMATIS_CUDA_SLOTS_MIN=ROWS`. Off by default: at 32 lanes a round took
    /// 38.4 ms against 34.2 ms with the per-row kernels (`bench/cuda-drama3-slots-*-2026-11-29-s7.json`).
    pub slots_min_rows: usize,
    /// BF16 linears of any row count below the tiled GEMM run on tensor cores (`gemv_tc2_*`,
    /// TF32 with split activations) where K allows, instead of the FMA GEMV.
    pub tc_gemv: bool,
    /// Tensor-core GEMVs with short key ranges per warp (`gemv_tc2_*`): at least this many keys
    /// per warp (`DRAMATIS_CUDA_GEMV_KC`, default 256; 0 gives session 7's `gemv_tc`
    /// arithmetic, 512 keys per warp in 32-key steps, whatever `gemv_v`). With cold weights at
    /// one row, 256 keys in 64-key steps read 1.4x faster than `gemv_tc`
    /// (`bench/cuda-gemvbench-2026-11-30-s8.md`); one lane 88.6 -> 99.8 frames/s.
    pub gemv_kc: usize,
    /// `gemv_tc2_*` load layout (`DRAMATIS_CUDA_GEMV_V`, default 2): 1, 8 keys per thread and
    /// step; 2, 16 contiguous keys (one 128-byte line per row and step) where K is a multiple of
    /// 64, else 1.
    pub gemv_v: usize,
    /// Warps a block of `gemv_tc2_*` for up to 8 rows (`DRAMATIS_CUDA_GEMV_WARPS`) and for more
    /// (`DRAMATIS_CUDA_GEMV_WARPS_MANY`): each warp takes a run of the K chunks, summed in chunk
    /// order whatever the count, so the bits never change; 0 is a warp per chunk (up to 16).
    /// Fewer warps than chunks let the warps of a multiprocessor walk the activations in the
    /// same order (one L1 working set) instead of each reading its own chunk of every row; on
    /// the H200 that was slower at every row count (`gemvbench`, session 11: GDN projections at
    /// 32 rows 58.6 us with a warp per chunk, 68.0 with 2 warps, 90.2 with 1), so both default
    /// to 0.
    pub gemv_warps: usize,
    pub gemv_warps_many: usize,
    /// Rows from which BF16 linears with layout 2 take `gemv_tt*` (the same bits as
    /// `gemv_tc2_*`, the data moved once per 64 x 64 tile: prompts and joined prefills;
    /// `DRAMATIS_CUDA_GEMV_TILE_MIN`, default 64; 0 is never).
    pub gemv_tile_min: usize,
    /// Where `gemv_tt*` would run, `gemv_tw*` instead: `gemv_ts`'s 64 x 32 tiles of four
    /// cp.async-fed warps, each block walking all of K, the same bits
    /// (`DRAMATIS_CUDA_GEMV_WALK=0` turns it off). On an H100 (session 29) the contract passed
    /// bitwise, `gemvbench` ran the prompts' wide shapes 15-39% faster at 64-512 rows, a 100-row first
    /// audio from nothing 0.0781 -> 0.0744 s; 32 lanes even.
    pub gemv_walk: bool,
    /// Fewest `gemv_tt` blocks (64 x 64 tiles) for it to run (`DRAMATIS_CUDA_GEMV_TILE_BLOCKS`,
    /// default `TT_MIN_BLOCKS`): a tile walks all of K in one block, so a few tiles leave most of
    /// the device idle, and `gemv_tc2` (the same bits) runs instead.
    pub gemv_tile_blocks: usize,
    /// `gemv_tc2_*` over more than 32 rows in one block a 32-row pass (grid y), not every block
    /// walking all the passes: the GEMVs of few outputs (the MoE group's 81 blocks, the 128 of a
    /// 2048-output weight) then use the whole device in a prompt's prefill. The same bits (a
    /// row's operations do not depend on its block): `DRAMATIS_CUDA_GEMV_SLABS=0` turns it off.
    pub gemv_slabs: bool,
    /// Rows from which BF16 linears with layout 2 that do not take `gemv_tt*` take `gemv_ts*`,
    /// up to `GEMV_TS_MAX_ROWS` (64-output x 32-row tiles, one key chunk a block, the chunks
    /// added in order by each tile's last block: the same bits as `gemv_tc2_*`);
    /// `DRAMATIS_CUDA_GEMV_SPLIT_MIN`, default 17; 0 is never.
    pub gemv_split_min: usize,
    /// Fewest `gemv_ts` blocks (tiles times key chunks) for it to run, else `gemv_tc2` (the same
    /// bits): `DRAMATIS_CUDA_GEMV_SPLIT_BLOCKS`, default `TS_MIN_BLOCKS` (none; a bound measured
    /// slower in the round, though few blocks leave part of the device idle in a last wave).
    pub gemv_split_blocks: usize,
    /// Side branches (`Backend::aside_begin`, up to `ASIDE_MAX_ROWS` rows: the MoE's shared
    /// expert beside its router and routed experts, attention's query heads beside its key
    /// heads, the tower's gate copy beside its value's, a GDN step's z projection beside its
    /// other projections and conv step) on a second stream; the initial value of
    /// `CudaBackend::set_aside`. `DRAMATIS_CUDA_ASIDE=0` runs every op in order on one stream
    /// (the same operations, so the same bits).
    pub aside: bool,
    /// Joined prompts' GDN conv and recurrence in one launch for up to 32 lanes
    /// (`gdn_prefill_lanes`); `DRAMATIS_CUDA_GDN_LANES=0` runs them lane by lane (the same bits).
    pub gdn_lanes: bool,
    /// The GDN recurrence always on the generic kernel (`gdn_recur`), never the `dk` 128 one
    /// that keeps the state column in registers, and a one-row conv as `gdn_conv_rows` then
    /// `gdn_conv_shift`: for the contract's bitwise comparisons (no environment variable).
    pub gdn_generic: bool,
    /// A decode row's delta rule and gated norm in one launch, `gdn_step_k128_gated` (key and
    /// value dims 128), the same bits as gdn_prep, gdn_recur_k128 and rmsnorm_silu_groups:
    /// `DRAMATIS_CUDA_GDN_FUSED=0` runs the three kernels instead.
    pub gdn_fused: bool,
    /// Lanes with at least this many rows in a GDN prefill call run the chunked delta rule
    /// (`gdn_chunk`: 64-row chunks, DRAMA3.md §4.3; key and value dims 128) instead of the
    /// per-row recurrence: `DRAMATIS_CUDA_GDN_CHUNK_MIN=ROWS`, default [`GDN_CHUNK_MIN`]
    /// (0 is never). Each lane of a call takes its kernel by its own row count, so joined
    /// prompts keep their solo bits; the chunks restart at each call, and the engine splits a
    /// prompt into the same calls whether its reference prefix is cached or not, so a cache hit
    /// keeps the uncached bits.
    pub gdn_chunk_min: usize,
    /// A joined prefill's attention in one launch for all its lanes (`attn_flash_rows_*` and
    /// `kv_append_rows_*`: each lane the bits of its own launch) instead of a launch per lane
    /// with its rows split out and the outputs joined (`DRAMATIS_CUDA_ATTN_JOINED=1`; off until
    /// measured on a device).
    pub attn_joined: bool,
    /// Frame rounds stay on the device (draws there, one download per round):
    /// `DRAMATIS_CUDA_ROUNDS=host` draws on the host after each head instead.
    pub kept_rounds: bool,
    /// Kept rounds are recorded once per lane set as a CUDA graph and replayed:
    /// `DRAMATIS_CUDA_GRAPH=0` issues every launch instead.
    pub graphs: bool,
    /// Split decode attention's head groups over more blocks when blocks are few
    /// (`kernels::decode_heads_per_block`); on by default (contract and goldens pass with it,
    /// one lane 82.0 -> 88.5 frames/s, `bench/cuda-drama3-head-split-*-2026-11-29-s7.json`):
    /// `DRAMATIS_CUDA_HEAD_SPLIT=0` turns it off.
    pub decode_head_split: bool,
    /// `Rows::Bulk` BF16 linears (from `gemm_min_rows` rows) run as BF16 tensor-core GEMMs
    /// through cuBLASLt with split activations (`lt.rs`) instead of the tiled GEMM:
    /// `DRAMATIS_CUDA_GEMM_LT=1`. Off by default until the contract and parity have run it on
    /// the device (written after the session's device time ran out); without the library the
    /// tiled GEMM runs.
    pub gemm_lt: bool,
    /// `Rows::Bulk` BF16 linears and grouped FP8 experts run their 64x64 tiles on TF32 tensor
    /// cores (activations split hi + lo, per-MMA f32 adds, FP8 block scales per 128-key block)
    /// instead of FMA tiles, where K is a multiple of 32: `DRAMATIS_CUDA_TC_BULK=1`. Off until a
    /// device run has passed the contract, goldens and parity with it.
    pub tc_bulk: bool,
    /// Routed FP8 experts of every call below the bulk tiles run on TF32 tensor cores
    /// (`moe_tc_*`: split activations, per-MMA f32 adds, block scales per 128-key block) where
    /// H and I are multiples of 128, one arithmetic at every row count, instead of the per-row
    /// FMA kernels (`moe_*_tab*`): `DRAMATIS_CUDA_MOE_TC=1`. Off by default: correct on the
    /// device (contract, goldens, `say` hashes) but slower in frame rounds at 8 and 32 lanes
    /// (NOTES.md, session 9).
    pub moe_tc: bool,
    /// The same for one lane's prompt (`Rows::Bulk`) below the bulk tiles only: on by default
    /// (first audio 0.061 -> 0.057 s at one lane, 2.11 -> 1.91 s at 32; a prompt runs alone, so
    /// the rounds' batch promise is untouched). `DRAMATIS_CUDA_MOE_TC=0` turns both off.
    pub moe_tc_bulk: bool,
    /// From this many rows on, the tensor-core experts group slots by expert (up to 8 a tile,
    /// each weight read once per tile) instead of one slot a tile: the same bits, so any
    /// threshold keeps the batch promise (`DRAMATIS_CUDA_MOE_TC_GROUP`, default 8).
    pub moe_tc_group_rows: usize,
    /// Warps a block of the grouped tensor-core experts (`moe_tc_gate_up`, `moe_tc_down`) at
    /// most, each taking key blocks w, w + warps, ...: fewer warps give a multiprocessor more
    /// blocks whose loads and chains overlap (gate/up keeps at least one thread per scale it
    /// stages, 2 H / 128). The same bits at every count (a block's warps only
    /// share out the key blocks): `DRAMATIS_CUDA_MOE_TC_WARPS`, 1 to 16, default 4 (an
    /// uncached 181-row first audio, session 15: 16 warps 0.118 s, 8 0.110, 4 0.107, 2 0.113).
    pub moe_tc_warps: usize,
    /// The grouped tensor-core experts' down projection four 16-output tiles a block
    /// (`moe_tc_down4`, where I / 128 <= 8), the same bits: `DRAMATIS_CUDA_MOE_TC_DOWN4=0` gives
    /// one tile a block (`moe_tc_down`).
    pub moe_tc_down4: bool,
    /// The tensor-core experts' gate/up with each warp's next key block loaded while the current
    /// one computes (`moe_tc_gate_up_pf`), the same bits: `DRAMATIS_CUDA_MOE_TC_PREFETCH=0` gives
    /// `moe_tc_gate_up`.
    pub moe_tc_prefetch: bool,
    /// The per-row FP8 experts' down projection from `GEMV_WIDE_ROWS` rows on with a row's k
    /// experts in k warps of one block per 4-output tile (`moe_down_tab4_split`), so their
    /// loads are in flight at once, instead of one warp walking them in turn
    /// (`moe_down_tab4`): the same operations, so the same bits.
    /// `DRAMATIS_CUDA_MOE_DOWN_SPLIT4=0` gives `moe_down_tab4`. At 32 lanes the two measured
    /// the same (call 90: kept round 23.40 / 23.31 ms split, 23.42 / 23.20 walking).
    pub moe_down_split4: bool,
    /// The per-row FP8 experts' gate/up from `GEMV_WIDE_ROWS` rows on with two key steps a lane
    /// unrolled (`moe_gate_up_tab4u2`: the next step's weight loads in flight with this one's),
    /// the same bits as `moe_gate_up_tab4`: `DRAMATIS_CUDA_MOE_GU_U2=1` (off: no faster at 32
    /// lanes in call 90, kept round 23.39 / 23.38 ms against 23.40 / 23.31).
    pub moe_gate_up_u2: bool,
}

impl CudaOptions {
    /// `DRAMATIS_CUDA_KV=f32|bf16` (default f32: BF16 K/V fails the fixture's 1e-3 logits
    /// tolerance and drifts at Drama 3 geometry, see NOTES.md), `DRAMATIS_CUDA_SPLIT_MIN`
    /// (1, the default: always the split-key decode; any other value: never),
    /// `DRAMATIS_CUDA_FLASH_MIN` (default 2), `DRAMATIS_CUDA_GEMM_MIN` (default never).
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// The options from a variable lookup (`from_env` with `std::env::var`); unset or
    /// unparsable numbers take the defaults.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Self {
        let num = |k: &str, default: usize| {
            get(k)
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(default)
        };
        let gemm_min = num("DRAMATIS_CUDA_GEMM_MIN", usize::MAX);
        CudaOptions {
            kv_f32: !get("DRAMATIS_CUDA_KV").is_some_and(|v| v.eq_ignore_ascii_case("bf16")),
            // 1 (always split) or never: a threshold between would pick a lane's kernel by the
            // longest lane of its call, so its bits would depend on the batch
            split_min_keys: match num("DRAMATIS_CUDA_SPLIT_MIN", 1) {
                1 => 1,
                _ => usize::MAX,
            },
            flash_min_rows: num("DRAMATIS_CUDA_FLASH_MIN", 2),
            gemm_min_rows: gemm_min,
            group_min_rows: num("DRAMATIS_CUDA_GROUP_MIN", gemm_min),
            slots_min_rows: num("DRAMATIS_CUDA_SLOTS_MIN", usize::MAX),
            tc_gemv: get("DRAMATIS_CUDA_TC").is_none_or(|v| v.trim() != "0"),
            gemv_kc: num("DRAMATIS_CUDA_GEMV_KC", 256).min(8192),
            gemv_v: num("DRAMATIS_CUDA_GEMV_V", 2).clamp(1, 2),
            gemv_warps: num("DRAMATIS_CUDA_GEMV_WARPS", 0).min(16),
            gemv_warps_many: num("DRAMATIS_CUDA_GEMV_WARPS_MANY", 0).min(16),
            gemv_tile_min: match num("DRAMATIS_CUDA_GEMV_TILE_MIN", 64) {
                0 => usize::MAX,
                n => n,
            },
            gemv_tile_blocks: num("DRAMATIS_CUDA_GEMV_TILE_BLOCKS", TT_MIN_BLOCKS),
            gemv_walk: get("DRAMATIS_CUDA_GEMV_WALK").is_none_or(|v| v.trim() != "0"),
            gemv_slabs: get("DRAMATIS_CUDA_GEMV_SLABS").is_none_or(|v| v.trim() != "0"),
            gemv_split_min: match num("DRAMATIS_CUDA_GEMV_SPLIT_MIN", 17) {
                0 => usize::MAX,
                n => n,
            },
            gemv_split_blocks: num("DRAMATIS_CUDA_GEMV_SPLIT_BLOCKS", TS_MIN_BLOCKS),
            aside: get("DRAMATIS_CUDA_ASIDE").is_none_or(|v| v.trim() != "0"),
            gdn_lanes: get("DRAMATIS_CUDA_GDN_LANES").is_none_or(|v| v.trim() != "0"),
            gdn_generic: false,
            gdn_fused: get("DRAMATIS_CUDA_GDN_FUSED").is_none_or(|v| v.trim() != "0"),
            gdn_chunk_min: match num("DRAMATIS_CUDA_GDN_CHUNK_MIN", GDN_CHUNK_MIN) {
                0 => usize::MAX,
                n => n,
            },
            attn_joined: get("DRAMATIS_CUDA_ATTN_JOINED").is_some_and(|v| v.trim() == "1"),
            kept_rounds: get("DRAMATIS_CUDA_ROUNDS").is_none_or(|v| v.trim() != "host"),
            graphs: get("DRAMATIS_CUDA_GRAPH").is_none_or(|v| v.trim() != "0"),
            decode_head_split: get("DRAMATIS_CUDA_HEAD_SPLIT").is_none_or(|v| v.trim() != "0"),
            gemm_lt: get("DRAMATIS_CUDA_GEMM_LT").is_some_and(|v| v.trim() == "1"),
            tc_bulk: get("DRAMATIS_CUDA_TC_BULK").is_some_and(|v| v.trim() == "1"),
            moe_tc: get("DRAMATIS_CUDA_MOE_TC").is_some_and(|v| v.trim() == "1"),
            moe_tc_bulk: get("DRAMATIS_CUDA_MOE_TC").is_none_or(|v| v.trim() != "0"),
            moe_tc_group_rows: num("DRAMATIS_CUDA_MOE_TC_GROUP", 8).max(1),
            moe_tc_warps: num("DRAMATIS_CUDA_MOE_TC_WARPS", 4).clamp(1, 16),
            moe_tc_down4: get("DRAMATIS_CUDA_MOE_TC_DOWN4").is_none_or(|v| v.trim() != "0"),
            moe_tc_prefetch: get("DRAMATIS_CUDA_MOE_TC_PREFETCH").is_none_or(|v| v.trim() != "0"),
            moe_down_split4: get("DRAMATIS_CUDA_MOE_DOWN_SPLIT4").is_none_or(|v| v.trim() != "0"),
            moe_gate_up_u2: get("DRAMATIS_CUDA_MOE_GU_U2").is_some_and(|v| v.trim() == "1"),
        }
    }
}

/// The CUDA backend: one device, one stream, kernels compiled on first use.
pub struct CudaBackend {
    gpu: Arc<Gpu>,
    variant: Variant,
    opts: CudaOptions,
    /// KV precision of caches made from now on (starts at `opts.kv_f32`).
    kv_f32: std::sync::atomic::AtomicBool,
    expert_tables: Mutex<Vec<ExpertTable>>,
    /// Expert lists already turned into a table: a MoE call costs a hash lookup, not a walk
    /// over every expert (about 28 µs per layer on the H200 host).
    expert_keys: Mutex<std::collections::HashMap<ExpertKey, TableRef>>,
    /// One i32 of sticky error bits the kernels set (bit 0: a router row with every kept logit
    /// NaN or -inf; bit 1: a routing that names a pruned or out-of-range expert). Read, reported
    /// and cleared at each download, with the download's own synchronisation.
    err: Option<Mem>,
    /// Per (lane, kv head) block counters of the split-key decode kernel, zero between calls
    /// (the last block of each group resets its own).
    decode_count: Option<Mem>,
    /// `gemv_ts*` tickets: `GEMV_TS_TILES` for the model stream, then as many for a side
    /// branch's (launches on the two may run at once); each launch leaves them zero.
    gemv_count: Option<Mem>,
    small: Arc<SmallPool>,
    /// While a frame round is recorded: the graph's private pool, which `alloc` serves from.
    recording: Mutex<Option<Arc<SmallPool>>>,
    /// Uploaded router keep-masks by content (a recorded round cannot upload).
    masks: Mutex<std::collections::HashMap<Vec<u8>, Mem>>,
    /// cuBLASLt for bulk linears (`gemm_lt`), made at first use with its workspace; `Err` once
    /// it could not be made (the tiled GEMM runs instead, and the reason is logged once).
    lt: Mutex<Option<std::result::Result<(crate::lt::Lt, Mem), String>>>,
    prof: Prof,
    /// Programmatic dependent launch for `go!`'s launches (sm_90+ unless `DRAMATIS_CUDA_PDL=0`,
    /// `runtime::pdl_for`).
    pdl: bool,
    /// A timing tool, never for output: kernels whose names start with one of these prefixes,
    /// and the GEMVs of the weights of an `RxC` entry (`DRAMATIS_CUDA_SKIP=a,b,8192x2048,...`,
    /// read by `new`) are left out of recorded frame rounds, so a round's time without them
    /// places their in-graph cost (ncu's serialised, cold durations overstate small kernels).
    /// The rounds' results are then wrong; prompts and every launch outside a recording run in
    /// full. Logged at start.
    skip: Vec<String>,
    /// The weight shape `(rows << 32) | cols` of the linear op launching now (0: none), so that
    /// `DRAMATIS_CUDA_SKIP` entries `RxC` (`skip_shape`) leave out the GEMVs of one weight class.
    shape: std::sync::atomic::AtomicU64,
    /// The side branch (`Backend::aside_begin`): its stream, made at first use, and its state.
    aside_stream: std::sync::OnceLock<AsideStream>,
    aside: Mutex<AsideState>,
    /// Whether `aside_begin` opens branches (starts at `opts.aside`; `set_aside`).
    aside_on: std::sync::atomic::AtomicBool,
}

/// A side branch's stream (the model stream's priority) and two events: `fork` orders a branch
/// launch after the model stream's work so far, `done` the model stream's later work after the
/// branch.
struct AsideStream {
    stream: Arc<CudaStream>,
    fork: cudarc::driver::CudaEvent,
    done: cudarc::driver::CudaEvent,
}

/// Where a side branch stands (`CudaBackend::aside_begin`).
#[derive(Default)]
struct AsideState {
    /// Launches go to the branch's stream (between `aside_begin` and `aside_end`).
    on: bool,
    /// A branch was begun and is not joined yet.
    open: bool,
    /// The branch launched something (a join is then a wait).
    launched: bool,
    /// The pools holding blocks handed back while the branch is open.
    pools: Vec<Arc<SmallPool>>,
}

/// Rows up to which `aside_begin` opens a side branch: frame rounds (a lane a row, two with
/// guidance) and prompts of up to this many rows. While a branch is open every buffer comes
/// from the small pool (`alloc`), whose blocks handed back are held until the join
/// (`SmallPool::hold`), never freed to the driver.
pub const ASIDE_MAX_ROWS: usize = 64;

/// Per-op host time, counts and launch / allocation totals, kept when `DRAMATIS_CUDA_PROFILE`
/// is set and printed to stderr when the backend is dropped: where a frame's host time goes.
#[derive(Default)]
struct Prof {
    on: bool,
    /// op -> (calls, host ns, device ns)
    ops: Mutex<std::collections::HashMap<&'static str, (u64, u128, u128)>>,
    launches: std::sync::atomic::AtomicU64,
    allocs: std::sync::atomic::AtomicU64,
    /// With `DRAMATIS_CUDA_PROFILE=gpu`: events around each op on the backend's stream.
    timer: Option<GpuTimer>,
}

/// Device time per op from events recorded before and after it on the stream; pairs are read
/// (after a wait for the newest) every few thousand ops, so profiling stays bounded in memory.
struct GpuTimer {
    stream: Arc<cudarc::driver::CudaStream>,
    pending: Mutex<
        Vec<(
            &'static str,
            cudarc::driver::CudaEvent,
            cudarc::driver::CudaEvent,
        )>,
    >,
}

impl GpuTimer {
    fn event(&self) -> Option<cudarc::driver::CudaEvent> {
        let ev = self
            .stream
            .context()
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .ok()?;
        ev.record(&self.stream).ok()?;
        Some(ev)
    }

    /// Adds every pending pair's elapsed time to `ops` (waits for the newest event).
    fn drain(&self, ops: &mut std::collections::HashMap<&'static str, (u64, u128, u128)>) {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        for (op, a, b) in pending {
            if let Ok(ms) = a.elapsed_ms(&b) {
                ops.entry(op).or_insert((0, 0, 0)).2 += (f64::from(ms) * 1e6) as u128;
            }
        }
    }
}

/// Records one op's host time (and device time, when timed) on drop; nothing when profiling is
/// off.
struct ProfGuard<'a> {
    prof: &'a Prof,
    op: &'static str,
    t0: Option<std::time::Instant>,
    ev0: Option<cudarc::driver::CudaEvent>,
}

impl Drop for ProfGuard<'_> {
    fn drop(&mut self) {
        if let Some(t0) = self.t0 {
            let ns = t0.elapsed().as_nanos();
            let mut m = self.prof.ops.lock().unwrap_or_else(|p| p.into_inner());
            let e = m.entry(self.op).or_insert((0, 0, 0));
            e.0 += 1;
            e.1 += ns;
            if let (Some(timer), Some(a)) = (&self.prof.timer, self.ev0.take()) {
                if let Some(b) = timer.event() {
                    let full = {
                        let mut p = timer.pending.lock().unwrap_or_else(|p| p.into_inner());
                        p.push((self.op, a, b));
                        p.len() >= 4096
                    };
                    if full {
                        timer.drain(&mut m);
                    }
                }
            }
        }
    }
}

impl Prof {
    fn new(stream: &Arc<cudarc::driver::CudaStream>) -> Self {
        let v = std::env::var("DRAMATIS_CUDA_PROFILE").ok();
        Prof {
            on: v.is_some(),
            timer: v
                .filter(|v| v.eq_ignore_ascii_case("gpu"))
                .map(|_| GpuTimer {
                    stream: stream.clone(),
                    pending: Mutex::new(Vec::new()),
                }),
            ..Default::default()
        }
    }

    fn guard(&self, op: &'static str) -> ProfGuard<'_> {
        ProfGuard {
            prof: self,
            op,
            t0: self.on.then(std::time::Instant::now),
            ev0: self.timer.as_ref().and_then(|t| t.event()),
        }
    }

    /// The table: op, calls, host ms, µs per call, device ms and µs per call when timed; then
    /// launches and allocations.
    fn report(&self) -> String {
        let mut m = self.ops.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = &self.timer {
            t.drain(&mut m);
        }
        let mut rows: Vec<_> = m.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1.max(r.1 .2)));
        let host: u128 = rows.iter().map(|r| r.1 .1).sum();
        let device: u128 = rows.iter().map(|r| r.1 .2).sum();
        let mut out = format!(
            "cuda profile: host time in backend ops {:.1} ms, device time {:.1} ms; {} launches, {} allocations\n",
            host as f64 / 1e6,
            device as f64 / 1e6,
            self.launches.load(std::sync::atomic::Ordering::Relaxed),
            self.allocs.load(std::sync::atomic::Ordering::Relaxed)
        );
        out.push_str("op                  calls      host ms   us/call    device ms   us/call\n");
        for (op, (n, ns, dns)) in rows {
            let n = (*n).max(1) as f64;
            out.push_str(&format!(
                "{op:<18} {n:>7} {:>12.1} {:>9.2} {:>12.1} {:>9.2}\n",
                *ns as f64 / 1e6,
                *ns as f64 / 1e3 / n,
                *dns as f64 / 1e6,
                *dns as f64 / 1e3 / n
            ));
        }
        out
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if self.prof.on {
            eprintln!("{}", self.prof.report());
        }
    }
}

/// From this many rows on, BF16 GEMVs take four outputs per warp (`*_w4`, gemv.cu): a quarter
/// of the activation loads, the same bits; below it one output per warp keeps more blocks.
const GEMV_WIDE_ROWS: usize = 4;
/// moe.cu's `SR` (slots a group) and `SO` (outputs a warp) of `moe_slots_*`: they must match
/// (the scan builds `SLOTS_TILE`-slot groups the kernels walk as `SR`); a drift fails the
/// contract's `moe_experts_slots_fp8` against FP64.
const SLOTS_TILE: usize = 8;
const SLOTS_PER_WARP: usize = 4;

/// Values of a group each norm thread holds in registers (ops.cu `NORM_REG`).
const NORM_REG: usize = 16;
/// The largest RMSNorm group the kernels take: `NORM_REG` values in each of 1024 threads.
pub(crate) const NORM_GROUP_MAX: usize = NORM_REG * 1024;

/// Threads per RMSNorm group (every `*rmsnorm*` kernel): one rule for all, so the fused ops'
/// reduction order, and bits, equal the plain norm's. 128 below 1024 values, else 256, or more
/// where a group passes 256 threads' `NORM_REG` values (Drama 3's groups, at most 2048, never
/// do): a group over 4096 values takes more threads than before session 10, so its bits
/// differ from that build's. A group beyond 1024 threads' is refused.
fn norm_block(op: &'static str, group: usize) -> BResult<u32> {
    let max = NORM_GROUP_MAX;
    if group > max {
        return Err(BackendError::Shape {
            op,
            why: format!(
                "a norm group of {group} values is over the kernels' {max} ({NORM_REG} values \
                 a thread, 1024 threads a block)"
            ),
        });
    }
    Ok(if group >= 1024 {
        (group.div_ceil(NORM_REG).div_ceil(32) * 32).max(256) as u32
    } else {
        128
    })
}

/// The BF16 GEMV kernels of a call: for one weight and for several (`Multi`), the outputs a
/// block covers and its threads. Tensor cores (`gemv_tc2_*`, when on) take K a multiple of 32 up
/// to 8192 with one warp per `kc` keys; otherwise the FMA GEMVs, with four outputs per warp
/// from `GEMV_WIDE_ROWS` rows on. Each choice gives every row the same bits at any row count.
struct Bf16Gemv {
    single: &'static str,
    multi: &'static str,
    per_block: usize,
    block: u32,
    /// The kernels' key chunk (`gemv_tc2_*`: keys per warp; `gemv_tt*`: the chunk whose sums
    /// it adds in order; `gemv_ts*`: a block's keys, grid z the chunk count).
    kc: Option<i32>,
    /// `gemv_tc2_*`: the single-weight kernels with `silu(x) * u` and `x * sigmoid(u)` made as
    /// the input loads (`Act`).
    act: Option<(&'static str, &'static str)>,
    /// `gemv_tt*`: rows a block (grid y walks the row tiles); otherwise every block takes all
    /// rows, or a slab of them (`row_slabs`).
    row_tile: Option<usize>,
    /// `gemv_tc2_*` over more than 32 rows: grid y cuts the rows into slabs of one 32-row pass
    /// each (gemv.cu `gemv_slab`), so few output blocks still fill the device.
    row_slabs: bool,
    /// `gemv_ts*`: key chunks (grid z, a block each); their sums go to a workspace and a
    /// tile's last block adds them (`CudaBackend::gemv_split`, two more arguments).
    split: Option<usize>,
}

impl Bf16Gemv {
    /// The launch grid for `blocks` output blocks over `rows` rows.
    fn grid(&self, op: &'static str, blocks: usize, rows: usize) -> BResult<(u32, u32, u32)> {
        let y = match self.row_tile {
            Some(t) => rows.div_ceil(t).max(1),
            // gemv_slab sizes the slabs from grid y, so a cap only makes them longer
            None if self.row_slabs && rows > 32 => rows.div_ceil(32).min(MAX_GRID_Y),
            None => 1,
        };
        Ok((
            u32v(op, blocks)?,
            u32v(op, y)?,
            u32v(op, self.split.unwrap_or(1))?,
        ))
    }
}

/// Most rows `gemv_ts*` takes (two 32-row tiles); more rows keep a block walking all of K.
pub const GEMV_TS_MAX_ROWS: usize = 64;

/// Rows a `gemv_ts*` tile (gemv.cu `TS_RT`): a tile's chunk sums are 64 x this many floats.
pub const GEMV_TS_ROWS: usize = 32;

/// Most key chunks a `gemv_ts*` tile adds (gemv.cu `TS_MAXC`; `gemv_tc2_keys` makes at most 16).
pub const GEMV_TS_MAX_CHUNKS: usize = 16;

/// The default of `CudaOptions::gemv_split_blocks`: none. Session 20: alone and cold
/// (`gemvbench --rows 32`) the 512-block shapes (the 2048 x 4096 out projection, the tower's
/// w2, a head: 1.3 waves of three blocks a multiprocessor) ran slower split (30-38 us against
/// 20-29 on `gemv_tc2`), but in the 32-lane round a bound of 1024 blocks, which gives them to
/// `gemv_tc2`, made the kept round slower: 24.24 / 24.46 ms against 22.49 / 23.00 with every
/// split (alternated, one call; NOTES.md). Session 21's `gemv_ts` (four-warp blocks, four a
/// multiprocessor, cp.async) runs them alone about as fast as `gemv_tc2` (20.7 / 26.0 / 20.3 us).
pub const TS_MIN_BLOCKS: usize = 0;

/// `gemv_ts*` tiles a launch at most: each stream (the model's, a side branch's) has this many
/// tickets (`CudaBackend::gemv_count`).
pub const GEMV_TS_TILES: usize = 4096;

/// The elementwise op a `gemv_tc2_*` input load makes: `silu(x) * u` or `x * sigmoid(u)`.
#[derive(Clone, Copy)]
enum Act {
    Silu,
    Sigmoid,
}

impl Act {
    fn op(self) -> &'static str {
        match self {
            Act::Silu => "linear_silu_mul",
            Act::Sigmoid => "linear_sigmoid_mul",
        }
    }
}

/// Keys per warp of `gemv_tc2_*` for K (a multiple of 32 `v`, at most 8192): at least `base`
/// and few enough for 16 warps to cover K. A function of K alone, so a row's bits do not depend
/// on the row count.
fn gemv_tc2_keys(base: usize, v: usize, k: usize) -> usize {
    let step = 32 * v;
    // short rows (the shared expert's down projection, K 512) keep four warps
    let base = if k <= 1024 { base.min(128) } else { base };
    base.max(k.div_ceil(16)).div_ceil(step) * step
}

/// The default of `CudaOptions::gemv_tile_blocks` (`gemvbench`, session 12: 64 rows of the
/// 2048 x 4096 out-projection, 32 tiles, took 103 us tiled against 44 us on `gemv_tc2`; 256
/// rows of the MoE group, 84 tiles, 49 against 117). Session 16, with `gemv_tc2` in 32-row
/// slabs: 128 rows of that out-projection (64 tiles) took 140 us tiled against 39 us for 64
/// rows in slabs, and a 100-row prompt's first audio from nothing was 0.094 s at 64 tiles,
/// 0.079 at 128 and at 256 (NOTES.md, session 16 call 3).
pub const TT_MIN_BLOCKS: usize = 128;

/// The single-weight BF16 GEMV kernel that `rows` rows of K `k` into `outs` outputs run with
/// options `o` (`bf16_gemv`), and its launch grid: for the contract's dispatch and slab checks.
pub(crate) fn bf16_gemv_grid(
    o: &CudaOptions,
    rows: usize,
    k: usize,
    outs: usize,
) -> (&'static str, (u32, u32, u32)) {
    let gv = bf16_gemv(o, rows, k, outs);
    let g = gv
        .grid("gemv", outs.div_ceil(gv.per_block), rows)
        .unwrap_or((0, 0, 0));
    (gv.single, g)
}

/// A several-weight launch's outputs as the kernel choice counts them: each weight's in 64-wide
/// tiles, so `bf16_gemv`'s tile count is the sum of the weights' tiles.
pub(crate) fn tiled_outputs(outs: impl IntoIterator<Item = usize>) -> usize {
    outs.into_iter().map(|n| n.div_ceil(64) * 64).sum()
}

/// The several-weight BF16 GEMV kernel that `rows` rows of K `k` into `outs` outputs in all (64
/// a weight's tile, as `linear_many` counts them) run with options `o`: for the contract.
pub(crate) fn bf16_gemv_multi(o: &CudaOptions, rows: usize, k: usize, outs: usize) -> &'static str {
    bf16_gemv(o, rows, k, outs).multi
}

/// The BF16 GEMV kernels for `rows` rows of K `k` into `outs` outputs in all (the weights of one
/// launch together).
fn bf16_gemv(o: &CudaOptions, rows: usize, k: usize, outs: usize) -> Bf16Gemv {
    if o.tc_gemv && k >= 32 && k.is_multiple_of(32) && k <= 8192 {
        // DRAMATIS_CUDA_GEMV_KC=0: session 7's gemv_tc arithmetic, 512 keys per warp in 32-key
        // steps (the kernel it was is this one with those settings, the same bits)
        let (v, kc) = if o.gemv_kc == 0 {
            (1, 512)
        } else {
            // layout 2 takes 64 keys a step
            let v = if o.gemv_v == 2 && k.is_multiple_of(64) {
                2
            } else {
                1
            };
            (v, gemv_tc2_keys(o.gemv_kc, v, k))
        };
        let (single, multi, silu, sigm) = match (rows <= 8, v) {
            (true, 1) => (
                "gemv_tc2_g1_v1",
                "gemv_tc2_multi_g1_v1",
                "gemv_tc2_silu_g1_v1",
                "gemv_tc2_sigm_g1_v1",
            ),
            (false, 1) => (
                "gemv_tc2_g4_v1",
                "gemv_tc2_multi_g4_v1",
                "gemv_tc2_silu_g4_v1",
                "gemv_tc2_sigm_g4_v1",
            ),
            (true, _) => (
                "gemv_tc2_g1_v2",
                "gemv_tc2_multi_g1_v2",
                "gemv_tc2_silu_g1_v2",
                "gemv_tc2_sigm_g1_v2",
            ),
            (false, _) => (
                "gemv_tc2_g4_v2",
                "gemv_tc2_multi_g4_v2",
                "gemv_tc2_silu_g4_v2",
                "gemv_tc2_sigm_g4_v2",
            ),
        };
        if v == 2
            && rows >= o.gemv_tile_min
            && outs.div_ceil(64) * rows.div_ceil(64) >= o.gemv_tile_blocks
        {
            if o.gemv_walk {
                // the same bits from 64 x 32 tiles walking K (gemv.cu `gemv_tw`)
                return Bf16Gemv {
                    single: "gemv_tw",
                    multi: "gemv_tw_multi",
                    per_block: 64,
                    block: 128,
                    kc: Some(kc as i32),
                    act: Some(("gemv_tw_silu", "gemv_tw_sigm")),
                    row_tile: Some(GEMV_TS_ROWS),
                    row_slabs: false,
                    split: None,
                };
            }
            // gemv_tc2 (V = 2)'s bits from 64 x 64 tiles
            return Bf16Gemv {
                single: "gemv_tt",
                multi: "gemv_tt_multi",
                per_block: 64,
                block: 256,
                kc: Some(kc as i32),
                act: Some(("gemv_tt_silu", "gemv_tt_sigm")),
                row_tile: Some(64),
                row_slabs: false,
                split: None,
            };
        }
        let chunks = k.div_ceil(kc);
        // gemv_ts walks 64-key steps and never checks: whole steps a chunk, the host's chunks
        if v == 2
            && kc.is_multiple_of(64)
            && rows >= o.gemv_split_min
            && rows <= GEMV_TS_MAX_ROWS
            && chunks <= GEMV_TS_MAX_CHUNKS
            && outs.div_ceil(64) * rows.div_ceil(GEMV_TS_ROWS) <= GEMV_TS_TILES
            && outs.div_ceil(64) * rows.div_ceil(GEMV_TS_ROWS) * chunks >= o.gemv_split_blocks
        {
            // gemv_tc2 (V = 2)'s bits from 64 x 32 tiles, a key chunk a block
            return Bf16Gemv {
                single: "gemv_ts",
                multi: "gemv_ts_multi",
                per_block: 64,
                block: 128,
                kc: Some(kc as i32),
                act: Some(("gemv_ts_silu", "gemv_ts_sigm")),
                row_tile: Some(GEMV_TS_ROWS),
                row_slabs: false,
                split: Some(chunks),
            };
        }
        let warps = match if rows <= 8 {
            o.gemv_warps
        } else {
            o.gemv_warps_many
        } {
            0 => chunks,
            w => w.min(chunks),
        };
        Bf16Gemv {
            single,
            multi,
            per_block: 16,
            block: (32 * warps) as u32,
            kc: Some(kc as i32),
            act: Some((silu, sigm)),
            row_tile: None,
            row_slabs: o.gemv_slabs,
            split: None,
        }
    } else if rows >= GEMV_WIDE_ROWS {
        Bf16Gemv {
            single: "gemv_bf16_w4",
            multi: "gemv_bf16_multi_w4",
            per_block: 32,
            block: 256,
            kc: None,
            act: None,
            row_tile: None,
            row_slabs: false,
            split: None,
        }
    } else {
        Bf16Gemv {
            single: "gemv_bf16",
            multi: "gemv_bf16_multi",
            per_block: 8,
            block: 256,
            kc: None,
            act: None,
            row_tile: None,
            row_slabs: false,
            split: None,
        }
    }
}

/// A `DRAMATIS_CUDA_SKIP` entry `RxC` (e.g. `8192x2048`): the GEMVs of `R x C` weights (a
/// linear op's first weight, for one launching several), packed as `CudaBackend::shape` holds
/// it; `None` for a kernel-name entry.
fn skip_shape(entry: &str) -> Option<u64> {
    let (r, c) = entry.split_once('x')?;
    let (r, c) = (r.parse::<u32>().ok()?, c.parse::<u32>().ok()?);
    Some((u64::from(r) << 32) | u64::from(c))
}

/// Restores `CudaBackend::shape` when a linear op ends (ops nest: the fallback of a fused op
/// runs `linear` inside it).
struct ShapeGuard<'a> {
    cell: &'a std::sync::atomic::AtomicU64,
    was: u64,
}

impl Drop for ShapeGuard<'_> {
    fn drop(&mut self) {
        self.cell
            .store(self.was, std::sync::atomic::Ordering::Relaxed);
    }
}

macro_rules! go {
    ($be:expr, $src:expr, $name:expr, $grid:expr, $block:expr, $smem:expr; $($arg:expr),* $(,)?) => {{
        let f = $be.gpu.func($src, $be.variant, $name).map_err(dev)?;
        if !$be.skipped($name) {
            let stream = $be.launch_stream()?;
            $be.prof.launches.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let grid: (u32, u32, u32) = $grid;
            if grid.1 as usize > MAX_GRID_Y || grid.2 as usize > MAX_GRID_Y || grid.0 == 0 {
                return Err(dev(format!("{}: grid {:?} outside the device limits", $name, grid)));
            }
            let cfg = LaunchConfig {
                grid_dim: grid,
                block_dim: ($block, 1, 1),
                shared_mem_bytes: $smem,
            };
            if $be.pdl {
                // SAFETY: as below; each parameter is passed as a pointer to its value, as the
                // launch builder does. One statement, so argument temporaries outlive the launch.
                unsafe {
                    launch_pdl(&f, stream, &cfg,
                        &mut [$( $arg as *const _ as *mut std::ffi::c_void ),*])
                }
                .map_err(dev)?;
            } else {
                // SAFETY: the arguments match the kernel's C signature in kernels/*.cu in type and
                // order, and the calling op checked every extent the kernel touches against the
                // allocations behind the pointers. One statement, so argument temporaries outlive it.
                unsafe { stream.launch_builder(&f)$(.arg($arg))*.launch(cfg) }.map_err(dev)?;
            }
        }
    }};
}

/// A launch that lets the kernel start while the one ahead of it on the stream drains
/// (programmatic stream serialisation; `runtime::pdl_enabled`). Every kernel opens with
/// `griddepcontrol.wait` in such builds, so none touches memory before its predecessor is done.
///
/// # Safety
/// `params` holds one pointer per kernel parameter, in order, each to a live value of the
/// parameter's C type; the extents the kernel touches lie inside the allocations passed.
unsafe fn launch_pdl(
    f: &cudarc::driver::CudaFunction,
    stream: &cudarc::driver::CudaStream,
    cfg: &LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
) -> Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    stream.context().bind_to_thread()?;
    // SAFETY: a zeroed attribute is a valid C value; its id and union member are set below.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    // SAFETY: `lc` and `attr` live across the call; the caller vouches for `params`.
    unsafe {
        sys::cuLaunchKernelEx(
            &lc,
            f.cu_function(),
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
}

impl CudaBackend {
    /// Opens device 0 with options from the environment; a clear error without a driver.
    pub fn new() -> Result<Self, CudaError> {
        let gpu = Arc::new(Gpu::with_priority(
            0,
            crate::runtime::StreamPriority::Model,
        )?);
        let mut be = Self::with_gpu(gpu, Variant::Exact, CudaOptions::from_env());
        if let Ok(v) = std::env::var("DRAMATIS_CUDA_SKIP") {
            be.skip = v
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
            if !be.skip.is_empty() {
                tracing::warn!(
                    "DRAMATIS_CUDA_SKIP: kernels {:?} are left out of recorded frame rounds \
                     (a timing tool: the rounds' output is wrong)",
                    be.skip
                );
            }
        }
        Ok(be)
    }

    /// A backend over an opened device running the given kernel builds (the contract uses the
    /// low-precision and planted builds).
    pub fn with_gpu(gpu: Arc<Gpu>, variant: Variant, opts: CudaOptions) -> Self {
        keep_pool_memory(&gpu);
        // a dependent launch is safe only for kernels built with the wait at their top, which
        // runtime::compile_options decides by the same call
        let pdl = crate::runtime::pdl_for(&gpu.arch);
        let prof = Prof::new(&gpu.stream);
        let mut be = CudaBackend {
            gpu,
            variant,
            kv_f32: std::sync::atomic::AtomicBool::new(opts.kv_f32),
            opts,
            pdl,
            expert_tables: Mutex::new(Vec::new()),
            expert_keys: Mutex::new(std::collections::HashMap::new()),
            err: None,
            decode_count: None,
            gemv_count: None,
            small: Arc::new(SmallPool::new()),
            recording: Mutex::new(None),
            masks: Mutex::new(std::collections::HashMap::new()),
            lt: Mutex::new(None),
            prof,
            skip: Vec::new(),
            shape: std::sync::atomic::AtomicU64::new(0),
            aside_stream: std::sync::OnceLock::new(),
            aside: Mutex::new(AsideState::default()),
            aside_on: std::sync::atomic::AtomicBool::new(opts.aside),
        };
        // without it `route` refuses to run (it could not report a non-finite row)
        be.err = be.zeroed(4).ok();
        // one counter per (lane, block row): at most a block per query head
        be.decode_count = be
            .zeroed(4 * MAX_LANES * kernels::DECODE_MAX_KV_HEADS * kernels::DECODE_MAX_GROUP)
            .ok();
        be.gemv_count = be.zeroed(4 * 2 * GEMV_TS_TILES).ok();
        if be.gemv_count.is_none() {
            // no tickets: the split GEMVs cannot run, gemv_tc2 (the same bits) does
            be.opts.gemv_split_min = usize::MAX;
        }
        be
    }

    /// Whether `DRAMATIS_CUDA_SKIP` leaves this launch out: a named kernel while a frame round is
    /// recorded (`CudaBackend::skip`).
    fn skipped(&self, name: &str) -> bool {
        if self.skip.is_empty() || !self.is_recording() {
            return false;
        }
        let shape = self.shape.load(std::sync::atomic::Ordering::Relaxed);
        self.skip.iter().any(|p| {
            name.starts_with(p.as_str())
                || (name.starts_with("gemv") && skip_shape(p) == Some(shape) && shape != 0)
        })
    }

    /// Marks the linear op of weight `w` (its first weight, for several) as launching, for
    /// `DRAMATIS_CUDA_SKIP`'s shape entries, until the guard drops; nothing without the tool
    /// (the linear ops' usual path stays as it was).
    fn shape_guard(&self, w: &CudaWeight) -> Option<ShapeGuard<'_>> {
        if self.skip.is_empty() {
            return None;
        }
        let packed = ((w.rows() as u64) << 32) | (w.cols() as u64 & 0xffff_ffff);
        let was = self
            .shape
            .swap(packed, std::sync::atomic::Ordering::Relaxed);
        Some(ShapeGuard {
            cell: &self.shape,
            was,
        })
    }

    /// `out = x · Wᵀ` for a BF16 `W [n, k]` through cuBLASLt (`lt.rs`), in slices of rows so
    /// the split activations stay small; `false` (nothing launched) when cuBLASLt cannot be
    /// used here: not made (logged once), or while a frame round is being recorded.
    fn gemm_lt(&self, w: u64, x: &CudaBuf, out: &CudaBuf, n: usize, k: usize) -> BResult<bool> {
        /// Rows per slice: the BF16 halves of at most 8192 x 8192 activations, 256 MiB.
        const SLICE: usize = 8192;
        /// cuBLASLt's recommended workspace on Hopper.
        const WORKSPACE: usize = 32 << 20;
        if self.is_recording() {
            return Ok(false);
        }
        let mut lt = self.lt.lock().unwrap_or_else(|p| p.into_inner());
        if lt.is_none() {
            let made = self
                .alloc(WORKSPACE)
                .map_err(|e| e.to_string())
                .and_then(|ws| crate::lt::Lt::new(ws.ptr, WORKSPACE).map(|l| (l, ws)));
            if let Err(e) = &made {
                tracing::warn!("cuBLASLt unavailable, bulk linears use the tiled GEMM: {e}");
            }
            *lt = Some(made);
        }
        let Some(Ok((l, _ws))) = lt.as_ref() else {
            return Ok(false);
        };
        let op = "linear (cuBLASLt)";
        let _p = self.prof.guard("linear_lt");
        let slice = SLICE.min(x.rows);
        let halves = cmul(op, &[slice, k, 2])?;
        let (hi, lo) = (self.alloc(halves)?, self.alloc(halves)?);
        let mut r0 = 0;
        while r0 < x.rows {
            let rn = (x.rows - r0).min(slice);
            let len = cmul(op, &[rn, k])?;
            let len64 = i64v(op, len)?;
            let xp = x.row_ptr(r0)?;
            go!(self, Source::Gemm, "split_bf16", (u32v(op, len.div_ceil(256))?, 1, 1), 256, 0;
                &xp, &hi.ptr, &lo.ptr, &len64);
            let stream = self.issue_stream()?;
            // SAFETY: w holds [n, k] BF16 (the caller's weight), hi and lo [rn, k] BF16 (just
            // written), out rows r0.. [rn, n] f32; all stay live past the stream's matmuls (the
            // buffers return to the stream-ordered pool only after them).
            unsafe { l.gemm(w, hi.ptr, lo.ptr, out.row_ptr(r0)?, n, k, rn, stream) }
                .map_err(dev)?;
            r0 += rn;
        }
        Ok(true)
    }

    /// Whether cuBLASLt was made for bulk linears (`Err` with the reason, or "not used yet").
    pub fn lt_status(&self) -> std::result::Result<(), String> {
        match &*self.lt.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(e.clone()),
            None => Err("cuBLASLt not used yet".into()),
        }
    }

    fn err_ptr(&self) -> BResult<u64> {
        self.err
            .as_ref()
            .map(|m| m.ptr)
            .ok_or_else(|| dev("the device error flag could not be allocated"))
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn options(&self) -> CudaOptions {
        CudaOptions {
            kv_f32: self.kv_f32.load(std::sync::atomic::Ordering::Relaxed),
            ..self.opts
        }
    }

    /// Chooses the precision of KV caches created from now on (existing caches keep theirs).
    pub fn set_kv_f32(&self, f32: bool) {
        self.kv_f32.store(f32, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether side branches open from now on (starts at `opts.aside`; parity compares both).
    pub fn set_aside(&self, on: bool) {
        self.aside_on
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// (free, total) device memory in bytes.
    pub fn mem_info(&self) -> BResult<(usize, usize)> {
        self.gpu.ctx.mem_get_info().map_err(dev)
    }

    /// Kernel launches this backend has issued through its launch macro (the contract checks
    /// with it that a fused op ran as one launch, not as the composed ops).
    pub fn launch_count(&self) -> u64 {
        self.prof
            .launches
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits for every queued launch.
    pub fn synchronize(&self) -> BResult<()> {
        self.gpu.stream.synchronize().map_err(dev)
    }

    fn cu_stream(&self) -> cudarc::driver::sys::CUstream {
        self.gpu.stream.cu_stream()
    }

    /// The stream a launch goes to: the model's, or while a side branch is on
    /// (`Backend::aside_begin`), the branch's, made to wait first for the model stream's work
    /// so far (the branch's own allocations and copies included).
    fn launch_stream(&self) -> BResult<&CudaStream> {
        let mut a = self.aside.lock().unwrap_or_else(|p| p.into_inner());
        if !a.on {
            return Ok(&self.gpu.stream);
        }
        let s = self
            .aside_stream
            .get()
            .ok_or_else(|| dev("a side branch without its stream"))?;
        s.fork.record(&self.gpu.stream).map_err(dev)?;
        s.stream.wait(&s.fork).map_err(dev)?;
        a.launched = true;
        Ok(&s.stream)
    }

    /// The stream a copy or memset goes to: [`CudaBackend::launch_stream`]'s (so inside a side
    /// branch it is ordered with the branch's kernels on both sides).
    fn issue_stream(&self) -> BResult<cudarc::driver::sys::CUstream> {
        Ok(self.launch_stream()?.cu_stream())
    }

    /// Whether a side branch is open (begun and not joined yet).
    fn aside_open(&self) -> bool {
        self.aside.lock().unwrap_or_else(|p| p.into_inner()).open
    }

    fn alloc(&self, bytes: usize) -> BResult<Mem> {
        self.prof
            .allocs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let recording = self
            .recording
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(pool) = recording {
            // a recorded round's buffers: the graph's own, never shared with other work
            let class = SmallPool::class(bytes);
            let ptr = pool.take_or_alloc_raw(class)?;
            return Ok(Mem {
                owner: Owner::Pool(pool, class),
                ptr,
                bytes,
                id: next_mem_id(),
            });
        }
        // while a side branch is open every block comes from the pool, whose blocks handed
        // back are held until the join (a driver block would be freed in the model stream's
        // order, before the branch may be done with it)
        if bytes <= SMALL_MAX || self.aside_open() {
            let class = SmallPool::class(bytes);
            let ptr = match self.small.take(class) {
                Some(p) => p,
                None => {
                    // SAFETY: as below; the block lives in the pool's backing list until the
                    // backend is dropped.
                    let s: CudaSlice<u8> =
                        unsafe { self.gpu.stream.alloc(1usize << class) }.map_err(dev)?;
                    let p = s.device_ptr(&self.gpu.stream).0;
                    self.small
                        .backing
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push(s);
                    p
                }
            };
            return Ok(Mem {
                owner: Owner::Pool(self.small.clone(), class),
                ptr,
                bytes,
                id: next_mem_id(),
            });
        }
        self.alloc_exact(bytes)
    }

    /// `bytes` from the stream-ordered pool, uninitialised.
    fn alloc_exact(&self, bytes: usize) -> BResult<Mem> {
        // SAFETY: the memory is uninitialised; every user writes before it reads, or zeroes it.
        let s: CudaSlice<u8> = unsafe { self.gpu.stream.alloc(bytes.max(1)) }.map_err(dev)?;
        let ptr = s.device_ptr(&self.gpu.stream).0;
        Ok(Mem {
            ptr,
            owner: Owner::Driver(s),
            bytes,
            id: next_mem_id(),
        })
    }

    /// A zeroed allocation of exactly `bytes` from the stream-ordered pool, never from the
    /// small power-of-two pool: a lane's K/V and Gated DeltaNet state (most lanes' K/V are
    /// under the small pool's 4 MiB limit, where they would take twice their size and stay in
    /// its free lists after the lane ends, out of reach of larger lanes).
    fn zeroed_state(&self, bytes: usize) -> BResult<Mem> {
        if self.is_recording() {
            return Err(dev("lane state made inside a recorded frame round"));
        }
        self.prof
            .allocs
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let m = self.alloc_exact(bytes)?;
        // SAFETY: m covers `bytes` bytes.
        unsafe { cu::memset_d8_async(m.ptr, 0, bytes, self.issue_stream()?) }.map_err(dev)?;
        Ok(m)
    }

    fn zeroed(&self, bytes: usize) -> BResult<Mem> {
        let m = self.alloc(bytes)?;
        // SAFETY: m covers at least `bytes` bytes.
        unsafe { cu::memset_d8_async(m.ptr, 0, bytes, self.issue_stream()?) }.map_err(dev)?;
        Ok(m)
    }

    /// Whether launches are being recorded into a round's graph.
    fn is_recording(&self) -> bool {
        self.recording
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn htod<T: Copy>(&self, v: &[T]) -> BResult<Mem> {
        if self.is_recording() {
            // a replay would copy from host memory that is gone by then
            return Err(dev("an upload inside a recorded frame round"));
        }
        let bytes = std::mem::size_of_val(v);
        let m = self.alloc(bytes)?;
        if bytes > 0 {
            // SAFETY: m holds `bytes` bytes; pageable host memory is staged before the call
            // returns, so `v` may be dropped afterwards.
            unsafe { cu::memcpy_htod_async(m.ptr, v, self.issue_stream()?) }.map_err(dev)?;
        }
        Ok(m)
    }

    fn dtoh<T: Copy + Default>(&self, ptr: u64, n: usize) -> BResult<Vec<T>> {
        if self.is_recording() {
            return Err(dev("a download inside a recorded frame round"));
        }
        if self.aside.lock().unwrap_or_else(|p| p.into_inner()).on {
            // it would wait for the model stream, not for the branch's work
            return Err(dev("a download inside a side branch"));
        }
        let mut out = vec![T::default(); n];
        let mut flag = [0i32; 1];
        self.gpu.ctx.bind_to_thread().map_err(dev)?;
        if n > 0 {
            // SAFETY: the caller passes a device range of n elements of T; the copy completes
            // before `out` is read, by the synchronisation below.
            unsafe { cu::memcpy_dtoh_async(&mut out, ptr, self.cu_stream()) }.map_err(dev)?;
        }
        if let Some(e) = &self.err {
            // SAFETY: the flag allocation holds one i32; the copy completes at the sync below.
            unsafe { cu::memcpy_dtoh_async(&mut flag, e.ptr, self.cu_stream()) }.map_err(dev)?;
        }
        self.synchronize()?;
        if flag[0] != 0 {
            if let Some(e) = &self.err {
                // SAFETY: the flag allocation holds 4 bytes.
                unsafe { cu::memset_d8_async(e.ptr, 0, 4, self.cu_stream()) }.map_err(dev)?;
            }
            return Err(BackendError::NonFinite {
                op: if flag[0] & 3 == 0 {
                    "round_embed"
                } else {
                    "route"
                },
                why: if flag[0] & 1 != 0 {
                    "a router row had every kept logit NaN or -inf; the hidden state feeding \
                     the router is not finite"
                        .into()
                } else if flag[0] & 2 != 0 {
                    "a routing named a pruned or out-of-range expert".into()
                } else {
                    "a frame round embedded a code outside its table (a drawn code past the \
                     table's rows)"
                        .into()
                },
            });
        }
        Ok(out)
    }

    fn dtod(&self, dst: u64, src: u64, bytes: usize) -> BResult<()> {
        self.gpu.ctx.bind_to_thread().map_err(dev)?;
        if bytes > 0 {
            // SAFETY: the callers checked that both ranges lie inside their allocations.
            unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.issue_stream()?) }.map_err(dev)?;
        }
        Ok(())
    }

    fn buf(&self, rows: usize, cols: usize) -> BResult<CudaBuf> {
        let mem = self.alloc(cmul("buffer", &[rows, cols, 4])?)?;
        Ok(CudaBuf { rows, cols, mem })
    }

    /// A BF16 matrix from host bits (contract and tests).
    pub fn weight_bf16(&self, rows: usize, cols: usize, bits: &[u16]) -> BResult<CudaWeight> {
        if cmul("weight", &[rows, cols])? != bits.len() {
            return Err(shape_err(
                "weight_bf16",
                format!("{} values for [{rows}, {cols}]", bits.len()),
            ));
        }
        Ok(CudaWeight::Bf16 {
            mem: self.htod(bits)?,
            rows,
            cols,
        })
    }

    /// An FP8 matrix from host bytes and its block scales (contract and tests).
    pub fn weight_fp8(
        &self,
        rows: usize,
        cols: usize,
        q: &[u8],
        scale: &[f32],
    ) -> BResult<CudaWeight> {
        let want = cmul(
            "scales",
            &[rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)],
        )?;
        if cmul("weight", &[rows, cols])? != q.len() || scale.len() != want {
            return Err(shape_err(
                "weight_fp8",
                format!(
                    "{} bytes and {} scales for [{rows}, {cols}]",
                    q.len(),
                    scale.len()
                ),
            ));
        }
        Ok(CudaWeight::Fp8 {
            mem: self.htod(q)?,
            scale: self.htod(scale)?,
            rows,
            cols,
        })
    }

    /// An NVFP4 matrix `[rows, cols]` from its stored parts (contract and tests): `codes`
    /// `[rows, cols/2]`, E4M3 `scales` `[rows, cols/16]`, the f32 `global`.
    pub fn weight_nvfp4(
        &self,
        rows: usize,
        cols: usize,
        codes: &[u8],
        scales: &[u8],
        global: f32,
    ) -> BResult<CudaWeight> {
        if !cols.is_multiple_of(NVFP4_GROUP)
            || cmul("weight", &[rows, cols / 2])? != codes.len()
            || cmul("scales", &[rows, cols / NVFP4_GROUP])? != scales.len()
        {
            return Err(shape_err(
                "weight_nvfp4",
                format!(
                    "{} code bytes and {} scales for [{rows}, {cols}] (cols a multiple of {NVFP4_GROUP})",
                    codes.len(),
                    scales.len()
                ),
            ));
        }
        let mut s = Vec::with_capacity(NVFP4_SCALE_AT + scales.len());
        s.extend_from_slice(&global.to_le_bytes());
        s.resize(NVFP4_SCALE_AT, 0);
        s.extend_from_slice(scales);
        Ok(CudaWeight::Nvfp4 {
            mem: self.htod(codes)?,
            scale: self.htod(&s)?,
            global,
            rows,
            cols,
        })
    }

    /// A small f32 vector from the host (contract and tests).
    pub fn vector_f32(&self, v: &[f32]) -> BResult<CudaVector> {
        Ok(CudaVector {
            mem: self.htod(v)?,
            len: v.len(),
        })
    }

    /// Downloads a KV cache's first `len` rows as f32 `[kv_heads, len, head_dim]` per K and V.
    pub fn kv_download(&self, kv: &CudaKv) -> BResult<(Vec<f32>, Vec<f32>)> {
        let n = cmul("kv", &[kv.kv_heads, kv.capacity, kv.head_dim])?;
        let grab = |m: &Mem| -> BResult<Vec<f32>> {
            let all: Vec<f32> = if kv.f32 {
                self.dtoh::<f32>(m.ptr, n)?
            } else {
                self.dtoh::<u16>(m.ptr, n)?
                    .into_iter()
                    .map(|b| f32::from_bits(u32::from(b) << 16))
                    .collect()
            };
            let mut out = Vec::with_capacity(kv.kv_heads * kv.len * kv.head_dim);
            for h in 0..kv.kv_heads {
                let s = h * kv.capacity * kv.head_dim;
                out.extend_from_slice(&all[s..s + kv.len * kv.head_dim]);
            }
            Ok(out)
        };
        Ok((grab(&kv.k)?, grab(&kv.v)?))
    }

    /// Downloads a GDN state: (conv history, S).
    pub fn gdn_download(&self, g: &CudaGdn) -> BResult<(Vec<f32>, Vec<f32>)> {
        Ok((
            self.dtoh(g.conv.ptr, g.conv.bytes / 4)?,
            self.dtoh(g.s.ptr, g.s.bytes / 4)?,
        ))
    }

    fn elementwise(&self, a: &CudaBuf, b: &CudaBuf, op: i32) -> BResult<CudaBuf> {
        let out = self.buf(a.rows, a.cols)?;
        let n = a.rows * a.cols;
        if n == 0 {
            return Ok(out);
        }
        let (nn, cols, bcols) = (
            i64v("elementwise", n)?,
            i32v("elementwise", a.cols)?,
            i32v("elementwise", b.cols)?,
        );
        go!(self, Source::Ops, "elementwise", stride_grid(n), 256, 0;
            &a.ptr(), &b.ptr(), &out.ptr(), &nn, &cols, &bcols, &op);
        Ok(out)
    }

    /// The device table of one layer's experts, found by [`ExpertKey`] or built.
    fn expert_table(&self, experts: &[Option<Expert<CudaWeight>>]) -> BResult<TableRef> {
        let key: ExpertKey = experts
            .iter()
            .flat_map(|e| match e {
                Some(e) => [e.gate.id(), e.up.id(), e.down.id()],
                None => [0; 3],
            })
            .collect();
        if let Some(t) = self
            .expert_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(*t);
        }
        let t = self.build_expert_table(experts)?;
        self.expert_keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, t);
        Ok(t)
    }

    /// The device table of one layer's experts, uploaded on first use and reused after. Every
    /// kept expert must have the same format (FP8 or NVFP4) and shapes.
    fn build_expert_table(&self, experts: &[Option<Expert<CudaWeight>>]) -> BResult<TableRef> {
        let op = "moe_experts";
        let nvfp4 = match experts.iter().flatten().next() {
            Some(ex) => matches!(ex.gate, CudaWeight::Nvfp4 { .. }),
            None => return Err(shape_err(op, "every expert is pruned".into())),
        };
        let per = if nvfp4 { TAB_NVFP4 } else { TAB_FP8 };
        let mut host = Vec::with_capacity(experts.len() * per);
        let mut dims: Option<(usize, usize)> = None;
        for (e, ex) in experts.iter().enumerate() {
            let Some(ex) = ex else {
                host.resize(host.len() + per, 0u64);
                continue;
            };
            // (codes, scales, global address or 0, rows, cols)
            let parts = |w: &CudaWeight| match (w, nvfp4) {
                (
                    CudaWeight::Fp8 {
                        mem,
                        scale,
                        rows,
                        cols,
                    },
                    false,
                ) => Ok((mem.ptr, scale.ptr, 0, *rows, *cols)),
                (
                    CudaWeight::Nvfp4 {
                        mem,
                        scale,
                        rows,
                        cols,
                        ..
                    },
                    true,
                ) => Ok((mem.ptr, scale.at(NVFP4_SCALE_AT)?, scale.ptr, *rows, *cols)),
                (w, _) => Err(shape_err(
                    op,
                    format!(
                        "expert {e} is {}; the CUDA experts kernels read FP8 block-scaled or NVFP4 \
                         weights, one format per layer ({} here)",
                        w.format_name(),
                        if nvfp4 { "NVFP4" } else { "FP8" }
                    ),
                )),
            };
            let (g, gs, gg, i, h) = parts(&ex.gate)?;
            let (u, us, ug, ui, uh) = parts(&ex.up)?;
            let (d, ds, dg, dh, di) = parts(&ex.down)?;
            if (ui, uh) != (i, h) || (dh, di) != (h, i) {
                return Err(shape_err(
                    op,
                    format!("expert {e}: gate [{i}, {h}], up [{ui}, {uh}], down [{dh}, {di}]"),
                ));
            }
            let align = if nvfp4 { NVFP4_GROUP } else { 16 };
            if !i.is_multiple_of(align) || !h.is_multiple_of(align) {
                return Err(shape_err(
                    op,
                    format!("expert {e}: I {i} and H {h} must be multiples of {align}"),
                ));
            }
            match dims {
                None => dims = Some((i, h)),
                Some(d0) if d0 != (i, h) => {
                    return Err(shape_err(
                        op,
                        format!("expert {e} is [{i}, {h}], the first kept expert is {d0:?}"),
                    ))
                }
                _ => {}
            }
            host.extend([g, u, d, gs, us, ds]);
            if nvfp4 {
                host.extend([gg, ug, dg]);
            }
        }
        let (i, h) = dims.ok_or_else(|| shape_err(op, "every expert is pruned".into()))?;
        let mut tabs = self.expert_tables.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = tabs.iter().find(|t| t.nvfp4 == nvfp4 && t.host == host) {
            return Ok(TableRef {
                ptr: t.dev.ptr,
                i,
                h,
                nvfp4,
            });
        }
        let dev_tab = self.htod(&host)?;
        let ptr = dev_tab.ptr;
        // Tables live as long as the backend: a recorded round holds their addresses. There is
        // one per layer's expert list (a few KiB each).
        tabs.push(ExpertTable {
            nvfp4,
            host,
            dev: dev_tab,
        });
        Ok(TableRef { ptr, i, h, nvfp4 })
    }

    /// Appends `t` rows per lane (`k`, `v` `[lanes·t, kv_heads·hd]`, starting at row `row0`) to
    /// the caches, then attends causally; returns nothing, writes `out` rows from `row0`.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        d: &AttnDims,
        caches: &mut [&mut CudaKv],
        t: usize,
        row0: usize,
        out: &CudaBuf,
        dev_lens: Option<u64>,
    ) -> BResult<()> {
        let lanes = caches.len();
        let (nh, nkv, hd) = (d.q_heads, d.kv_heads, d.head_dim);
        // the largest capacity plans the grids; each lane's own is in the table
        let cap = caches.iter().map(|c| c.capacity).max().unwrap_or(0);
        let f32kv = caches[0].f32;
        let mut tab = kv_table(caches, nkv, hd, |_| t)?;
        if let Some(p) = dev_lens {
            // a round's counters (the host lengths, checked equal by the caller, are noted
            // after the round): the same kernels, lengths read on the device
            tab.lenp = p;
            tab.lstride = LANE_IN_WORDS as i64;
        }
        let (t32, nh32, nkv32, hd32) = (
            i32v("attention", t)?,
            i32v("attention", nh)?,
            i32v("attention", nkv)?,
            i32v("attention", hd)?,
        );
        let cap64 = i64v("attention", cap)?;
        let (kp, vp) = (k.row_ptr(row0)?, v.row_ptr(row0)?);
        let (qp, op) = (q.row_ptr(row0)?, out.row_ptr(row0)?);
        let grid_app = (u32v("kv append", t * nkv)?, u32v("kv append", lanes)?, 1);
        let app = if f32kv {
            "kv_append_f32"
        } else {
            "kv_append_bf16"
        };
        go!(self, Source::Ops, app, grid_app, 128, 0; &tab, &kp, &vp, &t32, &nkv32, &hd32, &cap64);
        // check::attn (in every caller) already made the heads whole groups of the kv heads
        // a round's one row per lane takes the decode kernels (its lengths are on the device)
        let flash = dev_lens.is_none() && self.prefill_flash(t, hd);
        if flash {
            self.attend_flash(&tab, qp, op, d, lanes, t, cap, f32kv)?;
            for c in caches.iter_mut() {
                c.len += t;
            }
            return Ok(());
        }
        let longest = caches.iter().map(|c| c.len + t).max().unwrap_or(0);
        let counters = self.decode_counters().unwrap_or(0);
        // A round's lengths grow at each replay: it always splits (the default threshold, 1).
        let split = t == 1
            && (longest >= self.opts.split_min_keys || dev_lens.is_some())
            && kernels::decode_fits(nh, nkv, hd)
            && counters != 0;
        let planted = self.variant == Variant::Planted;
        if split {
            // the new rows are in the caches now: each lane sees len + 1 keys
            let mut seen = tab;
            seen.ladd = 1;
            for (i, c) in caches.iter().enumerate() {
                seen.len[i] = i64v("attention", c.len + 1)?;
            }
            // a round's grid covers any length up to the capacity (chunks past a lane's
            // length add exactly nothing)
            let nchunks = match dev_lens {
                Some(_) => kernels::decode_chunks_upto(cap, planted),
                None => kernels::decode_chunks(caches.iter().map(|c| c.len + 1), planted),
            };
            self.attend_decode(&seen, lanes, qp, op, d, cap, f32kv, counters, nchunks)?;
        } else {
            let scale = 1.0f32 / (hd as f32).sqrt();
            let grid = (u32v("attention", t * nh)?, u32v("attention", lanes)?, 1);
            let name = if f32kv {
                "attn_generic_f32"
            } else {
                "attn_generic_bf16"
            };
            let smem = u32v("attention", hd * 4)?;
            go!(self, Source::Ops, name, grid, 128, smem;
                &tab, &qp, &op, &t32, &nh32, &nkv32, &hd32, &cap64, &scale);
        }
        if dev_lens.is_none() {
            for c in caches.iter_mut() {
                c.len += t;
            }
        }
        Ok(())
    }

    /// Scratch for grouping up to `max_slots` slots of `e` experts by expert: counts [E],
    /// offsets [E + 1], tiles [E + 1], cursor [E] and the slot order.
    fn slot_groups(&self, e: usize, max_slots: usize) -> BResult<SlotGroups> {
        let op = "moe_experts";
        let ints = self.alloc(cmul(op, &[4 * e + 2, 4])?)?;
        let counts = ints.ptr;
        let offsets = counts + 4 * e as u64;
        let tiles = offsets + 4 * (e as u64 + 1);
        let cursor = tiles + 4 * (e as u64 + 1);
        let order = self.alloc(cmul(op, &[max_slots, 4])?)?;
        Ok(SlotGroups {
            _ints: ints,
            counts,
            offsets,
            tiles,
            cursor,
            order,
        })
    }

    /// Lists `n_slots` slots (routed ids at `ids`) per expert in `g`: counts, offsets and tile
    /// starts of `tm` slots a tile (moe_group_count / scan / fill); a slot naming an expert
    /// without weights is left out and sets the error flag.
    fn group_slots(
        &self,
        g: &SlotGroups,
        ids: u64,
        tab: u64,
        n_slots: usize,
        e: usize,
        tm: usize,
    ) -> BResult<()> {
        let op = "moe_experts";
        let (s32, e32, tm32, ep) = (
            i32v(op, n_slots)?,
            i32v(op, e)?,
            i32v(op, tm)?,
            self.err_ptr()?,
        );
        let (counts, offsets, tiles, cursor) = (g.counts, g.offsets, g.tiles, g.cursor);
        // SAFETY: `counts` is E i32 of the group scratch, zeroed here.
        unsafe { cu::memset_d8_async(counts, 0, 4 * e, self.issue_stream()?) }.map_err(dev)?;
        let sg = (u32v(op, n_slots.div_ceil(256))?, 1, 1);
        go!(self, Source::Gemm, "moe_group_count", sg, 256, 0;
            &ids, &tab, &counts, &s32, &e32, &ep);
        go!(self, Source::Gemm, "moe_group_scan", (1, 1, 1), 256, 0;
            &counts, &offsets, &tiles, &cursor, &e32, &tm32);
        go!(self, Source::Gemm, "moe_group_fill", sg, 256, 0;
            &ids, &tab, &offsets, &cursor, &g.order.ptr, &s32, &e32);
        Ok(())
    }

    /// The routed FP8 experts of many rows grouped by expert: slots (row, rank) are counted and
    /// listed per expert on the device (gemm.cu), each expert's slots run together, and each
    /// row sums its experts in rank order. `slots`: as SR-slot groups with the per-row kernels'
    /// arithmetic (moe.cu `moe_slots_*`, the same bits as `moe_*_tab`, each weight row read
    /// once per group instead of once per slot); otherwise as 64-row GEMM tiles (gate/up with
    /// SiLU-mul, then down). Rows go 4096 at a time, which bounds the two slot buffers
    /// (`[4096·k, I]`, `[4096·k, H]`).
    #[allow(clippy::too_many_arguments)]
    fn experts_grouped(
        &self,
        x: &CudaBuf,
        route: &CudaRoute,
        tab: u64,
        e: usize,
        i: usize,
        h: usize,
        y: &CudaBuf,
        slots: bool,
    ) -> BResult<()> {
        let op = "moe_experts";
        let k = route.k;
        let (e32, i32_, h32, k32) = (i32v(op, e)?, i32v(op, i)?, i32v(op, h)?, i32v(op, k)?);
        // (source, gate/up, down, slots a tile, outputs a block)
        let (src, gate_up, down, tm, per_block) = if slots {
            (
                Source::Moe,
                "moe_slots_gate_up",
                "moe_slots_down",
                SLOTS_TILE,
                8 * SLOTS_PER_WARP,
            )
        } else if self.opts.tc_bulk && i.is_multiple_of(32) && h.is_multiple_of(32) {
            // the tensor-core tiles take both depths (H, I) in 32-key steps
            (
                Source::Gemm,
                "moe_group_gate_up_tc",
                "moe_group_down_tc",
                64,
                64,
            )
        } else {
            (Source::Gemm, "moe_group_gate_up", "moe_group_down", 64, 64)
        };
        self.grouped_passes(x, route, tab, e, i, h, y, tm, |p| {
            let (tab, order, offsets, tiles) = (tab, p.order, p.offsets, p.tiles);
            let (xp, hbuf, obuf) = (p.xp, p.hbuf, p.obuf);
            // at most ceil(slots / tm) + min(E, slots) tiles; blocks past the count exit
            let tile_bound = u32v(op, p.bound)?;
            go!(self, src, gate_up, (u32v(op, i.div_ceil(per_block))?, tile_bound, 1), 256, 0;
                &tab, &xp, &order, &offsets, &tiles, &hbuf, &i32_, &h32, &k32, &e32);
            go!(self, src, down, (u32v(op, h.div_ceil(per_block))?, tile_bound, 1), 256, 0;
                &tab, &hbuf, &order, &offsets, &tiles, &obuf, &i32_, &h32, &e32);
            Ok(())
        })
    }

    /// The passes of grouped experts (`experts_grouped`, `experts_tc`): rows go `group_chunk`
    /// at a time; each pass lists its slots per expert in `tm`-slot tiles (`group_slots`),
    /// `mid` launches the gate/up and down projections from `x` into the pass's per-slot
    /// output buffer, and `moe_group_combine` sums each row's experts in rank order into `y`.
    #[allow(clippy::too_many_arguments)]
    fn grouped_passes(
        &self,
        x: &CudaBuf,
        route: &CudaRoute,
        tab: u64,
        e: usize,
        i: usize,
        h: usize,
        y: &CudaBuf,
        tm: usize,
        mut mid: impl FnMut(&GroupPass) -> BResult<()>,
    ) -> BResult<()> {
        let op = "moe_experts";
        let k = route.k;
        let (e32, h32, k32) = (i32v(op, e)?, i32v(op, h)?, i32v(op, k)?);
        let chunk = group_chunk(x.rows, e, tm, k);
        let max_slots = chunk * k;
        let g = self.slot_groups(e, max_slots)?;
        let hbuf = self.alloc(cmul(op, &[max_slots, i, 4])?)?;
        let obuf = self.alloc(cmul(op, &[max_slots, h, 4])?)?;
        let mut r0 = 0;
        while r0 < x.rows {
            let rn = (x.rows - r0).min(chunk);
            let n_slots = rn * k;
            let ids = route.ids.at(r0 * k * 4)?;
            let wts = route.wts.at(r0 * k * 4)?;
            let yp = y.row_ptr(r0)?;
            self.group_slots(&g, ids, tab, n_slots, e, tm)?;
            mid(&GroupPass {
                ids,
                xp: x.row_ptr(r0)?,
                order: g.order.ptr,
                offsets: g.offsets,
                tiles: g.tiles,
                hbuf: hbuf.ptr,
                obuf: obuf.ptr,
                bound: n_slots.div_ceil(tm) + e.min(n_slots),
            })?;
            let rows64 = i64v(op, rn)?;
            go!(self, Source::Gemm, "moe_group_combine", stride_grid(rn * h), 256, 0;
                &ids, &tab, &wts, &obuf.ptr, &yp, &rows64, &h32, &k32, &e32);
            r0 += rn;
        }
        Ok(())
    }

    /// The routed FP8 experts on tensor cores (moe.cu `moe_tc_*`), one arithmetic at every
    /// row count. Direct (`grouped` false): one slot a tile, gate/up then the down projection
    /// with each row's rank-ordered sum in one launch: two launches, for few rows whose slots
    /// seldom share an expert. Grouped: slots counted and listed per expert on the device
    /// (gemm.cu), up to 8 of one expert a tile so each weight is read once per tile, then the
    /// per-slot down projection and the rank-ordered sum (`moe_group_combine`). Both give the
    /// same bits (an MMA's columns are independent). Rows go 4096 at a time in the grouped
    /// form (the slot buffers) and `MAX_GRID_Y / k` at a time in the direct one.
    #[allow(clippy::too_many_arguments)]
    fn experts_tc(
        &self,
        x: &CudaBuf,
        route: &CudaRoute,
        tab: u64,
        e: usize,
        i: usize,
        h: usize,
        y: &CudaBuf,
        grouped: bool,
    ) -> BResult<()> {
        let op = "moe_experts";
        let k = route.k;
        let (e32, i32_, h32, k32) = (i32v(op, e)?, i32v(op, i)?, i32v(op, h)?, i32v(op, k)?);
        let ep = self.err_ptr()?;
        let block = |kb: usize, most: usize| u32v(op, 32 * kb.clamp(1, most));
        let (gu_block, dn_block) = tc_expert_blocks(self.opts.moe_tc_warps, i, h);
        let (gu_block, dn_block) = (u32v(op, gu_block)?, u32v(op, dn_block)?);
        let (gx, dx) = (u32v(op, i / 16)?, u32v(op, h / 16)?);
        let gate_up = if self.opts.moe_tc_prefetch {
            "moe_tc_gate_up_pf"
        } else {
            "moe_tc_gate_up"
        };
        if !grouped {
            let null = 0u64;
            let chunk = (MAX_GRID_Y / k.max(1)).max(1);
            let hw = self.alloc(cmul(op, &[x.rows.min(chunk), k, i, 4])?)?;
            let mut r0 = 0;
            while r0 < x.rows {
                let rn = (x.rows - r0).min(chunk);
                let ids = route.ids.at(r0 * k * 4)?;
                let wts = route.wts.at(r0 * k * 4)?;
                let (xp, yp) = (x.row_ptr(r0)?, y.row_ptr(r0)?);
                go!(self, Source::Moe, gate_up, (gx, u32v(op, rn * k)?, 1), gu_block, 0;
                    &tab, &ids, &xp, &null, &null, &hw.ptr, &i32_, &h32, &k32, &e32, &ep);
                go!(self, Source::Moe, "moe_tc_down_rows", (dx, u32v(op, rn)?, 1),
                    block(k * (i / 128), 32)?, 0;
                    &tab, &ids, &wts, &hw.ptr, &yp, &i32_, &h32, &k32, &e32, &ep);
                r0 += rn;
            }
            return Ok(());
        }
        const TM: usize = 8;
        // (expert, first slot, count) of each tile, sized by the first pass's tile bound (the
        // largest: later passes have at most as many rows)
        let mut tinfo: Option<Mem> = None;
        self.grouped_passes(x, route, tab, e, i, h, y, TM, |p| {
            let tinfo = match &tinfo {
                Some(t) => t.ptr,
                None => tinfo.insert(self.alloc(cmul(op, &[p.bound, 3, 4])?)?).ptr,
            };
            let (ids, xp, order, offsets, tiles) = (p.ids, p.xp, p.order, p.offsets, p.tiles);
            let (hbuf, obuf) = (p.hbuf, p.obuf);
            let (tile_bound, b32) = (u32v(op, p.bound)?, i32v(op, p.bound)?);
            go!(self, Source::Moe, "moe_tc_tiles", (u32v(op, p.bound.div_ceil(256))?, 1, 1), 256, 0;
                &offsets, &tiles, &tinfo, &e32, &b32);
            go!(self, Source::Moe, gate_up, (gx, tile_bound, 1), gu_block, 0;
                &tab, &ids, &xp, &order, &tinfo, &hbuf, &i32_, &h32, &k32, &e32, &ep);
            // four 16-output tiles a block where their key blocks fit its partials
            let (down, dgx) = if self.opts.moe_tc_down4 && i / 128 <= DN4_MAX_KB {
                ("moe_tc_down4", u32v(op, h / 64)?)
            } else {
                ("moe_tc_down", dx)
            };
            go!(self, Source::Moe, down, (dgx, tile_bound, 1), dn_block, 0;
                &tab, &ids, &hbuf, &order, &tinfo, &obuf, &i32_, &h32, &e32, &ep);
            Ok(())
        })
    }

    /// Tiled causal attention of `t` rows per lane whose caches already hold them (the
    /// prefill): `tab.len` are the lengths before the append.
    #[allow(clippy::too_many_arguments)]
    fn attend_flash(
        &self,
        tab: &KvTab,
        q: u64,
        out: u64,
        d: &AttnDims,
        lanes: usize,
        t: usize,
        cap: usize,
        f32kv: bool,
    ) -> BResult<()> {
        let p = kernels::plan_flash(t, d.q_heads, lanes, d.head_dim, cap, f32kv).map_err(dev)?;
        let f = self.optin_func(Source::Ops, &p)?;
        let (t32, nh, nkv, hd) = (
            i32v("attention", t)?,
            i32v("attention", d.q_heads)?,
            i32v("attention", d.kv_heads)?,
            i32v("attention", d.head_dim)?,
        );
        let cap64 = i64v("attention", cap)?;
        let scale = 1.0f32 / (d.head_dim as f32).sqrt();
        let cfg = p.cfg().map_err(dev)?;
        // SAFETY: the arguments match attn_flash_{f32,bf16} in kernels/ops.cu; `attend` checked
        // every lane's cache holds len + t rows of its layout and q/out hold lanes * t rows.
        unsafe {
            self.gpu
                .stream
                .launch_builder(&f)
                .arg(tab)
                .arg(&q)
                .arg(&out)
                .arg(&t32)
                .arg(&nh)
                .arg(&nkv)
                .arg(&hd)
                .arg(&cap64)
                .arg(&scale)
                .launch(cfg)
        }
        .map_err(dev)?;
        Ok(())
    }

    /// Whether a lane's prefill call of `t` rows takes the flash kernel (`attend`; the joined
    /// attention runs only lanes that each would).
    fn prefill_flash(&self, t: usize, hd: usize) -> bool {
        t >= self.opts.flash_min_rows && kernels::flash_fits(hd)
    }

    /// A joined prefill's attention for up to `MAX_LANES` lanes in two launches: lane i's
    /// `lens[i]` rows (one lane after another from row `row0` of `q`, `k`, `v` and `out`)
    /// appended to `caches[i]` (`kv_append_rows_*`), then attended causally
    /// (`attn_flash_rows_*`). The caller checked that each lane alone takes the flash kernel.
    #[allow(clippy::too_many_arguments)]
    fn attend_rows(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        d: &AttnDims,
        caches: &mut [&mut CudaKv],
        lens: &[usize],
        row0: usize,
        out: &CudaBuf,
    ) -> BResult<()> {
        let op = "attention";
        let lanes = caches.len();
        let (nh, nkv, hd) = (d.q_heads, d.kv_heads, d.head_dim);
        let cap = caches.iter().map(|c| c.capacity).max().unwrap_or(0);
        let f32kv = caches[0].f32;
        let tab = kv_table(caches, nkv, hd, |i| lens[i])?;
        let rt = RowTab::of(op, lens)?;
        let most = lens.iter().copied().max().unwrap_or(0);
        let rows: usize = lens.iter().sum();
        let (nkv32, hd32) = (i32v(op, nkv)?, i32v(op, hd)?);
        let (kp, vp) = (k.row_ptr(row0)?, v.row_ptr(row0)?);
        let (qp, op_) = (q.row_ptr(row0)?, out.row_ptr(row0)?);
        let app = if f32kv {
            "kv_append_rows_f32"
        } else {
            "kv_append_rows_bf16"
        };
        let grid_app = (u32v("kv append", most * nkv)?, u32v("kv append", lanes)?, 1);
        go!(self, Source::Ops, app, grid_app, 128, 0; &tab, &rt, &kp, &vp, &nkv32, &hd32);
        let p = kernels::plan_flash_rows(most, rows, nh, lanes, hd, cap, f32kv).map_err(dev)?;
        let f = self.optin_func(Source::Ops, &p)?;
        let nh32 = i32v(op, nh)?;
        let cap64 = i64v(op, cap)?;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let cfg = p.cfg().map_err(dev)?;
        // SAFETY: the arguments match attn_flash_rows_{f32,bf16} in kernels/ops.cu; every lane's
        // cache was checked to hold its len + lens[i] rows of this layout, and q/out hold `rows`
        // rows from row0 (the caller's checks).
        unsafe {
            self.gpu
                .stream
                .launch_builder(&f)
                .arg(&tab)
                .arg(&rt)
                .arg(&qp)
                .arg(&op_)
                .arg(&nh32)
                .arg(&nkv32)
                .arg(&hd32)
                .arg(&cap64)
                .arg(&scale)
                .launch(cfg)
        }
        .map_err(dev)?;
        for (c, &t) in caches.iter_mut().zip(lens) {
            c.len += t;
        }
        Ok(())
    }

    /// Writes K/V rows `[rows, kv_heads · head_dim]` into an f32 cache from position 0 and sets
    /// its length to `rows` (the contract fills long caches this way, without a prefill).
    pub fn kv_fill_f32(&self, kv: &mut CudaKv, k: &[f32], v: &[f32]) -> BResult<()> {
        let w = kv.kv_heads * kv.head_dim;
        let rows = k.len().checked_div(w).unwrap_or(0);
        if !kv.f32 || k.len() != v.len() || rows * w != k.len() || rows > kv.capacity {
            return Err(shape_err(
                "kv_fill_f32",
                format!(
                    "{} K and {} V values into an {} cache of {} rows x {w}",
                    k.len(),
                    v.len(),
                    if kv.f32 { "f32" } else { "bf16" },
                    kv.capacity
                ),
            ));
        }
        // the cache is [kv head][position][dim]
        for (src, dst) in [(k, &kv.k), (v, &kv.v)] {
            let mut host = vec![0.0f32; kv.kv_heads * kv.capacity * kv.head_dim];
            for r in 0..rows {
                for h in 0..kv.kv_heads {
                    let at = (h * kv.capacity + r) * kv.head_dim;
                    host[at..at + kv.head_dim]
                        .copy_from_slice(&src[r * w + h * kv.head_dim..][..kv.head_dim]);
                }
            }
            self.gpu.ctx.bind_to_thread().map_err(dev)?;
            // SAFETY: the cache holds kv_heads x capacity x head_dim f32; pageable memory is
            // staged before the call returns.
            unsafe { cu::memcpy_htod_async(dst.ptr, &host, self.issue_stream()?) }.map_err(dev)?;
        }
        kv.len = rows;
        Ok(())
    }

    /// The split-key decode kernel alone (no append), for the contract: lane i's row of `q`
    /// over the first `keys[i]` rows of `caches[i]` (at most its length), or the kernel's
    /// refusal when it does not take these heads.
    pub fn attn_decode_only(
        &self,
        q: &CudaBuf,
        d: &AttnDims,
        caches: &[&CudaKv],
        keys: &[usize],
    ) -> BResult<CudaBuf> {
        check::lanes("attn_decode", q.rows, caches.len())?;
        check::lanes("attn_decode", keys.len(), caches.len())?;
        if caches.is_empty() || caches.len() > MAX_LANES {
            return Err(shape_err(
                "attn_decode",
                format!("{} lanes outside 1..={MAX_LANES}", caches.len()),
            ));
        }
        let cap = caches.iter().map(|c| c.capacity).max().unwrap_or(0);
        let f32kv = caches[0].f32;
        let mut tab = KvTab::empty();
        for (i, (c, &n)) in caches.iter().zip(keys).enumerate() {
            if c.f32 != f32kv || c.kv_heads != d.kv_heads || c.head_dim != d.head_dim {
                return Err(shape_err(
                    "attn_decode",
                    "lanes must share the cache layout (precision, kv heads, head dim)".into(),
                ));
            }
            tab.cap[i] = i64v("attn_decode", c.capacity)?;
            if n == 0 || n > c.len {
                return Err(shape_err(
                    "attn_decode",
                    format!("lane {i} sees {n} keys of {}", c.len),
                ));
            }
            tab.k[i] = c.k.ptr;
            tab.v[i] = c.v.ptr;
            tab.len[i] = i64v("attn_decode", n)?;
        }
        if q.cols != d.q_heads * d.head_dim {
            return Err(shape_err(
                "attn_decode",
                format!("q has {} columns", q.cols),
            ));
        }
        let counters = self.decode_counters()?;
        let out = self.buf(q.rows, q.cols)?;
        self.attend_decode(
            &tab,
            keys.len(),
            q.ptr(),
            out.ptr(),
            d,
            cap,
            f32kv,
            counters,
            kernels::decode_chunks(keys.iter().copied(), self.variant == Variant::Planted),
        )?;
        Ok(out)
    }

    /// The kernel of a plan that raises its dynamic shared memory limit, checked against the
    /// device, with the limit set; counts the launch that follows.
    fn optin_func(
        &self,
        src: Source,
        p: &kernels::LaunchPlan,
    ) -> BResult<cudarc::driver::CudaFunction> {
        if let Some(why) = p.problems(&self.gpu.info).first() {
            return Err(dev(format!("{}: {why}", p.kernel)));
        }
        let f = self.gpu.func(src, self.variant, p.kernel).map_err(dev)?;
        let smem = i32v(p.kernel, p.dyn_smem as usize)?;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem,
        )
        .map_err(dev)?;
        self.prof
            .launches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(f)
    }

    /// `rope` of `x` into `out`, row r at position `pos.0[r · pos.1]` (i64 words).
    #[allow(clippy::too_many_arguments)]
    fn rope_launch(
        &self,
        x: &CudaBuf,
        out: &CudaBuf,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        pos: (u64, i64),
    ) -> BResult<()> {
        let (c32, hd32, rot32) = (
            i32v("rope", x.cols)?,
            i32v("rope", head_dim)?,
            i32v("rope", rot_dims)?,
        );
        let inter = i32::from(style == Rope::Interleaved);
        go!(self, Source::Ops, "rope", rope_grid(x, head_dim, rot_dims)?, 128, 0;
            &x.ptr(), &out.ptr(), &pos.0, &pos.1, &c32, &hd32, &rot32, &theta, &inter);
        Ok(())
    }

    /// Whether a linear of `n` rows in `mode` takes the bulk GEMM tiles (else the per-row
    /// GEMVs): the one rule for `linear`, `linear_many` and the fused-input linears, so that a
    /// fused linear and its composed ops run the same kernel class.
    fn bulk_rows(&self, mode: Rows, n: usize) -> bool {
        mode == Rows::Bulk && n >= self.opts.gemm_min_rows
    }

    /// `linear(act(x, u), w)` with the elementwise op made as `gemv_tc2_*` loads its input
    /// (bit for bit the op then the linear); `None` where that kernel does not run (bulk rows,
    /// other weight formats, the FMA GEMVs), for the caller to compose.
    fn linear_act(
        &self,
        x: &CudaBuf,
        u: &CudaBuf,
        w: &CudaWeight,
        rows: Rows,
        act: Act,
    ) -> BResult<Option<CudaBuf>> {
        let op = act.op();
        if x.shape() != u.shape() {
            // a broadcast gate (sigmoid_mul's [n, 1]): the composed ops check and run it
            return Ok(None);
        }
        let k = x.cols;
        let gv = bf16_gemv(&self.opts, x.rows, k, w.rows());
        let bulk = self.bulk_rows(rows, x.rows);
        let (CudaWeight::Bf16 { mem, .. }, Some(kc), Some((silu, sigm)), false) =
            (w, gv.kc, gv.act, bulk)
        else {
            return Ok(None);
        };
        let _p = self.prof.guard(op);
        let n_out = w.rows();
        check::linear(x.shape(), (n_out, w.cols()))?;
        let out = self.buf(x.rows, n_out)?;
        if x.rows == 0 || n_out == 0 {
            return Ok(Some(out));
        }
        let name = match act {
            Act::Silu => silu,
            Act::Sigmoid => sigm,
        };
        let (n32, k32, r32) = (i32v(op, n_out)?, i32v(op, k)?, i32v(op, x.rows)?);
        let g = gv.grid(op, n_out.div_ceil(gv.per_block), x.rows)?;
        if let Some(chunks) = gv.split {
            let (part, count) = self.gemv_split(op, (g.0 * g.1) as usize, chunks)?;
            go!(self, Source::Gemv, name, g, gv.block, 0;
                &mem.ptr, &x.ptr(), &u.ptr(), &out.ptr(), &n32, &k32, &r32, &kc, &part.ptr, &count);
        } else {
            go!(self, Source::Gemv, name, g, gv.block, 0;
                &mem.ptr, &x.ptr(), &u.ptr(), &out.ptr(), &n32, &k32, &r32, &kc);
        }
        Ok(Some(out))
    }

    /// A `gemv_ts*` launch's last two arguments for `tiles` tiles (grid x times y) of `chunks`
    /// key chunks: the chunk sums' workspace (held by the caller until the launch is issued;
    /// the pool orders its reuse) and the launching stream's tickets.
    fn gemv_split(&self, op: &'static str, tiles: usize, chunks: usize) -> BResult<(Mem, u64)> {
        if tiles > GEMV_TS_TILES {
            return Err(shape_err(
                op,
                format!("{tiles} GEMV tiles in one launch; the tickets hold {GEMV_TS_TILES}"),
            ));
        }
        let count = self
            .gemv_count
            .as_ref()
            .ok_or_else(|| dev("the GEMV tile tickets could not be allocated"))?;
        let branch = self.aside.lock().unwrap_or_else(|p| p.into_inner()).on;
        let part = self.alloc(cmul(op, &[tiles, chunks, 64 * GEMV_TS_ROWS, 4])?)?;
        Ok((
            part,
            count.ptr + if branch { 4 * GEMV_TS_TILES as u64 } else { 0 },
        ))
    }

    fn decode_counters(&self) -> BResult<u64> {
        self.decode_count
            .as_ref()
            .map(|m| m.ptr)
            .ok_or_else(|| dev("the decode block counters could not be allocated"))
    }

    /// Split-key decode attention (`attn_decode_*`, ops.cu) of one row per lane whose caches
    /// already hold it: lane i < `lanes` sees `tab.len[i]` keys. Chunks per lane depend on the
    /// lane's own length only, and the last block of each (kv head, lane) combines them in
    /// chunk order, so every lane's bits equal its solo step.
    #[allow(clippy::too_many_arguments)]
    fn attend_decode(
        &self,
        tab: &KvTab,
        lanes: usize,
        q: u64,
        out: u64,
        d: &AttnDims,
        cap: usize,
        f32kv: bool,
        counters: u64,
        nchunks: usize,
    ) -> BResult<()> {
        let (nh, nkv, hd) = (d.q_heads, d.kv_heads, d.head_dim);
        // the whole group per block unless the split is asked for (not yet run on the device)
        let hpb = if self.opts.decode_head_split {
            kernels::decode_heads_per_block(
                lanes,
                nh,
                nkv,
                nchunks,
                self.gpu.info.sm_count.max(1) as usize,
            )
        } else {
            nh / nkv.max(1)
        };
        let p = kernels::plan_decode(lanes, nh, nkv, hd, cap, nchunks, f32kv, hpb).map_err(dev)?;
        if let Some(why) = p.problems(&self.gpu.info).first() {
            return Err(dev(format!("{}: {why}", p.kernel)));
        }
        let parts = kernels::decode_workspace(lanes, nh, hd, nchunks).map_err(dev)?;
        let ws = self.alloc(cmul("attention", &[parts, 4])?)?;
        let ml = lanes * nh * nchunks;
        let (pm, pl, pacc) = (ws.ptr, ws.ptr + 4 * ml as u64, ws.ptr + 8 * ml as u64);
        let (nh32, nkv32, hd32) = (
            i32v("attention", nh)?,
            i32v("attention", nkv)?,
            i32v("attention", hd)?,
        );
        let cap64 = i64v("attention", cap)?;
        let scale = 1.0f32 / (hd as f32).sqrt();
        let grid = (
            u32v("attention", p.grid[0] as usize)?,
            u32v("attention", p.grid[1] as usize)?,
            u32v("attention", p.grid[2] as usize)?,
        );
        go!(self, Source::Ops, p.kernel, grid, p.block as u32, 0;
            tab, &q, &out, &pm, &pl, &pacc, &counters, &nh32, &nkv32, &hd32, &cap64, &scale,
            &(hpb as i32));
        Ok(())
    }

    /// Conv over lane i's `lens[i]` rows of `x` (one lane after another from row `row0`) into
    /// `u` (same rows).
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &self,
        x: &CudaBuf,
        w: &CudaVector,
        d: &GdnDims,
        states: &mut [&mut CudaGdn],
        lens: &[usize],
        row0: usize,
        u: &CudaBuf,
    ) -> BResult<()> {
        let (c, k) = (d.channels(), d.conv_kernel);
        let tab = gdn_tab("gdn_conv", states, d, |s| s.conv.ptr)?;
        let cblocks = c.div_ceil(128);
        let (c32, k32) = (i32v("gdn_conv", c)?, i32v("gdn_conv", k)?);
        let (xp, up) = (x.row_ptr(row0)?, u.row_ptr(row0)?);
        let lanes = u32v("gdn_conv", states.len())?;
        let tmax = lens.iter().copied().max().unwrap_or(0);
        if tmax == 0 {
            return Ok(());
        }
        if lens.iter().all(|&t| t == 1) && !self.opts.gdn_generic {
            // one row per lane: output and history shift in one launch (the same bits)
            go!(self, Source::Ops, "gdn_conv_one", (u32v("gdn_conv", cblocks)?, lanes, 1), 128, 0;
                &tab, &xp, &w.mem.ptr, &up, &c32, &k32);
            return Ok(());
        }
        let rt = RowTab::of("gdn_conv", lens)?;
        go!(self, Source::Ops, "gdn_conv_rows", (u32v("gdn_conv", tmax * cblocks)?, lanes, 1), 128, 0;
            &tab, &rt, &xp, &w.mem.ptr, &up, &c32, &k32);
        go!(self, Source::Ops, "gdn_conv_shift", (u32v("gdn_conv", cblocks)?, lanes, 1), 128, 0;
            &tab, &rt, &xp, &c32, &k32);
        Ok(())
    }

    /// The delta rule over lane i's `lens[i]` rows (one lane after another from row `row0`).
    #[allow(clippy::too_many_arguments)]
    fn delta(
        &self,
        qkv: &CudaBuf,
        b: &CudaBuf,
        a: &CudaBuf,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
        d: &GdnDims,
        states: &mut [&mut CudaGdn],
        lens: &[usize],
        row0: usize,
        o: &CudaBuf,
    ) -> BResult<()> {
        let (nk, nv, dk, dv, c) = (d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.channels());
        let rows: usize = lens.iter().sum();
        if rows == 0 {
            return Ok(());
        }
        let rt = RowTab::of("gdn", lens)?;
        // workspace: qn, kn [rows, nk, dk]; kq [rows, nk]; beta, gate [rows, nv]
        let (qk_n, kq_n, g_n) = (
            cmul("gdn", &[rows, nk, dk])?,
            cmul("gdn", &[rows, nk])?,
            cmul("gdn", &[rows, nv])?,
        );
        let ws = self.alloc((2 * qk_n + kq_n + 2 * g_n) * 4)?;
        let qn = ws.ptr;
        let kn = qn + 4 * qk_n as u64;
        let kq = kn + 4 * qk_n as u64;
        let beta = kq + 4 * kq_n as u64;
        let gate = beta + 4 * g_n as u64;
        let (c32, nk32, dk32, nv32, dv32) = (
            i32v("gdn", c)?,
            i32v("gdn", nk)?,
            i32v("gdn", dk)?,
            i32v("gdn", nv)?,
            i32v("gdn", dv)?,
        );
        let q_scale = 1.0f32 / (dk as f32).sqrt();
        let (up, bp, ap) = (qkv.row_ptr(row0)?, b.row_ptr(row0)?, a.row_ptr(row0)?);
        go!(self, Source::Ops, "gdn_prep", (u32v("gdn", rows)?, 1, 1), 128, 0;
            &up, &bp, &ap, &a_log.mem.ptr, &dt_bias.mem.ptr, &qn, &kn, &kq, &beta, &gate,
            &c32, &nk32, &dk32, &nv32, &q_scale);
        let tab = gdn_tab("gdn", states, d, |s| s.s.ptr)?;
        let op = o.row_ptr(row0)?;
        // lanes of at least gdn_chunk_min rows take the chunked form, each by its own count
        // (where the device grants its shared memory; else the recurrence)
        let chunked = dk == kernels::GDN_HEAD_DIM
            && dv == kernels::GDN_HEAD_DIM
            && !self.opts.gdn_generic
            && self.gpu.info.max_smem_optin >= kernels::GDN_CHUNK_SMEM as u64;
        let min = self.opts.gdn_chunk_min;
        let (long, short): (Vec<usize>, Vec<usize>) = if chunked && lens.iter().any(|&n| n >= min) {
            (0..lens.len()).partition(|&i| lens[i] >= min)
        } else {
            (Vec::new(), Vec::new())
        };
        if !long.is_empty() {
            let (ltab, lrt) = (tab.pick(&long), rt.pick(&long));
            let p = kernels::plan_gdn_chunk(rows, nk, nv, long.len()).map_err(dev)?;
            let f = self.optin_func(Source::Ops, &p)?;
            let cfg = p.cfg().map_err(dev)?;
            // SAFETY: the arguments match gdn_chunk in kernels/ops.cu; gdn_prep wrote qn, kn,
            // beta and gate for every row of the row table, whose lanes' states hold nv x 128 x
            // 128 f32 and whose rows lie inside qkv and o.
            unsafe {
                self.gpu
                    .stream
                    .launch_builder(&f)
                    .arg(&ltab)
                    .arg(&lrt)
                    .arg(&qn)
                    .arg(&kn)
                    .arg(&up)
                    .arg(&beta)
                    .arg(&gate)
                    .arg(&op)
                    .arg(&c32)
                    .arg(&nk32)
                    .arg(&nv32)
                    .launch(cfg)
            }
            .map_err(dev)?;
            if short.is_empty() {
                return Ok(());
            }
        }
        // the recurrence's lanes: all of them, or those the chunked launch left
        let (tab, rt) = if long.is_empty() {
            (tab, rt)
        } else {
            (tab.pick(&short), rt.pick(&short))
        };
        let grid = (u32v("gdn", nv)?, u32v("gdn", lens.len() - long.len())?, 1);
        if dk == 128 && !self.opts.gdn_generic {
            // each thread's state column in registers, one warp a block over a head's columns,
            // the next row's inputs loaded while a row computes (the same bits)
            let grid = (u32v("gdn", nv * dv.div_ceil(32))?, grid.1, 1);
            go!(self, Source::Ops, "gdn_recur_k128", grid, 32, 0;
                &tab, &rt, &qn, &kn, &kq, &up, &beta, &gate, &op, &c32, &nk32, &dk32, &nv32, &dv32);
        } else {
            let (block, smem) = (u32v("gdn", dv.div_ceil(32) * 32)?, u32v("gdn", 2 * dk * 4)?);
            go!(self, Source::Ops, "gdn_recur", grid, block, smem;
                &tab, &rt, &qn, &kn, &kq, &up, &beta, &gate, &op, &c32, &nk32, &dk32, &nv32, &dv32);
        }
        Ok(())
    }
}

impl CudaBackend {
    /// `name` = `<stem>.weight` stored as U8 `[rows, cols_bytes]`: the NVFP4 codes, beside
    /// `<stem>.weight_scale` (F8_E4M3 `[rows, 2 cols_bytes / 16]`) and `<stem>.weight_scale_2`
    /// (one F32). Uploaded as stored; the checks are the CPU backend's.
    fn nvfp4_weight(
        &self,
        ck: &Checkpoint,
        name: &str,
        rows: usize,
        col_bytes: usize,
    ) -> BResult<CudaWeight> {
        let p = model::stored::nvfp4_parts(ck, name, rows, col_bytes)?;
        self.weight_nvfp4(rows, p.cols, p.codes.bytes, p.scales.bytes, p.global)
    }
}

/// `memwatch::keep_freed_memory` for the backend's device: freed memory stays in the pool for the
/// next op (and the start-up reservation stays held). A failure is logged once: allocations
/// then still work, only slower, and `reserve` reports what the pool really keeps.
fn keep_pool_memory(gpu: &Gpu) {
    static LOGGED: std::sync::Once = std::sync::Once::new();
    if let Err(e) = crate::memwatch::keep_freed_memory(&gpu.ctx) {
        LOGGED.call_once(|| {
            tracing::warn!("the device memory pool keeps nothing between allocations: {e}")
        });
    }
}

/// `rope`'s grid, (rows, heads); its shared angle table holds `rot / 2 <= 256` pairs.
fn rope_grid(x: &CudaBuf, head_dim: usize, rot_dims: usize) -> BResult<(u32, u32, u32)> {
    if rot_dims > 512 {
        return Err(shape_err(
            "rope",
            format!("{rot_dims} rotary dims, at most 512"),
        ));
    }
    Ok((u32v("rope", x.rows)?, u32v("rope", x.cols / head_dim)?, 1))
}

fn same_shape(op: &'static str, a: &CudaBuf, b: &CudaBuf) -> BResult<()> {
    check::same_shape(op, a.shape(), b.shape())
}

/// The caches of one attention call as its kernels read them: every lane of the first lane's
/// layout (precision, kv heads, head dim) with room for its `new_rows(i)` rows.
fn kv_table(
    caches: &[&mut CudaKv],
    nkv: usize,
    hd: usize,
    new_rows: impl Fn(usize) -> usize,
) -> BResult<KvTab> {
    let op = "attention";
    let f32kv = caches.first().is_some_and(|c| c.f32);
    let mut tab = KvTab::empty();
    for (i, c) in caches.iter().enumerate() {
        if c.f32 != f32kv || c.kv_heads != nkv || c.head_dim != hd {
            return Err(shape_err(
                op,
                "lanes of one call must share the cache layout (precision, kv heads, head dim)"
                    .into(),
            ));
        }
        check::kv_room(c.len, new_rows(i), c.capacity)?;
        tab.k[i] = c.k.ptr;
        tab.v[i] = c.v.ptr;
        tab.len[i] = i64v(op, c.len)?;
        tab.cap[i] = i64v(op, c.capacity)?;
    }
    Ok(tab)
}

fn check_attn(q: &CudaBuf, k: &CudaBuf, v: &CudaBuf, d: &AttnDims, kv: &CudaKv) -> BResult<()> {
    check::attn(
        q.shape(),
        k.shape(),
        v.shape(),
        d,
        kv.kv_heads * kv.head_dim,
    )?;
    // the kernels' own bounds: the cache's head layout, and the generic kernel's head dim
    if kv.head_dim != d.head_dim || d.head_dim == 0 || d.head_dim > GENERIC_MAX_HD {
        return Err(shape_err(
            "attention",
            format!(
                "head dim {} with a cache of {} x {} (the kernels take 1..={GENERIC_MAX_HD})",
                d.head_dim, kv.kv_heads, kv.head_dim
            ),
        ));
    }
    Ok(())
}

fn check_conv(x: &CudaBuf, w: &CudaVector, d: &GdnDims) -> BResult<()> {
    check::conv(x.shape(), w.len, d)
}

fn check_gdn(
    qkv: &CudaBuf,
    b: &CudaBuf,
    a: &CudaBuf,
    a_log: &CudaVector,
    dt: &CudaVector,
    d: &GdnDims,
) -> BResult<()> {
    check::gdn(qkv.shape(), b.shape(), a.shape(), a_log.len, dt.len, d)?;
    // the recurrence kernel's block holds one value head
    if d.v_dim == 0 || d.v_dim > 1024 {
        return Err(shape_err(
            "gated delta rule",
            format!("value head dim {} (the kernel takes 1..=1024)", d.v_dim),
        ));
    }
    Ok(())
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Weight = CudaWeight;
    type Vector = CudaVector;
    type Kv = CudaKv;
    type Gdn = CudaGdn;
    type Route = CudaRoute;
    type Round = CudaRound;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn vector_len(&self, v: &CudaVector) -> usize {
        v.len
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> BResult<CudaBuf> {
        let _p = self.prof.guard("upload");
        check::upload(data.len(), rows, cols)?;
        Ok(CudaBuf {
            rows,
            cols,
            mem: self.htod(data)?,
        })
    }

    fn download(&self, x: &CudaBuf) -> BResult<Vec<f32>> {
        let _p = self.prof.guard("download");
        self.dtoh(x.ptr(), x.rows * x.cols)
    }

    fn shape(&self, x: &CudaBuf) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn cols(&self, x: &CudaBuf, start: usize, len: usize) -> BResult<CudaBuf> {
        // profiled as the cols_grouped call it is (one guard, so nothing is counted twice)
        self.cols_grouped(x, x.cols, start, len)
    }

    fn cols_grouped(
        &self,
        x: &CudaBuf,
        group: usize,
        offset: usize,
        len: usize,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("cols_grouped");
        check::cols_grouped(x.shape(), group, offset, len)?;
        let groups = x.cols / group;
        let out = self.buf(x.rows, groups * len)?;
        let total = x.rows * groups * len;
        if total == 0 {
            return Ok(out);
        }
        let op = "cols_grouped";
        let (rows, sc, g, o, l, gs) = (
            i64v(op, x.rows)?,
            i32v(op, x.cols)?,
            i32v(op, group)?,
            i32v(op, offset)?,
            i32v(op, len)?,
            i32v(op, groups)?,
        );
        go!(self, Source::Ops, "gather_cols", stride_grid(total), 256, 0;
            &x.ptr(), &out.ptr(), &rows, &sc, &g, &o, &l, &gs);
        Ok(out)
    }

    fn rows(&self, x: &CudaBuf, start: usize, len: usize) -> BResult<CudaBuf> {
        let _p = self.prof.guard("rows");
        check::rows(x.shape(), start, len)?;
        let out = self.buf(len, x.cols)?;
        self.dtod(out.ptr(), x.row_ptr(start)?, len * x.cols * 4)?;
        Ok(out)
    }

    fn concat_cols(&self, a: &CudaBuf, b: &CudaBuf) -> BResult<CudaBuf> {
        let _p = self.prof.guard("concat_cols");
        check::concat_cols(a.shape(), b.shape())?;
        let w = a.cols + b.cols;
        let out = self.buf(a.rows, w)?;
        let op = "concat_cols";
        let (rows, w32) = (i64v(op, a.rows)?, i32v(op, w)?);
        for (part, off) in [(a, 0usize), (b, a.cols)] {
            let n = part.rows * part.cols;
            if n == 0 {
                continue;
            }
            let (pc, off32) = (i32v(op, part.cols)?, i32v(op, off)?);
            go!(self, Source::Ops, "place_cols", stride_grid(n), 256, 0;
                &part.ptr(), &out.ptr(), &rows, &pc, &w32, &off32);
        }
        Ok(out)
    }

    fn concat_rows(&self, parts: &[&CudaBuf]) -> BResult<CudaBuf> {
        let _p = self.prof.guard("concat_rows");
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut rows = 0;
        for p in parts {
            check::concat_rows(cols, p.shape())?;
            rows += p.rows;
        }
        let out = self.buf(rows, cols)?;
        let mut at = 0;
        for p in parts {
            self.dtod(out.row_ptr(at)?, p.ptr(), p.rows * p.cols * 4)?;
            at += p.rows;
        }
        Ok(out)
    }

    fn weight(&self, ck: &Checkpoint, name: &str) -> BResult<CudaWeight> {
        let v = ck.tensor(name)?;
        let (rows, cols) = model::stored::matrix_shape(name, v.shape())?;
        match v.dtype() {
            DType::BF16 => Ok(CudaWeight::Bf16 {
                mem: self.htod(v.bytes)?,
                rows,
                cols,
            }),
            DType::F8E4M3 => {
                let sname = format!("{name}_scale_inv");
                let s = ck.tensor(&sname)?;
                let want = [rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK)];
                if s.dtype() != DType::F32 || s.shape() != want {
                    return Err(BackendError::Weight {
                        name: sname,
                        why: format!("expected F32 {want:?}, found {} {:?}", s.dtype(), s.shape()),
                    });
                }
                if !cols.is_multiple_of(16) {
                    return Err(BackendError::Weight {
                        name: name.into(),
                        why: format!("FP8 rows of {cols} bytes: the kernels need multiples of 16"),
                    });
                }
                Ok(CudaWeight::Fp8 {
                    mem: self.htod(v.bytes)?,
                    scale: self.htod(s.bytes)?,
                    rows,
                    cols,
                })
            }
            DType::U8 => self.nvfp4_weight(ck, name, rows, cols),
            d => Err(BackendError::Weight {
                name: name.into(),
                why: format!(
                    "dtype {d} is not a weight format of the CUDA backend (BF16, F8_E4M3, \
                     NVFP4 as U8 codes)"
                ),
            }),
        }
    }

    fn weight_rows(&self, ck: &Checkpoint, name: &str, rows: &[u32]) -> BResult<CudaWeight> {
        let (out, cols) = model::stored::bf16_rows(ck, name, rows)?;
        Ok(CudaWeight::Bf16 {
            mem: self.htod(&out)?,
            rows: rows.len(),
            cols,
        })
    }

    fn vector(&self, ck: &Checkpoint, name: &str) -> BResult<CudaVector> {
        self.vector_f32(&ck.tensor(name)?.to_f32())
    }

    fn kv_new(&self, capacity: usize, kv_heads: usize, head_dim: usize) -> BResult<CudaKv> {
        let f32 = self.kv_f32.load(std::sync::atomic::Ordering::Relaxed);
        let elem = if f32 { 4 } else { 2 };
        let bytes = cmul("kv_new", &[kv_heads, capacity, head_dim, elem])?;
        Ok(CudaKv {
            k: self.zeroed_state(bytes)?,
            v: self.zeroed_state(bytes)?,
            len: 0,
            capacity,
            kv_heads,
            head_dim,
            f32,
        })
    }

    fn kv_len(&self, kv: &CudaKv) -> usize {
        kv.len
    }

    fn kv_copy(&self, src: &CudaKv, dst: &mut CudaKv) -> BResult<()> {
        let _p = self.prof.guard("kv_copy");
        if dst.len != 0
            || dst.kv_heads != src.kv_heads
            || dst.head_dim != src.head_dim
            || dst.f32 != src.f32
            || dst.capacity < src.len
        {
            return Err(shape_err(
                "kv_copy",
                format!(
                    "source holds {} rows of {}x{}; destination holds {} rows of {}x{} with capacity {}",
                    src.len, src.kv_heads, src.head_dim, dst.len, dst.kv_heads, dst.head_dim, dst.capacity
                ),
            ));
        }
        let elem = if src.f32 { 4 } else { 2 };
        let row = src.head_dim * elem;
        for h in 0..src.kv_heads {
            let (so, d_o) = (h * src.capacity * row, h * dst.capacity * row);
            let n = src.len * row;
            self.dtod(dst.k.at(d_o)?, src.k.at(so)?, n)?;
            self.dtod(dst.v.at(d_o)?, src.v.at(so)?, n)?;
        }
        dst.len = src.len;
        Ok(())
    }

    fn gdn_copy(&self, src: &CudaGdn, dst: &mut CudaGdn) -> BResult<()> {
        let _p = self.prof.guard("gdn_copy");
        if dst.dims != src.dims {
            return Err(shape_err(
                "gdn_copy",
                "source and destination have different GDN geometry".into(),
            ));
        }
        self.dtod(dst.conv.ptr, src.conv.ptr, src.conv.bytes)?;
        self.dtod(dst.s.ptr, src.s.ptr, src.s.bytes)
    }

    fn gdn_fits(&self, st: &CudaGdn, dims: &GdnDims) -> bool {
        st.dims == *dims
    }

    fn gdn_new(&self, d: &GdnDims) -> BResult<CudaGdn> {
        if d.conv_kernel == 0 {
            return Err(shape_err("gdn_new", "conv kernel of 0 taps".into()));
        }
        Ok(CudaGdn {
            conv: self.zeroed_state(cmul("gdn_new", &[d.conv_kernel - 1, d.channels(), 4])?)?,
            s: self.zeroed_state(cmul("gdn_new", &[d.v_heads, d.k_dim, d.v_dim, 4])?)?,
            dims: *d,
        })
    }

    fn gather_sum(&self, tables: &[&CudaWeight], rows: &[GatherRow]) -> BResult<CudaBuf> {
        let _p = self.prof.guard("gather_sum");
        let op = "gather_sum";
        if tables.len() > 8 {
            return Err(shape_err(op, format!("{} tables, at most 8", tables.len())));
        }
        let cols = tables.first().map_or(0, |t| t.cols());
        let mut tabs = Tables { p: [0; 8] };
        for (i, t) in tables.iter().enumerate() {
            match t {
                CudaWeight::Bf16 { mem, cols: c, .. } if *c == cols => tabs.p[i] = mem.ptr,
                _ => {
                    return Err(shape_err(
                        op,
                        format!("table {i} must be BF16 with {cols} cols"),
                    ))
                }
            }
        }
        let out = self.buf(rows.len(), cols)?;
        if rows.is_empty() || cols == 0 {
            return Ok(out);
        }
        // one upload: start [n+1] | table [P] | row [P] | scale bits [n]
        let picks: usize = rows.iter().map(|r| r.picks.len()).sum();
        let mut host: Vec<u32> = Vec::with_capacity(2 * rows.len() + 1 + 2 * picks);
        let mut at = 0u32;
        for r in rows {
            host.push(at);
            at += r.picks.len() as u32;
        }
        host.push(at);
        for r in rows {
            for &(t, row) in &r.picks {
                let table = tables
                    .get(t)
                    .ok_or_else(|| shape_err(op, format!("table {t} of {}", tables.len())))?;
                if row as usize >= table.rows() {
                    return Err(shape_err(
                        op,
                        format!("row {row} of a {}-row table", table.rows()),
                    ));
                }
                host.push(t as u32);
            }
        }
        for r in rows {
            host.extend(r.picks.iter().map(|&(_, row)| row));
        }
        host.extend(rows.iter().map(|r| r.scale.to_bits()));
        let meta = self.htod(&host)?;
        let n = rows.len();
        let start = meta.ptr;
        let pt = start + 4 * (n as u64 + 1);
        let prow = pt + 4 * picks as u64;
        let scale = prow + 4 * picks as u64;
        let c32 = i32v(op, cols)?;
        go!(self, Source::Ops, "gather_sum", (u32v(op, n)?, 1, 1), 128, 0;
            &tabs, &start, &pt, &prow, &scale, &out.ptr(), &c32);
        Ok(out)
    }

    fn rms_norm(
        &self,
        x: &CudaBuf,
        w: &CudaVector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("rms_norm");
        check::rms_norm("rms_norm", x.shape(), group, w.len)?;
        let out = self.buf(x.rows, x.cols)?;
        let groups = x.rows * (x.cols / group);
        if groups == 0 {
            return Ok(out);
        }
        let block = norm_block("rms_norm", group)?;
        let (g32, p1) = (i32v("rms_norm", group)?, i32::from(plus_one));
        go!(self, Source::Ops, "rmsnorm_groups", (u32v("rms_norm", groups)?, 1, 1), block, 0;
            &x.ptr(), &w.mem.ptr, &out.ptr(), &g32, &eps, &p1);
        Ok(out)
    }

    fn rms_norm_silu(
        &self,
        x: &CudaBuf,
        z: &CudaBuf,
        w: &CudaVector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("rms_norm_silu");
        let op = "rms_norm_silu";
        check::rms_norm(op, x.shape(), group, w.len)?;
        same_shape(op, x, z)?;
        let out = self.buf(x.rows, x.cols)?;
        let groups = x.rows * (x.cols / group);
        if groups == 0 {
            return Ok(out);
        }
        let (g32, p1) = (i32v(op, group)?, i32::from(plus_one));
        go!(self, Source::Ops, "rmsnorm_silu_groups", (u32v(op, groups)?, 1, 1), norm_block(op, group)?, 0;
            &x.ptr(), &z.ptr(), &w.mem.ptr, &out.ptr(), &g32, &eps, &p1);
        Ok(out)
    }

    fn add_gated_rms_norm(
        &self,
        a: &CudaBuf,
        a2: &CudaBuf,
        x: &CudaBuf,
        gate: &CudaBuf,
        w: &CudaVector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<(CudaBuf, CudaBuf)> {
        let _p = self.prof.guard("add_gated_rms_norm");
        let op = "add_gated_rms_norm";
        same_shape(op, a, a2)?;
        same_shape(op, a, x)?;
        check::gate(op, x.shape(), gate.shape())?;
        check::rms_norm(op, a.shape(), group, w.len)?;
        let sum = self.buf(a.rows, a.cols)?;
        let out = self.buf(a.rows, a.cols)?;
        let groups = a.rows * (a.cols / group);
        if groups == 0 {
            return Ok((sum, out));
        }
        let (g32, c32, gc32) = (i32v(op, group)?, i32v(op, a.cols)?, i32v(op, gate.cols)?);
        let p1 = i32::from(plus_one);
        go!(self, Source::Ops, "add_gated_rmsnorm_groups", (u32v(op, groups)?, 1, 1), norm_block(op, group)?, 0;
            &a.ptr(), &a2.ptr(), &x.ptr(), &gate.ptr(), &w.mem.ptr, &sum.ptr(), &out.ptr(),
            &g32, &c32, &gc32, &eps, &p1);
        Ok((sum, out))
    }

    fn linear_silu_mul(
        &self,
        gate: &CudaBuf,
        up: &CudaBuf,
        w: &CudaWeight,
        rows: Rows,
    ) -> BResult<CudaBuf> {
        let _s = self.shape_guard(w);
        match self.linear_act(gate, up, w, rows, Act::Silu)? {
            Some(y) => Ok(y),
            None => self.linear(&self.silu_mul(gate, up)?, w, rows),
        }
    }

    fn linear_sigmoid_mul(
        &self,
        x: &CudaBuf,
        gate: &CudaBuf,
        w: &CudaWeight,
        rows: Rows,
    ) -> BResult<CudaBuf> {
        let _s = self.shape_guard(w);
        match self.linear_act(x, gate, w, rows, Act::Sigmoid)? {
            Some(y) => Ok(y),
            None => self.linear(&self.sigmoid_mul(x, gate)?, w, rows),
        }
    }

    fn rms_norm_concat(
        &self,
        a: &CudaBuf,
        wa: &CudaVector,
        b: &CudaBuf,
        wb: &CudaVector,
        eps: f32,
        plus_one: bool,
    ) -> BResult<CudaBuf> {
        let op = "rms_norm_concat";
        check::rms_norm(op, a.shape(), a.cols, wa.len)?;
        check::rms_norm(op, b.shape(), b.cols, wb.len)?;
        check::concat_cols(a.shape(), b.shape())?;
        if norm_block(op, a.cols)? != norm_block(op, b.cols)? {
            let an = self.rms_norm(a, wa, a.cols, eps, plus_one)?;
            let bn = self.rms_norm(b, wb, b.cols, eps, plus_one)?;
            return self.concat_cols(&an, &bn);
        }
        let _p = self.prof.guard(op);
        let out = self.buf(a.rows, a.cols + b.cols)?;
        if a.rows == 0 || a.cols + b.cols == 0 {
            return Ok(out);
        }
        let (ca, cb, p1) = (i32v(op, a.cols)?, i32v(op, b.cols)?, i32::from(plus_one));
        go!(self, Source::Ops, "rmsnorm_concat", (u32v(op, a.rows)?, 2, 1), norm_block(op, a.cols)?, 0;
            &a.ptr(), &wa.mem.ptr, &b.ptr(), &wb.mem.ptr, &out.ptr(), &ca, &cb, &eps, &p1);
        Ok(out)
    }

    fn linear(&self, x: &CudaBuf, w: &CudaWeight, _rows: Rows) -> BResult<CudaBuf> {
        let _p = self.prof.guard("linear");
        let _s = self.shape_guard(w);
        let op = "linear";
        let (n_out, k) = (w.rows(), w.cols());
        check::linear(x.shape(), (n_out, k))?;
        let out = self.buf(x.rows, n_out)?;
        if x.rows == 0 || n_out == 0 {
            return Ok(out);
        }
        let (n32, k32, r32) = (i32v(op, n_out)?, i32v(op, k)?, i32v(op, x.rows)?);
        let grid = (u32v(op, n_out.div_ceil(8))?, 1, 1);
        match w {
            CudaWeight::Bf16 { mem, .. }
                if self.bulk_rows(_rows, x.rows) && k.is_multiple_of(8) =>
            {
                if self.opts.gemm_lt && self.gemm_lt(mem.ptr, x, &out, n_out, k)? {
                    return Ok(out);
                }
                // the tensor-core tile takes K in 32-key steps
                let name = if self.opts.tc_bulk && k.is_multiple_of(32) {
                    "gemm_bf16_tc"
                } else {
                    "gemm_bf16_tiled"
                };
                let mut r0 = 0;
                while r0 < x.rows {
                    // grid.y is at most 65535 tiles of 64 rows
                    let rn = (x.rows - r0).min(MAX_GRID_Y * 64);
                    let (xp, yp) = (x.row_ptr(r0)?, out.row_ptr(r0)?);
                    let rn32 = i32v(op, rn)?;
                    let g = (u32v(op, n_out.div_ceil(64))?, u32v(op, rn.div_ceil(64))?, 1);
                    go!(self, Source::Gemm, name, g, 256, 0;
                        &mem.ptr, &xp, &yp, &n32, &k32, &rn32);
                    r0 += rn;
                }
            }
            CudaWeight::Bf16 { mem, .. } => {
                if !k.is_multiple_of(8) {
                    return Err(shape_err(
                        op,
                        format!("BF16 GEMV needs K a multiple of 8, got {k}"),
                    ));
                }
                let gv = bf16_gemv(&self.opts, x.rows, k, n_out);
                let g = gv.grid(op, n_out.div_ceil(gv.per_block), x.rows)?;
                if let (Some(kc), Some(chunks)) = (gv.kc, gv.split) {
                    let (part, count) = self.gemv_split(op, (g.0 * g.1) as usize, chunks)?;
                    go!(self, Source::Gemv, gv.single, g, gv.block, 0;
                        &mem.ptr, &x.ptr(), &out.ptr(), &n32, &k32, &r32, &kc, &part.ptr, &count);
                } else if let Some(kc) = gv.kc {
                    go!(self, Source::Gemv, gv.single, g, gv.block, 0;
                        &mem.ptr, &x.ptr(), &out.ptr(), &n32, &k32, &r32, &kc);
                } else {
                    let null = 0u64;
                    go!(self, Source::Gemv, gv.single, g, gv.block, 0;
                        &mem.ptr, &x.ptr(), &out.ptr(), &null, &n32, &k32, &r32);
                }
            }
            CudaWeight::Fp8 { mem, scale, .. } => {
                go!(self, Source::Moe, "gemv_fp8", grid, 256, 0;
                    &mem.ptr, &scale.ptr, &x.ptr(), &out.ptr(), &n32, &k32, &r32);
            }
            CudaWeight::Nvfp4 { mem, scale, .. } => {
                // weight_nvfp4 / nvfp4_weight checked: k a multiple of 16, codes [n_out, k/2],
                // scales [n_out, k/16] after the global
                let sp = scale.at(NVFP4_SCALE_AT)?;
                go!(self, Source::Moe, "gemv_nvfp4", grid, 256, 0;
                    &mem.ptr, &sp, &scale.ptr, &x.ptr(), &out.ptr(), &n32, &k32, &r32);
            }
        }
        Ok(out)
    }

    fn add_rms_norm(
        &self,
        a: &CudaBuf,
        b: &CudaBuf,
        w: &CudaVector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<(CudaBuf, CudaBuf)> {
        let _p = self.prof.guard("add_rms_norm");
        same_shape("add_rms_norm", a, b)?;
        check::rms_norm("add_rms_norm", a.shape(), group, w.len)?;
        let sum = self.buf(a.rows, a.cols)?;
        let out = self.buf(a.rows, a.cols)?;
        let groups = a.rows * (a.cols / group);
        if groups == 0 {
            return Ok((sum, out));
        }
        let block = norm_block("add_rms_norm", group)?;
        let (g32, p1) = (i32v("add_rms_norm", group)?, i32::from(plus_one));
        go!(self, Source::Ops, "add_rmsnorm_groups", (u32v("add_rms_norm", groups)?, 1, 1), block, 0;
            &a.ptr(), &b.ptr(), &w.mem.ptr, &sum.ptr(), &out.ptr(), &g32, &eps, &p1);
        Ok((sum, out))
    }

    fn linear_many(&self, x: &CudaBuf, ws: &[&CudaWeight], rows: Rows) -> BResult<Vec<CudaBuf>> {
        let op = "linear_many";
        let k = x.cols;
        let fits = !ws.is_empty()
            && ws.len() <= MULTI_MAX
            && k.is_multiple_of(8)
            && ws
                .iter()
                .all(|w| matches!(w, CudaWeight::Bf16 { cols, .. } if *cols == k));
        let bulk = self.bulk_rows(rows, x.rows);
        if !fits || x.rows == 0 || bulk {
            return ws.iter().map(|w| self.linear(x, w, rows)).collect();
        }
        let _p = self.prof.guard("linear_many");
        let _s = self.shape_guard(ws[0]);
        let mut m = Multi {
            w: [0; MULTI_MAX],
            y: [0; MULTI_MAX],
            n_out: [0; MULTI_MAX],
            start: [0; MULTI_MAX + 1],
            count: ws.len() as i32,
        };
        let mut outs = Vec::with_capacity(ws.len());
        let total = tiled_outputs(ws.iter().map(|w| w.rows()));
        let gv = bf16_gemv(&self.opts, x.rows, k, total);
        let Bf16Gemv {
            multi: name,
            per_block,
            block,
            kc,
            split,
            ..
        } = gv;
        let mut blocks = 0usize;
        for (j, w) in ws.iter().enumerate() {
            let CudaWeight::Bf16 { mem, rows: n, .. } = w else {
                unreachable!("checked above: every weight is BF16");
            };
            let y = self.buf(x.rows, *n)?;
            m.w[j] = mem.ptr;
            m.y[j] = y.ptr();
            m.n_out[j] = i32v(op, *n)?;
            m.start[j] = i32v(op, blocks)?;
            blocks += n.div_ceil(per_block);
            outs.push(y);
        }
        for j in ws.len()..=MULTI_MAX {
            m.start[j] = i32v(op, blocks)?;
        }
        if blocks == 0 {
            // every weight has zero outputs: nothing to launch
            return Ok(outs);
        }
        let (k32, r32) = (i32v(op, k)?, i32v(op, x.rows)?);
        let g = gv.grid(op, blocks, x.rows)?;
        if let (Some(kc), Some(chunks)) = (kc, split) {
            let (part, count) = self.gemv_split(op, (g.0 * g.1) as usize, chunks)?;
            go!(self, Source::Gemv, name, g, block, 0;
                &m, &x.ptr(), &k32, &r32, &kc, &part.ptr, &count);
        } else if let Some(kc) = kc {
            go!(self, Source::Gemv, name, g, block, 0;
                &m, &x.ptr(), &k32, &r32, &kc);
        } else {
            go!(self, Source::Gemv, name, g, block, 0;
                &m, &x.ptr(), &k32, &r32);
        }
        Ok(outs)
    }

    fn add_sigmoid_mul(&self, a: &CudaBuf, x: &CudaBuf, gate: &CudaBuf) -> BResult<CudaBuf> {
        let _p = self.prof.guard("add_sigmoid_mul");
        same_shape("add_sigmoid_mul", a, x)?;
        check::gate("add_sigmoid_mul", x.shape(), gate.shape())?;
        let out = self.buf(a.rows, a.cols)?;
        let n = a.rows * a.cols;
        if n == 0 {
            return Ok(out);
        }
        let op = "add_sigmoid_mul";
        let (nn, cols, gcols) = (i64v(op, n)?, i32v(op, a.cols)?, i32v(op, gate.cols)?);
        go!(self, Source::Ops, "add_sigmoid_mul", stride_grid(n), 256, 0;
            &a.ptr(), &x.ptr(), &gate.ptr(), &out.ptr(), &nn, &cols, &gcols);
        Ok(out)
    }

    fn add(&self, a: &CudaBuf, b: &CudaBuf) -> BResult<CudaBuf> {
        let _p = self.prof.guard("add");
        same_shape("add", a, b)?;
        self.elementwise(a, b, 0)
    }

    fn silu_mul(&self, gate: &CudaBuf, up: &CudaBuf) -> BResult<CudaBuf> {
        let _p = self.prof.guard("silu_mul");
        same_shape("silu_mul", gate, up)?;
        self.elementwise(gate, up, 1)
    }

    fn sigmoid_mul(&self, x: &CudaBuf, gate: &CudaBuf) -> BResult<CudaBuf> {
        let _p = self.prof.guard("sigmoid_mul");
        check::gate("sigmoid_mul", x.shape(), gate.shape())?;
        self.elementwise(x, gate, 2)
    }

    fn rope(
        &self,
        x: &CudaBuf,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        positions: &[usize],
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("rope");
        check::rope(x.shape(), positions.len(), head_dim, rot_dims)?;
        let out = self.buf(x.rows, x.cols)?;
        if x.rows == 0 || x.cols == 0 {
            return Ok(out);
        }
        let pos: Vec<i64> = positions
            .iter()
            .map(|&p| i64v("rope", p))
            .collect::<BResult<_>>()?;
        let pd = self.htod(&pos)?;
        self.rope_launch(x, &out, head_dim, rot_dims, theta, style, (pd.ptr, 1))?;
        Ok(out)
    }

    fn attn_prefill(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        d: &AttnDims,
        cache: &mut CudaKv,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("attn_prefill");
        check_attn(q, k, v, d, cache)?;
        let out = self.buf(q.rows, d.q_heads * d.head_dim)?;
        if q.rows == 0 {
            return Ok(out);
        }
        self.attend(q, k, v, d, &mut [cache], q.rows, 0, &out, None)?;
        Ok(out)
    }

    fn attn_prefill_lanes(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        d: &AttnDims,
        caches: &mut [&mut CudaKv],
        lens: &[usize],
    ) -> BResult<Option<CudaBuf>> {
        if lens.len() != caches.len() {
            return Err(shape_err(
                "attn_prefill_lanes",
                format!("{} row counts for {} lanes", lens.len(), caches.len()),
            ));
        }
        // only lanes that alone would each take the flash kernel (so each keeps its bits), of
        // one cache precision (mixed precisions run lane by lane)
        let f32kv = caches.first().is_some_and(|c| c.f32);
        let joinable = lens
            .iter()
            .zip(caches.iter())
            .all(|(&t, c)| t > 0 && self.prefill_flash(t, d.head_dim) && c.f32 == f32kv);
        if !self.opts.attn_joined || lens.len() < 2 || !joinable {
            return Ok(None);
        }
        let _p = self.prof.guard("attn_prefill");
        let rows: usize = lens.iter().sum();
        if q.rows != rows {
            return Err(shape_err(
                "attn_prefill_lanes",
                format!("{} query rows for lanes of {rows} rows in all", q.rows),
            ));
        }
        // every lane's shapes and room before any launch, so an error leaves every cache as it
        // was (each chunk's `kv_table` checks its own lanes only)
        for (c, &t) in caches.iter().zip(lens) {
            check_attn(q, k, v, d, c)?;
            check::kv_room(c.len, t, c.capacity)?;
        }
        let out = self.buf(rows, d.q_heads * d.head_dim)?;
        let mut row0 = 0;
        for (chunk, ls) in caches.chunks_mut(MAX_LANES).zip(lens.chunks(MAX_LANES)) {
            self.attend_rows(q, k, v, d, chunk, ls, row0, &out)?;
            row0 += ls.iter().sum::<usize>();
        }
        Ok(Some(out))
    }

    fn attn_step(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        d: &AttnDims,
        caches: &mut [&mut CudaKv],
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("attn_step");
        check::lanes("attn_step", q.rows, caches.len())?;
        for c in caches.iter() {
            check_attn(q, k, v, d, c)?;
        }
        let out = self.buf(q.rows, d.q_heads * d.head_dim)?;
        for (ci, chunk) in caches.chunks_mut(MAX_LANES).enumerate() {
            self.attend(q, k, v, d, chunk, 1, ci * MAX_LANES, &out, None)?;
        }
        Ok(out)
    }

    fn gdn_conv(
        &self,
        x: &CudaBuf,
        w: &CudaVector,
        d: &GdnDims,
        state: &mut CudaGdn,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("gdn_conv");
        check_conv(x, w, d)?;
        let u = self.buf(x.rows, x.cols)?;
        if x.rows > 0 {
            self.conv(x, w, d, &mut [state], &[x.rows], 0, &u)?;
        }
        Ok(u)
    }

    fn gdn_conv_step(
        &self,
        x: &CudaBuf,
        w: &CudaVector,
        d: &GdnDims,
        states: &mut [&mut CudaGdn],
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("gdn_conv_step");
        check_conv(x, w, d)?;
        check::lanes("gdn_conv_step", x.rows, states.len())?;
        let u = self.buf(x.rows, x.cols)?;
        for (ci, chunk) in states.chunks_mut(MAX_LANES).enumerate() {
            let ones = &ONE_ROW_EACH[..chunk.len()];
            self.conv(x, w, d, chunk, ones, ci * MAX_LANES, &u)?;
        }
        Ok(u)
    }

    fn gdn_prefill(
        &self,
        qkv: &CudaBuf,
        b: &CudaBuf,
        a: &CudaBuf,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
        d: &GdnDims,
        state: &mut CudaGdn,
        _chunked: bool,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("gdn_prefill");
        check_gdn(qkv, b, a, a_log, dt_bias, d)?;
        let o = self.buf(qkv.rows, d.v_heads * d.v_dim)?;
        self.delta(
            qkv,
            b,
            a,
            a_log,
            dt_bias,
            d,
            &mut [state],
            &[qkv.rows],
            0,
            &o,
        )?;
        Ok(o)
    }

    /// Up to `MAX_LANES` lanes a launch, each lane's rows at their own offset and count
    /// (`RowTab`): the same kernels, and so the same bits, as each lane's own `gdn_conv` and
    /// `gdn_prefill` (a one-row lane takes `gdn_conv_rows` + `gdn_conv_shift` here and
    /// `gdn_conv_one` alone, bitwise equal in the contract).
    fn gdn_prefill_lanes(
        &self,
        qkv: &CudaBuf,
        b: &CudaBuf,
        a: &CudaBuf,
        conv: &CudaVector,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
        d: &GdnDims,
        lens: &[usize],
        states: &mut [&mut CudaGdn],
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("gdn_prefill_lanes");
        if !self.opts.gdn_lanes || lens.contains(&0) {
            // lane by lane (it checks every input first): for comparison, or where a lane
            // brings no rows (its solo calls return at once; the row tables take lanes of at
            // least one row)
            return model::backend::gdn_prefill_each(
                self, qkv, b, a, conv, a_log, dt_bias, d, lens, states,
            );
        }
        // every check before any lane's history or state moves
        model::backend::check_gdn_lanes(self, qkv, b, a, conv, a_log, dt_bias, d, lens, states)?;
        let u = self.buf(qkv.rows, qkv.cols)?;
        let mut row0 = 0;
        for (lc, sc) in lens.chunks(MAX_LANES).zip(states.chunks_mut(MAX_LANES)) {
            self.conv(qkv, conv, d, sc, lc, row0, &u)?;
            row0 += lc.iter().sum::<usize>();
        }
        let o = self.buf(qkv.rows, d.v_heads * d.v_dim)?;
        let mut row0 = 0;
        for (lc, sc) in lens.chunks(MAX_LANES).zip(states.chunks_mut(MAX_LANES)) {
            self.delta(&u, b, a, a_log, dt_bias, d, sc, lc, row0, &o)?;
            row0 += lc.iter().sum::<usize>();
        }
        Ok(o)
    }

    fn gdn_step(
        &self,
        qkv: &CudaBuf,
        b: &CudaBuf,
        a: &CudaBuf,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
        d: &GdnDims,
        states: &mut [&mut CudaGdn],
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("gdn_step");
        check_gdn(qkv, b, a, a_log, dt_bias, d)?;
        check::lanes("gdn_step", qkv.rows, states.len())?;
        let o = self.buf(qkv.rows, d.v_heads * d.v_dim)?;
        for (ci, chunk) in states.chunks_mut(MAX_LANES).enumerate() {
            let ones = &ONE_ROW_EACH[..chunk.len()];
            self.delta(
                qkv,
                b,
                a,
                a_log,
                dt_bias,
                d,
                chunk,
                ones,
                ci * MAX_LANES,
                &o,
            )?;
        }
        Ok(o)
    }

    fn gdn_step_gated(
        &self,
        qkv: &CudaBuf,
        b: &CudaBuf,
        a: &CudaBuf,
        a_log: &CudaVector,
        dt_bias: &CudaVector,
        d: &GdnDims,
        states: &mut [&mut CudaGdn],
        z: &CudaBuf,
        w: &CudaVector,
        eps: f32,
    ) -> BResult<CudaBuf> {
        let op = "gdn_step_gated";
        let (nk, nv, dk, dv, c) = (d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.channels());
        // gdn_step_k128_gated's reach; otherwise the two ops it stands for
        let fits = self.opts.gdn_fused
            && !self.opts.gdn_generic
            && dk == 128
            && dv == 128
            && nk > 0
            && nv.is_multiple_of(nk)
            // rmsnorm_silu_groups' block for the group, which the fused block's sum repeats
            && norm_block(op, dv).is_ok_and(|b| b == 128);
        if !fits {
            let o = self.gdn_step(qkv, b, a, a_log, dt_bias, d, states)?;
            return self.rms_norm_silu(&o, z, w, dv, eps, false);
        }
        let _p = self.prof.guard("gdn_step");
        check_gdn(qkv, b, a, a_log, dt_bias, d)?;
        check::lanes(op, qkv.rows, states.len())?;
        let out = self.buf(qkv.rows, nv * dv)?;
        check::rms_norm(op, out.shape(), dv, w.len)?;
        same_shape(op, &out, z)?;
        let (c32, nk32, nv32) = (i32v(op, c)?, i32v(op, nk)?, i32v(op, nv)?);
        let q_scale = 1.0f32 / (dk as f32).sqrt();
        for (ci, chunk) in states.chunks(MAX_LANES).enumerate() {
            let row0 = ci * MAX_LANES;
            let tab = gdn_tab(op, chunk, d, |s| s.s.ptr)?;
            let (up, bp, ap) = (qkv.row_ptr(row0)?, b.row_ptr(row0)?, a.row_ptr(row0)?);
            let (zp, op_) = (z.row_ptr(row0)?, out.row_ptr(row0)?);
            let grid = (u32v(op, nv)?, u32v(op, chunk.len())?, 1);
            go!(self, Source::Ops, "gdn_step_k128_gated", grid, 128, 0;
                &tab, &up, &bp, &ap, &a_log.mem.ptr, &dt_bias.mem.ptr, &zp, &w.mem.ptr, &op_,
                &c32, &nk32, &nv32, &q_scale, &eps);
        }
        Ok(out)
    }

    fn route(&self, logits: &CudaBuf, k: usize, keep: Option<&[bool]>) -> BResult<CudaRoute> {
        let _p = self.prof.guard("route");
        let e = logits.cols;
        check::route(e, k, keep)?;
        let n = logits.rows;
        let ids = self.alloc(cmul("route", &[n, k, 4])?)?;
        let wts = self.alloc(cmul("route", &[n, k, 4])?)?;
        if n > 0 {
            let mp = match keep {
                Some(m) => {
                    let bytes: Vec<u8> = m.iter().map(|&b| u8::from(b)).collect();
                    let mut masks = self.masks.lock().unwrap_or_else(|p| p.into_inner());
                    match masks.get(&bytes) {
                        Some(d) => d.ptr,
                        None => {
                            let d = self.htod(&bytes)?;
                            let p = d.ptr;
                            masks.insert(bytes, d);
                            p
                        }
                    }
                }
                None => 0,
            };
            let ep = self.err_ptr()?;
            let p = kernels::plan_router(n, e, k).map_err(dev)?;
            let (e32, k32) = (i32v("route", e)?, i32v("route", k)?);
            // a row whose kept logits are all NaN/-inf sets the error flag: the next download
            // reports it as NonFinite (no synchronisation here)
            go!(self, Source::Moe, "moe_router", (u32v("route", n)?, 1, 1), 256, p.dyn_smem as u32;
                &logits.ptr(), &ids.ptr, &wts.ptr, &e32, &k32, &mp, &ep);
        }
        Ok(CudaRoute {
            ids,
            wts,
            rows: n,
            k,
        })
    }

    fn route_host(&self, route: &CudaRoute) -> BResult<Route> {
        let n = route.rows * route.k;
        let ids: Vec<u32> = self.dtoh(route.ids.ptr, n)?;
        let wts: Vec<f32> = self.dtoh(route.wts.ptr, n)?;
        let k = route.k.max(1);
        Ok(Route {
            experts: ids.chunks(k).map(<[u32]>::to_vec).collect(),
            weights: wts.chunks(k).map(<[f32]>::to_vec).collect(),
        })
    }

    fn moe_experts(
        &self,
        x: &CudaBuf,
        route: &CudaRoute,
        experts: &[Option<Expert<CudaWeight>>],
        kind: Rows,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("moe_experts");
        let op = "moe_experts";
        let TableRef {
            ptr: tab,
            i,
            h,
            nvfp4,
        } = self.expert_table(experts)?;
        if x.cols != h || route.rows != x.rows {
            return Err(shape_err(
                op,
                format!(
                    "x [{}, {}] with {} routed rows for experts of H {h}",
                    x.rows, x.cols, route.rows
                ),
            ));
        }
        // A routing that names a pruned expert (null table entries) or an id past the table is
        // caught by the kernels, which then read nothing, write NaN and set the error flag that
        // the next download reports: no host synchronisation per layer.
        let (e32, ep) = (i32v(op, experts.len())?, self.err_ptr()?);
        let (n, k) = (x.rows, route.k);
        // outputs per warp: four from a few rows on (the same bits, a quarter of the activation
        // loads), when I and H split into fours
        let wide = !nvfp4 && n >= GEMV_WIDE_ROWS && i.is_multiple_of(4) && h.is_multiple_of(4);
        let ((gate_up, down), per_warp) = if nvfp4 {
            (("moe_gate_up_nvfp4", "moe_down_nvfp4"), 1)
        } else if wide && self.opts.moe_gate_up_u2 {
            (("moe_gate_up_tab4u2", "moe_down_tab4"), 4)
        } else if wide {
            (("moe_gate_up_tab4", "moe_down_tab4"), 4)
        } else {
            (("moe_gate_up_tab", "moe_down_tab"), 1)
        };
        let y = self.buf(n, h)?;
        if n == 0 {
            return Ok(y);
        }
        if kind == Rows::Bulk && !nvfp4 && n >= self.opts.group_min_rows {
            self.experts_grouped(x, route, tab, experts.len(), i, h, &y, false)?;
            return Ok(y);
        }
        // many rows: the same bits with each expert's weights read once per slot group (`wide`
        // already holds I and H to multiples of 4, which SLOTS_PER_WARP divides)
        const _: () = assert!(4 % SLOTS_PER_WARP == 0);
        if wide && n >= self.opts.slots_min_rows && kind != Rows::Joined {
            self.experts_grouped(x, route, tab, experts.len(), i, h, &y, true)?;
            return Ok(y);
        }
        // joined prompts take what each prompt alone would (fewer rows than joined_rows)
        let tc = self.opts.moe_tc
            || (matches!(kind, Rows::Bulk | Rows::Joined) && self.opts.moe_tc_bulk);
        if !nvfp4 && tc && tc_experts_fit(i, h, k) {
            let grouped = n >= self.opts.moe_tc_group_rows;
            self.experts_tc(x, route, tab, experts.len(), i, h, &y, grouped)?;
            return Ok(y);
        }
        let hw = self.alloc(cmul(op, &[n, k, i, 4])?)?;
        let (i32_, h32, k32) = (i32v(op, i)?, i32v(op, h)?, i32v(op, k)?);
        let mut r0 = 0;
        while r0 < n {
            let rn = (n - r0).min(MAX_GRID_Y);
            let ids = route.ids.at(r0 * k * 4)?;
            let wts = route.wts.at(r0 * k * 4)?;
            let xp = x.row_ptr(r0)?;
            let hp = hw.at(r0 * k * i * 4)?;
            let yp = y.row_ptr(r0)?;
            let rows = u32v(op, rn)?;
            if nvfp4 {
                let gx = u32v(op, (k * i).div_ceil(8 * per_warp))?;
                go!(self, Source::Moe, gate_up, (gx, rows, 1), 256, 0;
                    &tab, &ids, &xp, &hp, &i32_, &h32, &k32, &e32, &ep);
            } else {
                // slot-major (moe.cu `moe_gate_up_tab_body`): one tile of every slot in flight
                let (slots, tiles) = (u32v(op, rn * k)?, u32v(op, i.div_ceil(8 * per_warp))?);
                go!(self, Source::Moe, gate_up, (slots, tiles, 1), 256, 0;
                    &tab, &ids, &xp, &hp, &i32_, &h32, &k32, &e32, &ep);
            }
            if per_warp == 1 && !nvfp4 && (1..=32).contains(&k) {
                // the k experts of an output in k warps of one block: the same bits, the k
                // dots' loads at once
                let block = u32v(op, 32 * k)?;
                go!(self, Source::Moe, "moe_down_tab_split", (u32v(op, h)?, rows, 1), block, 0;
                    &tab, &ids, &wts, &hp, &yp, &i32_, &h32, &k32, &e32, &ep);
            } else if per_warp == 4
                && self.opts.moe_down_split4
                && (1..=32).contains(&k)
                && h / 4 <= MAX_GRID_Y
            {
                // the k experts of a 4-output tile in k warps of one block: the same bits as
                // moe_down_tab4, the k dots' loads at once
                let block = u32v(op, 32 * k)?;
                go!(self, Source::Moe, "moe_down_tab4_split", (rows, u32v(op, h / 4)?, 1), block, 0;
                    &tab, &ids, &wts, &hp, &yp, &i32_, &h32, &k32, &e32, &ep);
            } else if nvfp4 {
                let gx = u32v(op, h.div_ceil(8 * per_warp))?;
                go!(self, Source::Moe, down, (gx, rows, 1), 256, 0;
                    &tab, &ids, &wts, &hp, &yp, &i32_, &h32, &k32, &e32, &ep);
            } else {
                // row-major (moe.cu `moe_down_tab_body`): one tile of every row in flight
                let tiles = u32v(op, h.div_ceil(8 * per_warp))?;
                go!(self, Source::Moe, down, (rows, tiles, 1), 256, 0;
                    &tab, &ids, &wts, &hp, &yp, &i32_, &h32, &k32, &e32, &ep);
            }
            r0 += rn;
        }
        Ok(y)
    }

    /// A prompt under every row count from which `Rows::Bulk` changes kernels (the tiled GEMM,
    /// the grouped FMA experts, the slot experts) runs the row-invariant GEMVs and experts
    /// alone, so joined with others it keeps its bits (`bulk_rows`, `moe_experts`).
    fn joined_rows(&self) -> usize {
        let o = &self.opts;
        o.gemm_min_rows
            .min(o.group_min_rows)
            .min(o.slots_min_rows)
            .saturating_sub(1)
    }

    fn settle(&self) -> BResult<()> {
        // a download of nothing: the wait, and the device error flag read and cleared
        self.dtoh::<u8>(0, 0).map(|_| ())
    }

    fn reserve(&self, bytes: u64) -> BResult<u64> {
        if bytes == 0 {
            return Ok(0);
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let n = usize::try_from(bytes)
            .map_err(|_| dev(format!("a reservation of {bytes} bytes does not fit usize")))?;
        // One block from the stream-ordered pool, handed straight back: the pool keeps freed
        // memory (`keep_pool_memory`: release threshold u64::MAX) and serves every later
        // allocation of this context from it, lane state and scratch alike.
        let block = match self.alloc_exact(n) {
            Ok(b) => b,
            Err(e) => {
                let free = self.mem_info().map(|(f, _)| f as u64).unwrap_or(0);
                // what the failed start-up took goes back to the driver, not only to the pool
                let _ = self.synchronize();
                let _ = crate::memwatch::trim_pool();
                return Err(dev(format!(
                    "the memory plan's device state is {:.3} GiB ({bytes} bytes: KV pool, lane \
                     state, scratch, codec state, reference cache) and cannot be reserved: {e} \
                     ({:.3} GiB free on the device); lower --parallel, --context or \
                     --prompt-cache-gib, or leave guidance off",
                    gib(bytes),
                    gib(free)
                )));
            }
        };
        drop(block);
        self.synchronize()?;
        // what the pool now keeps unallocated: the reservation, if the driver kept it
        let held = match (
            crate::memwatch::pool_reserved_bytes(),
            crate::memwatch::pool_used_bytes(),
        ) {
            (Ok(r), Ok(u)) => r.saturating_sub(u).min(bytes),
            _ => 0,
        };
        Ok(held)
    }

    fn resident_rounds(&self) -> bool {
        // a round always takes the split-key decode; a higher threshold sends short host-path
        // steps to the generic kernel, whose bits differ, so rounds stay on the host then
        self.opts.kept_rounds && self.opts.split_min_keys <= 1
    }

    fn write_rows(&self, src: &CudaBuf, dst: &mut [&mut CudaBuf]) -> BResult<()> {
        let _p = self.prof.guard("write_rows");
        check::lanes("write_rows", src.rows, dst.len())?;
        for (i, d) in dst.iter_mut().enumerate() {
            if (d.rows, d.cols) != (1, src.cols) {
                return Err(shape_err(
                    "write_rows",
                    format!(
                        "row {i} goes to a {:?} buffer, not [1, {}]",
                        (d.rows, d.cols),
                        src.cols
                    ),
                ));
            }
            self.dtod(d.ptr(), src.row_ptr(i)?, src.cols * 4)?;
        }
        Ok(())
    }

    fn kv_note(&self, kv: &mut CudaKv, rows: usize) -> BResult<()> {
        kv.len = check::kv_room(kv.len, rows, kv.capacity)?;
        Ok(())
    }

    fn round_new(&self, lanes: usize, spec: &model::backend::RoundSpec) -> BResult<CudaRound> {
        if lanes == 0 {
            return Err(shape_err("round_new", "a round of 0 lanes".into()));
        }
        let lane_in = self.zeroed(cmul("round", &[lanes, std::mem::size_of::<LaneIn>()])?)?;
        let frames = self.zeroed(cmul("round", &[lanes, model::ROW_WIDTH, 8])?)?;
        let cands = self.htod(&spec.candidates)?;
        Ok(CudaRound {
            graph: None,
            pool: None,
            lanes,
            leaders: 0,
            lane_in,
            frames,
            cands,
            spec: spec.clone(),
            host: Vec::new(),
        })
    }

    fn round_write(
        &self,
        round: &mut CudaRound,
        lanes: &[model::backend::RoundLane],
    ) -> BResult<()> {
        let _p = self.prof.guard("round_write");
        if lanes.len() != round.lanes {
            return Err(shape_err(
                "round_write",
                format!("{} lanes for a round of {}", lanes.len(), round.lanes),
            ));
        }
        if self.is_recording() {
            return Err(dev("round_write inside a recorded frame round"));
        }
        let leaders = model::backend::round_leaders(lanes)?;
        let host: Vec<LaneIn> = lanes
            .iter()
            .map(|l| {
                let (follow, guide, gamma) = match l.branch {
                    model::backend::Branch::Own => (-1, -1, 0.0),
                    model::backend::Branch::Guided { uncond, gamma } => {
                        (-1, i32v("round_write", uncond)?, gamma)
                    }
                    model::backend::Branch::Uncond { of } => (i32v("round_write", of)?, -1, 0.0),
                };
                Ok(LaneIn {
                    rows: i64v("round_write", l.rows)?,
                    tower_rows: i64v("round_write", l.tower_rows)?,
                    seed: l.seed,
                    step: l.step,
                    temperature: l.params.temperature,
                    top_k: i32::try_from(l.params.top_k).unwrap_or(i32::MAX),
                    top_p: l.params.top_p,
                    ras: i32::from(l.params.ras),
                    n_recent: l.n_recent.min(model::RAS_WINDOW) as i32,
                    follow,
                    guide,
                    gamma,
                    last: l.last,
                    recent: l.recent,
                })
            })
            .collect::<BResult<_>>()?;
        self.gpu.ctx.bind_to_thread().map_err(dev)?;
        // SAFETY: lane_in holds `lanes` LaneIn; pageable memory is staged before the call
        // returns.
        unsafe { cu::memcpy_htod_async(round.lane_in.ptr, &host, self.issue_stream()?) }
            .map_err(dev)?;
        round.host = lanes.to_vec();
        round.leaders = leaders;
        Ok(())
    }

    fn round_frames(&self, round: &CudaRound) -> BResult<Vec<model::Row>> {
        let _p = self.prof.guard("download");
        let v: Vec<i64> = self.dtoh(round.frames.ptr, round.lanes * model::ROW_WIDTH)?;
        let drawn: Vec<model::Row> = v
            .chunks_exact(model::ROW_WIDTH)
            .map(|c| {
                let mut r = [0i64; model::ROW_WIDTH];
                r.copy_from_slice(c);
                r
            })
            .collect();
        if round.host.len() != round.lanes {
            return Err(shape_err(
                "round_frames",
                "the round's lanes were never written".into(),
            ));
        }
        Ok(model::backend::round_frames_of(&round.host, &drawn))
    }

    fn round_sample(
        &self,
        logits: &CudaBuf,
        round: &mut CudaRound,
        slot: model::backend::Slot,
    ) -> BResult<()> {
        let _p = self.prof.guard("round_sample");
        let op = "round_sample";
        // main logits cover every lane (a guided lane mixes in its branch's row in place), a
        // head's only the drawing lanes; one block per covered lane, an unconditional
        // branch's block returning at once
        let covers = match slot {
            model::backend::Slot::Main => model::backend::Counter::Backbone,
            model::backend::Slot::Head(_) => model::backend::Counter::Tower,
        };
        round.check_rows(op, logits.rows, covers)?;
        let n = logits.cols;
        let slot32 = match slot {
            model::backend::Slot::Main => {
                if n != round.spec.candidates.len() {
                    return Err(shape_err(
                        op,
                        format!(
                            "{n} main logits per row for {} candidates",
                            round.spec.candidates.len()
                        ),
                    ));
                }
                -1
            }
            model::backend::Slot::Head(r) => {
                if 2 + r >= model::ROW_WIDTH {
                    return Err(shape_err(
                        op,
                        format!("head {r} of {}", model::ROW_WIDTH - 2),
                    ));
                }
                r as i32
            }
        };
        let p = kernels::plan_round_sample(logits.rows, n).map_err(dev)?;
        let f = self.optin_func(Source::Round, &p)?;
        let (n32, rounds32) = (i32v(op, n)?, i32v(op, kernels::round_sample_rounds(n))?);
        let cfg = p.cfg().map_err(dev)?;
        let (ss, se) = (round.spec.semantic_start, round.spec.semantic_end);
        if self.skipped(op) {
            return Ok(());
        }
        // SAFETY: the arguments match round_sample in kernels/round.cu: logits [rows, n] (rows
        // the covered lanes; a guided lane's row is rewritten in place), lane_in [lanes],
        // frames [lanes, 11], cands [n] (main), rounds = ceil(n / 1024); the plan sized the
        // shared memory for n and checked rounds against the kernel's most.
        unsafe {
            self.gpu
                .stream
                .launch_builder(&f)
                .arg(&logits.ptr())
                .arg(&n32)
                .arg(&rounds32)
                .arg(&round.lane_in.ptr)
                .arg(&round.frames.ptr)
                .arg(&round.cands.ptr)
                .arg(&slot32)
                .arg(&ss)
                .arg(&se)
                .launch(cfg)
        }
        .map_err(dev)?;
        Ok(())
    }

    fn round_embed(
        &self,
        tables: &[&CudaWeight],
        round: &CudaRound,
        terms: &[model::backend::CodeTerm],
        scale: f32,
        lanes: model::backend::Counter,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("round_embed");
        let op = "round_embed";
        let rows = round.covered(lanes);
        round.check_rows(op, rows, lanes)?;
        if tables.len() > 8 || terms.len() > MAX_TERMS {
            return Err(shape_err(
                op,
                format!(
                    "{} tables and {} terms, at most 8 and {MAX_TERMS}",
                    tables.len(),
                    terms.len()
                ),
            ));
        }
        let cols = tables.first().map_or(0, |t| t.cols());
        let mut tabs = Tables { p: [0; 8] };
        let mut tm = Terms {
            table_rows: [0; 8],
            n: terms.len() as i32,
            table: [0; MAX_TERMS],
            last: [0; MAX_TERMS],
            col: [0; MAX_TERMS],
            offset: [0; MAX_TERMS],
            guarded: [0; MAX_TERMS],
        };
        for (i, t) in tables.iter().enumerate() {
            match t {
                CudaWeight::Bf16 { mem, cols: c, rows } if *c == cols => {
                    tabs.p[i] = mem.ptr;
                    tm.table_rows[i] = i64v(op, *rows)?;
                }
                w => {
                    return Err(shape_err(
                        op,
                        format!(
                        "table {i} is {} [{}, {}]; tables must be BF16 with table 0's {cols} cols",
                        w.format_name(),
                        w.rows(),
                        w.cols()
                    ),
                    ))
                }
            }
        }
        for (i, t) in terms.iter().enumerate() {
            if t.table >= tables.len() || t.col >= model::ROW_WIDTH {
                return Err(shape_err(
                    op,
                    format!(
                        "term {i}: table {} of {} tables, frame column {} of {}",
                        t.table,
                        tables.len(),
                        t.col,
                        model::ROW_WIDTH
                    ),
                ));
            }
            tm.table[i] = t.table as i32;
            tm.last[i] = i32::from(t.frame == model::backend::Frame::Last);
            tm.col[i] = t.col as i32;
            tm.offset[i] = t.offset;
            tm.guarded[i] = i32::from(t.guarded);
        }
        let out = self.buf(rows, cols)?;
        if cols == 0 || rows == 0 {
            return Ok(out);
        }
        let (c32, ep) = (i32v(op, cols)?, self.err_ptr()?);
        let (ss, se) = (round.spec.semantic_start, round.spec.semantic_end);
        let cblocks = u32v(op, cols.div_ceil(128))?;
        go!(self, Source::Round, "round_embed", (u32v(op, rows)?, cblocks, 1), 128, 0;
            &tabs, &tm, &round.lane_in.ptr, &round.frames.ptr, &out.ptr(), &c32, &scale, &ss, &se, &ep);
        Ok(out)
    }

    fn norm_rope(
        &self,
        x: &CudaBuf,
        sel: (usize, usize, usize),
        w: &CudaVector,
        eps: f32,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        at: model::backend::RopeAt<'_, CudaRound>,
    ) -> BResult<CudaBuf> {
        use model::backend::RopeAt;
        let op = "norm_rope";
        let (group, offset, len) = sel;
        // the whole of x: no selection (as the trait's default body)
        let whole = (group, offset, len) == (x.cols, 0, group);
        // heads whole inside a selected group, within the kernel's shared tables; otherwise the
        // composed ops
        let fits =
            head_dim > 0 && len.is_multiple_of(head_dim) && head_dim <= 512 && rot_dims <= head_dim;
        if !fits || (whole && x.cols == 0) {
            return model::backend::norm_rope_composed(
                self, x, sel, w, eps, head_dim, rot_dims, theta, style, at,
            );
        }
        if !whole {
            check::cols_grouped(x.shape(), group, offset, len)?;
        }
        let cols = (x.cols / group) * len;
        check::rms_norm(op, (x.rows, cols), head_dim, w.len)?;
        // the positions' checks come before any early return, as rope's and rope_round's do
        match at {
            RopeAt::Host(p) => check::rope((x.rows, cols), p.len(), head_dim, rot_dims)?,
            RopeAt::Round(r, c) => {
                r.check_rows(op, x.rows, c)?;
                check::rope((x.rows, cols), x.rows, head_dim, rot_dims)?;
            }
        }
        let _p = self.prof.guard("norm_rope");
        let out = self.buf(x.rows, cols)?;
        if x.rows == 0 || cols == 0 {
            return Ok(out);
        }
        let held;
        let pos = match at {
            RopeAt::Host(p) => {
                let pv: Vec<i64> = p.iter().map(|&v| i64v(op, v)).collect::<BResult<_>>()?;
                held = self.htod(&pv)?;
                (held.ptr, 1i64)
            }
            RopeAt::Round(r, c) => (r.counter_ptr(c, 0), LANE_IN_WORDS as i64),
        };
        let (sc, g32, o32, l32) = (
            i32v(op, x.cols)?,
            i32v(op, group)?,
            i32v(op, offset)?,
            i32v(op, len)?,
        );
        let (hd32, rot32) = (i32v(op, head_dim)?, i32v(op, rot_dims)?);
        let inter = i32::from(style == Rope::Interleaved);
        let grid = (u32v(op, x.rows)?, u32v(op, cols / head_dim)?, 1);
        go!(self, Source::Ops, "rmsnorm_rope", grid, norm_block(op, head_dim)?, 0;
            &x.ptr(), &w.mem.ptr, &out.ptr(), &pos.0, &pos.1, &sc, &g32, &o32, &l32, &hd32, &rot32,
            &theta, &inter, &eps, &1i32);
        Ok(out)
    }

    fn rope_round(
        &self,
        x: &CudaBuf,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        round: &CudaRound,
        counter: model::backend::Counter,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("rope");
        round.check_rows("rope_round", x.rows, counter)?;
        check::rope(x.shape(), x.rows, head_dim, rot_dims)?;
        let out = self.buf(x.rows, x.cols)?;
        if x.cols == 0 {
            return Ok(out);
        }
        let pos = (round.counter_ptr(counter, 0), LANE_IN_WORDS as i64);
        self.rope_launch(x, &out, head_dim, rot_dims, theta, style, pos)?;
        Ok(out)
    }

    fn attn_step_round(
        &self,
        q: &CudaBuf,
        k: &CudaBuf,
        v: &CudaBuf,
        d: &AttnDims,
        caches: &mut [&mut CudaKv],
        round: &CudaRound,
        counter: model::backend::Counter,
    ) -> BResult<CudaBuf> {
        let _p = self.prof.guard("attn_step");
        check::lanes("attn_step_round", q.rows, caches.len())?;
        round.check_rows("attn_step_round", q.rows, counter)?;
        for (i, c) in caches.iter().enumerate() {
            check_attn(q, k, v, d, c)?;
            let want = round.host_counter(counter, i);
            if c.len != want {
                return Err(shape_err(
                    "attn_step_round",
                    format!(
                        "lane {i}'s cache holds {} rows, its round counter {want}",
                        c.len
                    ),
                ));
            }
        }
        let out = self.buf(q.rows, d.q_heads * d.head_dim)?;
        for (ci, chunk) in caches.chunks_mut(MAX_LANES).enumerate() {
            let lens = round.counter_ptr(counter, ci * MAX_LANES);
            self.attend(q, k, v, d, chunk, 1, ci * MAX_LANES, &out, Some(lens))?;
        }
        Ok(out)
    }

    fn capture_begin(&self) -> BResult<bool> {
        if !self.opts.graphs || self.prof.on {
            return Ok(false);
        }
        let mut rec = self.recording.lock().unwrap_or_else(|p| p.into_inner());
        if rec.is_some() {
            return Err(dev("a frame round is already being recorded"));
        }
        self.gpu
            .stream
            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(dev)?;
        *rec = Some(Arc::new(SmallPool::for_graph(self.gpu.ctx.clone())));
        Ok(true)
    }

    fn capture_end(&self, round: &mut CudaRound, keep: bool) -> BResult<()> {
        let pool = self
            .recording
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| dev("capture_end without capture_begin"))?;
        let g = self
            .gpu
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
            .map_err(dev)?;
        if keep {
            let g = g.ok_or_else(|| dev("the recorded frame round is empty"))?;
            round.graph = Some(Graph(g));
            round.pool = Some(pool);
        }
        Ok(())
    }

    fn round_replay(&self, round: &CudaRound) -> BResult<bool> {
        let Some(g) = &round.graph else {
            return Ok(false);
        };
        let _p = self.prof.guard("round_replay");
        g.0.launch().map_err(dev)?;
        Ok(true)
    }

    fn aside_begin(&self, rows: usize) -> BResult<bool> {
        // the profiler times ops on the model stream: there every op runs in order
        let on = self.aside_on.load(std::sync::atomic::Ordering::Relaxed);
        if !on || rows > ASIDE_MAX_ROWS || self.prof.on {
            return Ok(false);
        }
        let mut a = self.aside.lock().unwrap_or_else(|p| p.into_inner());
        if a.open {
            return Err(dev("a side branch begun inside another"));
        }
        if self.aside_stream.get().is_none() {
            let ctx = &self.gpu.ctx;
            let stream = if crate::runtime::model_priority_on() {
                ctx.bind_to_thread().map_err(dev)?;
                let (_least, greatest) =
                    cudarc::driver::result::stream::get_priority_range().map_err(dev)?;
                ctx.new_stream_with_priority(greatest).map_err(dev)?
            } else {
                ctx.new_stream().map_err(dev)?
            };
            let made = AsideStream {
                stream,
                fork: ctx.new_event(None).map_err(dev)?,
                done: ctx.new_event(None).map_err(dev)?,
            };
            // only this thread makes it (under the state's lock)
            let _ = self.aside_stream.set(made);
        }
        let mut pools = vec![self.small.clone()];
        if let Some(rec) = self
            .recording
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            pools.push(rec.clone());
        }
        for p in &pools {
            p.hold();
        }
        *a = AsideState {
            on: true,
            open: true,
            launched: false,
            pools,
        };
        Ok(true)
    }

    fn aside_end(&self) -> BResult<()> {
        self.aside.lock().unwrap_or_else(|p| p.into_inner()).on = false;
        Ok(())
    }

    fn aside_join(&self) -> BResult<()> {
        let mut a = self.aside.lock().unwrap_or_else(|p| p.into_inner());
        if !a.open {
            return Ok(());
        }
        let st = std::mem::take(&mut *a);
        drop(a);
        let waited = match (st.launched, self.aside_stream.get()) {
            (true, Some(s)) => s
                .done
                .record(&s.stream)
                .and_then(|_| self.gpu.stream.wait(&s.done))
                .map_err(dev),
            (true, None) => Err(dev("a side branch without its stream")),
            (false, _) => Ok(()),
        };
        if waited.is_ok() {
            for p in &st.pools {
                p.release();
            }
        } else {
            // the model stream is not ordered after the branch: its blocks stay out of use
            for p in &st.pools {
                let _ = p.held.lock().map(|mut h| h.take());
            }
        }
        waited
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The number a kernel source `#define`s `name` to.
    fn kernel_define(src: Source, name: &str) -> usize {
        let body = src.body();
        let head = format!("#define {name} ");
        let at = body
            .find(&head)
            .unwrap_or_else(|| panic!("{} defines {name}", src.name()));
        body[at + head.len()..]
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{} defines {name} to a number", src.name()))
    }

    /// `gdn_chunk`'s shared memory as ops.cu's `#define`s size it, against `GDN_CHUNK_SMEM`,
    /// and its map of threads to the lower 4 x 4 tiles of M and P (each tile once).
    #[test]
    fn gdn_chunk_smem_and_tiles_are_the_kernels() {
        let d = |name| kernel_define(Source::Ops, name);
        let (l, dk, ks, vs, ms) = (d("GC_L"), d("GC_D"), d("GC_KS"), d("GC_VS"), d("GC_MS"));
        assert_eq!((l, dk, d("GC_CW")), (64, 128, 32));
        let body = Source::Ops.body();
        assert!(body.contains(
            "#define GC_SMEM (3 * GC_L * GC_KS + GC_L * GC_VS + 2 * GC_L * GC_MS + GC_D * GC_VS + 4 * GC_L)"
        ));
        let floats = 3 * l * ks + l * vs + 2 * l * ms + dk * vs + 4 * l;
        assert_eq!(kernels::GDN_CHUNK_SMEM, 4 * floats);
        // odd row strides: a warp's 32 rows at one column hit 32 banks
        assert!(ks % 2 == 1 && vs % 2 == 1 && ms % 2 == 1);
        assert!(body.contains("while (ib < 15 && (ib + 1) * (ib + 2) / 2 <= tid) ++ib;"));
        let mut seen = std::collections::BTreeSet::new();
        for tid in 0..d("GC_TRI") {
            let mut ib = 0;
            while ib < 15 && (ib + 1) * (ib + 2) / 2 <= tid {
                ib += 1;
            }
            let jb = tid - ib * (ib + 1) / 2;
            assert!(jb <= ib && seen.insert((ib, jb)));
        }
        assert_eq!(seen.len(), 16 * 17 / 2);
    }

    /// `gemv_ts`'s shared-memory layout (gemv.cu, no padding, word w of row r at w ^ (r & 1),
    /// activations at ts_xsw(w) ^ (r & 1)), emulated: each step's copy and its fragment reads
    /// agree on where a word sits, the maps are one-to-one within a buffer, and every 8-thread
    /// phase of a 16-byte copy or read hits 8 distinct 16-byte bank groups. The kernel's index
    /// expressions are matched in the source, so a change there fails here until this follows.
    #[test]
    fn gemv_ts_layout_is_one_to_one_and_conflict_free() {
        let body = Source::Gemv.body();
        for expr in [
            "Ws[b][row * 8 + (w ^ (row & 1))]",
            "Xs[b][r * 16 + (ts_xsw(w) ^ (r & 1))]",
            "Ws[b][(32 * wo + 16 * i + 8 * q + g) * 8 + ((2 * t + h) ^ (g & 1))]",
            "Xs[b][(16 * wr + 8 * j + g) * 16 + (ts_xsw(4 * t + 2 * h + e) ^ (g & 1))]",
            "int ts_xsw(int w) { return w ^ (((w >> 3) & 1) << 1); }",
        ] {
            assert!(body.contains(expr), "gemv.cu no longer indexes {expr}");
        }
        let xsw = |w: usize| w ^ (((w >> 3) & 1) << 1);
        let wslot = |row: usize, w: usize| row * 8 + (w ^ (row & 1));
        let xslot = |r: usize, w: usize| r * 16 + (xsw(w) ^ (r & 1));
        // 16-byte words: 8 to a 128-byte line of the 32 banks
        let distinct = |a: &[usize]| {
            let mut g: Vec<usize> = a.iter().map(|v| v % 8).collect();
            g.sort_unstable();
            g.dedup();
            g.len() == a.len()
        };
        // copies: thread tid copies words tid + 128 m (weights 64 rows x 8, activations 32 x 16)
        let (mut wall, mut xall) = (Vec::new(), Vec::new());
        for m in 0..4 {
            let (mut wa, mut xa) = (Vec::new(), Vec::new());
            for tid in 0..128 {
                let q = tid + 128 * m;
                wa.push(wslot(q >> 3, q & 7));
                xa.push(xslot(q >> 4, q & 15));
            }
            for ph in 0..16 {
                assert!(
                    distinct(&wa[8 * ph..8 * ph + 8]),
                    "weight copy m {m} phase {ph}"
                );
                assert!(
                    distinct(&xa[8 * ph..8 * ph + 8]),
                    "activation copy m {m} phase {ph}"
                );
            }
            wall.extend(wa);
            xall.extend(xa);
        }
        for all in [&mut wall, &mut xall] {
            all.sort_unstable();
            assert_eq!(
                *all,
                (0..512).collect::<Vec<_>>(),
                "a buffer's words, one slot each"
            );
        }
        // fragment reads: lane = 4 g + t; each load instruction fixes (wo, i, q, h) or (wr, j, h, e)
        let phases = |a: Vec<usize>| (0..4).all(|ph| distinct(&a[8 * ph..8 * ph + 8]));
        // the four 0/1 indices of a load instruction
        let quads = || (0..16).map(|b: usize| (b >> 3, (b >> 2) & 1, (b >> 1) & 1, b & 1));
        for (wo, i, q, h) in quads() {
            let a = (0..32)
                .map(|l| wslot(32 * wo + 16 * i + 8 * q + (l >> 2), 2 * (l & 3) + h))
                .collect();
            assert!(phases(a), "weight read wo {wo} i {i} q {q} h {h}");
        }
        for (wr, j, h, e) in quads() {
            let a = (0..32)
                .map(|l| xslot(16 * wr + 8 * j + (l >> 2), 4 * (l & 3) + 2 * h + e))
                .collect();
            assert!(phases(a), "activation read wr {wr} j {j} h {h} e {e}");
        }
    }

    #[test]
    fn split_tile_rows_are_the_kernels() {
        // gemv_ts writes 64 x TS_RT chunk sums a tile: the host sizes the workspace by that
        assert_eq!(kernel_define(Source::Gemv, "TS_RT"), GEMV_TS_ROWS);
        assert_eq!(kernel_define(Source::Gemv, "TS_MAXC"), GEMV_TS_MAX_CHUNKS);
        // the key rule never makes more chunks than a tile adds
        for k in (64usize..=8192).step_by(64) {
            assert!(
                k.div_ceil(gemv_tc2_keys(256, 2, k)) <= GEMV_TS_MAX_CHUNKS,
                "K {k}"
            );
        }
    }

    #[test]
    fn down4_limit_is_the_kernels() {
        // moe_tc_down4's partials hold XT_DN4_KB key blocks: the host's limit must be that
        assert_eq!(kernel_define(Source::Moe, "XT_DN4_KB"), DN4_MAX_KB);
    }

    #[test]
    fn round_sample_limit_is_the_kernels() {
        // the sort's registers hold RADIX_MAX_ROUNDS rounds: the plan's limit must be within it
        assert!(
            kernels::ROUND_SAMPLE_MAX_ROUNDS <= kernel_define(Source::Round, "RADIX_MAX_ROUNDS")
        );
        assert_eq!(kernels::round_sample_rounds(1), 1);
        assert_eq!(kernels::round_sample_rounds(1024), 1);
        assert_eq!(kernels::round_sample_rounds(4097), 5);
        let most = 1024 * kernels::ROUND_SAMPLE_MAX_ROUNDS;
        let p = kernels::plan_round_sample(32, most).unwrap();
        // Hopper's opt-in shared memory a block (227 KiB)
        assert!(p.smem <= 227 * 1024, "{} B at {most} logits", p.smem);
        assert!(kernels::plan_round_sample(1, most + 1).is_err());
    }

    #[test]
    fn norm_blocks_hold_every_group() {
        // norm_block sizes blocks for ops.cu's NORM_REG values a thread: the two must agree
        assert_eq!(kernel_define(Source::Ops, "NORM_REG"), NORM_REG);
        for g in [
            1,
            64,
            127,
            128,
            1000,
            1023,
            1024,
            2048,
            4096,
            4097,
            12288,
            NORM_GROUP_MAX,
        ] {
            let b = norm_block("t", g).unwrap() as usize;
            assert!(
                b.is_multiple_of(32) && b <= 1024 && g <= NORM_REG * b,
                "{g}: {b}"
            );
        }
        // the figures Drama 3 runs at keep their pre-session-10 block sizes (and bits)
        assert_eq!(norm_block("t", 2048).unwrap(), 256);
        assert_eq!(norm_block("t", 256).unwrap(), 128);
        assert!(norm_block("t", NORM_GROUP_MAX + 1).is_err());
    }

    #[test]
    fn tables_have_the_c_layout() {
        assert_eq!(std::mem::size_of::<PtrTab>(), 8 * MAX_LANES);
        // ops.cu `KvTab`: four arrays (k, v, len, cap), then lenp, lstride, ladd
        assert_eq!(std::mem::size_of::<KvTab>(), 32 * MAX_LANES + 24);
        assert_eq!(std::mem::offset_of!(KvTab, cap), 24 * MAX_LANES);
        assert_eq!(std::mem::offset_of!(KvTab, lenp), 32 * MAX_LANES);
        // round.cu `LaneIn`: 4 words, 8 ints/floats, then last[11] and recent[16]
        assert_eq!(std::mem::size_of::<LaneIn>(), 280);
        assert_eq!(std::mem::offset_of!(LaneIn, last), 64);
        assert_eq!(LANE_IN_WORDS, 35);
        // round.cu `Terms`: table_rows[8], n, then five arrays of 16 ints
        assert_eq!(
            std::mem::size_of::<Terms>(),
            (64 + 4 + 5 * 4 * MAX_TERMS).next_multiple_of(8)
        );
        assert_eq!(
            std::mem::offset_of!(Terms, guarded),
            64 + 4 + 4 * 4 * MAX_TERMS
        );
        assert_eq!(std::mem::size_of::<Tables>(), 64);
        // gemv.cu `Multi`: 8 + 8 u64, 8 + 9 + 1 i32
        assert_eq!(std::mem::size_of::<Multi>(), 200);
        assert_eq!(std::mem::offset_of!(Multi, n_out), 128);
        assert_eq!(std::mem::offset_of!(Multi, count), 196);
    }

    #[test]
    fn new_errors_cleanly_without_a_driver() {
        if crate::runtime::driver_present() {
            eprintln!("skipped: a CUDA driver is present");
            return;
        }
        assert!(matches!(CudaBackend::new(), Err(CudaError::NoDriver)));
    }

    #[test]
    fn tensor_core_experts_take_whole_key_blocks() {
        // Drama 3 (I 512, H 2048, top-8) and the tiny fixture (I 256, H 128, top-8)
        assert!(tc_experts_fit(512, 2048, 8) && tc_experts_fit(256, 128, 8));
        // not whole 128-key blocks, too many for the partials, too many down pairs
        assert!(!tc_experts_fit(200, 2048, 8) && !tc_experts_fit(512, 2000, 8));
        assert!(!tc_experts_fit(512, 128 * 33, 8) && !tc_experts_fit(1024, 2048, 9));
        assert!(!tc_experts_fit(512, 2048, 0) && !tc_experts_fit(0, 2048, 8));
    }

    #[test]
    fn skip_entries_name_kernels_or_weight_shapes() {
        assert_eq!(skip_shape("8192x2048"), Some((8192 << 32) | 2048));
        assert_eq!(skip_shape("4097x2048"), Some((4097 << 32) | 2048));
        for name in [
            "gemv_",
            "round_sample",
            "x2048",
            "8192x",
            "8192x2048x1",
            "-1x2",
        ] {
            assert_eq!(skip_shape(name), None, "{name}");
        }
    }

    #[test]
    fn options_take_defaults_and_read_each_variable() {
        let d = CudaOptions::from_lookup(|_| None);
        assert!(d.kv_f32 && d.tc_gemv && d.kept_rounds && d.graphs);
        let one = |k: &'static str, v: &'static str| {
            CudaOptions::from_lookup(move |q| (q == k).then(|| v.to_string()))
        };
        assert!(!one("DRAMATIS_CUDA_ROUNDS", "host").kept_rounds);
        assert!(one("DRAMATIS_CUDA_ROUNDS", "device").kept_rounds);
        assert!(!one("DRAMATIS_CUDA_GRAPH", "0").graphs);
        assert!(d.decode_head_split && !one("DRAMATIS_CUDA_HEAD_SPLIT", "0").decode_head_split);
        assert!(d.gdn_fused && !one("DRAMATIS_CUDA_GDN_FUSED", "0").gdn_fused);
        assert_eq!(d.gdn_chunk_min, GDN_CHUNK_MIN);
        assert!(d.gemv_walk && !one("DRAMATIS_CUDA_GEMV_WALK", "0").gemv_walk);
        assert!(!d.attn_joined && one("DRAMATIS_CUDA_ATTN_JOINED", "1").attn_joined);
        assert_eq!(
            one("DRAMATIS_CUDA_GDN_CHUNK_MIN", "0").gdn_chunk_min,
            usize::MAX
        );
        assert_eq!(one("DRAMATIS_CUDA_GDN_CHUNK_MIN", "256").gdn_chunk_min, 256);
        assert!(!d.gemm_lt && one("DRAMATIS_CUDA_GEMM_LT", "1").gemm_lt);
        assert!(!d.tc_bulk && one("DRAMATIS_CUDA_TC_BULK", "1").tc_bulk);
        assert_eq!(d.slots_min_rows, usize::MAX);
        assert_eq!(one("DRAMATIS_CUDA_SLOTS_MIN", "24").slots_min_rows, 24);
        assert!(!d.moe_tc && d.moe_tc_bulk);
        let (on, off) = (
            one("DRAMATIS_CUDA_MOE_TC", "1"),
            one("DRAMATIS_CUDA_MOE_TC", "0"),
        );
        assert!(on.moe_tc && on.moe_tc_bulk && !off.moe_tc && !off.moe_tc_bulk);
        assert_eq!(d.moe_tc_group_rows, 8);
        assert_eq!(d.moe_tc_warps, 4);
        assert!(d.gemv_slabs && !one("DRAMATIS_CUDA_GEMV_SLABS", "0").gemv_slabs);
        assert!(d.aside && !one("DRAMATIS_CUDA_ASIDE", "0").aside);
        assert!(d.moe_down_split4 && !one("DRAMATIS_CUDA_MOE_DOWN_SPLIT4", "0").moe_down_split4);
        assert!(!d.moe_gate_up_u2 && one("DRAMATIS_CUDA_MOE_GU_U2", "1").moe_gate_up_u2);
        // the tensor-core experts' blocks: Drama 3 (I 512, H 2048) at 4 warps, 1 and 16; the
        // contract's H 2560 at one warp keeps 64 threads for gate/up's 40 scales
        assert_eq!(tc_expert_blocks(4, 512, 2048), (128, 128));
        assert_eq!(tc_expert_blocks(1, 512, 2048), (32, 32));
        assert_eq!(tc_expert_blocks(16, 512, 2048), (512, 128));
        assert_eq!(tc_expert_blocks(1, 640, 2560), (64, 32));
        assert_eq!(tc_expert_blocks(0, 128, 128), (32, 32));
        // gemv_tc2 past 32 rows: a 32-row slab a block row (grid y); up to 32 rows, one
        let tc2 = CudaOptions {
            gemv_tile_min: usize::MAX,
            gemv_split_min: usize::MAX,
            ..d
        };
        assert_eq!(
            bf16_gemv_grid(&tc2, 110, 2048, 2048),
            ("gemv_tc2_g4_v2", (128, 4, 1))
        );
        assert_eq!(
            bf16_gemv_grid(&tc2, 32, 2048, 2048),
            ("gemv_tc2_g4_v2", (128, 1, 1))
        );
        assert_eq!(
            bf16_gemv_grid(&tc2, 5, 2048, 2048),
            ("gemv_tc2_g1_v2", (128, 1, 1))
        );
        let off = CudaOptions {
            gemv_slabs: false,
            ..tc2
        };
        assert_eq!(bf16_gemv_grid(&off, 110, 2048, 2048).1, (128, 1, 1));
        // 17-64 rows: 64 x 32 tiles, a key chunk a block (grid z), where the 64-row tiles do not
        // run; 16 rows and 65 keep gemv_tc2
        assert_eq!((d.gemv_split_min, d.gemv_split_blocks), (17, 0));
        assert_eq!(
            one("DRAMATIS_CUDA_GEMV_SPLIT_BLOCKS", "1024").gemv_split_blocks,
            1024
        );
        assert_eq!(
            one("DRAMATIS_CUDA_GEMV_SPLIT_MIN", "0").gemv_split_min,
            usize::MAX
        );
        assert_eq!(bf16_gemv_grid(&d, 32, 2048, 8192), ("gemv_ts", (128, 1, 8)));
        assert_eq!(bf16_gemv_grid(&d, 64, 4096, 2048), ("gemv_ts", (32, 2, 16)));
        assert_eq!(bf16_gemv_grid(&d, 17, 512, 2048), ("gemv_ts", (32, 1, 4)));
        // fewer blocks than a set gemv_split_blocks: gemv_tc2
        let bound = CudaOptions {
            gemv_split_blocks: 1024,
            ..d
        };
        assert_eq!(bf16_gemv_grid(&bound, 32, 4096, 2048).0, "gemv_tc2_g4_v2");
        assert_eq!(bf16_gemv_grid(&bound, 32, 2048, 9216).0, "gemv_ts");
        assert_eq!(bf16_gemv_grid(&d, 16, 2048, 8192).0, "gemv_tc2_g4_v2");
        assert_eq!(
            bf16_gemv_grid(&d, 65, 2048, 2048),
            ("gemv_tc2_g4_v2", (128, 3, 1))
        );
        assert_eq!(bf16_gemv_grid(&d, 64, 2048, 8192).0, "gemv_tw");
        // the walking tiles are 32 rows a block; the 64-row tiles (walk off) keep their own
        assert_eq!(
            bf16_gemv_grid(&d, 130, 2048, 12288),
            ("gemv_tw", (192, 5, 1))
        );
        let tt = CudaOptions {
            gemv_walk: false,
            ..d
        };
        assert_eq!(bf16_gemv_grid(&tt, 64, 2048, 8192).0, "gemv_tt");
        assert_eq!(
            bf16_gemv_grid(&tt, 130, 2048, 12288),
            ("gemv_tt", (192, 3, 1))
        );
        assert_eq!(one("DRAMATIS_CUDA_MOE_TC_WARPS", "16").moe_tc_warps, 16);
        assert_eq!(one("DRAMATIS_CUDA_MOE_TC_WARPS", "0").moe_tc_warps, 1);
        assert_eq!(one("DRAMATIS_CUDA_MOE_TC_GROUP", "0").moe_tc_group_rows, 1);
        assert_eq!(
            one("DRAMATIS_CUDA_MOE_TC_GROUP", "32").moe_tc_group_rows,
            32
        );
        assert!(
            !CudaOptions::from_lookup(|k| (k == "DRAMATIS_CUDA_TC").then(|| "0".into())).tc_gemv
        );
        assert_eq!(
            (
                d.split_min_keys,
                d.flash_min_rows,
                d.gemm_min_rows,
                d.group_min_rows
            ),
            (1, 2, usize::MAX, usize::MAX)
        );
        // the experts' threshold follows the dense one unless set apart
        let g = |a: &'static str, b: Option<&'static str>| {
            CudaOptions::from_lookup(move |k| match k {
                "DRAMATIS_CUDA_GEMM_MIN" => Some(a.to_string()),
                "DRAMATIS_CUDA_GROUP_MIN" => b.map(str::to_string),
                _ => None,
            })
        };
        assert_eq!(
            (g("32", None).gemm_min_rows, g("32", None).group_min_rows),
            (32, 32)
        );
        assert_eq!(
            (
                g("32", Some("4096")).gemm_min_rows,
                g("32", Some("4096")).group_min_rows
            ),
            (32, 4096)
        );
        let set = |k: &str| -> Option<String> {
            match k {
                "DRAMATIS_CUDA_KV" => Some("BF16".into()),
                "DRAMATIS_CUDA_SPLIT_MIN" => Some("4096".into()),
                "DRAMATIS_CUDA_FLASH_MIN" => Some(" 7 ".into()),
                "DRAMATIS_CUDA_GEMM_MIN" => Some("lots".into()),
                _ => None,
            }
        };
        let o = CudaOptions::from_lookup(set);
        assert!(!o.kv_f32);
        assert_eq!(
            (o.split_min_keys, o.flash_min_rows, o.gemm_min_rows),
            (usize::MAX, 7, usize::MAX)
        );
    }
}

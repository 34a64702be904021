//! The GPU executor: `kernels/codec.cu` compiled by NVRTC for the device (cached on disk like
//! backend-cuda's kernels, same key scheme), buffers as raw device allocations on one stream.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use backend_cuda::runtime::{cache_dir, cache_key, compile_options, nvrtc_version, Variant};
use backend_cuda::Gpu;
use cudarc::driver::{CudaFunction, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg};

use crate::exec::{Exec, Gemm, StreamRows, P};
use crate::{CudaCodecError, Result};

/// The kernel source (no CUDA headers).
pub const SOURCE: &str = include_str!("../kernels/codec.cu");
/// Kernel names in [`SOURCE`].
pub const KERNELS: [&str; 27] = [
    "gemm_tc16",
    "gemm_fr",
    "gemm_fr4",
    "gemm_tc64",
    "gemm_tcs",
    "gemm_tcw",
    "gemm_tcw2",
    "gemm_tcw2s",
    "gemm_tcw3s",
    "gemm_tcw4s",
    "gemm_tcw96s",
    "gemm_big",
    "gemm_reduce",
    "gemm_small",
    "gemm_n1",
    "snake",
    "dwconv",
    "layer_norm",
    "rms_norm",
    "gelu",
    "swiglu",
    "copy_many",
    "rope_kv_many",
    "attention_many",
    "vq_sum",
    "vq_nearest",
    "tf32_split_check",
];

/// Most entries of one `copy_many`, `rope_kv_many` or `attention_many` launch (`MANY` in
/// kernels/codec.cu); longer lists take several launches.
pub const MANY: usize = 64;

/// `Segs` in kernels/codec.cu: copies by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct Segs {
    dst: [u64; MANY],
    src: [u64; MANY],
    n: [i64; MANY],
    count: i32,
}

/// `Streams` in kernels/codec.cu: each stream's rings, RoPE table, position and rows.
#[repr(C)]
#[derive(Clone, Copy)]
struct Streams {
    k: [u64; MANY],
    v: [u64; MANY],
    cs: [u64; MANY],
    pos0: [i64; MANY],
    row0: [i32; MANY],
    rows: [i32; MANY],
    ring: [i32; MANY],
    count: i32,
}

// SAFETY: plain integers in #[repr(C)] structs whose layout matches `Segs` and `Streams` in
// kernels/codec.cu (u64 / i64 arrays, then i32 arrays and the count; the tail padding is the
// same), passed by value.
unsafe impl DeviceRepr for Segs {}
// SAFETY: as above.
unsafe impl DeviceRepr for Streams {}

/// Rows at or under which the frame-rate GEMM tiling is used (the same fma chains either way).
const SMALL_M: usize = 32;

/// Compiles [`SOURCE`] for `arch` in one kernel build (`Exact`, or `LowPrecision`: the
/// tensor-core GEMM without its small terms, a twin the checks must catch), through the disk
/// cache. Returns PTX and whether it was cached.
pub fn compile_variant(arch: &str, variant: Variant) -> Result<(String, bool)> {
    let options = compile_options(arch, variant);
    let key = cache_key(SOURCE, &options, arch, nvrtc_version()?);
    let path = cache_dir().map(|d| d.join(format!("codec-{key}.ptx")));
    if let Some(p) = &path {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            return Ok((ptx, true));
        }
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: options.clone(),
        name: Some("codec.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| CudaCodecError::Compile(format!("{e:?}")))?
        .to_src();
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        // A cache that cannot be written only costs a recompile next time.
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, p);
        }
    }
    Ok((ptx, false))
}

/// A device allocation and its base address.
type DevBuf = (CudaSlice<f32>, u64);

/// Buffers and kernels on one device stream. Not `Sync`: one thread drives it at a time.
pub struct CudaExec {
    pub gpu: Arc<Gpu>,
    funcs: HashMap<&'static str, CudaFunction>,
    bufs: RefCell<Vec<Option<DevBuf>>>,
    /// Split-K partial sums, grown on demand (used only between a GEMM and its combine).
    part: RefCell<Option<DevBuf>>,
    /// GEMMs of two or more columns on tensor cores (3xTF32, `gemm_tc*`) instead of the FMA
    /// tiles: the decoder's choice (`DRAMATIS_CODEC_TC=0` turns it off); the encoder keeps the
    /// FMA tiles, whose codes match the encode goldens exactly.
    tc: bool,
    /// Tensor-core GEMMs with fewer tiles than this sum K's segments across blocks (partials
    /// through memory, then `gemm_reduce`); others inside each block, except the wide GEMMs
    /// when a one-segment kernel is set (see `seg1`). The same bits either way.
    split_below: std::cell::Cell<usize>,
    /// Tensor-core GEMMs of many rows on `gemm_tc*`'s wide tiles (the same bits): `None` off,
    /// else the kernel (`gemm_tcw`, one block a multiprocessor, or `gemm_tcw2`, two).
    wide: std::cell::Cell<Option<&'static str>>,
    /// Launches of the wide kernels so far (checks count them, so a check that meant to run
    /// them cannot pass on the other kernels alone).
    wide_launches: std::cell::Cell<u64>,
    /// The wide tiles' kernel for one K segment a block (`gemm_tcw4s` by default, `gemm_tcw3s`
    /// or `gemm_tcw2s`), which the wide GEMMs of several segments then split across
    /// blocks; `None`: the wide kernel sums a tile's segments itself. See [`seg1_kernel`].
    seg1: std::cell::Cell<Option<&'static str>>,
    /// Whether the split was set by [`CudaExec::set_split_below`] (a check's forced mode: the
    /// wide GEMMs then split exactly as it says).
    split_forced: std::cell::Cell<bool>,
    /// Launches of the one-segment kernels so far.
    seg1_launches: std::cell::Cell<u64>,
    /// Whether one-segment wide GEMMs whose columns 96-wide tiles pad less than 64-wide ones
    /// (N = 96: 128 columns on 64-wide tiles) take `gemm_tcw96s`. See [`wide96`].
    wide96: std::cell::Cell<bool>,
    /// Launches of `gemm_tcw96s` so far.
    wide96_launches: std::cell::Cell<u64>,
    /// Tensor-core GEMMs of up to 16 rows on `gemm_tcs` (the weights staged by `cp.async` in
    /// six shared-memory stages; the same bits as `gemm_tc16`) where its operands allow
    /// (`DRAMATIS_CODEC_TCS=1`; off by default, see [`small_tiles`]).
    small: std::cell::Cell<bool>,
    /// Launches of `gemm_tcs` so far.
    small_launches: std::cell::Cell<u64>,
    /// Tensor-core GEMMs of up to this many rows (0, 16 or 64) on `gemm_fr` / `gemm_fr4` (the
    /// weights in flight a whole piece a warp; the same bits as `gemm_tc16` / `gemm_tc64`)
    /// unless `gemm_tcs` takes them. See [`frame_rows`].
    frame: std::cell::Cell<usize>,
    /// Launches of `gemm_fr` and `gemm_fr4` so far.
    frame_launches: std::cell::Cell<u64>,
}

/// Rows above which a tensor-core GEMM may take the wide tiles (128 rows a block).
pub(crate) const WIDE_MIN_ROWS: usize = 64;

/// Whether the cp.async tiles (`gemm_tcw*`, `gemm_tcs`) may take a GEMM: they copy 16-key
/// chunks as aligned float4s (see gemm_tcw), so cin, K and the segment length `ks` are
/// multiples of 16, N, the row stride `rsa` and the tap stride `jstride` of 4 floats, and the
/// operands' device addresses `a`, `b` of 16 bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn staged(
    cin: usize,
    k: usize,
    ks: usize,
    n: usize,
    rsa: usize,
    jstride: usize,
    a: u64,
    b: u64,
) -> bool {
    cin.is_multiple_of(16)
        && k.is_multiple_of(16)
        && ks.is_multiple_of(16)
        && n.is_multiple_of(4)
        && rsa.is_multiple_of(4)
        && jstride.is_multiple_of(4)
        && a.is_multiple_of(16)
        && b.is_multiple_of(16)
}

/// The wide tensor-core kernel from `DRAMATIS_CODEC_TCW`: unset or `2`, `gemm_tcw2` (two blocks
/// a multiprocessor, a few registers spilled: 2344 against 2200 frames/s in 16-frame pushes at
/// Drama 3 geometry, session 14); `1`, `gemm_tcw`; `0`, none (`gemm_tc64` for every GEMM of
/// many rows).
pub fn wide_kernel() -> Option<&'static str> {
    wide_from(std::env::var("DRAMATIS_CODEC_TCW").ok().as_deref())
}

/// The wide tiles' one-segment kernel from `DRAMATIS_CODEC_TCW_SEG1`: unset or `4`,
/// `gemm_tcw4s` (the 128 x 64 tile as four warps of 64 x 32: 128 threads, four blocks a
/// multiprocessor, 9.6 SASS instructions an MMA); `3`, `gemm_tcw3s` (eight warps of 32 x 32,
/// three blocks, 11.7 an MMA); `2`, `gemm_tcw2s` (two blocks, no spills); `0`, none (the wide
/// kernel sums each tile's segments in one block unless the tiles are too few to fill the
/// device). With one, a wide GEMM of several segments splits them across blocks and sums the
/// partials in `gemm_reduce`: the same bits, more blocks for the device's slots (a 12-frame
/// push's 7x192-key convolution had 288 blocks for 264: two waves, the second 9% full), and no
/// sum of segments to hold (`gemm_tcw2`: 128 registers and 80 bytes spilled). Session 22,
/// Drama 3 geometry on the H200: a 12-frame push 7135 (none) / 6233 (`2`) / 5875 us (`3`).
/// Session 25 (call 88): 32 streams x 12 frames in one call 3973 (`3`) / 4255 (`4`) frames/s;
/// 32 lanes' kept round 23.71 / 23.81 ms (`3`) against 23.34 / 23.47 (`4`), alternated.
pub fn seg1_kernel() -> Option<&'static str> {
    seg1_from(std::env::var("DRAMATIS_CODEC_TCW_SEG1").ok().as_deref())
}

pub(crate) fn seg1_from(v: Option<&str>) -> Option<&'static str> {
    match v.map(str::trim) {
        Some("0") => None,
        Some("2") => Some("gemm_tcw2s"),
        Some("3") => Some("gemm_tcw3s"),
        _ => Some("gemm_tcw4s"),
    }
}

/// Threads a block of one-segment kernel `name` (every one a 128 x 64 tile).
pub(crate) fn seg1_threads(name: &str) -> u32 {
    if name == "gemm_tcw4s" {
        128
    } else {
        256
    }
}

/// Whether one-segment wide GEMMs of N = 96 (or any N that 96-wide tiles pad less) take
/// `gemm_tcw96s`, 64 x 96 tiles (`DRAMATIS_CODEC_TCW96`, default on, `0` off; the same bits).
pub fn wide96() -> bool {
    on_unless_zero(std::env::var("DRAMATIS_CODEC_TCW96").ok().as_deref())
}

/// Whether 96-wide tiles pad `n` columns less than 64-wide ones.
pub(crate) fn pads_less_at_96(n: usize) -> bool {
    n.div_ceil(96) * 96 < n.div_ceil(64) * 64
}

/// An on/off setting: on unless `0`.
pub(crate) fn on_unless_zero(v: Option<&str>) -> bool {
    v.is_none_or(|v| v.trim() != "0")
}

/// The rows up to which tensor-core GEMMs take `gemm_fr` (up to 16 rows, for `gemm_tc16`) and
/// `gemm_fr4` (17-64, for `gemm_tc64`), from `DRAMATIS_CODEC_FR`: unset or `64`, both; `16`
/// (or `1`), `gemm_fr` alone; `0`, neither. Session 22, a 12-frame push at Drama 3 geometry:
/// `gemm_fr`'s 33 launches 528 against `gemm_tc16`'s 774 us.
pub fn frame_rows() -> usize {
    frame_from(std::env::var("DRAMATIS_CODEC_FR").ok().as_deref())
}

pub(crate) fn frame_from(v: Option<&str>) -> usize {
    match v.map(str::trim) {
        Some("0") => 0,
        Some("1" | "16") => 16,
        _ => 64,
    }
}

/// Whether GEMMs of up to 16 rows take `gemm_tcs` (`DRAMATIS_CODEC_TCS=1`; default off). In
/// session 14's measurement its launches in a 16-frame push took 716 against `gemm_tc16`'s 882
/// us, but in a 1-frame push 905 against 689, and the rounds did not move (1 lane 7.38 against
/// 7.28 ms, 32 lanes 639.9 against 642.0 frames/s).
pub fn small_tiles() -> bool {
    small_from(std::env::var("DRAMATIS_CODEC_TCS").ok().as_deref())
}

pub(crate) fn small_from(v: Option<&str>) -> bool {
    v.is_some_and(|v| v.trim() == "1")
}

pub(crate) fn wide_from(v: Option<&str>) -> Option<&'static str> {
    match v.map(str::trim) {
        Some("0") => None,
        Some("1") => Some("gemm_tcw"),
        _ => Some("gemm_tcw2"),
    }
}

/// Whether the decoder's GEMMs run on tensor cores (`DRAMATIS_CODEC_TC`, default on).
pub fn decoder_tc() -> bool {
    on_unless_zero(std::env::var("DRAMATIS_CODEC_TC").ok().as_deref())
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

fn u32_of(v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| CudaCodecError::Shape(format!("{v} exceeds a launch dimension")))
}

fn i32_of(v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaCodecError::Shape(format!("{v} exceeds a 32-bit size")))
}

fn i64_of(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn grid1(n: usize, block: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (u32_of(cdiv(n, block).max(1))?, 1, 1),
        block_dim: (u32_of(block)?, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl CudaExec {
    /// Compiles (or reads from the cache) and loads the kernels on `gpu` (FMA-tile GEMMs).
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Self::with(gpu, Variant::Exact, false)
    }

    /// The kernels of build `variant` on `gpu`; `tc`: GEMMs of two or more columns on tensor
    /// cores.
    pub fn with(gpu: Arc<Gpu>, variant: Variant, tc: bool) -> Result<Self> {
        let (ptx, _cached) = compile_variant(&gpu.arch, variant)?;
        let module = gpu
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(backend_cuda::CudaError::from)?;
        let mut funcs = HashMap::new();
        for name in KERNELS {
            let f = module
                .load_function(name)
                .map_err(backend_cuda::CudaError::from)?;
            funcs.insert(name, f);
        }
        Ok(Self {
            gpu,
            funcs,
            bufs: RefCell::new(Vec::new()),
            part: RefCell::new(None),
            tc,
            split_below: std::cell::Cell::new(0),
            wide: std::cell::Cell::new(wide_kernel()),
            wide_launches: std::cell::Cell::new(0),
            seg1: std::cell::Cell::new(seg1_kernel()),
            split_forced: std::cell::Cell::new(false),
            seg1_launches: std::cell::Cell::new(0),
            wide96: std::cell::Cell::new(wide96()),
            wide96_launches: std::cell::Cell::new(0),
            frame: std::cell::Cell::new(frame_rows()),
            frame_launches: std::cell::Cell::new(0),
            small: std::cell::Cell::new(small_tiles()),
            small_launches: std::cell::Cell::new(0),
        })
        .inspect(|e| e.set_split_below(None))
    }

    /// The tile count under which tensor-core GEMMs split K's segments across blocks; `None`:
    /// twice the multiprocessors (the frame-rate layers split, the sample-rate ones do not).
    pub fn set_split_below(&self, tiles: Option<usize>) {
        let sms = usize::try_from(self.gpu.info.sm_count).unwrap_or(1);
        self.split_below.set(tiles.unwrap_or(2 * sms));
        self.split_forced.set(tiles.is_some());
    }

    /// The wide tiles' one-segment kernel (`None`: the wide kernel for every wide GEMM).
    pub fn set_seg1(&self, kernel: Option<&'static str>) {
        self.seg1.set(kernel);
    }

    /// The rows up to which GEMMs take `gemm_fr` / `gemm_fr4` (0, 16 or 64; else `gemm_tc16` /
    /// `gemm_tc64`; `gemm_tcs` first where it is on and allowed).
    pub fn set_frame(&self, rows: usize) {
        self.frame.set(rows);
    }

    /// Launches of `gemm_fr` and `gemm_fr4` so far.
    pub fn frame_launches(&self) -> u64 {
        self.frame_launches.get()
    }

    /// Whether one-segment wide GEMMs that 96-wide tiles pad less take `gemm_tcw96s`.
    pub fn set_wide96(&self, on: bool) {
        self.wide96.set(on);
    }

    /// Launches of `gemm_tcw96s` so far.
    pub fn wide96_launches(&self) -> u64 {
        self.wide96_launches.get()
    }

    /// Launches of the one-segment wide kernels so far.
    pub fn seg1_launches(&self) -> u64 {
        self.seg1_launches.get()
    }

    /// The wide tensor-core kernel to use (`None`: `gemm_tc64` for every GEMM of many rows).
    pub fn set_wide(&self, kernel: Option<&'static str>) {
        self.wide.set(kernel);
    }

    /// Launches of the wide tensor-core kernels so far.
    pub fn wide_launches(&self) -> u64 {
        self.wide_launches.get()
    }

    /// Whether GEMMs of up to 16 rows take `gemm_tcs` (the same bits as `gemm_tc16`).
    pub fn set_small(&self, on: bool) {
        self.small.set(on);
    }

    /// Launches of `gemm_tcs` so far.
    pub fn small_launches(&self) -> u64 {
        self.small_launches.get()
    }

    /// Device address of `p` (element offset checked against the allocation for `n` elements).
    fn ptr(&self, p: P, n: usize) -> Result<u64> {
        let b = self.bufs.borrow();
        let (s, base) = b
            .get(p.buf)
            .and_then(|x| x.as_ref())
            .ok_or_else(|| CudaCodecError::Shape(format!("buffer {} is not live", p.buf)))?;
        if p.off + n > s.len() {
            return Err(CudaCodecError::Shape(format!(
                "buffer {} holds {} floats, {} needed at offset {}",
                p.buf,
                s.len(),
                n,
                p.off
            )));
        }
        Ok(base + 4 * p.off as u64)
    }

    /// Device address of a partial-sum buffer of at least `n` floats.
    fn part(&self, n: usize) -> Result<u64> {
        let mut p = self.part.borrow_mut();
        if p.as_ref().is_none_or(|(s, _)| s.len() < n) {
            // The old buffer is freed in stream order, after the work queued on it.
            *p = None;
            let s = self
                .stream()
                .alloc_zeros::<f32>(n)
                .map_err(backend_cuda::CudaError::from)?;
            let base = {
                let (ptr, _sync) = s.device_ptr(self.stream());
                ptr
            };
            *p = Some((s, base));
        }
        Ok(p.as_ref().map_or(0, |(_, b)| *b))
    }

    fn opt(&self, p: Option<P>, n: usize) -> Result<u64> {
        p.map_or(Ok(0), |p| self.ptr(p, n))
    }

    fn f(&self, name: &'static str) -> &CudaFunction {
        &self.funcs[name]
    }

    fn stream(&self) -> &Arc<cudarc::driver::CudaStream> {
        &self.gpu.stream
    }

    /// The `Streams` table of up to [`MANY`] streams (rings of `w` floats a slot, every pointer
    /// range-checked; their RoPE tables too, `hd` floats a row, when `cs_hd` is given), the
    /// most rows of one and the row past the last of any.
    fn stream_table(
        &self,
        part: &[StreamRows],
        w: usize,
        cs_hd: Option<usize>,
    ) -> Result<(Streams, usize, usize)> {
        let mut t = Streams {
            k: [0; MANY],
            v: [0; MANY],
            cs: [0; MANY],
            pos0: [0; MANY],
            row0: [0; MANY],
            rows: [0; MANY],
            ring: [0; MANY],
            count: i32_of(part.len())?,
        };
        let (mut most, mut end) = (0, 0);
        for (i, s) in part.iter().enumerate() {
            t.k[i] = self.ptr(s.kring, s.ring * w)?;
            t.v[i] = self.ptr(s.vring, s.ring * w)?;
            if let Some(hd) = cs_hd {
                t.cs[i] = self.ptr(s.cs, s.rows * hd)?;
            }
            t.pos0[i] =
                i64::try_from(s.pos0).map_err(|_| CudaCodecError::Shape("position".into()))?;
            t.row0[i] = i32_of(s.row0)?;
            t.rows[i] = i32_of(s.rows)?;
            t.ring[i] = i32_of(s.ring)?;
            most = most.max(s.rows);
            end = end.max(s.row0 + s.rows);
        }
        Ok((t, most, end))
    }

    /// Waits for all queued work.
    pub fn sync(&self) -> Result<()> {
        self.stream()
            .synchronize()
            .map_err(backend_cuda::CudaError::from)?;
        Ok(())
    }
}

macro_rules! launch {
    ($self:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let f = $self.f($name);
        let mut b = $self.stream().launch_builder(f);
        $( b.arg($arg); )*
        // SAFETY: argument types and order match the kernel's signature in kernels/codec.cu, and
        // every pointer was range-checked by `ptr` for the extent the kernel touches.
        unsafe { b.launch($cfg) }.map_err(backend_cuda::CudaError::from)?;
    }};
}

impl Exec for CudaExec {
    fn alloc(&self, n: usize) -> Result<usize> {
        let s = self
            .stream()
            .alloc_zeros::<f32>(n)
            .map_err(backend_cuda::CudaError::from)?;
        let base = {
            let (p, _sync) = s.device_ptr(self.stream());
            p
        };
        let mut b = self.bufs.borrow_mut();
        b.push(Some((s, base)));
        Ok(b.len() - 1)
    }

    fn free(&self, buf: usize) {
        if let Some(x) = self.bufs.borrow_mut().get_mut(buf) {
            *x = None;
        }
    }

    fn write(&self, dst: P, data: &[f32]) -> Result<()> {
        let d = self.ptr(dst, data.len())?;
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(backend_cuda::CudaError::from)?;
        // SAFETY: `d` addresses data.len() live f32 (checked); pageable source memory is staged
        // before the call returns, so `data` may go after it.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(d, data, self.stream().cu_stream())
                .map_err(backend_cuda::CudaError::from)?
        };
        Ok(())
    }

    fn read(&self, src: P, n: usize) -> Result<Vec<f32>> {
        let s = self.ptr(src, n)?;
        let mut out = vec![0.0f32; n];
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(backend_cuda::CudaError::from)?;
        // SAFETY: `s` addresses n live f32 (checked); the stream is synchronised before `out`
        // is used.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out, s, self.stream().cu_stream())
                .map_err(backend_cuda::CudaError::from)?
        };
        self.sync()?;
        Ok(out)
    }

    fn copy(&self, dst: P, src: P, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let (d, s) = (self.ptr(dst, n)?, self.ptr(src, n)?);
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(backend_cuda::CudaError::from)?;
        // SAFETY: both ranges are live (checked) and the decoder never copies overlapping ones.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(d, s, 4 * n, self.stream().cu_stream())
                .map_err(backend_cuda::CudaError::from)?
        };
        Ok(())
    }

    fn gemm(&self, g: &Gemm) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        if g.k == 0 || g.cin == 0 {
            return Err(CudaCodecError::Shape(format!(
                "GEMM of K {} over {} input channels: both must be at least 1",
                g.k, g.cin
            )));
        }
        // The furthest A element read: row m−1, tap (k−1)/cin, channel cin−1.
        let taps = (g.k - 1) / g.cin;
        let a_extent = (g.m - 1) * g.rsa + taps * g.jstride + g.cin.min(g.k);
        let a = self.ptr(g.a, a_extent)?;
        let b = self.ptr(g.b, g.k * g.n)?;
        let c = self.ptr(g.c, g.m * g.n)?;
        let bias = self.opt(g.bias, g.bias_n)?;
        let gamma = self.opt(g.gamma, g.n)?;
        let res = self.opt(g.res, g.m * g.n)?;
        let (m, n, k) = (i32_of(g.m)?, i32_of(g.n)?, i32_of(g.k)?);
        let (rsa, cin, js) = (i64_of(g.rsa), i32_of(g.cin)?, i64_of(g.jstride));
        let bias_n = i32_of(g.bias_n.max(1))?;
        let act = i32::from(g.tanh);
        if g.n == 1 {
            let cfg = grid1(g.m, 128)?;
            launch!(
                self, "gemm_n1", cfg, &m, &k, &a, &rsa, &cin, &js, &b, &c, &bias, &gamma, &res,
                &act
            );
            return Ok(());
        }
        let ks = crate::exec::split_len(g.k, g.n);
        let nseg = cdiv(g.k, ks);
        // (kernel, rows and columns a block, threads, K segments across blocks: 1 = a block
        // sums all of its segments itself). Either way an output is the same arithmetic.
        let (name, bm, bn, threads, zs) = if self.tc {
            let staged = staged(g.cin, g.k, ks, g.n, g.rsa, g.jstride, a, b);
            let wide = self.wide.get().filter(|_| staged && g.m > WIDE_MIN_ROWS);
            let small = staged && g.m <= 16 && self.small.get();
            let frame = wide.is_none() && !small && g.m <= self.frame.get();
            let (name, bm, bn, threads) = match wide {
                Some(w) => (w, 128, 64, 256),
                None if small => ("gemm_tcs", 16, 64, 128),
                None if frame && g.m <= 16 => ("gemm_fr", 16, 32, 128),
                None if frame => ("gemm_fr4", 64, 32, 128),
                None if g.m <= 16 => ("gemm_tc16", 16, 64, 128),
                None => ("gemm_tc64", 64, 64, 128),
            };
            // segments across blocks only when the tiles alone would leave most of the
            // device idle (frame-rate layers); otherwise no partial sums go through memory
            let tiles = cdiv(g.n, 64) * cdiv(g.m, bm);
            let seg1 = self.seg1.get().filter(|_| wide.is_some());
            let zs =
                if tiles < self.split_below.get() || (seg1.is_some() && !self.split_forced.get()) {
                    nseg
                } else {
                    1
                };
            let (name, bm, bn, threads) = match seg1 {
                Some(s) if zs > 1 || nseg == 1 => {
                    self.seg1_launches.set(self.seg1_launches.get() + 1);
                    if self.wide96.get() && pads_less_at_96(g.n) {
                        self.wide96_launches.set(self.wide96_launches.get() + 1);
                        ("gemm_tcw96s", 64, 96, 192)
                    } else {
                        (s, bm, bn, seg1_threads(s))
                    }
                }
                _ => (name, bm, bn, threads),
            };
            if wide.is_some() {
                self.wide_launches.set(self.wide_launches.get() + 1);
            } else if small {
                self.small_launches.set(self.small_launches.get() + 1);
            } else if frame {
                self.frame_launches.set(self.frame_launches.get() + 1);
            }
            (name, bm, bn, threads, zs)
        } else if g.m <= SMALL_M {
            ("gemm_small", 8, 128, 256, nseg)
        } else {
            ("gemm_big", 64, 64, 256, nseg)
        };
        let part = if zs > 1 {
            self.part(zs * g.m * g.n)?
        } else {
            0
        };
        let cfg = LaunchConfig {
            grid_dim: (u32_of(cdiv(g.n, bn))?, u32_of(cdiv(g.m, bm))?, u32_of(zs)?),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        let ksi = i32_of(ks)?;
        launch!(
            self, name, cfg, &m, &n, &k, &a, &rsa, &cin, &js, &b, &c, &bias, &bias_n, &gamma, &res,
            &act, &ksi, &part
        );
        if zs > 1 {
            let ns = i32_of(zs)?;
            launch!(
                self,
                "gemm_reduce",
                grid1(g.m * g.n, 256)?,
                &part,
                &ns,
                &m,
                &n,
                &c,
                &bias,
                &bias_n,
                &gamma,
                &res,
                &act
            );
        }
        Ok(())
    }

    fn snake(&self, x: P, alpha: P, inv: P, out: P, n: usize, c: usize) -> Result<()> {
        let (xp, op) = (self.ptr(x, n)?, self.ptr(out, n)?);
        let (ap, ip) = (self.ptr(alpha, c)?, self.ptr(inv, c)?);
        let (nn, cc) = (i64_of(n), i32_of(c)?);
        launch!(self, "snake", grid1(n, 256)?, &xp, &ap, &ip, &op, &nn, &cc);
        Ok(())
    }

    fn dwconv(&self, buf: P, w: P, b: P, out: P, l: usize, c: usize, k: usize) -> Result<()> {
        let bp = self.ptr(buf, (k - 1 + l) * c)?;
        let (wp, bb, op) = (self.ptr(w, k * c)?, self.ptr(b, c)?, self.ptr(out, l * c)?);
        let (ll, cc, kk) = (i32_of(l)?, i32_of(c)?, i32_of(k)?);
        launch!(
            self,
            "dwconv",
            grid1(l * c, 256)?,
            &bp,
            &wp,
            &bb,
            &op,
            &ll,
            &cc,
            &kk
        );
        Ok(())
    }

    fn layer_norm(&self, x: P, w: P, b: P, out: P, rows: usize, c: usize, eps: f32) -> Result<()> {
        let (xp, op) = (self.ptr(x, rows * c)?, self.ptr(out, rows * c)?);
        let (wp, bp) = (self.ptr(w, c)?, self.ptr(b, c)?);
        let cc = i32_of(c)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(rows)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "layer_norm", cfg, &xp, &wp, &bp, &op, &cc, &eps);
        Ok(())
    }

    fn rms_norm(&self, x: P, w: P, out: P, rows: usize, c: usize, eps: f32) -> Result<()> {
        let (xp, op, wp) = (
            self.ptr(x, rows * c)?,
            self.ptr(out, rows * c)?,
            self.ptr(w, c)?,
        );
        let cc = i32_of(c)?;
        let cfg = LaunchConfig {
            grid_dim: (u32_of(rows)?, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, "rms_norm", cfg, &xp, &wp, &op, &cc, &eps);
        Ok(())
    }

    fn gelu(&self, x: P, n: usize) -> Result<()> {
        let xp = self.ptr(x, n)?;
        let nn = i64_of(n);
        launch!(self, "gelu", grid1(n, 256)?, &xp, &nn);
        Ok(())
    }

    fn swiglu(&self, ab: P, out: P, rows: usize, f: usize) -> Result<()> {
        let (ap, op) = (self.ptr(ab, rows * 2 * f)?, self.ptr(out, rows * f)?);
        let (rr, ff) = (i32_of(rows)?, i32_of(f)?);
        launch!(self, "swiglu", grid1(rows * f, 256)?, &ap, &op, &rr, &ff);
        Ok(())
    }

    fn copy_many(&self, list: &[(P, P, usize)]) -> Result<()> {
        for part in list.chunks(MANY) {
            let mut t = Segs {
                dst: [0; MANY],
                src: [0; MANY],
                n: [0; MANY],
                count: i32_of(part.len())?,
            };
            let mut most = 0;
            for (i, &(d, s, n)) in part.iter().enumerate() {
                t.dst[i] = self.ptr(d, n)?;
                t.src[i] = self.ptr(s, n)?;
                t.n[i] = i64_of(n);
                most = most.max(n);
            }
            if most == 0 {
                continue;
            }
            let cfg = LaunchConfig {
                grid_dim: (
                    u32_of(most.div_ceil(256).min(1024))?,
                    u32_of(part.len())?,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, "copy_many", cfg, &t);
        }
        Ok(())
    }

    fn rope_kv_many(&self, qkv: P, streams: &[StreamRows], heads: usize, hd: usize) -> Result<()> {
        let w = heads * hd;
        for part in streams.chunks(MANY) {
            let (t, most, end) = self.stream_table(part, w, Some(hd))?;
            if most == 0 {
                continue;
            }
            let qp = self.ptr(qkv, end * 3 * w)?;
            let (hh, dd) = (i32_of(heads)?, i32_of(hd)?);
            let cfg = LaunchConfig {
                grid_dim: (
                    u32_of((most * heads * (hd / 2)).div_ceil(256))?,
                    u32_of(part.len())?,
                    1,
                ),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(self, "rope_kv_many", cfg, &qp, &t, &hh, &dd);
        }
        Ok(())
    }

    fn attention_many(
        &self,
        qkv: P,
        out: P,
        streams: &[StreamRows],
        heads: usize,
        hd: usize,
        window: usize,
    ) -> Result<()> {
        let w = heads * hd;
        for part in streams.chunks(MANY) {
            let (t, most, end) = self.stream_table(part, w, None)?;
            if most == 0 {
                continue;
            }
            let (qp, op) = (self.ptr(qkv, end * 3 * w)?, self.ptr(out, end * w)?);
            let (hh, dd, ww) = (i32_of(heads)?, i32_of(hd)?, i32_of(window)?);
            let scale = 1.0f32 / (hd as f32).sqrt();
            let cfg = LaunchConfig {
                grid_dim: (u32_of(most * heads)?, u32_of(part.len())?, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: u32_of(4 * window)?,
            };
            launch!(
                self,
                "attention_many",
                cfg,
                &qp,
                &op,
                &t,
                &hh,
                &dd,
                &ww,
                &scale
            );
        }
        Ok(())
    }

    fn vq_sum(
        &self,
        e: P,
        w: P,
        b: P,
        out: P,
        t: usize,
        q: usize,
        cb: usize,
        dim: usize,
    ) -> Result<()> {
        let ep = self.ptr(e, t * q * cb)?;
        let (wp, bp) = (self.ptr(w, q * cb * dim)?, self.ptr(b, q * dim)?);
        let op = self.ptr(out, t * dim)?;
        let (tt, qq, cc, dd) = (i32_of(t)?, i32_of(q)?, i32_of(cb)?, i32_of(dim)?);
        launch!(
            self,
            "vq_sum",
            grid1(t * dim, 256)?,
            &ep,
            &wp,
            &bp,
            &op,
            &tt,
            &qq,
            &cc,
            &dd
        );
        Ok(())
    }

    fn vq_nearest(
        &self,
        ze: P,
        book_n: P,
        cn2: P,
        book: P,
        codes: P,
        st: P,
        t: usize,
        n: usize,
        cb: usize,
    ) -> Result<()> {
        if t == 0 {
            return Ok(());
        }
        let (zp, sp) = (self.ptr(ze, t * cb)?, self.ptr(st, t * cb)?);
        let (np, cp) = (self.ptr(book_n, n * cb)?, self.ptr(cn2, n)?);
        let (bp, op) = (self.ptr(book, n * cb)?, self.ptr(codes, t)?);
        let (nn, cc) = (i32_of(n)?, i32_of(cb)?);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(t)?, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: u32_of(4 * cb)?,
        };
        launch!(
            self,
            "vq_nearest",
            cfg,
            &zp,
            &np,
            &cp,
            &bp,
            &op,
            &sp,
            &nn,
            &cc
        );
        Ok(())
    }
}

impl CudaExec {
    /// `tf32_split_check` over `x`: for each value the split's hi and lo bits and cvt.rna's hi
    /// (`[h, l, cvt_h]` a value), for [`crate::check::tf32_split`].
    pub fn tf32_split_bits(&self, x: &[f32]) -> Result<Vec<[u32; 3]>> {
        let n = x.len();
        let xb = self.alloc(n)?;
        let ob = self.alloc(3 * n)?;
        let run = || -> Result<Vec<[u32; 3]>> {
            let (xp, op) = (P { buf: xb, off: 0 }, P { buf: ob, off: 0 });
            self.write(xp, x)?;
            let (xd, od, nn) = (self.ptr(xp, n)?, self.ptr(op, 3 * n)?, i64_of(n));
            launch!(self, "tf32_split_check", grid1(n, 256)?, &xd, &od, &nn);
            let out = self.read(op, 3 * n)?;
            Ok(out
                .chunks_exact(3)
                .map(|c| [c[0].to_bits(), c[1].to_bits(), c[2].to_bits()])
                .collect())
        };
        let r = run();
        self.free(xb);
        self.free(ob);
        r
    }
}

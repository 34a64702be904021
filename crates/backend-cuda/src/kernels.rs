//! Typed launch wrappers. Each kernel has a pure launch plan (grid, block, shared memory, index
//! ranges), used both to launch and to record launch limits at the largest admitted shapes.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};

use crate::error::{i32_of, mul, u32_of, CudaError, Result};
use crate::runtime::{DeviceInfo, Gpu, Source, Variant};

/// Geometry fixed by the kernels' code.
pub const GDN_HEAD_DIM: usize = 128;
/// Largest head dim of the flash-style prefill kernel (8 float4 column groups per thread).
pub const FLASH_MAX_HEAD_DIM: usize = 256;
/// Query rows per block and keys per tile of the flash-style prefill kernel (ops.cu FQ, FK).
const FLASH_ROWS: usize = 32;
const FLASH_KEYS: usize = 32;

/// How one kernel is launched at a shape.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchPlan {
    pub kernel: &'static str,
    pub grid: [u64; 3],
    pub block: u64,
    /// static + dynamic shared memory, bytes
    pub smem: u64,
    pub dyn_smem: u64,
    /// The kernel raises its dynamic shared memory limit (`MAX_DYNAMIC_SHARED_SIZE_BYTES`),
    /// so the opt-in limit applies instead of the default 48 KiB.
    pub optin: bool,
    /// the largest value held by a 32-bit (int) index or size in the kernel
    pub i32_max: u64,
    /// the largest element offset, computed in 64-bit
    pub offset_max: u64,
}

impl LaunchPlan {
    /// Every way this plan breaks the device's limits (empty when it fits).
    pub fn problems(&self, info: &DeviceInfo) -> Vec<String> {
        let mut p = Vec::new();
        for (axis, (&g, &lim)) in self.grid.iter().zip(&info.max_grid).enumerate() {
            if g == 0 || g > lim {
                p.push(format!("grid[{axis}] = {g} outside 1..={lim}"));
            }
        }
        if self.block == 0 || self.block > info.max_block_threads {
            p.push(format!(
                "block = {} outside 1..={}",
                self.block, info.max_block_threads
            ));
        }
        if self.optin && self.smem > info.max_smem_optin {
            p.push(format!(
                "shared memory {} B over the opt-in limit of {} B",
                self.smem, info.max_smem_optin
            ));
        } else if !self.optin && self.smem > info.max_smem_block {
            p.push(format!(
                "shared memory {} B over {} B (no opt-in used)",
                self.smem, info.max_smem_block
            ));
        }
        if self.i32_max > i32::MAX as u64 {
            p.push(format!(
                "32-bit index reaches {} > {}",
                self.i32_max,
                i32::MAX
            ));
        }
        p
    }

    /// The launch configuration: the plan's grid, block and dynamic shared memory.
    pub(crate) fn cfg(&self) -> Result<LaunchConfig> {
        let g = |i: usize| {
            u32_of(
                "grid dimension",
                usize::try_from(self.grid[i]).unwrap_or(usize::MAX),
            )
        };
        Ok(LaunchConfig {
            grid_dim: (g(0)?, g(1)?, g(2)?),
            block_dim: (u32_of("block", self.block as usize)?, 1, 1),
            shared_mem_bytes: u32_of("shared memory", self.dyn_smem as usize)?,
        })
    }

    fn check(&self, info: &DeviceInfo) -> Result<()> {
        match self.problems(info).first() {
            None => Ok(()),
            Some(what) => Err(CudaError::Shape {
                kernel: self.kernel,
                what: what.clone(),
            }),
        }
    }
}

fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

fn need(kernel: &'static str, ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape {
            kernel,
            what: what(),
        })
    }
}

fn len_at_least<T>(kernel: &'static str, name: &str, buf: &CudaSlice<T>, n: usize) -> Result<()> {
    need(kernel, buf.len() >= n, || {
        format!("{name} holds {} elements, needs {n}", buf.len())
    })
}

macro_rules! launch {
    ($gpu:expr, $plan:expr, $src:expr, $var:expr, $($arg:expr),* $(,)?) => {{
        let plan: &LaunchPlan = $plan;
        plan.check(&$gpu.info)?;
        let f = $gpu.func($src, $var, plan.kernel)?;
        let mut b = $gpu.stream.launch_builder(&f);
        $( b.arg($arg); )*
        // SAFETY: argument types and order match the kernel's signature in kernels/*.cu, and the
        // wrapper checked every buffer length against the extents the kernel touches.
        unsafe { b.launch(plan.cfg()?) }?;
    }};
}

// ---------------------------------------------------------------- RMSNorm

pub fn plan_rmsnorm(rows: usize, n: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "rmsnorm_f32",
        grid: [rows as u64, 1, 1],
        block: 256,
        smem: 128,
        dyn_smem: 0,
        optin: false,
        i32_max: n as u64,
        offset_max: mul("rmsnorm extent", &[rows, n])? as u64,
    })
}

/// out[r] = rms(x[r]) * (add_one ? 1 + w : w), rows of n.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm(
    gpu: &Gpu,
    v: Variant,
    x: &CudaSlice<f32>,
    w: &CudaSlice<u16>,
    out: &mut CudaSlice<f32>,
    rows: usize,
    n: usize,
    eps: f32,
    add_one: bool,
) -> Result<()> {
    let k = "rmsnorm_f32";
    let total = mul("rmsnorm extent", &[rows, n])?;
    len_at_least(k, "x", x, total)?;
    len_at_least(k, "out", out, total)?;
    len_at_least(k, "w", w, n)?;
    let p = plan_rmsnorm(rows, n)?;
    let (n32, a) = (i32_of("n", n)?, i32::from(add_one));
    launch!(gpu, &p, Source::Norm, v, x, w, out, &n32, &eps, &a);
    Ok(())
}

// ---------------------------------------------------------------- GEMV / small-batch GEMM

pub fn plan_gemv(n_out: usize, k: usize, rows: usize, w_rows: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "gemv_bf16",
        grid: [cdiv(n_out, 8) as u64, 1, 1],
        block: 256,
        smem: 0,
        dyn_smem: 0,
        optin: false,
        i32_max: [k, n_out, rows].into_iter().max().unwrap_or(0) as u64,
        offset_max: mul("gemv weight extent", &[w_rows, k])?
            .max(mul("gemv output", &[rows, n_out])?) as u64,
    })
}

/// y[r, n] = W[row(n)] . x[r] for r < rows; W [w_rows, k] bf16, row(n) = row_ids[n] or n.
/// Each row's result is bit-identical whatever `rows` is.
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    v: Variant,
    w: &CudaSlice<u16>,
    w_rows: usize,
    x: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    row_ids: Option<&CudaSlice<u32>>,
    n_out: usize,
    k: usize,
    rows: usize,
) -> Result<()> {
    let kn = "gemv_bf16";
    need(kn, k.is_multiple_of(8) && k > 0, || {
        format!("k = {k} must be a positive multiple of 8")
    })?;
    len_at_least(kn, "w", w, mul("gemv weight", &[w_rows, k])?)?;
    len_at_least(kn, "x", x, mul("gemv x", &[rows, k])?)?;
    len_at_least(kn, "y", y, mul("gemv y", &[rows, n_out])?)?;
    match row_ids {
        Some(ids) => len_at_least(kn, "row_ids", ids, n_out)?,
        None => need(kn, n_out <= w_rows, || {
            format!("n_out {n_out} > weight rows {w_rows}")
        })?,
    }
    let p = plan_gemv(n_out, k, rows, w_rows)?;
    let (n32, k32, r32) = (
        i32_of("n_out", n_out)?,
        i32_of("k", k)?,
        i32_of("rows", rows)?,
    );
    let null = 0u64;
    match row_ids {
        Some(ids) => launch!(gpu, &p, Source::Gemv, v, w, x, y, ids, &n32, &k32, &r32),
        None => launch!(gpu, &p, Source::Gemv, v, w, x, y, &null, &n32, &k32, &r32),
    }
    Ok(())
}

// ---------------------------------------------------------------- MoE

pub fn plan_router(rows: usize, e: usize, k: usize) -> Result<LaunchPlan> {
    // key[E], p[E] and the k picks' probabilities, f32
    let dyn_smem = mul("router shared memory", &[2 * e + k, 4])? as u64;
    Ok(LaunchPlan {
        kernel: "moe_router",
        grid: [rows as u64, 1, 1],
        block: 256,
        // scratch[32] f32 (the picks are one warp's, without shared arrays)
        smem: dyn_smem + 128,
        dyn_smem,
        optin: false,
        i32_max: e as u64,
        offset_max: mul("router logits", &[rows, e])? as u64,
    })
}

/// Softmax over e logits per row, top-k by logit (ties to the lower index), renormalised weights.
#[allow(clippy::too_many_arguments)]
pub fn router(
    gpu: &Gpu,
    v: Variant,
    logits: &CudaSlice<f32>,
    ids: &mut CudaSlice<u32>,
    wts: &mut CudaSlice<f32>,
    rows: usize,
    e: usize,
    k: usize,
) -> Result<()> {
    let kn = "moe_router";
    need(kn, k >= 1 && k <= e, || {
        format!("k = {k} must be in 1..={e}")
    })?;
    len_at_least(kn, "logits", logits, mul("router logits", &[rows, e])?)?;
    len_at_least(kn, "ids", ids, mul("router ids", &[rows, k])?)?;
    len_at_least(kn, "weights", wts, mul("router weights", &[rows, k])?)?;
    let p = plan_router(rows, e, k)?;
    let (e32, k32) = (i32_of("e", e)?, i32_of("k", k)?);
    let (no_keep, no_err) = (0u64, 0u64);
    launch!(
        gpu,
        &p,
        Source::Moe,
        v,
        logits,
        ids,
        wts,
        &e32,
        &k32,
        &no_keep,
        &no_err
    );
    Ok(())
}

/// FP8 expert weights of one layer: gate, up [E, I, H]; down [E, H, I]; block scales.
pub struct ExpertWeights {
    pub gate: CudaSlice<u8>,
    pub up: CudaSlice<u8>,
    pub down: CudaSlice<u8>,
    pub gate_s: CudaSlice<f32>,
    pub up_s: CudaSlice<f32>,
    pub down_s: CudaSlice<f32>,
    pub e: usize,
    pub i: usize,
    pub h: usize,
}

impl ExpertWeights {
    fn validate(&self, kernel: &'static str) -> Result<()> {
        need(
            kernel,
            self.i.is_multiple_of(16) && self.h.is_multiple_of(16) && self.i > 0 && self.h > 0,
            || {
                format!(
                    "I = {} and H = {} must be positive multiples of 16",
                    self.i, self.h
                )
            },
        )?;
        let mat = mul("expert weights", &[self.e, self.i, self.h])?;
        let smat = mul(
            "expert scales",
            &[self.e, cdiv(self.i, 128), cdiv(self.h, 128)],
        )?;
        len_at_least(kernel, "gate", &self.gate, mat)?;
        len_at_least(kernel, "up", &self.up, mat)?;
        len_at_least(kernel, "down", &self.down, mat)?;
        len_at_least(kernel, "gate scales", &self.gate_s, smat)?;
        len_at_least(kernel, "up scales", &self.up_s, smat)?;
        len_at_least(kernel, "down scales", &self.down_s, smat)
    }
}

pub fn plan_gate_up(k: usize, i: usize, h: usize, e: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "moe_gate_up_fp8",
        grid: [cdiv(mul("gate/up warps", &[k, i])?, 8) as u64, 1, 1],
        block: 256,
        smem: 0,
        dyn_smem: 0,
        optin: false,
        i32_max: [i, h, k].into_iter().max().unwrap_or(0) as u64,
        offset_max: mul("expert weights", &[e, i, h])? as u64,
    })
}

pub fn plan_down(k: usize, i: usize, h: usize, e: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "moe_down_fp8",
        grid: [cdiv(h, 8) as u64, 1, 1],
        block: 256,
        smem: 0,
        dyn_smem: 0,
        optin: false,
        i32_max: [i, h, k].into_iter().max().unwrap_or(0) as u64,
        offset_max: mul("expert weights", &[e, i, h])? as u64,
    })
}

/// h[j, :] = silu(gate_{ids[j]} x) * (up_{ids[j]} x) for j < k; x one row of H.
pub fn expert_gate_up(
    gpu: &Gpu,
    v: Variant,
    w: &ExpertWeights,
    ids: &CudaSlice<u32>,
    x: &CudaSlice<f32>,
    h: &mut CudaSlice<f32>,
    k: usize,
) -> Result<()> {
    let kn = "moe_gate_up_fp8";
    w.validate(kn)?;
    len_at_least(kn, "ids", ids, k)?;
    len_at_least(kn, "x", x, w.h)?;
    len_at_least(kn, "h", h, mul("h", &[k, w.i])?)?;
    let p = plan_gate_up(k, w.i, w.h, w.e)?;
    let (i32v, h32, k32) = (i32_of("I", w.i)?, i32_of("H", w.h)?, i32_of("k", k)?);
    launch!(
        gpu,
        &p,
        Source::Moe,
        v,
        &w.gate,
        &w.up,
        &w.gate_s,
        &w.up_s,
        ids,
        x,
        h,
        &i32v,
        &h32,
        &k32
    );
    Ok(())
}

/// y = sum_j wts[j] * down_{ids[j]} h[j].
#[allow(clippy::too_many_arguments)]
pub fn expert_down(
    gpu: &Gpu,
    v: Variant,
    w: &ExpertWeights,
    ids: &CudaSlice<u32>,
    wts: &CudaSlice<f32>,
    h: &CudaSlice<f32>,
    y: &mut CudaSlice<f32>,
    k: usize,
) -> Result<()> {
    let kn = "moe_down_fp8";
    w.validate(kn)?;
    len_at_least(kn, "ids", ids, k)?;
    len_at_least(kn, "weights", wts, k)?;
    len_at_least(kn, "h", h, mul("h", &[k, w.i])?)?;
    len_at_least(kn, "y", y, w.h)?;
    let p = plan_down(k, w.i, w.h, w.e)?;
    let (i32v, h32, k32) = (i32_of("I", w.i)?, i32_of("H", w.h)?, i32_of("k", k)?);
    launch!(
        gpu,
        &p,
        Source::Moe,
        v,
        &w.down,
        &w.down_s,
        ids,
        wts,
        h,
        y,
        &i32v,
        &h32,
        &k32
    );
    Ok(())
}

// ---------------------------------------------------------------- Gated DeltaNet

pub fn plan_conv(c: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "gdn_conv_step",
        grid: [cdiv(c, 256) as u64, 1, 1],
        block: 256,
        smem: 0,
        dyn_smem: 0,
        optin: false,
        i32_max: mul("conv state", &[c, 4])? as u64,
        offset_max: mul("conv state", &[c, 4])? as u64,
    })
}

/// u = silu(causal depthwise conv of [state; x] with w [C, 4]); state [3, C] shifted in place.
pub fn conv_step(
    gpu: &Gpu,
    v: Variant,
    x: &CudaSlice<f32>,
    state: &mut CudaSlice<f32>,
    w: &CudaSlice<u16>,
    u: &mut CudaSlice<f32>,
    c: usize,
) -> Result<()> {
    let kn = "gdn_conv_step";
    len_at_least(kn, "x", x, c)?;
    len_at_least(kn, "state", state, mul("conv state", &[3, c])?)?;
    len_at_least(kn, "w", w, mul("conv w", &[4, c])?)?;
    len_at_least(kn, "u", u, c)?;
    let p = plan_conv(c)?;
    let c32 = i32_of("C", c)?;
    launch!(gpu, &p, Source::Gdn, v, x, state, w, u, &c32);
    Ok(())
}

pub fn plan_l2norm(nk: usize, dk: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "gdn_l2norm",
        grid: [cdiv(mul("l2norm warps", &[2, nk, 32])?, 256) as u64, 1, 1],
        block: 256,
        smem: 0,
        dyn_smem: 0,
        optin: false,
        i32_max: mul("l2norm extent", &[2, nk, dk])? as u64,
        offset_max: mul("l2norm extent", &[2, nk, dk])? as u64,
    })
}

/// In place over [q; k] (nk heads of dk each): l2-normalise, q also times q_scale.
pub fn l2norm(
    gpu: &Gpu,
    v: Variant,
    qk: &mut CudaSlice<f32>,
    nk: usize,
    dk: usize,
    q_scale: f32,
) -> Result<()> {
    len_at_least("gdn_l2norm", "qk", qk, mul("l2norm extent", &[2, nk, dk])?)?;
    let p = plan_l2norm(nk, dk)?;
    let (nk32, dk32) = (i32_of("nk", nk)?, i32_of("dk", dk)?);
    launch!(gpu, &p, Source::Gdn, v, qk, &nk32, &dk32, &q_scale);
    Ok(())
}

pub fn plan_recurrent(nv: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "gdn_recurrent_step",
        grid: [nv as u64, 1, 1],
        block: 512,
        smem: (2 * 128 + 8 * 128) * 4,
        dyn_smem: 0,
        optin: false,
        i32_max: nv as u64,
        offset_max: mul("delta state", &[nv, GDN_HEAD_DIM, GDN_HEAD_DIM])? as u64,
    })
}

/// Dynamic shared memory of `gdn_chunk` (ops.cu `GC_SMEM` floats: the chunk's k, q and W
/// tiles at row stride 129, v at 33, M and P at 65, the state's 32 columns at 33, four scalars
/// a row).
pub const GDN_CHUNK_SMEM: usize = 4 * (3 * 64 * 129 + 64 * 33 + 2 * 64 * 65 + 128 * 33 + 4 * 64);

/// The chunked delta rule (`gdn_chunk`, dk = dv = 128) over `lanes` lanes of `rows` rows in all,
/// `nk` key and `nv` value heads: a block a value head's 32 state columns and lane.
pub fn plan_gdn_chunk(rows: usize, nk: usize, nv: usize, lanes: usize) -> Result<LaunchPlan> {
    let c = mul("gdn channels", &[2 * nk + nv, GDN_HEAD_DIM])?;
    Ok(LaunchPlan {
        kernel: "gdn_chunk",
        grid: [
            mul("gdn_chunk grid", &[nv, GDN_HEAD_DIM / 32])? as u64,
            lanes as u64,
            1,
        ],
        block: 256,
        smem: GDN_CHUNK_SMEM as u64,
        dyn_smem: GDN_CHUNK_SMEM as u64,
        optin: true,
        // ints: a lane's start and length (row counts), C, the heads
        i32_max: [rows, c, nv].into_iter().max().unwrap_or(0) as u64,
        // rows of u (rows x C) and of o (rows x nv x 128), computed in 64-bit
        offset_max: mul("gdn_chunk offsets", &[rows, c])?
            .max(mul("gdn_chunk output", &[rows, nv, GDN_HEAD_DIM])?) as u64,
    })
}

/// Device buffers of one recurrent step.
pub struct DeltaBuffers<'a> {
    pub q: &'a CudaSlice<f32>,
    pub k: &'a CudaSlice<f32>,
    pub v: &'a CudaSlice<f32>,
    pub b: &'a CudaSlice<f32>,
    pub a: &'a CudaSlice<f32>,
    pub a_log: &'a CudaSlice<u16>,
    pub dt_bias: &'a CudaSlice<u16>,
}

/// One delta-rule step for nv value heads (dk = dv = 128); state [nv, 128, 128] f32 in place.
pub fn recurrent_step(
    gpu: &Gpu,
    v: Variant,
    bufs: &DeltaBuffers,
    state: &mut CudaSlice<f32>,
    o: &mut CudaSlice<f32>,
    nk: usize,
    nv: usize,
) -> Result<()> {
    let kn = "gdn_recurrent_step";
    let d = GDN_HEAD_DIM;
    need(kn, nk > 0 && nv.is_multiple_of(nk), || {
        format!("nv = {nv} must be a multiple of nk = {nk}")
    })?;
    len_at_least(kn, "q", bufs.q, mul("q", &[nk, d])?)?;
    len_at_least(kn, "k", bufs.k, mul("k", &[nk, d])?)?;
    len_at_least(kn, "v", bufs.v, mul("v", &[nv, d])?)?;
    for (n, b) in [("b", bufs.b), ("a", bufs.a)] {
        len_at_least(kn, n, b, nv)?;
    }
    len_at_least(kn, "A_log", bufs.a_log, nv)?;
    len_at_least(kn, "dt_bias", bufs.dt_bias, nv)?;
    len_at_least(kn, "state", state, mul("state", &[nv, d, d])?)?;
    len_at_least(kn, "o", o, mul("o", &[nv, d])?)?;
    let p = plan_recurrent(nv)?;
    let (nk32, nv32) = (i32_of("nk", nk)?, i32_of("nv", nv)?);
    launch!(
        gpu,
        &p,
        Source::Gdn,
        v,
        bufs.q,
        bufs.k,
        bufs.v,
        bufs.b,
        bufs.a,
        bufs.a_log,
        bufs.dt_bias,
        state,
        o,
        &nk32,
        &nv32
    );
    Ok(())
}

pub fn plan_gated_norm(nv: usize, dv: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "gdn_gated_norm",
        grid: [cdiv(mul("gated norm warps", &[nv, 32])?, 256) as u64, 1, 1],
        block: 256,
        smem: 0,
        dyn_smem: 0,
        optin: false,
        i32_max: dv as u64,
        offset_max: mul("gated norm extent", &[nv, dv])? as u64,
    })
}

/// out = rms(o) * w * silu(z) per head of dv (plain w).
#[allow(clippy::too_many_arguments)]
pub fn gated_norm(
    gpu: &Gpu,
    v: Variant,
    o: &CudaSlice<f32>,
    z: &CudaSlice<f32>,
    w: &CudaSlice<u16>,
    out: &mut CudaSlice<f32>,
    nv: usize,
    dv: usize,
    eps: f32,
) -> Result<()> {
    let kn = "gdn_gated_norm";
    let total = mul("gated norm extent", &[nv, dv])?;
    len_at_least(kn, "o", o, total)?;
    len_at_least(kn, "z", z, total)?;
    len_at_least(kn, "out", out, total)?;
    len_at_least(kn, "w", w, dv)?;
    let p = plan_gated_norm(nv, dv)?;
    let (nv32, dv32) = (i32_of("nv", nv)?, i32_of("dv", dv)?);
    launch!(gpu, &p, Source::Gdn, v, o, z, w, out, &nv32, &dv32, &eps);
    Ok(())
}

// ---------------------------------------------------------------- flash-style causal prefill

/// Whether `attn_flash_*` takes a head dim (a multiple of 32 up to 256).
pub fn flash_fits(hd: usize) -> bool {
    hd.is_multiple_of(32) && hd > 0 && hd <= FLASH_MAX_HEAD_DIM
}

/// `attn_flash_{f32,bf16}` (ops.cu) over `t` rows per lane of `nh` heads of `hd` dims, caches of
/// `cap` rows: one block per 32 rows of one head of one lane, Q and a K/V tile in shared memory.
pub fn plan_flash(
    t: usize,
    nh: usize,
    lanes: usize,
    hd: usize,
    cap: usize,
    f32kv: bool,
) -> Result<LaunchPlan> {
    flash_plan(
        t,
        mul("flash rows", &[lanes, t])?,
        nh,
        lanes,
        hd,
        cap,
        f32kv,
        false,
    )
}

/// `attn_flash_rows_{f32,bf16}` (ops.cu): a joined call's `lanes` lanes of at most `t` rows
/// each, `rows` in all, in one launch (the grid of [`plan_flash`] at `t` rows; a lane's blocks
/// past its own rows exit).
pub fn plan_flash_rows(
    t: usize,
    rows: usize,
    nh: usize,
    lanes: usize,
    hd: usize,
    cap: usize,
    f32kv: bool,
) -> Result<LaunchPlan> {
    flash_plan(t, rows, nh, lanes, hd, cap, f32kv, true)
}

#[allow(clippy::too_many_arguments)]
fn flash_plan(
    t: usize,
    rows: usize,
    nh: usize,
    lanes: usize,
    hd: usize,
    cap: usize,
    f32kv: bool,
    joined: bool,
) -> Result<LaunchPlan> {
    let kernel = match (joined, f32kv) {
        (false, true) => "attn_flash_f32",
        (false, false) => "attn_flash_bf16",
        (true, true) => "attn_flash_rows_f32",
        (true, false) => "attn_flash_rows_bf16",
    };
    need(kernel, flash_fits(hd), || {
        format!("head dim {hd} is not a multiple of 32 in 32..={FLASH_MAX_HEAD_DIM}")
    })?;
    let floats = mul(
        "flash shared memory",
        &[FLASH_ROWS + 2 * FLASH_KEYS, hd + 4],
    )? + FLASH_ROWS * (FLASH_KEYS + 1);
    let dyn_smem = (floats * 4) as u64;
    Ok(LaunchPlan {
        kernel,
        grid: [cdiv(t, FLASH_ROWS) as u64, nh as u64, lanes as u64],
        block: 128,
        smem: dyn_smem,
        dyn_smem,
        optin: true,
        // ints: t, nh, hd, and the FQ * hd shared index
        i32_max: [t, nh, hd, FLASH_ROWS * (hd + 4)]
            .into_iter()
            .max()
            .unwrap_or(0) as u64,
        // q/out rows (all lanes') * nh * hd; cache kvh * cap * hd + key * hd
        offset_max: mul("flash offsets", &[rows, nh, hd])?.max(mul("flash cache", &[cap, hd])?)
            as u64,
    })
}

// ---------------------------------------------------------------- frame-round draws

/// `round_sample` (round.cu): one block of 1024 threads per lane over `n` logits, radix-sorting
/// `n` u64 keys in shared memory through a second buffer of `n` (which then holds the order),
/// with 16 digit counts per warp and round, plus the static argmax scratch (1024 floats and
/// ints), the result, the cut's 32 f64 and the sort's 32 warp sums.
pub fn plan_round_sample(lanes: usize, n: usize) -> Result<LaunchPlan> {
    let rounds = round_sample_rounds(n);
    need("round_sample", rounds <= ROUND_SAMPLE_MAX_ROUNDS, || {
        format!(
            "{n} logits a row, the most is {} (the radix sort's keys, second buffer and counts \
             in shared memory: {ROUND_SAMPLE_MAX_ROUNDS} rounds of 1024)",
            1024 * ROUND_SAMPLE_MAX_ROUNDS
        )
    })?;
    // keys and the sort's second buffer (n u64 each), its counts (16 digits x rounds x 32 warps)
    let dyn_smem = (mul("round_sample shared memory", &[n.max(1), 16])?
        + mul("round_sample shared memory", &[16, rounds, 32, 4])?) as u64;
    Ok(LaunchPlan {
        kernel: "round_sample",
        grid: [lanes as u64, 1, 1],
        block: 1024,
        smem: dyn_smem + ROUND_SAMPLE_STATIC_SMEM,
        dyn_smem,
        optin: true,
        i32_max: mul("round_sample logits", &[16, rounds, 32])?.max(n) as u64,
        offset_max: mul("round_sample logits", &[lanes, n])? as u64,
    })
}

/// `round_sample`'s static shared memory, at most: sv and si (8 KiB), the result, block_draw's
/// 32-entry f64 pbuf, the sort's 32 warp sums, the selection's 256-bin histogram and state
/// (9648 bytes by ptxas in session 17, alignment included).
const ROUND_SAMPLE_STATIC_SMEM: u64 = 10 * 1024;

/// The most 1024-element rounds `round_sample` takes: 12 (12288 logits) keeps its shared memory
/// (16 B a key, 2 KiB of counts a round, the static part) inside Hopper's 227 KiB a block; the
/// kernel's registers hold up to round.cu's `RADIX_MAX_ROUNDS` (16).
pub const ROUND_SAMPLE_MAX_ROUNDS: usize = 12;

/// The 1024-element rounds of `round_sample`'s sort for `n` logits (its `rounds` argument).
pub fn round_sample_rounds(n: usize) -> usize {
    n.max(1).div_ceil(1024)
}

// ---------------------------------------------------------------- split-key decode

/// Query heads per kv head, head dim and kv heads per lane that `attn_decode_*` takes.
pub const DECODE_MAX_GROUP: usize = 8;
pub const DECODE_MAX_HEAD_DIM: usize = 256;
pub const DECODE_MAX_KV_HEADS: usize = 16;
const DECODE_MAX_CHUNKS: usize = 256;

/// Keys per block for a lane that sees `keys` keys (ops.cu `decode_chunk`): 128 doubled until
/// at most 256 chunks cover them. A lane's own length alone decides it, so its bits do not
/// depend on the batch.
pub fn decode_chunk(keys: usize) -> usize {
    let mut ch = 128;
    while ch * DECODE_MAX_CHUNKS < keys {
        ch *= 2;
    }
    ch
}

/// Chunks of the decode grid for lanes seeing `keys` keys: the most any lane needs. The planted
/// build (`past_limit`) reads one key past each lane's limit, so it is sized for one key more
/// (an extra chunk is empty for the other lanes and adds exactly nothing).
pub fn decode_chunks(keys: impl IntoIterator<Item = usize>, past_limit: bool) -> usize {
    let extra = usize::from(past_limit);
    keys.into_iter()
        .map(|k| cdiv(k + extra, decode_chunk(k)))
        .max()
        .unwrap_or(1)
        .max(1)
}

/// Chunks of a decode grid that covers any length up to `cap` keys (a recorded round, whose
/// lengths grow at each replay): no lane of at most `cap` keys needs more.
pub fn decode_chunks_upto(cap: usize, past_limit: bool) -> usize {
    let extra = usize::from(past_limit);
    cdiv(cap + extra, 128).min(DECODE_MAX_CHUNKS + extra).max(1)
}

/// Whether `attn_decode_*` takes these heads.
pub fn decode_fits(nh: usize, nkv: usize, hd: usize) -> bool {
    nkv > 0
        && nkv <= DECODE_MAX_KV_HEADS
        && nh.is_multiple_of(nkv)
        && nh / nkv <= DECODE_MAX_GROUP
        && hd.is_multiple_of(32)
        && hd > 0
        && hd <= DECODE_MAX_HEAD_DIM
}

/// Workspace floats of `attn_decode_*`: m and l `[lanes·nh][nchunks]`, then acc times `hd`.
pub fn decode_workspace(lanes: usize, nh: usize, hd: usize, nchunks: usize) -> Result<usize> {
    mul("decode partials", &[lanes, nh, nchunks, hd + 2])
}

/// Query heads per block of `attn_decode_*`: the whole group of a kv head (its K/V read once)
/// unless that leaves fewer than two blocks per multiprocessor, then halved down to one head
/// (short contexts: few chunks, and the block's serial work is per head). A head's bits do not
/// depend on it.
pub fn decode_heads_per_block(
    lanes: usize,
    nh: usize,
    nkv: usize,
    nchunks: usize,
    sms: usize,
) -> usize {
    let g = nh.checked_div(nkv).unwrap_or(1).max(1);
    let mut hpb = g;
    while hpb > 1 && hpb.is_multiple_of(2) && lanes * nkv * (g / hpb) * nchunks < 2 * sms {
        hpb /= 2;
    }
    hpb
}

/// `attn_decode_{f32,bf16}` (ops.cu): one query row per lane, `nchunks` key chunks per
/// (kv head, lane), `hpb` query heads per block ([`decode_heads_per_block`]), caches of `cap`
/// rows.
#[allow(clippy::too_many_arguments)]
pub fn plan_decode(
    lanes: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    cap: usize,
    nchunks: usize,
    f32kv: bool,
    hpb: usize,
) -> Result<LaunchPlan> {
    let kernel = if f32kv {
        "attn_decode_f32"
    } else {
        "attn_decode_bf16"
    };
    need(kernel, decode_fits(nh, nkv, hd), || {
        format!(
            "{nh} heads over {nkv} kv heads of {hd} dims: needs groups of at most \
             {DECODE_MAX_GROUP}, at most {DECODE_MAX_KV_HEADS} kv heads and a head dim that is a \
             multiple of 32 up to {DECODE_MAX_HEAD_DIM}"
        )
    })?;
    need(kernel, hpb > 0 && (nh / nkv).is_multiple_of(hpb), || {
        format!(
            "{hpb} heads per block do not divide the group of {}",
            nh / nkv
        )
    })?;
    Ok(LaunchPlan {
        kernel,
        grid: [
            nchunks as u64,
            (nkv * (nh / nkv / hpb)) as u64,
            lanes as u64,
        ],
        block: 128,
        // q [8][256], K staging [4][32][68], p [4][32][8], per-warp m and l, the last flag
        smem: ((DECODE_MAX_GROUP * DECODE_MAX_HEAD_DIM
            + 4 * 32 * 68
            + 4 * 32 * DECODE_MAX_GROUP
            + 2 * 4 * DECODE_MAX_GROUP)
            * 4
            + 4) as u64,
        dyn_smem: 0,
        optin: false,
        i32_max: [nh, hd, nchunks, 8 * hd].into_iter().max().unwrap_or(0) as u64,
        // cache kvh * cap * hd + key * hd; partial acc (lanes * nh * nchunks + c) * hd
        offset_max: mul("decode cache", &[nkv, cap, hd])?
            .max(decode_workspace(lanes, nh, hd, nchunks)?) as u64,
    })
}

// ---------------------------------------------------------------- tiled GEMM

/// `gemm_bf16_tiled` (gemm.cu): `rows` x `k` activations into `n` outputs, 64 x 64 tiles.
pub fn plan_gemm(rows: usize, k: usize, n: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "gemm_bf16_tiled",
        grid: [cdiv(n, 64) as u64, cdiv(rows, 64) as u64, 1],
        block: 256,
        // two [32][68] f32 tiles
        smem: 2 * 32 * 68 * 4,
        dyn_smem: 0,
        optin: false,
        i32_max: [rows, k, n].into_iter().max().unwrap_or(0) as u64,
        offset_max: mul("gemm offsets", &[rows, k])?.max(mul("gemm offsets", &[rows, n])?) as u64,
    })
}

/// `gemm_bf16_tc`: the tiled GEMM's grid on tensor cores (K a multiple of 32).
pub fn plan_gemm_tc(rows: usize, k: usize, n: usize) -> Result<LaunchPlan> {
    Ok(LaunchPlan {
        kernel: "gemm_bf16_tc",
        // a [64][36] f32 weight tile and two [64][36] u32 activation tiles (hi, lo)
        smem: 3 * 64 * 36 * 4,
        ..plan_gemm(rows, k, n)?
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn decode_heads_per_block_splits_groups_only_when_blocks_are_few() {
        // one lane, 2 kv heads of 8 query heads, 1 chunk: a block per head
        assert_eq!(decode_heads_per_block(1, 16, 2, 1, 132), 1);
        // 2 chunks x 2 kv heads x 8 lanes = 32 blocks per group: a block per head (256)
        assert_eq!(decode_heads_per_block(8, 16, 2, 2, 132), 1);
        // 32 lanes: 2 heads a block already make 512 blocks
        assert_eq!(decode_heads_per_block(32, 16, 2, 2, 132), 2);
        // long contexts keep the whole group (K/V read once)
        assert_eq!(decode_heads_per_block(1, 16, 2, 256, 132), 8);
        assert_eq!(decode_heads_per_block(32, 16, 2, 8, 132), 8);
        // a group of 3 is not halved
        assert_eq!(decode_heads_per_block(1, 6, 2, 1, 132), 3);
        for (lanes, nh, nkv, nc) in [(1, 16, 2, 1), (3, 32, 4, 5), (32, 16, 16, 1)] {
            let hpb = decode_heads_per_block(lanes, nh, nkv, nc, 132);
            assert!(plan_decode(lanes, nh, nkv, 256, 4096, nc, true, hpb).is_ok());
        }
        assert!(plan_decode(1, 16, 2, 256, 4096, 1, true, 3).is_err());
    }

    #[test]
    fn decode_chunks_upto_covers_every_length_to_the_capacity() {
        for cap in [1usize, 127, 128, 129, 300, 32_768, 32_769, 65_537, 262_144] {
            for past in [false, true] {
                // every length, sparser past 70k keys plus each chunk-size boundary
                let bounds = (7..=11).flat_map(|e| {
                    let k = DECODE_MAX_CHUNKS << e;
                    [k - 1, k, k + 1]
                });
                let most = (1..=cap)
                    .step_by(if cap > 70_000 { 97 } else { 1 })
                    .chain(bounds.filter(|&k| k <= cap))
                    .chain([cap])
                    .map(|k| decode_chunks([k], past))
                    .max()
                    .unwrap();
                assert!(
                    decode_chunks_upto(cap, past) >= most,
                    "cap {cap} past {past}"
                );
                assert!(decode_chunks_upto(cap, past) <= DECODE_MAX_CHUNKS + usize::from(past));
            }
        }
    }

    use super::*;

    #[test]
    fn plans_fit_h200_at_largest_shapes_and_flag_overflow() {
        let info = DeviceInfo::h200_nominal();
        let nc = decode_chunks([262_144], true);
        for f32kv in [true, false] {
            for hpb in [1, 8] {
                assert!(plan_decode(32, 16, 2, 256, 262_144, nc, f32kv, hpb)
                    .unwrap()
                    .problems(&info)
                    .is_empty());
            }
            assert!(plan_flash(262_144, 16, 1, 256, 262_144, f32kv)
                .unwrap()
                .problems(&info)
                .is_empty());
            // a joined call of 32 lanes, 262144 rows in all: the uniform plan's grid at the
            // longest lane, its offsets over every lane's rows
            let joined = plan_flash_rows(8192, 262_144, 16, 32, 256, 262_144, f32kv).unwrap();
            let uniform = plan_flash(8192, 16, 32, 256, 262_144, f32kv).unwrap();
            assert!(joined.problems(&info).is_empty());
            assert_eq!(
                (joined.grid, joined.dyn_smem, joined.offset_max),
                (uniform.grid, uniform.dyn_smem, uniform.offset_max)
            );
            assert!(joined.kernel.starts_with("attn_flash_rows_"));
        }
        assert!(plan_gemv(262_144, 8192, 8, 262_144)
            .unwrap()
            .problems(&info)
            .is_empty());
        // a grid.y past 65535 and a 32-bit index past 2^31 are both reported
        let mut bad = plan_decode(1, 16, 2, 256, 262_144, nc, true, 8).unwrap();
        bad.grid[1] = 70_000;
        bad.i32_max = 1 << 31;
        assert_eq!(bad.problems(&info).len(), 2);
    }
}

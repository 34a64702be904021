//! The kernel contract: every registered kernel against its FP64 CPU reference on fresh random
//! inputs, with a precision-derived tolerance, a precision-discriminating case (the kernel's
//! lower-precision twin must fail it), a planted control (a deliberately wrong build that must be
//! caught), launch-limit records at the largest admitted shapes, and, for attention, planted
//! long-range cases at 262144 keys.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::error::Result;
use crate::kernels::{self as k, DeltaBuffers, ExpertWeights, LaunchPlan};
use crate::reference::{self as r, rel_l2};
use crate::rng::Rng;
use crate::runtime::{DeviceInfo, Gpu, Source, Variant};

#[path = "contract_ops.rs"]
mod ops;

/// What a printed line counts towards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// must hold for the kernel to pass
    Check,
    /// the lower-precision twin must fail the tolerance; part of the kernel passing
    Discriminate,
    /// a planted wrong build; `ok` means it was caught (red as planted)
    Control,
    /// a launch plan at the largest admitted shape; `ok` means within the device's limits
    Limit,
}

/// One case's result.
#[derive(Clone, Debug)]
pub struct Line {
    pub kernel: &'static str,
    pub case: String,
    pub kind: Kind,
    pub ok: bool,
    pub detail: String,
}

impl Line {
    pub fn render(&self) -> String {
        let tag = match (self.kind, self.ok) {
            (Kind::Check | Kind::Discriminate, true) => "PASS",
            (Kind::Check | Kind::Discriminate, false) => "FAIL",
            (Kind::Control, true) => "RED (as planted)",
            (Kind::Control, false) => "MISSED",
            (Kind::Limit, true) => "LIMIT ok",
            (Kind::Limit, false) => "LIMIT PROBLEM",
        };
        format!(
            "{:<22} {:<44} {:<16} {}",
            self.kernel, self.case, tag, self.detail
        )
    }
}

/// Counts over a contract run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContractSummary {
    pub kernels: usize,
    pub pass: usize,
    pub fail: usize,
    pub controls: usize,
    pub red: usize,
    pub missed: usize,
    pub limit_problems: usize,
}

impl ContractSummary {
    /// Adds one kernel's lines; the kernel passes iff every check and discrimination holds and
    /// it ran without error.
    pub fn add_kernel(&mut self, lines: &[Line], errored: bool) {
        self.kernels += 1;
        let ok = !errored
            && lines
                .iter()
                .filter(|l| matches!(l.kind, Kind::Check | Kind::Discriminate))
                .all(|l| l.ok)
            && lines.iter().any(|l| l.kind == Kind::Check);
        if ok {
            self.pass += 1;
        } else {
            self.fail += 1;
        }
        for l in lines {
            match l.kind {
                Kind::Control => {
                    self.controls += 1;
                    if l.ok {
                        self.red += 1;
                    } else {
                        self.missed += 1;
                    }
                }
                Kind::Limit if !l.ok => self.limit_problems += 1,
                _ => {}
            }
        }
    }

    pub fn all_green(&self) -> bool {
        self.fail == 0 && self.missed == 0 && self.limit_problems == 0 && self.kernels > 0
    }

    /// The closing line.
    pub fn line(&self) -> String {
        format!(
            "SUMMARY {} kernels: {} pass, {} fail; {} controls: {} red as planted, {} missed; {} limit problems",
            self.kernels, self.pass, self.fail, self.controls, self.red, self.missed, self.limit_problems
        )
    }
}

/// Relative-L2 tolerance of f32 arithmetic over `depth` accumulated terms (unit roundoff 2^-24,
/// random-walk growth, a floor for exp/rsqrt ulps).
pub fn tol_f32(depth: usize) -> f64 {
    2f64.powi(-24) * (64.0 + 8.0 * (depth as f64).sqrt())
}

pub(crate) struct Ctx<'a> {
    pub(crate) gpu: &'a Gpu,
    pub(crate) shared: &'a Arc<Gpu>,
    pub(crate) rng: Rng,
    lines: Vec<Line>,
    kernel: &'static str,
}

impl Ctx<'_> {
    pub(crate) fn push(&mut self, case: impl Into<String>, kind: Kind, ok: bool, detail: String) {
        let l = Line {
            kernel: self.kernel,
            case: case.into(),
            kind,
            ok,
            detail,
        };
        println!("{}", l.render());
        self.lines.push(l);
    }
    pub(crate) fn check(&mut self, case: &str, err: f64, tol: f64) {
        self.push(
            case,
            Kind::Check,
            err <= tol,
            format!("rel_l2 {err:.3e} <= tol {tol:.3e}"),
        );
    }
    pub(crate) fn discriminate(&mut self, case: &str, err: f64, tol: f64) {
        self.push(
            format!("{case} [low precision must fail]"),
            Kind::Discriminate,
            err > tol,
            format!("rel_l2 {err:.3e} > tol {tol:.3e}"),
        );
    }
    pub(crate) fn control(&mut self, case: &str, err: f64, tol: f64) {
        self.push(
            format!("{case} [planted]"),
            Kind::Control,
            err > tol,
            format!("rel_l2 {err:.3e} vs tol {tol:.3e}"),
        );
    }
    /// Exact must pass, low precision must fail, planted must be caught, all on these inputs.
    pub(crate) fn triple(
        &mut self,
        case: &str,
        tol: f64,
        reference: &[f64],
        mut run: impl FnMut(&Gpu, Variant) -> Result<Vec<f32>>,
    ) -> Result<()> {
        let e = rel_l2(&run(self.gpu, Variant::Exact)?, reference);
        self.check(case, e, tol);
        let l = rel_l2(&run(self.gpu, Variant::LowPrecision)?, reference);
        self.discriminate(case, l, tol);
        let p = rel_l2(&run(self.gpu, Variant::Planted)?, reference);
        self.control(case, p, tol);
        Ok(())
    }
    pub(crate) fn limit(&mut self, case: &str, plan: Result<LaunchPlan>) {
        match plan {
            Ok(p) => {
                let probs = p.problems(&self.gpu.info);
                let detail = format!(
                    "{} grid {:?} block {} smem {} B i32max {} offsets<= {}{}",
                    p.kernel,
                    p.grid,
                    p.block,
                    p.smem,
                    p.i32_max,
                    p.offset_max,
                    if probs.is_empty() {
                        String::new()
                    } else {
                        format!(" :: {}", probs.join("; "))
                    }
                );
                self.push(
                    format!("limits {case}"),
                    Kind::Limit,
                    probs.is_empty(),
                    detail,
                );
            }
            Err(e) => self.push(format!("limits {case}"), Kind::Limit, false, e.to_string()),
        }
    }
}

fn up<T: DeviceRepr + Clone>(gpu: &Gpu, v: &[T]) -> Result<CudaSlice<T>> {
    Ok(gpu.stream.clone_htod(v)?)
}

fn down(gpu: &Gpu, s: &CudaSlice<f32>) -> Result<Vec<f32>> {
    Ok(gpu.stream.clone_dtoh(s)?)
}

/// Output buffer filled with NaN, so an unwritten element fails the check.
fn poisoned(gpu: &Gpu, n: usize) -> Result<CudaSlice<f32>> {
    up(gpu, &vec![f32::NAN; n])
}

pub(crate) type KernelFn = fn(&mut Ctx) -> Result<()>;

/// Every registered kernel, in order.
const REGISTRY: &[(&str, KernelFn)] = &[
    ("rmsnorm", rmsnorm),
    ("gemv_bf16", gemv_one_row),
    ("gemm_bf16_small_batch", gemm_batch),
    ("lm_head_candidates", lm_head),
    ("moe_router", router),
    ("moe_gate_up_fp8", gate_up),
    ("moe_down_fp8", expert_down),
    ("gdn_conv_step", conv),
    ("gdn_l2norm", l2norm),
    ("gdn_recurrent_step", recurrent),
    ("gdn_gated_norm", gated_norm),
    ("buffer_moves", ops::buffer_moves),
    ("gather_sum", ops::gather_sum),
    ("rmsnorm_groups_f32w", ops::rmsnorm_groups),
    ("elementwise", ops::elementwise),
    ("add_rms_norm_fused", ops::add_rms_norm),
    ("gemv_bf16_multi", ops::linear_many),
    ("gemv_tc2_edges", ops::linear_edges),
    ("add_sigmoid_mul_fused", ops::add_sigmoid_mul),
    ("add_gated_rms_norm_fused", ops::add_gated_rms_norm),
    ("rms_norm_silu_fused", ops::rms_norm_silu),
    ("rms_norm_concat_fused", ops::rms_norm_concat),
    ("gemv_tc2", ops::gemv_tc2),
    ("gemv_tt", ops::gemv_tt),
    ("gemv_tw", ops::gemv_tw),
    ("gemv_ts", ops::gemv_ts),
    ("gemm_bf16_tiled", ops::gemm_tiled),
    ("gemm_bf16_cublaslt", ops::gemm_lt),
    ("moe_experts_grouped_fp8", ops::experts_grouped),
    ("gemm_bf16_tc", ops::gemm_tc),
    ("moe_experts_grouped_fp8_tc", ops::experts_grouped_tc),
    ("moe_experts_slots_fp8", ops::experts_slots),
    ("moe_experts_tc_fp8", ops::experts_tc),
    ("rope_neox_interleaved", ops::rope),
    ("norm_rope_fused", ops::norm_rope),
    ("kv_append_bf16_f32", ops::kv_append),
    ("attn_generic_bf16_f32", ops::attn_generic),
    ("attn_flash_prefill", ops::attn_flash),
    ("attn_flash_joined", ops::attn_flash_joined),
    ("attn_decode_split_f32_bf16", ops::attn_decode_split),
    ("gdn_conv_rows", ops::conv_rows),
    ("gdn_delta_rule_rows", ops::delta_rule),
    ("gdn_prefill_lanes", ops::gdn_prefill_lanes),
    ("gdn_chunk", ops::delta_chunked),
    ("moe_router_keep", ops::router_keep),
    ("moe_experts_rows_fp8", ops::experts_rows),
    ("moe_experts_rows_split4_fp8", ops::experts_rows_split4),
    ("gemv_fp8", ops::gemv_fp8),
    ("moe_router_nonfinite", ops::router_nonfinite),
    ("moe_experts_rows_nvfp4", ops::experts_rows_nvfp4),
    ("gemv_nvfp4", ops::gemv_nvfp4),
    ("round_sample", ops::round_draws),
    ("round_embed", ops::round_embed),
];

/// Whether a kernel's registry name is selected by `--only`: it contains one of the
/// comma-separated parts of the pattern.
pub fn selected(name: &str, pattern: &str) -> bool {
    pattern.trim().is_empty()
        || pattern
            .split(',')
            .map(str::trim)
            .any(|p| !p.is_empty() && name.contains(p))
}

/// The sources a registered kernel group is expected to launch from: `--only` builds just these
/// at once (one source's three builds took up to a minute on a fresh machine). A source missed
/// here still compiles at its first use, so this decides speed, never what runs.
fn sources_for(name: &str) -> Vec<Source> {
    // Ops: buffer moves and the composed fallbacks every group may touch
    let mut v = vec![Source::Ops];
    let has = |p: &str| name.starts_with(p);
    if name == "rmsnorm" {
        v.push(Source::Norm);
    }
    if has("gemv") || has("lm_head") || has("gemm_bf16_small") || name.ends_with("_fused") {
        v.push(Source::Gemv);
    }
    if has("moe") {
        v.extend([Source::Moe, Source::Gemm]);
    }
    if has("gemm") {
        v.push(Source::Gemm);
    }
    if matches!(
        name,
        "gdn_conv_step" | "gdn_l2norm" | "gdn_recurrent_step" | "gdn_gated_norm"
    ) {
        v.push(Source::Gdn);
    }
    if has("round") {
        v.push(Source::Round);
    }
    v
}

/// The sources of every kernel group `pattern` selects, each once.
fn precompile_set(pattern: &str) -> Vec<Source> {
    let mut out: Vec<Source> = Vec::new();
    for (name, _) in REGISTRY.iter().filter(|(n, _)| selected(n, pattern)) {
        for s in sources_for(name) {
            if !out.contains(&s) {
                out.push(s);
            }
        }
    }
    out
}

/// Runs the contract on device 0 for kernels whose name contains `filter` (or, comma-separated,
/// any of its parts).
pub fn run(filter: Option<&str>) -> Result<ContractSummary> {
    let gpu = Arc::new(Gpu::new(0)?);
    run_on(&gpu, filter, Rng::fresh_seed())
}

/// Runs the contract on `gpu` with inputs drawn from `seed`.
pub fn run_on(shared: &Arc<Gpu>, filter: Option<&str>, seed: u64) -> Result<ContractSummary> {
    let gpu: &Gpu = shared;
    println!(
        "contract on {} (cc {}.{}, {} SMs, arch {}), seed {seed:#x}",
        gpu.info.name,
        gpu.info.compute_capability.0,
        gpu.info.compute_capability.1,
        gpu.info.sm_count,
        gpu.arch
    );
    let start = std::time::Instant::now();
    // every source's three builds at once (NVRTC on parallel threads), not one after another at
    // each source's first use; with `--only`, the selected groups' sources
    // (a build that fails here fails again at its first use, inside its kernel group's cases,
    // where the contract reports it)
    let sources = match filter {
        None => Source::ALL.to_vec(),
        Some(p) => precompile_set(p),
    };
    match gpu.precompile(&sources, &Variant::ALL) {
        Ok(built) => eprintln!(
            "contract: {built} source builds ready at {:.1} s",
            start.elapsed().as_secs_f64()
        ),
        Err(e) => eprintln!("contract: building every source at once failed: {e}"),
    }
    let mut summary = ContractSummary::default();
    for (i, (name, f)) in REGISTRY.iter().enumerate() {
        if filter.is_some_and(|p| !selected(name, p)) {
            continue;
        }
        // where the time goes (a fresh machine compiles every source for three builds): a
        // guard that cuts the run short shows how far it got
        eprintln!("contract: {name} at {:.1} s", start.elapsed().as_secs_f64());
        let mut ctx = Ctx {
            gpu,
            shared,
            rng: Rng::new(seed.wrapping_add(i as u64 * 0x1000_0001)),
            lines: Vec::new(),
            kernel: name,
        };
        let res = f(&mut ctx);
        if let Err(e) = &res {
            ctx.push("error", Kind::Check, false, e.to_string());
        }
        summary.add_kernel(&ctx.lines, res.is_err());
    }
    println!("{}", summary.line());
    Ok(summary)
}

// ------------------------------------------------------------------ kernels

fn rmsnorm(c: &mut Ctx) -> Result<()> {
    for (case, rows, n, add_one) in [
        ("1+w rows 4 x 2048", 4, 2048, true),
        ("plain w rows 3 x 128", 3, 128, false),
    ] {
        let x = c.rng.normals_f32(rows * n, 3.0);
        let w = c.rng.normals_bf16(n, if add_one { 0.1 } else { 1.0 });
        let reference = r::rmsnorm(&x, &w, n, 1e-6, add_one);
        let run = |g: &Gpu, v| -> Result<Vec<f32>> {
            let (xd, wd) = (up(g, &x)?, up(g, &w)?);
            let mut o = poisoned(g, rows * n)?;
            k::rmsnorm(g, v, &xd, &wd, &mut o, rows, n, 1e-6, add_one)?;
            down(g, &o)
        };
        if add_one {
            c.triple(case, tol_f32(n), &reference, run)?;
        } else {
            let e = rel_l2(&run(c.gpu, Variant::Exact)?, &reference);
            c.check(case, e, tol_f32(n));
        }
    }
    c.limit("262144 rows x 8192", k::plan_rmsnorm(262_144, 8192));
    Ok(())
}

fn gemv_one_row(c: &mut Ctx) -> Result<()> {
    let (n, kk) = (2048, 8192);
    let w = c.rng.normals_bf16(n * kk, 0.02);
    let x = c.rng.normals_f32(kk, 1.0);
    let ids: Vec<usize> = (0..n).collect();
    let reference = r::gemv(&w, &x, kk, 1, &ids);
    let wd = up(c.gpu, &w)?;
    c.triple("1 row, W 2048 x 8192", tol_f32(kk), &reference, |g, v| {
        let xd = up(g, &x)?;
        let mut y = poisoned(g, n)?;
        k::gemv(g, v, &wd, n, &xd, &mut y, None, n, kk, 1)?;
        down(g, &y)
    })?;
    c.limit(
        "W 262144 x 8192, 8 rows",
        k::plan_gemv(262_144, 8192, 8, 262_144),
    );
    Ok(())
}

fn gemm_batch(c: &mut Ctx) -> Result<()> {
    let (n, kk, rows) = (1024, 2048, 11);
    let w = c.rng.normals_bf16(n * kk, 0.02);
    let x = c.rng.normals_f32(rows * kk, 1.0);
    let ids: Vec<usize> = (0..n).collect();
    let reference = r::gemv(&w, &x, kk, rows, &ids);
    let wd = up(c.gpu, &w)?;
    let batch = |g: &Gpu, v| -> Result<Vec<f32>> {
        let xd = up(g, &x)?;
        let mut y = poisoned(g, rows * n)?;
        k::gemv(g, v, &wd, n, &xd, &mut y, None, n, kk, rows)?;
        down(g, &y)
    };
    let yb = batch(c.gpu, Variant::Exact)?;
    let mut identical = true;
    for row in 0..rows {
        let xd = up(c.gpu, &x[row * kk..(row + 1) * kk])?;
        let mut y = poisoned(c.gpu, n)?;
        k::gemv(c.gpu, Variant::Exact, &wd, n, &xd, &mut y, None, n, kk, 1)?;
        let y1 = down(c.gpu, &y)?;
        identical &= y1
            .iter()
            .zip(&yb[row * n..(row + 1) * n])
            .all(|(a, b)| a.to_bits() == b.to_bits());
    }
    c.push(
        "11 rows: each row bitwise = its 1-row launch",
        Kind::Check,
        identical,
        format!(
            "batch invariance {}",
            if identical { "holds" } else { "BROKEN" }
        ),
    );
    c.triple("11 rows, W 1024 x 2048", tol_f32(kk), &reference, batch)?;
    Ok(())
}

fn lm_head(c: &mut Ctx) -> Result<()> {
    let (vocab, kk) = (4480, 2048);
    let mut ids: Vec<usize> = vec![300];
    ids.extend(380..380 + 4096);
    let w = c.rng.normals_bf16(vocab * kk, 0.02);
    let x = c.rng.normals_f32(kk, 1.0);
    let reference = r::gemv(&w, &x, kk, 1, &ids);
    let ids32: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
    let (wd, idd) = (up(c.gpu, &w)?, up(c.gpu, &ids32)?);
    c.triple(
        "4097 candidates of 4480 x 2048",
        tol_f32(kk),
        &reference,
        |g, v| {
            let xd = up(g, &x)?;
            let mut y = poisoned(g, ids32.len())?;
            k::gemv(
                g,
                v,
                &wd,
                vocab,
                &xd,
                &mut y,
                Some(&idd),
                ids32.len(),
                kk,
                1,
            )?;
            down(g, &y)
        },
    )?;
    c.limit(
        "4097 of 262144 x 2048",
        k::plan_gemv(4097, 2048, 1, 262_144),
    );
    Ok(())
}

fn router(c: &mut Ctx) -> Result<()> {
    let (rows, e, kk) = (6, 256, 8);
    let mut logits: Vec<f32> = (0..rows * e)
        .map(|_| (c.rng.below(33) as f32 - 16.0) * 0.25)
        .collect();
    for row in 0..rows {
        // a planted tie at the top, between a low and a high index
        logits[row * e + 10] = 5.0;
        logits[row * e + 200] = 5.0;
    }
    let (rid, rw) = r::router(&logits, e, kk);
    let run = |g: &Gpu, v| -> Result<Vec<f32>> {
        let ld = up(g, &logits)?;
        let mut ids = up(g, &vec![u32::MAX; rows * kk])?;
        let mut w = poisoned(g, rows * kk)?;
        k::router(g, v, &ld, &mut ids, &mut w, rows, e, kk)?;
        let got: Vec<u32> = g.stream.clone_dtoh(&ids)?;
        let mut wv = down(g, &w)?;
        if got != rid {
            wv.iter_mut().for_each(|x| *x = f32::NAN); // wrong experts: no tolerance saves it
        }
        Ok(wv)
    };
    c.triple("6 rows, E 256, top-8, tied logits", tol_f32(e), &rw, run)?;
    c.limit("262144 rows, E 256, top 8", k::plan_router(262_144, 256, 8));
    Ok(())
}

/// Device expert weights plus the host copies (fp8 gate/up/down, their scales).
type HostExperts = (ExpertWeights, [Vec<u8>; 3], [Vec<f32>; 3]);

fn experts(c: &mut Ctx, e: usize, i: usize, h: usize) -> Result<HostExperts> {
    let mat = e * i * h;
    let smat = e * i.div_ceil(128) * h.div_ceil(128);
    let q = [
        c.rng.fp8_bytes(mat),
        c.rng.fp8_bytes(mat),
        c.rng.fp8_bytes(mat),
    ];
    let mut scale = || -> Vec<f32> {
        (0..smat)
            .map(|_| (c.rng.range(0.5, 2.0) * 1e-3) as f32)
            .collect()
    };
    let s = [scale(), scale(), scale()];
    let g = c.gpu;
    let w = ExpertWeights {
        gate: up(g, &q[0])?,
        up: up(g, &q[1])?,
        down: up(g, &q[2])?,
        gate_s: up(g, &s[0])?,
        up_s: up(g, &s[1])?,
        down_s: up(g, &s[2])?,
        e,
        i,
        h,
    };
    Ok((w, q, s))
}

fn pick(rng: &mut Rng, e: usize, kk: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = Vec::new();
    while ids.len() < kk {
        let x = rng.below(e) as u32;
        if !ids.contains(&x) {
            ids.push(x);
        }
    }
    ids
}

fn gate_up(c: &mut Ctx) -> Result<()> {
    let (e, i, h, kk) = (24, 512, 2048, 8);
    let (w, q, s) = experts(c, e, i, h)?;
    let ids = pick(&mut c.rng, e, kk);
    let x = c.rng.normals_f32(h, 1.0);
    let reference = r::expert_gate_up(&q[0], &q[1], &s[0], &s[1], &ids, &x, i, h);
    let idd = up(c.gpu, &ids)?;
    c.triple(
        "8 of 24 experts, I 512, H 2048",
        tol_f32(h),
        &reference,
        |g, v| {
            let xd = up(g, &x)?;
            let mut hd = poisoned(g, kk * i)?;
            k::expert_gate_up(g, v, &w, &idd, &xd, &mut hd, kk)?;
            down(g, &hd)
        },
    )?;
    c.limit(
        "8 of 256 experts, I 512, H 2048",
        k::plan_gate_up(8, 512, 2048, 256),
    );
    Ok(())
}

fn expert_down(c: &mut Ctx) -> Result<()> {
    let (e, i, h, kk) = (24, 512, 2048, 8);
    let (w, q, s) = experts(c, e, i, h)?;
    let ids = pick(&mut c.rng, e, kk);
    let hv = c.rng.normals_f32(kk * i, 1.0);
    let raw: Vec<f64> = (0..kk).map(|_| c.rng.range(0.1, 1.0)).collect();
    let tot: f64 = raw.iter().sum();
    let wts: Vec<f32> = raw.iter().map(|x| (x / tot) as f32).collect();
    let reference = r::expert_down(&q[2], &s[2], &ids, &wts, &hv, i, h);
    let (idd, wd) = (up(c.gpu, &ids)?, up(c.gpu, &wts)?);
    c.triple(
        "8 of 24 experts, H 2048 <- I 512",
        tol_f32(i * kk),
        &reference,
        |g, v| {
            let hd = up(g, &hv)?;
            let mut y = poisoned(g, h)?;
            k::expert_down(g, v, &w, &idd, &wd, &hd, &mut y, kk)?;
            down(g, &y)
        },
    )?;
    c.limit(
        "8 of 256 experts, H 2048 <- I 512",
        k::plan_down(8, 512, 2048, 256),
    );
    Ok(())
}

fn conv(c: &mut Ctx) -> Result<()> {
    let cdim = 8192;
    let x = c.rng.normals_f32(cdim, 1.0);
    let st = c.rng.normals_f32(3 * cdim, 1.0);
    let w = c.rng.normals_bf16(4 * cdim, 0.5);
    let (reference, ref_state) = r::conv_step(&x, &st, &w);
    let mut state_ok = true;
    c.triple("C 8192, kernel 4", tol_f32(4), &reference, |g, v| {
        let (xd, wd) = (up(g, &x)?, up(g, &w)?);
        let mut sd = up(g, &st)?;
        let mut u = poisoned(g, cdim)?;
        k::conv_step(g, v, &xd, &mut sd, &wd, &mut u, cdim)?;
        if v == Variant::Exact {
            state_ok = g
                .stream
                .clone_dtoh(&sd)?
                .iter()
                .zip(&ref_state)
                .all(|(a, b)| a.to_bits() == b.to_bits());
        }
        down(g, &u)
    })?;
    c.push(
        "conv state shifted exactly",
        Kind::Check,
        state_ok,
        format!("state {}", if state_ok { "equal" } else { "DIFFERS" }),
    );
    c.limit("C 8192", k::plan_conv(8192));
    Ok(())
}

fn l2norm(c: &mut Ctx) -> Result<()> {
    let (nk, dk) = (16, 128);
    let qk = c.rng.normals_f32(2 * nk * dk, 2.0);
    let qs = 1.0 / (dk as f64).sqrt();
    let reference = r::l2norm(&qk, nk, dk, qs);
    c.triple("q, k: 16 heads x 128", tol_f32(dk), &reference, |g, v| {
        let mut d = up(g, &qk)?;
        k::l2norm(g, v, &mut d, nk, dk, qs as f32)?;
        down(g, &d)
    })?;
    c.limit("16 heads x 128", k::plan_l2norm(16, 128));
    Ok(())
}

fn unit_rows(rng: &mut Rng, rows: usize, d: usize, scale: f64) -> Vec<f32> {
    let mut v = rng.normals_f32(rows * d, 1.0);
    for row in v.chunks_mut(d) {
        let n = row
            .iter()
            .map(|&x| f64::from(x).powi(2))
            .sum::<f64>()
            .sqrt();
        row.iter_mut()
            .for_each(|x| *x = (f64::from(*x) / n * scale) as f32);
    }
    v
}

fn recurrent(c: &mut Ctx) -> Result<()> {
    let (nk, nv, d, steps) = (16, 32, k::GDN_HEAD_DIM, 4);
    let state0 = c.rng.normals_f32(nv * d * d, 0.1);
    let a_log = c.rng.normals_bf16(nv, 0.5);
    let dt_bias = c.rng.normals_bf16(nv, 0.5);
    struct StepIn {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        b: Vec<f32>,
        a: Vec<f32>,
    }
    let inputs: Vec<StepIn> = (0..steps)
        .map(|_| StepIn {
            q: unit_rows(&mut c.rng, nk, d, 1.0 / (d as f64).sqrt()),
            k: unit_rows(&mut c.rng, nk, d, 1.0),
            v: c.rng.normals_f32(nv * d, 1.0),
            b: c.rng.normals_f32(nv, 1.0),
            a: c.rng.normals_f32(nv, 1.0),
        })
        .collect();
    let mut st: Vec<f64> = state0.iter().map(|&x| f64::from(x)).collect();
    let mut reference = Vec::new();
    for s in &inputs {
        let step = r::DeltaStep {
            q: &s.q,
            k: &s.k,
            v: &s.v,
            b: &s.b,
            a: &s.a,
            a_log: &a_log,
            dt_bias: &dt_bias,
            nk,
            nv,
            d,
        };
        reference.extend(r::delta_step(&step, &mut st));
    }
    reference.extend(&st);
    c.triple(
        "4 steps, 32 v-heads, state 128x128 (o and S)",
        tol_f32(d * steps),
        &reference,
        |g, v| {
            let mut sd = up(g, &state0)?;
            let (al, dt) = (up(g, &a_log)?, up(g, &dt_bias)?);
            let mut out = Vec::new();
            for s in &inputs {
                let (qd, kd, vd, bd, ad) = (
                    up(g, &s.q)?,
                    up(g, &s.k)?,
                    up(g, &s.v)?,
                    up(g, &s.b)?,
                    up(g, &s.a)?,
                );
                let bufs = DeltaBuffers {
                    q: &qd,
                    k: &kd,
                    v: &vd,
                    b: &bd,
                    a: &ad,
                    a_log: &al,
                    dt_bias: &dt,
                };
                let mut o = poisoned(g, nv * d)?;
                k::recurrent_step(g, v, &bufs, &mut sd, &mut o, nk, nv)?;
                out.extend(down(g, &o)?);
            }
            out.extend(down(g, &sd)?);
            Ok(out)
        },
    )?;
    c.limit("32 value heads", k::plan_recurrent(32));
    c.limit(
        "262144 rows, 16 / 32 heads x 128, one lane",
        k::plan_gdn_chunk(262_144, 16, 32, 1),
    );
    c.limit(
        "32 lanes of 8192 rows",
        k::plan_gdn_chunk(262_144, 16, 32, 32),
    );
    Ok(())
}

fn gated_norm(c: &mut Ctx) -> Result<()> {
    let (nv, dv) = (32, 128);
    let o = c.rng.normals_f32(nv * dv, 0.5);
    let z = c.rng.normals_f32(nv * dv, 1.5);
    let w = c.rng.normals_bf16(dv, 1.0);
    let reference = r::gated_norm(&o, &z, &w, dv, 1e-6);
    c.triple("32 heads x 128", tol_f32(dv), &reference, |g, v| {
        let (od, zd, wd) = (up(g, &o)?, up(g, &z)?, up(g, &w)?);
        let mut out = poisoned(g, nv * dv)?;
        k::gated_norm(g, v, &od, &zd, &wd, &mut out, nv, dv, 1e-6)?;
        down(g, &out)
    })?;
    c.limit("32 heads x 128", k::plan_gated_norm(32, 128));
    Ok(())
}

/// Launch records at the largest shapes, without a device (nominal H200 limits).
pub fn nominal_limits() -> Vec<(String, Vec<String>)> {
    let info = DeviceInfo::h200_nominal();
    [
        k::plan_gemv(262_144, 8192, 8, 262_144),
        k::plan_flash(262_144, 16, 1, 256, 262_144, true),
        k::plan_flash(262_144, 16, 1, 256, 262_144, false),
        k::plan_gdn_chunk(262_144, 16, 32, 1),
        k::plan_decode(
            32,
            16,
            2,
            256,
            262_144,
            k::decode_chunks([262_144], true),
            true,
            1,
        ),
        k::plan_decode(
            32,
            16,
            2,
            256,
            262_144,
            k::decode_chunks([262_144], true),
            false,
            1,
        ),
    ]
    .into_iter()
    .filter_map(|p| p.ok())
    .map(|p| (p.kernel.to_string(), p.problems(&info)))
    .collect()
}

/// Names of the registered kernels, in contract order.
pub fn kernel_names() -> Vec<&'static str> {
    REGISTRY.iter().map(|(n, _)| *n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(kind: Kind, ok: bool) -> Line {
        Line {
            kernel: "k",
            case: "c".into(),
            kind,
            ok,
            detail: String::new(),
        }
    }

    #[test]
    fn bookkeeping_counts_and_summary_format() {
        let mut s = ContractSummary::default();
        s.add_kernel(
            &[
                line(Kind::Check, true),
                line(Kind::Discriminate, true),
                line(Kind::Control, true),
                line(Kind::Limit, true),
            ],
            false,
        );
        // a discrimination that did not discriminate fails the kernel; a missed control counts
        s.add_kernel(
            &[
                line(Kind::Check, true),
                line(Kind::Discriminate, false),
                line(Kind::Control, false),
                line(Kind::Limit, false),
            ],
            false,
        );
        // an error fails the kernel even with no failing line
        s.add_kernel(&[line(Kind::Check, true)], true);
        // no check at all is not a pass
        s.add_kernel(&[line(Kind::Control, true)], false);
        assert_eq!(
            s,
            ContractSummary {
                kernels: 4,
                pass: 1,
                fail: 3,
                controls: 3,
                red: 2,
                missed: 1,
                limit_problems: 1
            }
        );
        assert_eq!(s.line(), "SUMMARY 4 kernels: 1 pass, 3 fail; 3 controls: 2 red as planted, 1 missed; 1 limit problems");
        assert!(!s.all_green());
    }

    #[test]
    fn tolerances_separate_f32_from_bf16() {
        // a bf16 rounding (relative ~2^-9) must exceed every f32 tolerance used by the contract
        for depth in [4, 128, 2048, 8192, 4096 + 262_144] {
            assert!(tol_f32(depth) < 2f64.powi(-9) / 4.0, "depth {depth}");
        }
        assert!(tol_f32(8192) > tol_f32(128));
    }

    #[test]
    fn only_takes_comma_separated_parts() {
        assert!(selected("add_rms_norm_fused", "norm"));
        assert!(selected("moe_router_keep", "norm, router"));
        assert!(selected("round_embed", "norm,router,round_embed"));
        assert!(!selected("gemv_tc2", "norm,router"));
        assert!(!selected("gemv_tc2", ","));
        assert!(
            selected("gemv_tc2", ""),
            "an empty pattern selects every kernel, as before"
        );
        let picked = REGISTRY
            .iter()
            .filter(|(n, _)| selected(n, "norm,router,round_embed"))
            .count();
        assert_eq!(picked, 13);
    }

    #[test]
    fn only_builds_the_selected_groups_sources() {
        // every group names at least Ops, and the full set covers every source
        for (name, _) in REGISTRY {
            assert!(sources_for(name).contains(&Source::Ops), "{name}");
        }
        let all = precompile_set("");
        assert!(Source::ALL.iter().all(|s| all.contains(s)), "{all:?}");
        assert_eq!(precompile_set("round_"), vec![Source::Ops, Source::Round]);
        let norms = precompile_set("norm");
        assert!(norms.contains(&Source::Norm) && norms.contains(&Source::Gdn));
        assert!(!norms.contains(&Source::Moe));
        let moe = precompile_set("moe_experts_rows");
        assert!(moe.contains(&Source::Moe) && !moe.contains(&Source::Round));
    }

    #[test]
    fn registry_names_are_unique_and_nominal_limits_fit() {
        let mut names: Vec<&str> = REGISTRY.iter().map(|(n, _)| *n).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), REGISTRY.len());
        assert!(nominal_limits().iter().all(|(_, p)| p.is_empty()));
    }

    #[test]
    fn contract_on_gpu_or_skip() {
        if !crate::runtime::driver_present() {
            eprintln!("skipped: no CUDA driver present");
            return;
        }
        let s = run(Some("rmsnorm")).expect("contract ran");
        assert!(s.all_green(), "{}", s.line());
    }
}

//! Contract cases of the `Backend` op kernels (kernels/ops.cu and the multi-row MoE kernels),
//! run through [`CudaBackend`] built with each kernel variant, against FP64 references written
//! here from the equations (plain loops, no code shared with the kernels or the CPU backend).

use model::{AttnDims, Backend, Expert, GatherRow, GdnDims, Rope, Rows};

use super::{tol_f32, Ctx, Kind};
use crate::backend::{CudaBackend, CudaBuf, CudaOptions, CudaVector, NORM_GROUP_MAX};
use crate::error::Result;
use crate::reference::{bf16, fp8_e4m3, rel_l2, sigmoid, silu};
use crate::runtime::Variant;

/// The contract's base options: every op on its per-row kernels (no split decode, no flash
/// prefill, no tiled GEMM), BF16 linears on tensor cores; the backends below change one knob.
fn base_opts(kv_f32: bool) -> CudaOptions {
    // the engine's defaults, whatever the caller's environment
    let d = CudaOptions::from_lookup(|_| None);
    CudaOptions {
        kv_f32,
        split_min_keys: usize::MAX,
        flash_min_rows: usize::MAX,
        gemm_min_rows: usize::MAX,
        group_min_rows: usize::MAX,
        slots_min_rows: usize::MAX,
        tc_gemv: true,
        // the engine's default GEMV layout
        gemv_kc: d.gemv_kc,
        gemv_v: d.gemv_v,
        gemv_warps: d.gemv_warps,
        gemv_warps_many: d.gemv_warps_many,
        gemv_tile_min: d.gemv_tile_min,
        gemv_tile_blocks: d.gemv_tile_blocks,
        gemv_walk: d.gemv_walk,
        gemv_slabs: d.gemv_slabs,
        // the per-row GEMVs: the gemv_ts case turns the split tiles on
        gemv_split_min: usize::MAX,
        gemv_split_blocks: d.gemv_split_blocks,
        aside: d.aside,
        gdn_lanes: true,
        gdn_generic: false,
        gdn_fused: d.gdn_fused,
        // the recurrence unless a case asks for the chunked form
        gdn_chunk_min: usize::MAX,
        // a launch per lane unless a case asks for the joined attention
        attn_joined: false,
        kept_rounds: true,
        graphs: true,
        decode_head_split: false,
        gemm_lt: false,
        tc_bulk: false,
        // the per-row FMA experts unless a case asks for the tensor-core ones
        moe_tc: false,
        moe_tc_bulk: false,
        moe_tc_group_rows: usize::MAX,
        moe_tc_warps: d.moe_tc_warps,
        moe_tc_down4: d.moe_tc_down4,
        moe_tc_prefetch: d.moe_tc_prefetch,
        moe_down_split4: d.moe_down_split4,
        moe_gate_up_u2: d.moe_gate_up_u2,
    }
}

fn backend(c: &Ctx, v: Variant, kv_f32: bool) -> CudaBackend {
    linear_backend(c, v, kv_f32, true)
}

/// [`backend`] with BF16 linears on tensor cores (`gemv_tc2_*`) or on the FMA GEMVs.
fn linear_backend(c: &Ctx, v: Variant, kv_f32: bool, tc_gemv: bool) -> CudaBackend {
    let o = CudaOptions {
        tc_gemv,
        ..base_opts(kv_f32)
    };
    CudaBackend::with_gpu(c.shared.clone(), v, o)
}

/// A backend whose prefill attention takes the tiled flash-style kernel from 2 rows on.
fn flash_backend(c: &Ctx, v: Variant, kv_f32: bool) -> CudaBackend {
    let o = CudaOptions {
        flash_min_rows: 2,
        ..base_opts(kv_f32)
    };
    CudaBackend::with_gpu(c.shared.clone(), v, o)
}

/// A backend whose `Rows::Bulk` linears and FP8 experts take the tiled GEMMs from 2 rows on.
fn gemm_backend(c: &Ctx, v: Variant) -> CudaBackend {
    gemm_backend_tc(c, v, false)
}

/// [`gemm_backend`] with the tiles on tensor cores (`tc`) or FMA.
fn gemm_backend_tc(c: &Ctx, v: Variant, tc: bool) -> CudaBackend {
    bulk_backend(c, v, if tc { BulkGemm::Tc } else { BulkGemm::Fma })
}

/// A backend whose `Rows::Bulk` linears and FP8 experts take `kind`'s GEMMs from 2 rows on.
fn bulk_backend(c: &Ctx, v: Variant, kind: BulkGemm) -> CudaBackend {
    let o = CudaOptions {
        gemm_min_rows: 2,
        group_min_rows: 2,
        tc_bulk: kind == BulkGemm::Tc,
        gemm_lt: kind == BulkGemm::Lt,
        ..base_opts(true)
    };
    CudaBackend::with_gpu(c.shared.clone(), v, o)
}

/// FP64 `x W^T` of a dense BF16 `W [n, k]` over `rows` rows ([`crate::reference::gemv`]).
fn gemv_ref(w: &[u16], x: &[f32], k: usize, rows: usize, n: usize) -> Vec<f64> {
    crate::reference::gemv(w, x, k, rows, &(0..n).collect::<Vec<_>>())
}

/// Cosine of an output against a planted value.
fn cosine(a: &[f32], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, y)| f64::from(x) * y).sum();
    let na = a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt();
    let nb = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| f64::from(v)).collect()
}

fn bits_equal(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// An op checked bit for bit against the ops it replaces or matches (`case` names both).
fn same_bits(c: &mut Ctx, case: String, fused: &[f32], separate: &[f32]) {
    let same = bits_equal(fused, separate);
    c.push(
        case,
        Kind::Check,
        same,
        (if same { "same bits" } else { "CHANGES BITS" }).to_string(),
    );
}

/// Checks that `op` issues exactly one kernel launch on `be`: a fused op's bitwise check
/// against its composed ops would also pass if it fell back to those ops.
fn one_launch(
    c: &mut Ctx,
    case: String,
    be: &CudaBackend,
    op: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let before = be.launch_count();
    op()?;
    let n = be.launch_count() - before;
    c.push(case, Kind::Check, n == 1, format!("{n} launch(es)"));
    Ok(())
}

/// Exact data movement: the tolerance is zero.
pub(super) fn buffer_moves(c: &mut Ctx) -> Result<()> {
    let (rows, cols) = (5, 48);
    let x = c.rng.normals_f32(rows * cols, 1.0);
    let y = c.rng.normals_f32(rows * 7, 1.0);
    // cols_grouped(group 12, offset 3, len 6) then [that | y]
    let mut reference = Vec::new();
    for r in 0..rows {
        for g in 0..4 {
            reference.extend(f64s(&x[r * cols + g * 12 + 3..r * cols + g * 12 + 9]));
        }
        reference.extend(f64s(&y[r * 7..(r + 1) * 7]));
    }
    triple3(
        c,
        "cols_grouped + concat_cols, 5 x 48",
        0.0,
        &reference,
        |be| {
            let xd = be.upload(&x, rows, cols)?;
            let yd = be.upload(&y, rows, 7)?;
            let g = be.cols_grouped(&xd, 12, 3, 6)?;
            Ok(be.download(&be.concat_cols(&g, &yd)?)?)
        },
        false,
    )?;
    let be = backend(c, Variant::Exact, false);
    let xd = be.upload(&x, rows, cols)?;
    let parts = [be.rows(&xd, 3, 2)?, be.rows(&xd, 0, 3)?];
    let got = be.download(&be.concat_rows(&[&parts[0], &parts[1]])?)?;
    let mut want = x[3 * cols..].to_vec();
    want.extend_from_slice(&x[..3 * cols]);
    let ok = bits_equal(&got, &want);
    c.push(
        "rows + concat_rows (device copies)",
        Kind::Check,
        ok,
        format!("rows {}", if ok { "equal" } else { "DIFFER" }),
    );
    Ok(())
}

pub(super) fn gather_sum(c: &mut Ctx) -> Result<()> {
    let cols = 64;
    let t0 = c.rng.normals_bf16(40 * cols, 1.0);
    let t1 = c.rng.normals_bf16(30 * cols, 1.0);
    let mut rows = Vec::new();
    for i in 0..7 {
        let mut picks = Vec::new();
        for j in 0..(i % 5) {
            let t = (i + j) % 2;
            picks.push((t, c.rng.below(if t == 0 { 40 } else { 30 }) as u32));
        }
        rows.push(GatherRow {
            picks,
            scale: c.rng.range(0.3, 1.5) as f32,
        });
    }
    let mut reference = Vec::new();
    for r in &rows {
        for col in 0..cols {
            let s: f64 = r
                .picks
                .iter()
                .map(|&(t, row)| {
                    let tab = if t == 0 { &t0 } else { &t1 };
                    bf16(tab[row as usize * cols + col])
                })
                .sum();
            reference.push(s * f64::from(r.scale));
        }
    }
    triple3(
        c,
        "7 rows of 0..4 picks from 2 bf16 tables",
        tol_f32(4),
        &reference,
        |be| {
            let a = be.weight_bf16(40, cols, &t0)?;
            let b = be.weight_bf16(30, cols, &t1)?;
            Ok(be.download(&be.gather_sum(&[&a, &b], &rows)?)?)
        },
        false,
    )?;
    Ok(())
}

/// Runs `run` for the three variants and records check / discrimination / control.
fn triple3(
    c: &mut Ctx,
    case: &str,
    tol: f64,
    reference: &[f64],
    run: impl Fn(&CudaBackend) -> Result<Vec<f32>>,
    kv_f32: bool,
) -> Result<()> {
    let make = |c: &Ctx, v| backend(c, v, kv_f32);
    triple_with(c, case, tol, reference, true, make, run).map(drop)
}

/// [`triple3`] on the first `reference.len()` values of each run (BF16 cache layout, linears
/// on tensor cores or not), which may append more for the caller's own checks; returns the
/// exact build's whole output.
fn triple_prefix(
    c: &mut Ctx,
    case: &str,
    tol: f64,
    reference: &[f64],
    tc_gemv: bool,
    run: impl Fn(&CudaBackend) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let make = |c: &Ctx, v| linear_backend(c, v, false, tc_gemv);
    triple_with(c, case, tol, reference, false, make, run)
}

/// The three builds from `make`, each run by `run`; check, discrimination and control on the
/// whole output (`whole`, where a length other than the reference's fails) or on its first
/// `reference.len()` values; the exact build's whole output.
fn triple_with(
    c: &mut Ctx,
    case: &str,
    tol: f64,
    reference: &[f64],
    whole: bool,
    make: impl Fn(&Ctx, Variant) -> CudaBackend,
    run: impl Fn(&CudaBackend) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let got: Vec<Vec<f32>> = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
        .iter()
        .map(|&v| run(&make(c, v)))
        .collect::<Result<_>>()?;
    let n = reference.len();
    let part = |g: &[f32]| -> f64 {
        let g = if whole { g } else { g.get(..n).unwrap_or(g) };
        rel_l2(g, reference)
    };
    c.check(case, part(&got[0]), tol);
    c.discriminate(case, part(&got[1]), tol);
    c.control(case, part(&got[2]), tol);
    Ok(got.into_iter().next().unwrap_or_default())
}

pub(super) fn rmsnorm_groups(c: &mut Ctx) -> Result<()> {
    for (case, rows, cols, group, plus_one, wscale) in [
        ("1+w, 3 x 256 in groups of 64", 3, 256, 64, true, 0.1),
        ("plain w, 4 x 2048", 4, 2048, 2048, false, 1.0),
        (
            "plain w, 3 x 1000, 128 threads: 8 values a thread, the last in part",
            3,
            1000,
            1000,
            false,
            1.0,
        ),
        (
            "plain w, 2 x 12288: 768 threads of 16 values",
            2,
            12288,
            12288,
            false,
            1.0,
        ),
    ] {
        let x = c.rng.normals_f32(rows * cols, 3.0);
        let w = c.rng.normals_f32(group, wscale);
        let mut reference = Vec::new();
        for g in x.chunks(group) {
            let ms = g.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / group as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for (v, wv) in g.iter().zip(&w) {
                let wp = f64::from(*wv) + if plus_one { 1.0 } else { 0.0 };
                reference.push(f64::from(*v) * inv * wp);
            }
        }
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let xd = be.upload(&x, rows, cols)?;
            let wd = be.vector_f32(&w)?;
            Ok(be.download(&be.rms_norm(&xd, &wd, group, 1e-6, plus_one)?)?)
        };
        if plus_one {
            triple3(c, case, tol_f32(group), &reference, run, false)?;
        } else {
            let e = rel_l2(&run(&backend(c, Variant::Exact, false))?, &reference);
            c.check(case, e, tol_f32(group));
        }
    }
    // a group past 1024 threads of 16 values each: refused by name, and the backend still works
    let be = backend(c, Variant::Exact, false);
    let big = NORM_GROUP_MAX + 64;
    let x = be.upload(&c.rng.normals_f32(big, 1.0), 1, big)?;
    let w = be.vector_f32(&c.rng.normals_f32(big, 0.1))?;
    let why = match be.rms_norm(&x, &w, big, 1e-6, true) {
        Err(e) => e.to_string(),
        Ok(_) => String::new(),
    };
    let xs = be.upload(&c.rng.normals_f32(256, 1.0), 4, 64)?;
    let ws = be.vector_f32(&c.rng.normals_f32(64, 0.1))?;
    let after = be
        .rms_norm(&xs, &ws, 64, 1e-6, true)
        .and_then(|o| be.download(&o))
        .is_ok_and(|v| v.iter().all(|f| f.is_finite()));
    c.push(
        format!("a group of {big} values is refused"),
        Kind::Check,
        why.contains(&big.to_string()) && why.contains(&NORM_GROUP_MAX.to_string()) && after,
        if why.is_empty() {
            "accepted".into()
        } else {
            why
        },
    );
    Ok(())
}

/// The residual add fused with the next norm: against FP64, and bit for bit the two ops.
pub(super) fn add_rms_norm(c: &mut Ctx) -> Result<()> {
    for (case, rows, cols, group) in [
        ("3 x 2048, one group per row", 3, 2048, 2048),
        ("5 x 256 in groups of 64", 5, 256, 64),
    ] {
        let a = c.rng.normals_f32(rows * cols, 2.0);
        let b = c.rng.normals_f32(rows * cols, 2.0);
        let w = c.rng.normals_f32(group, 0.1);
        let sum: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(&x, &y)| f64::from(x) + f64::from(y))
            .collect();
        let mut reference = sum.clone();
        for g in sum.chunks(group) {
            let ms = g.iter().map(|v| v * v).sum::<f64>() / group as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            reference.extend(
                g.iter()
                    .zip(&w)
                    .map(|(v, wv)| v * inv * (1.0 + f64::from(*wv))),
            );
        }
        let up = |be: &CudaBackend| -> Result<(CudaBuf, CudaBuf, CudaVector)> {
            Ok((
                be.upload(&a, rows, cols)?,
                be.upload(&b, rows, cols)?,
                be.vector_f32(&w)?,
            ))
        };
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let (ad, bd, wd) = up(be)?;
            let (s, n) = be.add_rms_norm(&ad, &bd, &wd, group, 1e-6, true)?;
            Ok([be.download(&s)?, be.download(&n)?].concat())
        };
        triple3(c, case, tol_f32(group), &reference, run, false)?;
        let be = backend(c, Variant::Exact, false);
        let (ad, bd, wd) = up(&be)?;
        let s = be.add(&ad, &bd)?;
        let two = [
            be.download(&s)?,
            be.download(&be.rms_norm(&s, &wd, group, 1e-6, true)?)?,
        ]
        .concat();
        let fused = run(&be)?;
        same_bits(
            c,
            format!("{case}: bitwise = add then rms_norm"),
            &fused,
            &two,
        );
    }
    Ok(())
}

/// The MoE's end with the residual add and the next norm in one launch: against FP64, and bit
/// for bit `add_sigmoid_mul` then `add_rms_norm`.
pub(super) fn add_gated_rms_norm(c: &mut Ctx) -> Result<()> {
    for (case, rows, cols, group, gcols) in [
        (
            "3 x 2048, gate [3, 1], one group per row",
            3usize,
            2048usize,
            2048usize,
            1usize,
        ),
        ("4 x 256 in groups of 64, gate [4, 256]", 4, 256, 64, 256),
        ("3 x 256 in groups of 64, gate [3, 1]", 3, 256, 64, 1),
    ] {
        let [a, a2, x] = [0; 3].map(|_| c.rng.normals_f32(rows * cols, 1.5));
        let g = c.rng.normals_f32(rows * gcols, 2.0);
        let w = c.rng.normals_f32(group, 0.1);
        let sum: Vec<f64> = (0..rows * cols)
            .map(|i| {
                let gv = f64::from(g[if gcols == 1 { i / cols } else { i }]);
                f64::from(a[i]) + f64::from(a2[i]) + f64::from(x[i]) * sigmoid(gv)
            })
            .collect();
        let mut reference = sum.clone();
        for grp in sum.chunks(group) {
            let ms = grp.iter().map(|v| v * v).sum::<f64>() / group as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            reference.extend(
                grp.iter()
                    .zip(&w)
                    .map(|(v, wv)| v * inv * (1.0 + f64::from(*wv))),
            );
        }
        let up = |be: &CudaBackend| -> Result<([CudaBuf; 4], CudaVector)> {
            Ok((
                [
                    be.upload(&a, rows, cols)?,
                    be.upload(&a2, rows, cols)?,
                    be.upload(&x, rows, cols)?,
                    be.upload(&g, rows, gcols)?,
                ],
                be.vector_f32(&w)?,
            ))
        };
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let ([ad, a2d, xd, gd], wd) = up(be)?;
            let (s, n) = be.add_gated_rms_norm(&ad, &a2d, &xd, &gd, &wd, group, 1e-6, true)?;
            Ok([be.download(&s)?, be.download(&n)?].concat())
        };
        triple3(c, case, tol_f32(group), &reference, run, false)?;
        let be = backend(c, Variant::Exact, false);
        let ([ad, a2d, xd, gd], wd) = up(&be)?;
        let y = be.add_sigmoid_mul(&a2d, &xd, &gd)?;
        let (s, n) = be.add_rms_norm(&ad, &y, &wd, group, 1e-6, true)?;
        let two = [be.download(&s)?, be.download(&n)?].concat();
        let fused = run(&be)?;
        same_bits(
            c,
            format!("{case}: bitwise = add_sigmoid_mul then add_rms_norm"),
            &fused,
            &two,
        );
        one_launch(c, format!("{case}: one launch"), &be, || {
            be.add_gated_rms_norm(&ad, &a2d, &xd, &gd, &wd, group, 1e-6, true)
                .map(drop)
                .map_err(Into::into)
        })?;
    }
    Ok(())
}

/// The tower's input norms and their concatenation in one launch: against FP64, and bit for
/// bit two `rms_norm` then `concat_cols`.
pub(super) fn rms_norm_concat(c: &mut Ctx) -> Result<()> {
    let (rows, cols) = (3usize, 2048usize);
    let a = c.rng.normals_f32(rows * cols, 2.0);
    let b = c.rng.normals_f32(rows * cols, 0.5);
    let (wa, wb) = (c.rng.normals_f32(cols, 0.1), c.rng.normals_f32(cols, 0.1));
    let norm = |x: &[f32], w: &[f32]| -> Vec<f64> {
        let ms = x.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / cols as f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        x.iter()
            .zip(w)
            .map(|(&v, &wv)| f64::from(v) * inv * (1.0 + f64::from(wv)))
            .collect()
    };
    let mut reference = Vec::new();
    for r in 0..rows {
        reference.extend(norm(&a[r * cols..(r + 1) * cols], &wa));
        reference.extend(norm(&b[r * cols..(r + 1) * cols], &wb));
    }
    let up = |be: &CudaBackend| -> Result<(CudaBuf, CudaBuf, CudaVector, CudaVector)> {
        Ok((
            be.upload(&a, rows, cols)?,
            be.upload(&b, rows, cols)?,
            be.vector_f32(&wa)?,
            be.vector_f32(&wb)?,
        ))
    };
    let run = |be: &CudaBackend| -> Result<Vec<f32>> {
        let (ad, bd, wad, wbd) = up(be)?;
        Ok(be.download(&be.rms_norm_concat(&ad, &wad, &bd, &wbd, 1e-6, true)?)?)
    };
    let case = "3 rows, [2048 | 2048]";
    triple3(c, case, tol_f32(cols), &reference, run, false)?;
    let be = backend(c, Variant::Exact, false);
    let (ad, bd, wad, wbd) = up(&be)?;
    let an = be.rms_norm(&ad, &wad, cols, 1e-6, true)?;
    let bn = be.rms_norm(&bd, &wbd, cols, 1e-6, true)?;
    let three = be.download(&be.concat_cols(&an, &bn)?)?;
    let fused = run(&be)?;
    same_bits(
        c,
        format!("{case}: bitwise = rms_norm, rms_norm, concat_cols"),
        &fused,
        &three,
    );
    one_launch(c, format!("{case}: one launch"), &be, || {
        be.rms_norm_concat(&ad, &wad, &bd, &wbd, 1e-6, true)
            .map(drop)
            .map_err(Into::into)
    })?;
    Ok(())
}

/// The GDN's gated norm in one launch: against FP64, and bit for bit `rms_norm` then
/// `silu_mul`.
pub(super) fn rms_norm_silu(c: &mut Ctx) -> Result<()> {
    for (case, rows, cols, group) in [
        ("2 x 4096 in groups of 128", 2usize, 4096usize, 128usize),
        ("3 x 2048, one group per row", 3, 2048, 2048),
    ] {
        let x = c.rng.normals_f32(rows * cols, 2.0);
        let z = c.rng.normals_f32(rows * cols, 2.0);
        let w = c.rng.normals_f32(group, 1.0);
        let mut reference = Vec::new();
        for (gi, grp) in x.chunks(group).enumerate() {
            let ms = grp.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / group as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for (j, (v, wv)) in grp.iter().zip(&w).enumerate() {
                let zv = f64::from(z[gi * group + j]);
                reference.push(silu(zv) * f64::from(*v) * inv * f64::from(*wv));
            }
        }
        let up = |be: &CudaBackend| -> Result<(CudaBuf, CudaBuf, CudaVector)> {
            Ok((
                be.upload(&x, rows, cols)?,
                be.upload(&z, rows, cols)?,
                be.vector_f32(&w)?,
            ))
        };
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let (xd, zd, wd) = up(be)?;
            Ok(be.download(&be.rms_norm_silu(&xd, &zd, &wd, group, 1e-6, false)?)?)
        };
        triple3(c, case, tol_f32(group), &reference, run, false)?;
        let be = backend(c, Variant::Exact, false);
        let (xd, zd, wd) = up(&be)?;
        let two = be.download(&be.silu_mul(&zd, &be.rms_norm(&xd, &wd, group, 1e-6, false)?)?)?;
        let fused = run(&be)?;
        same_bits(
            c,
            format!("{case}: bitwise = rms_norm then silu_mul"),
            &fused,
            &two,
        );
        one_launch(c, format!("{case}: one launch"), &be, || {
            be.rms_norm_silu(&xd, &zd, &wd, group, 1e-6, false)
                .map(drop)
                .map_err(Into::into)
        })?;
    }
    Ok(())
}

/// FP64 references of `W x`, `W (silu(x) * u)` and `W (x * sigmoid(u))`, one after another; the
/// gated inputs from their f32 products (the product's own rounding is below the GEMV's
/// tolerance).
fn gated_gemv_refs(w: &[u16], x: &[f32], u: &[f32], k: usize, rows: usize, n: usize) -> Vec<f64> {
    let gated = |f: fn(f64, f64) -> f64| -> Vec<f32> {
        x.iter()
            .zip(u)
            .map(|(&a, &b)| f(f64::from(a), f64::from(b)) as f32)
            .collect()
    };
    let mut reference = gemv_ref(w, x, k, rows, n);
    reference.extend(gemv_ref(w, &gated(|a, b| silu(a) * b), k, rows, n));
    reference.extend(gemv_ref(w, &gated(|a, b| a * sigmoid(b)), k, rows, n));
    reference
}

/// A gated-GEMV case's fresh inputs: BF16 weights [n, k], activations x and gates u [rows, k],
/// and their FP64 references (`gated_gemv_refs`).
fn gated_case(
    c: &mut Ctx,
    n: usize,
    k: usize,
    rows: usize,
) -> (Vec<u16>, Vec<f32>, Vec<f32>, Vec<f64>) {
    let w = c.rng.normals_bf16(n * k, 0.05);
    let x = c.rng.normals_f32(rows * k, 1.0);
    let u = c.rng.normals_f32(rows * k, 1.0);
    let reference = gated_gemv_refs(&w, &x, &u, k, rows, n);
    (w, x, u, reference)
}

/// BF16 weights `ws[j]` of `outs[j]` outputs and K `k` on the backend (a multi-weight case's).
fn bf16_weights(
    be: &CudaBackend,
    ws: &[Vec<u16>],
    outs: &[usize],
    k: usize,
) -> Result<Vec<crate::backend::CudaWeight>> {
    Ok(ws
        .iter()
        .zip(outs)
        .map(|(w, &n)| be.weight_bf16(n, k, w))
        .collect::<std::result::Result<Vec<_>, _>>()?)
}

/// `W x`, `W (silu(x) * u)` and `W (x * sigmoid(u))` on the backend, one after another (the
/// order of `gated_gemv_refs`).
fn gated_linears(
    be: &CudaBackend,
    x: &CudaBuf,
    u: &CudaBuf,
    w: &crate::backend::CudaWeight,
) -> Result<Vec<f32>> {
    let mut out = be.download(&be.linear(x, w, Rows::Exact)?)?;
    out.extend(be.download(&be.linear_silu_mul(x, u, w, Rows::Exact)?)?);
    out.extend(be.download(&be.linear_sigmoid_mul(x, u, w, Rows::Exact)?)?);
    Ok(out)
}

/// The tensor-core GEMV with short key ranges per warp (`gemv_tc2_*`, both load layouts), and
/// with `silu_mul` made as it loads its input (`gemv_tc2_silu_*`): against FP64 at edge shapes,
/// each row bitwise equal to its one-row launch, and the fused input bitwise equal to
/// `silu_mul` then the linear.
pub(super) fn gemv_tc2(c: &mut Ctx) -> Result<()> {
    for v in [1usize, 2] {
        for (n, k, rows) in [
            (2050usize, 4096usize, 5usize),
            (37, 128, 9),
            (300, 2048, 33),
            (70, 1056, 12),
            (40, 8192, 3),
            (2048, 6144, 1),
            (2048, 512, 8),
        ] {
            let (w, x, u, reference) = gated_case(c, n, k, rows);
            let make = |c: &Ctx, var| {
                // the default keys per warp (256; 128 where K <= 1024)
                let o = CudaOptions {
                    gemv_v: v,
                    ..base_opts(false)
                };
                CudaBackend::with_gpu(c.shared.clone(), var, o)
            };
            let run = |be: &CudaBackend| -> Result<Vec<f32>> {
                let wd = be.weight_bf16(n, k, &w)?;
                let (xd, ud) = (be.upload(&x, rows, k)?, be.upload(&u, rows, k)?);
                let mut out = gated_linears(be, &xd, &ud, &wd)?;
                // appended for the bitwise checks: each row alone, and each op then the linear
                for r in 0..rows {
                    let xr = be.upload(&x[r * k..(r + 1) * k], 1, k)?;
                    out.extend(be.download(&be.linear(&xr, &wd, Rows::Exact)?)?);
                }
                let silu_in = be.silu_mul(&xd, &ud)?;
                out.extend(be.download(&be.linear(&silu_in, &wd, Rows::Exact)?)?);
                let sigm_in = be.sigmoid_mul(&xd, &ud)?;
                out.extend(be.download(&be.linear(&sigm_in, &wd, Rows::Exact)?)?);
                Ok(out)
            };
            // layout 2 needs K a multiple of 64 (else layout 1 runs)
            let layout = if v == 2 && k % 64 == 0 { 2 } else { 1 };
            let case = format!(
                "layout {layout}: {rows} rows x {k} into {n}, plain, silu- and sigmoid-gated input"
            );
            let exact = triple_with(c, &case, tol_f32(k), &reference, false, make, run)?;
            let m = rows * n;
            same_bits(
                c,
                format!("{case}: each row bitwise = its one-row launch"),
                &exact[..m],
                &exact[3 * m..4 * m],
            );
            same_bits(
                c,
                format!("{case}: silu-gated input bitwise = silu_mul then linear"),
                &exact[m..2 * m],
                &exact[4 * m..5 * m],
            );
            same_bits(
                c,
                format!("{case}: sigmoid-gated input bitwise = sigmoid_mul then linear"),
                &exact[2 * m..3 * m],
                &exact[5 * m..6 * m],
            );
            // the bitwise checks above would also hold for the composed fallback: each fused
            // linear must be one launch
            let be = make(c, Variant::Exact);
            let wd = be.weight_bf16(n, k, &w)?;
            let (xd, ud) = (be.upload(&x, rows, k)?, be.upload(&u, rows, k)?);
            one_launch(
                c,
                format!("{case}: the silu-gated linear is one launch"),
                &be,
                || {
                    be.linear_silu_mul(&xd, &ud, &wd, Rows::Exact)?;
                    Ok(())
                },
            )?;
            one_launch(
                c,
                format!("{case}: the sigmoid-gated linear is one launch"),
                &be,
                || {
                    be.linear_sigmoid_mul(&xd, &ud, &wd, Rows::Exact)?;
                    Ok(())
                },
            )?;
            // the warps a block decide only which warp sums a chunk: three warps for few rows
            // and one for many give the default's bits (uneven runs where K has 5 chunks)
            let alt = CudaBackend::with_gpu(
                c.shared.clone(),
                Variant::Exact,
                CudaOptions {
                    gemv_v: v,
                    gemv_warps: 3,
                    gemv_warps_many: 1,
                    ..base_opts(false)
                },
            );
            let got = run(&alt)?;
            same_bits(
                c,
                format!("{case}: three and one warps a block bitwise = the default"),
                &got,
                &exact,
            );
        }
    }
    Ok(())
}

/// Weights of `outs` outputs sharing K `k`, an input of `rows` rows, and each weight's FP64
/// result in turn: the several-weight launches' cases.
fn many_case(
    c: &mut Ctx,
    k: usize,
    rows: usize,
    outs: &[usize],
) -> (Vec<Vec<u16>>, Vec<f32>, Vec<f64>) {
    let ws: Vec<Vec<u16>> = outs
        .iter()
        .map(|&n| c.rng.normals_bf16(n * k, 0.05))
        .collect();
    let x = c.rng.normals_f32(rows * k, 1.0);
    let mut reference = Vec::new();
    for (w, &n) in ws.iter().zip(outs) {
        reference.extend(gemv_ref(w, &x, k, rows, n));
    }
    (ws, x, reference)
}

/// `linear_many` of the weights `ws` over `x` ([rows, k]) on `be`, the outputs in weight order.
fn many_out(
    be: &CudaBackend,
    ws: &[Vec<u16>],
    outs: &[usize],
    k: usize,
    x: &[f32],
    rows: usize,
) -> Result<Vec<f32>> {
    let wd = bf16_weights(be, ws, outs, k)?;
    let xd = be.upload(x, rows, k)?;
    let refs: Vec<&crate::backend::CudaWeight> = wd.iter().collect();
    let mut out = Vec::new();
    for y in be.linear_many(&xd, &refs, Rows::Exact)? {
        out.extend(be.download(&y)?);
    }
    Ok(out)
}

/// Rows 0, mid and last of `got` (`[rows, n]`, the first op of `gated_linears`) bit for bit
/// against one-row launches of weight `w` on `be`.
#[allow(clippy::too_many_arguments)]
fn rows_as_one_row_launches(
    c: &mut Ctx,
    case: &str,
    be: &CudaBackend,
    w: &[u16],
    n: usize,
    k: usize,
    x: &[f32],
    got: &[f32],
) -> Result<()> {
    let rows = x.len() / k;
    let wd = be.weight_bf16(n, k, w)?;
    let mut one = Vec::new();
    let mut want = Vec::new();
    for r in [0, rows / 2, rows - 1] {
        let xr = be.upload(&x[r * k..(r + 1) * k], 1, k)?;
        one.extend(be.download(&be.linear(&xr, &wd, Rows::Exact)?)?);
        want.extend_from_slice(&got[r * n..(r + 1) * n]);
    }
    same_bits(
        c,
        format!("{case}: rows 0, mid, last bitwise = one-row launches"),
        &want,
        &one,
    );
    Ok(())
}

/// The `gemv_tt` / `gemv_tw` cases' options: the tiles from `tile` rows, whatever the tile count
/// (the engine's default also asks for `TT_MIN_BLOCKS` tiles); `walk`: `gemv_tw`'s.
fn tt_opts(tile: usize, walk: bool) -> CudaOptions {
    CudaOptions {
        gemv_v: 2,
        gemv_tile_min: tile,
        gemv_tile_blocks: 0,
        gemv_walk: walk,
        ..base_opts(false)
    }
}

/// The `gemv_tt` case's (outputs, K, rows): rows past one tile and not a multiple of 64,
/// outputs not a multiple of 64, K with an uneven last chunk (1088) and 384-key chunks (6144).
const GEMV_TT_SHAPES: [(usize, usize, usize); 7] = [
    (2050, 4096, 70),
    (300, 2048, 130),
    (96, 6144, 65),
    (2048, 512, 64),
    (70, 1088, 100),
    (40, 8192, 67),
    // a long prompt's rows (every prompt takes the tiles since session 29): 33 row tiles of 32
    (200, 2048, 1037),
];

/// `gemv_tt*` (many rows in 64 x 64 tiles): against FP64 with its twins, and bit for bit the
/// `gemv_tc2_*` kernels it stands in for (plain, silu- and sigmoid-gated input, several weights
/// in one launch), every row equal to its one-row launch. Rows past one tile and not a multiple
/// of 64, outputs not a multiple of 64, K with an uneven last chunk (1088) and with 384-key
/// chunks (6144), and a long prompt's 1037 rows.
pub(super) fn gemv_tt(c: &mut Ctx) -> Result<()> {
    tiles(c, false)
}

/// `gemv_tw*` (many rows in 64 x 32 tiles walking K): the `gemv_tt` case's checks with
/// `gemv_tw` in place of `gemv_tt`.
pub(super) fn gemv_tw(c: &mut Ctx) -> Result<()> {
    tiles(c, true)
}

/// The `gemv_tt` and `gemv_tw` cases (`walk`: `gemv_tw`).
fn tiles(c: &mut Ctx, walk: bool) -> Result<()> {
    let (kernel, tile) = if walk {
        ("gemv_tw", "64 x 32 tiles walking K")
    } else {
        ("gemv_tt", "64 x 64 tiles")
    };
    for (n, k, rows) in GEMV_TT_SHAPES {
        let (w, x, u, reference) = gated_case(c, n, k, rows);
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let wd = be.weight_bf16(n, k, &w)?;
            let (xd, ud) = (be.upload(&x, rows, k)?, be.upload(&u, rows, k)?);
            gated_linears(be, &xd, &ud, &wd)
        };
        let case =
            format!("{rows} rows x {k} into {n} in {tile}, plain, silu- and sigmoid-gated input");
        // the comparisons below mean something only if the tiles run and gemv_tc2 is the other side
        let (tt, tc2) = (
            crate::backend::bf16_gemv_grid(&tt_opts(1, walk), rows, k, n).0,
            crate::backend::bf16_gemv_grid(&tt_opts(usize::MAX, walk), rows, k, n).0,
        );
        c.push(
            format!("{case}: dispatched to {kernel}, against gemv_tc2"),
            Kind::Check,
            tt == kernel && tc2.starts_with("gemv_tc2_"),
            format!("{tt} against {tc2}"),
        );
        let make = |c: &Ctx, var| CudaBackend::with_gpu(c.shared.clone(), var, tt_opts(1, walk));
        let tiled = triple_with(c, &case, tol_f32(k), &reference, false, make, run)?;
        // the same three on gemv_tc2 (no tiles), then rows one at a time
        let plain =
            CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, tt_opts(usize::MAX, walk));
        let tc2 = run(&plain)?;
        same_bits(c, format!("{case}: bitwise = gemv_tc2"), &tiled, &tc2);
        // gemv_tc2 with each block on one 32-row slab (grid y) against every block on all rows
        // (gemv_tc2 alone: the gemv_tt case's)
        if !walk {
            let whole = CudaOptions {
                gemv_slabs: false,
                ..tt_opts(usize::MAX, walk)
            };
            let whole = run(&CudaBackend::with_gpu(
                c.shared.clone(),
                Variant::Exact,
                whole,
            ))?;
            let (_, grid) = crate::backend::bf16_gemv_grid(&tt_opts(usize::MAX, walk), rows, k, n);
            let slabbed = grid.1 as usize == rows.div_ceil(32) && grid.1 > 1;
            let same = bits_equal(&tc2, &whole);
            c.push(
                format!("{case}: gemv_tc2 in 32-row slabs bitwise = whole-row blocks"),
                Kind::Check,
                slabbed && same,
                format!(
                    "grid {grid:?}, {}",
                    if same { "same bits" } else { "BITS DIFFER" }
                ),
            );
        }
        rows_as_one_row_launches(c, &case, &plain, &w, n, k, &x, &tiled)?;
    }
    // several weights of one input (the GDN projections' shape, with outputs that do not fill a
    // tile): one tiled launch against separate gemv_tc2 launches
    let (k, rows) = (2048usize, 77usize);
    let outs = MANY_OUTS;
    let (ws, x, reference) = many_case(c, k, rows, &outs);
    let run_many = |be: &CudaBackend| many_out(be, &ws, &outs, k, &x, rows);
    let case = if walk {
        format!("{rows} rows x {k} into {outs:?}, one launch of {tile}")
    } else {
        // the name the gemv_tt case's line has had
        format!("{rows} rows x {k} into {outs:?}, one tiled launch")
    };
    let make = |c: &Ctx, var| CudaBackend::with_gpu(c.shared.clone(), var, tt_opts(1, walk));
    let tiled = triple_with(c, &case, tol_f32(k), &reference, false, make, run_many)?;
    let plain = CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, tt_opts(usize::MAX, walk));
    let tc2 = run_many(&plain)?;
    same_bits(c, format!("{case}: bitwise = gemv_tc2_multi"), &tiled, &tc2);
    let be = CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, tt_opts(1, walk));
    let wd = bf16_weights(&be, &ws, &outs, k)?;
    let xd = be.upload(&x, rows, k)?;
    let refs: Vec<&crate::backend::CudaWeight> = wd.iter().collect();
    one_launch(c, format!("{case}: one launch"), &be, || {
        be.linear_many(&xd, &refs, Rows::Exact)?;
        Ok(())
    })?;
    Ok(())
}

/// The several-weight cases' outputs (the GDN projections' shape, outputs that do not fill a
/// 64-wide tile).
const MANY_OUTS: [usize; 4] = [300, 64, 33, 128];

/// The `gemv_ts` case's options: the split tiles from one row, never the 64-row tiles; with
/// `split` false, `gemv_tc2` (the kernel whose bits they keep).
fn ts_opts(split: bool) -> CudaOptions {
    CudaOptions {
        gemv_v: 2,
        gemv_tile_min: usize::MAX,
        gemv_split_min: if split { 1 } else { usize::MAX },
        gemv_split_blocks: 0,
        ..base_opts(false)
    }
}

/// The `gemv_ts` case's (outputs, K, rows): one and two 32-row tiles (17, 32, 33, 64 rows),
/// outputs not a multiple of 64, K with an uneven last chunk (1088: five chunks, the last 64
/// keys), 384-key chunks (6144: 16), 128-key chunks (512) and one chunk (64); the last figure
/// is the key chunks (grid z) the engine's rule gives (256 keys, 128 up to K 1024, at least K / 16).
const GEMV_TS_SHAPES: [(usize, usize, usize, usize); 6] = [
    (2050, 4096, 33, 16),
    (300, 2048, 17, 8),
    (96, 6144, 64, 16),
    (2048, 512, 32, 4),
    (70, 1088, 40, 5),
    (130, 64, 20, 1),
];

/// `gemv_ts*` (17-64 rows in 64 x 32 tiles, a key chunk a block, a tile's chunk sums added in
/// order by its last block): against FP64 with its twins, bit for bit the `gemv_tc2_*` kernels
/// (plain, silu- and sigmoid-gated input, several weights in one launch), rows equal to their
/// one-row launches; the same bits launch after launch (the tickets reset), and in a side
/// branch beside a launch on the model stream (each stream its own tickets).
pub(super) fn gemv_ts(c: &mut Ctx) -> Result<()> {
    for (n, k, rows, chunks) in GEMV_TS_SHAPES {
        let (w, x, u, reference) = gated_case(c, n, k, rows);
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let wd = be.weight_bf16(n, k, &w)?;
            let (xd, ud) = (be.upload(&x, rows, k)?, be.upload(&u, rows, k)?);
            gated_linears(be, &xd, &ud, &wd)
        };
        let case = format!(
            "{rows} rows x {k} into {n} in 64 x 32 tiles split over K, plain, silu- and sigmoid-gated input"
        );
        let (ts, grid) = crate::backend::bf16_gemv_grid(&ts_opts(true), rows, k, n);
        let tc2 = crate::backend::bf16_gemv_grid(&ts_opts(false), rows, k, n).0;
        c.push(
            format!("{case}: dispatched to gemv_ts, against gemv_tc2"),
            Kind::Check,
            ts == "gemv_ts"
                && tc2.starts_with("gemv_tc2_")
                && grid
                    == (
                        n.div_ceil(64) as u32,
                        rows.div_ceil(32) as u32,
                        chunks as u32,
                    ),
            format!("{ts} grid {grid:?} against {tc2}"),
        );
        let make = |c: &Ctx, var| CudaBackend::with_gpu(c.shared.clone(), var, ts_opts(true));
        let split = triple_with(c, &case, tol_f32(k), &reference, false, make, run)?;
        let plain = CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, ts_opts(false));
        let want = run(&plain)?;
        same_bits(c, format!("{case}: bitwise = gemv_tc2"), &split, &want);
        // again on one backend: a launch leaves its tickets as it found them
        let be = CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, ts_opts(true));
        let mut again = run(&be)?;
        again.extend(run(&be)?);
        let mut twice = split.clone();
        twice.extend_from_slice(&split);
        same_bits(
            c,
            format!("{case}: two rounds of launches bitwise = the first"),
            &again,
            &twice,
        );
        rows_as_one_row_launches(c, &case, &plain, &w, n, k, &x, &split)?;
    }
    // several weights of one input (the GDN projections' shape, outputs that do not fill a
    // tile): one split launch against separate gemv_tc2 launches
    let (k, rows) = (2048usize, 32usize);
    let outs = MANY_OUTS;
    let (ws, x, reference) = many_case(c, k, rows, &outs);
    let run_many = |be: &CudaBackend| many_out(be, &ws, &outs, k, &x, rows);
    let case = format!("{rows} rows x {k} into {outs:?}, one split launch");
    let total = crate::backend::tiled_outputs(outs);
    let (multi, other) = (
        crate::backend::bf16_gemv_multi(&ts_opts(true), rows, k, total),
        crate::backend::bf16_gemv_multi(&ts_opts(false), rows, k, total),
    );
    c.push(
        format!("{case}: dispatched to gemv_ts_multi, against gemv_tc2"),
        Kind::Check,
        multi == "gemv_ts_multi" && other.starts_with("gemv_tc2_multi"),
        format!("{multi} against {other}"),
    );
    let make = |c: &Ctx, var| CudaBackend::with_gpu(c.shared.clone(), var, ts_opts(true));
    let split = triple_with(c, &case, tol_f32(k), &reference, false, make, run_many)?;
    let plain = CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, ts_opts(false));
    let want = run_many(&plain)?;
    same_bits(
        c,
        format!("{case}: bitwise = gemv_tc2_multi"),
        &split,
        &want,
    );
    let be = CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, ts_opts(true));
    let wd = bf16_weights(&be, &ws, &outs, k)?;
    let xd = be.upload(&x, rows, k)?;
    let refs: Vec<&crate::backend::CudaWeight> = wd.iter().collect();
    one_launch(c, format!("{case}: one launch"), &be, || {
        be.linear_many(&xd, &refs, Rows::Exact)?;
        Ok(())
    })?;
    // a side branch's split launch beside the model stream's: the branch's own tickets. Work
    // queued on the model stream first holds both back (the branch waits for the model
    // stream's work so far), so the two start together and overlap.
    for _ in 0..32 {
        be.linear_many(&xd, &refs, Rows::Exact)?;
    }
    be.set_aside(true);
    let opened = be.aside_begin(rows)?;
    let in_branch = be.linear_many(&xd, &refs, Rows::Exact);
    be.aside_end()?;
    let beside = be.linear_many(&xd, &refs, Rows::Exact);
    be.aside_join()?;
    let mut got = Vec::new();
    for y in in_branch?.iter().chain(beside?.iter()) {
        got.extend(be.download(y)?);
    }
    let mut twice = split.clone();
    twice.extend_from_slice(&split);
    let same = bits_equal(&got, &twice);
    c.push(
        format!("{case}: in a side branch and beside it on the model stream, both bitwise = alone"),
        Kind::Check,
        opened && same,
        format!(
            "branch {}, {}",
            if opened { "opened" } else { "NOT OPENED" },
            if same { "same bits" } else { "BITS DIFFER" }
        ),
    );
    Ok(())
}

/// The MoE output `routed + shared · sigmoid(gate)` in one launch: against FP64 (a per-row
/// gate and a full one), and bit for bit `sigmoid_mul` then `add`.
pub(super) fn add_sigmoid_mul(c: &mut Ctx) -> Result<()> {
    for (case, rows, cols, gcols) in [
        ("4 x 2048, gate [4, 1]", 4, 2048, 1),
        ("3 x 300, gate [3, 300]", 3, 300, 300),
    ] {
        let a = c.rng.normals_f32(rows * cols, 1.0);
        let x = c.rng.normals_f32(rows * cols, 1.0);
        let g = c.rng.normals_f32(rows * gcols, 2.0);
        let reference: Vec<f64> = (0..rows * cols)
            .map(|i| {
                let gv = f64::from(g[if gcols == 1 { i / cols } else { i }]);
                f64::from(a[i]) + f64::from(x[i]) * sigmoid(gv)
            })
            .collect();
        let up = |be: &CudaBackend| -> Result<[CudaBuf; 3]> {
            Ok([
                be.upload(&a, rows, cols)?,
                be.upload(&x, rows, cols)?,
                be.upload(&g, rows, gcols)?,
            ])
        };
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let [ad, xd, gd] = up(be)?;
            Ok(be.download(&be.add_sigmoid_mul(&ad, &xd, &gd)?)?)
        };
        triple3(c, case, tol_f32(4), &reference, run, false)?;
        let be = backend(c, Variant::Exact, false);
        let [ad, xd, gd] = up(&be)?;
        let two = be.download(&be.add(&ad, &be.sigmoid_mul(&xd, &gd)?)?)?;
        let fused = run(&be)?;
        same_bits(
            c,
            format!("{case}: bitwise = sigmoid_mul then add"),
            &fused,
            &two,
        );
    }
    Ok(())
}

/// Several BF16 linears of one input in one launch: against FP64, and bit for bit the
/// separate linears.
pub(super) fn linear_many(c: &mut Ctx) -> Result<()> {
    // the GDN projections of one layer at Drama 3 geometry (qkv, z, b, a), on tensor cores
    // (gemv_tc2_multi_*) and on the FMA GEMVs (3 rows: one output per warp, gemv_bf16_multi; 32
    // rows: four, gemv_bf16_multi_w4, whose rows must equal one-row launches bit for bit)
    let k = 2048;
    let outs = [8192usize, 4096, 32, 32];
    let ws: Vec<Vec<u16>> = outs
        .iter()
        .map(|&n| c.rng.normals_bf16(n * k, 0.05))
        .collect();
    for (rows, tc) in [(3usize, true), (32, true), (3, false), (32, false)] {
        let x = c.rng.normals_f32(rows * k, 1.0);
        let mut reference = Vec::new();
        for (w, &n) in ws.iter().zip(&outs) {
            reference.extend(gemv_ref(w, &x, k, rows, n));
        }
        // the weights' outputs together, then each weight alone, then (32 rows) rows 0, 17
        // and 31 alone through the one-row kernel, weight by weight
        let solo_rows: &[usize] = if rows > 3 { &[0, 17, 31] } else { &[] };
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let xd = be.upload(&x, rows, k)?;
            let wd = bf16_weights(be, &ws, &outs, k)?;
            let refs: Vec<&crate::backend::CudaWeight> = wd.iter().collect();
            let ys = be.linear_many(&xd, &refs, Rows::Exact)?;
            let mut out = Vec::new();
            for y in &ys {
                out.extend(be.download(y)?);
            }
            for w in &wd {
                out.extend(be.download(&be.linear(&xd, w, Rows::Exact)?)?);
            }
            for &r in solo_rows {
                let xr = be.upload(&x[r * k..(r + 1) * k], 1, k)?;
                for w in &wd {
                    out.extend(be.download(&be.linear(&xr, w, Rows::Exact)?)?);
                }
            }
            Ok(out)
        };
        let case = format!(
            "{rows} rows x 2048 into 8192 + 4096 + 32 + 32, {}",
            if tc { "tensor cores" } else { "FMA" }
        );
        let exact = triple_prefix(c, &case, tol_f32(k), &reference, tc, run)?;
        let half = reference.len();
        same_bits(
            c,
            format!("{case}: bitwise = separate linears"),
            &exact[..half],
            &exact[half..2 * half],
        );
        if !solo_rows.is_empty() {
            // the batched outputs of the solo rows, in the solo runs' order
            let mut batched = Vec::new();
            let mut at = 0;
            let mut starts = Vec::new();
            for &n in &outs {
                starts.push(at);
                at += rows * n;
            }
            for &r in solo_rows {
                for (j, &n) in outs.iter().enumerate() {
                    let s0 = starts[j] + r * n;
                    batched.extend_from_slice(&exact[s0..s0 + n]);
                }
            }
            same_bits(
                c,
                format!("{case}: rows 0, 17, 31 bitwise = each row alone"),
                &batched,
                &exact[2 * half..],
            );
        }
    }
    Ok(())
}

/// BF16 linears at edge shapes of the tensor-core GEMV: K over several 512-key warps, K of a
/// single partial warp, outputs that do not fill the last 16-output tile, rows that do not fill
/// the last group of 8; each against FP64, and each row bitwise equal to its one-row launch.
pub(super) fn linear_edges(c: &mut Ctx) -> Result<()> {
    // K 1056: three warps, the last of 32 keys; K 8192: sixteen warps, the most a block takes
    for (n, k, rows) in [
        (2050usize, 4096usize, 5usize),
        (37, 96, 9),
        (300, 2048, 33),
        (70, 1056, 12),
        (40, 8192, 3),
    ] {
        let w = c.rng.normals_bf16(n * k, 0.05);
        let x = c.rng.normals_f32(rows * k, 1.0);
        let reference = gemv_ref(&w, &x, k, rows, n);
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let wd = be.weight_bf16(n, k, &w)?;
            let mut out = be.download(&be.linear(&be.upload(&x, rows, k)?, &wd, Rows::Exact)?)?;
            for r in 0..rows {
                let xr = be.upload(&x[r * k..(r + 1) * k], 1, k)?;
                out.extend(be.download(&be.linear(&xr, &wd, Rows::Exact)?)?);
            }
            Ok(out)
        };
        // 512 keys per warp in 32-key steps, session 7's gemv_tc (DRAMATIS_CUDA_GEMV_KC=0);
        // the default layout has its own case (gemv_tc2)
        let case = format!("512 keys a warp: {rows} rows x {k} into {n}");
        let make = |c: &Ctx, v| {
            let o = CudaOptions {
                gemv_kc: 0,
                ..base_opts(false)
            };
            CudaBackend::with_gpu(c.shared.clone(), v, o)
        };
        let exact = triple_with(c, &case, tol_f32(k), &reference, false, make, run)?;
        let half = reference.len();
        same_bits(
            c,
            format!("{case}: each row bitwise = its one-row launch"),
            &exact[..half],
            &exact[half..],
        );
    }
    Ok(())
}

pub(super) fn elementwise(c: &mut Ctx) -> Result<()> {
    let (rows, cols) = (6, 300);
    let a = c.rng.normals_f32(rows * cols, 2.0);
    let b = c.rng.normals_f32(rows * cols, 2.0);
    let g1 = c.rng.normals_f32(rows, 2.0);
    let add: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| f64::from(x) + f64::from(y))
        .collect();
    let sm: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(&x, &y)| silu(f64::from(x)) * f64::from(y))
        .collect();
    let sg: Vec<f64> = a
        .iter()
        .enumerate()
        .map(|(i, &x)| f64::from(x) * sigmoid(f64::from(g1[i / cols])))
        .collect();
    let tol = tol_f32(4);
    triple3(
        c,
        "add 6 x 300",
        tol,
        &add,
        |be| {
            let (x, y) = (be.upload(&a, rows, cols)?, be.upload(&b, rows, cols)?);
            Ok(be.download(&be.add(&x, &y)?)?)
        },
        false,
    )?;
    triple3(
        c,
        "silu_mul 6 x 300",
        tol,
        &sm,
        |be| {
            let (x, y) = (be.upload(&a, rows, cols)?, be.upload(&b, rows, cols)?);
            Ok(be.download(&be.silu_mul(&x, &y)?)?)
        },
        false,
    )?;
    triple3(
        c,
        "sigmoid_mul, gate broadcast [6, 1]",
        tol,
        &sg,
        |be| {
            let (x, y) = (be.upload(&a, rows, cols)?, be.upload(&g1, rows, 1)?);
            Ok(be.download(&be.sigmoid_mul(&x, &y)?)?)
        },
        false,
    )?;
    Ok(())
}

fn rope_ref(
    x: &[f32],
    cols: usize,
    hd: usize,
    rot: usize,
    theta: f64,
    inter: bool,
    pos: &[usize],
) -> Vec<f64> {
    rope_ref64(f64s(x), cols, hd, rot, theta, inter, pos)
}

fn rope_ref64(
    mut out: Vec<f64>,
    cols: usize,
    hd: usize,
    rot: usize,
    theta: f64,
    inter: bool,
    pos: &[usize],
) -> Vec<f64> {
    let half = rot / 2;
    for (r, &p) in pos.iter().enumerate() {
        for h in 0..cols / hd {
            let base = r * cols + h * hd;
            for i in 0..half {
                let ang = p as f64 * theta.powf(-((2 * i) as f64) / rot as f64);
                let (cs, sn) = (ang.cos(), ang.sin());
                let (a, b) = if inter {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x0, x1) = (out[base + a], out[base + b]);
                out[base + a] = x0 * cs - x1 * sn;
                out[base + b] = x1 * cs + x0 * sn;
            }
        }
    }
    out
}

/// Attention's q/k norm and rotary embedding in one launch, heads read in place from a wider
/// buffer (the backbone's [q ; gate] per head, the tower's fused qkv): against FP64 (norm, then
/// rotation), and bit for bit `cols_grouped`, `rms_norm` and `rope`.
pub(super) fn norm_rope(c: &mut Ctx) -> Result<()> {
    for (case, rows, src_cols, sel, hd, rot, style) in [
        (
            "q of [q ; gate] per head, 16 heads of 256, NeoX rot 64",
            3usize,
            16 * 512usize,
            (512usize, 0usize, 256usize),
            256usize,
            64usize,
            Rope::Neox,
        ),
        (
            "k of a fused qkv (9216 cols), 2 heads of 256, NeoX rot 64",
            2,
            9216,
            (9216, 8192, 512),
            256,
            64,
            Rope::Neox,
        ),
        (
            "interleaved, 4 heads of 32 of 128 cols at offset 0, rot 16",
            4,
            128,
            (128, 0, 128),
            32,
            16,
            Rope::Interleaved,
        ),
    ] {
        let (group, offset, len) = sel;
        let cols = (src_cols / group) * len;
        let pos: Vec<usize> = (0..rows)
            .map(|r| [3usize, 200_000, 17, 65_535][r % 4])
            .collect();
        let x = c.rng.normals_f32(rows * src_cols, 2.0);
        let w = c.rng.normals_f32(hd, 0.1);
        let theta = 1e7;
        let mut normed = Vec::with_capacity(rows * cols);
        for r in 0..rows {
            for j in 0..cols {
                normed.push(f64::from(
                    x[r * src_cols + (j / len) * group + offset + j % len],
                ));
            }
        }
        for grp in normed.chunks_mut(hd) {
            let ms = grp.iter().map(|v| v * v).sum::<f64>() / hd as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for (v, wv) in grp.iter_mut().zip(&w) {
                *v *= inv * (1.0 + f64::from(*wv));
            }
        }
        let reference = rope_ref64(
            normed,
            cols,
            hd,
            rot,
            theta,
            style == Rope::Interleaved,
            &pos,
        );
        let up = |be: &CudaBackend| -> Result<(CudaBuf, CudaVector)> {
            Ok((be.upload(&x, rows, src_cols)?, be.vector_f32(&w)?))
        };
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let (xd, wd) = up(be)?;
            let at = model::backend::RopeAt::Host(&pos);
            Ok(be.download(&be.norm_rope(&xd, sel, &wd, 1e-6, hd, rot, theta, style, at)?)?)
        };
        triple3(c, case, tol_f32(hd), &reference, run, false)?;
        let be = backend(c, Variant::Exact, false);
        let (xd, wd) = up(&be)?;
        let picked = be.cols_grouped(&xd, group, offset, len)?;
        let n = be.rms_norm(&picked, &wd, hd, 1e-6, true)?;
        let three = be.download(&be.rope(&n, hd, rot, theta, style, &pos)?)?;
        let fused = run(&be)?;
        same_bits(
            c,
            format!("{case}: bitwise = cols_grouped, rms_norm, rope"),
            &fused,
            &three,
        );
        one_launch(c, format!("{case}: one launch"), &be, || {
            let at = model::backend::RopeAt::Host(&pos);
            be.norm_rope(&xd, sel, &wd, 1e-6, hd, rot, theta, style, at)
                .map(drop)
                .map_err(Into::into)
        })?;
    }
    Ok(())
}

pub(super) fn rope(c: &mut Ctx) -> Result<()> {
    let (hd, rot, heads) = (32, 16, 4);
    let cols = hd * heads;
    let pos = [0usize, 7, 200_000];
    let x = c.rng.normals_f32(pos.len() * cols, 1.0);
    for (case, style) in [
        ("NeoX, hd 32, rot 16, positions up to 200000", Rope::Neox),
        (
            "interleaved, hd 32, rot 16, positions up to 200000",
            Rope::Interleaved,
        ),
    ] {
        let reference = rope_ref(&x, cols, hd, rot, 1e7, style == Rope::Interleaved, &pos);
        triple3(
            c,
            case,
            tol_f32(2),
            &reference,
            |be| {
                let xd = be.upload(&x, pos.len(), cols)?;
                Ok(be.download(&be.rope(&xd, hd, rot, 1e7, style, &pos)?)?)
            },
            false,
        )?;
    }
    Ok(())
}

fn dims(nh: usize, nkv: usize, hd: usize) -> AttnDims {
    AttnDims {
        q_heads: nh,
        kv_heads: nkv,
        head_dim: hd,
        rot_dims: hd / 4,
        theta: 1e7,
        rope: Rope::Neox,
    }
}

fn round_bf16(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

pub(super) fn kv_append(c: &mut Ctx) -> Result<()> {
    let (nh, nkv, hd, t) = (4, 2, 32, 5);
    let d = dims(nh, nkv, hd);
    let q = c.rng.normals_f32(t * nh * hd, 1.0);
    let k = c.rng.normals_f32(t * nkv * hd, 1.0);
    let v = c.rng.normals_f32(t * nkv * hd, 1.0);
    for f32kv in [false, true] {
        // cache layout [nkv, len, hd], K then V
        let mut reference = Vec::new();
        for src in [&k, &v] {
            for h in 0..nkv {
                for r in 0..t {
                    for dd in 0..hd {
                        let x = src[r * nkv * hd + h * hd + dd];
                        reference.push(f64::from(if f32kv { x } else { round_bf16(x) }));
                    }
                }
            }
        }
        let case = if f32kv {
            "f32 cache, 5 rows, 2 kv heads x 32"
        } else {
            "bf16 cache (round to nearest even), 5 rows"
        };
        triple3(
            c,
            case,
            0.0,
            &reference,
            |be| {
                let mut kv = be.kv_new(8, nkv, hd)?;
                let (qd, kd, vd) = (
                    be.upload(&q, t, nh * hd)?,
                    be.upload(&k, t, nkv * hd)?,
                    be.upload(&v, t, nkv * hd)?,
                );
                be.attn_prefill(&qd, &kd, &vd, &d, &mut kv)?;
                let (kk, vv) = be.kv_download(&kv)?;
                Ok([kk, vv].concat())
            },
            f32kv,
        )?;
    }
    Ok(())
}

/// f64 causal attention: row r of the `t` new rows sees keys [0, past + r + 1).
#[allow(clippy::too_many_arguments)]
fn attn_ref(
    q: &[f32],
    ks: &[f32],
    vs: &[f32],
    nh: usize,
    nkv: usize,
    hd: usize,
    past: usize,
    t: usize,
) -> Vec<f64> {
    let g = nh / nkv;
    let scale = 1.0 / (hd as f64).sqrt();
    let mut out = vec![0.0; t * nh * hd];
    for r in 0..t {
        for h in 0..nh {
            let kvh = h / g;
            let qv = &q[(r * nh + h) * hd..(r * nh + h + 1) * hd];
            let n = past + r + 1;
            let s: Vec<f64> = (0..n)
                .map(|j| {
                    let kr = &ks[j * nkv * hd + kvh * hd..j * nkv * hd + (kvh + 1) * hd];
                    scale
                        * kr.iter()
                            .zip(qv)
                            .map(|(&a, &b)| f64::from(a) * f64::from(b))
                            .sum::<f64>()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l: f64 = s.iter().map(|x| (x - m).exp()).sum();
            let o = &mut out[(r * nh + h) * hd..(r * nh + h + 1) * hd];
            for (j, sj) in s.iter().enumerate() {
                let p = (sj - m).exp() / l;
                let vr = &vs[j * nkv * hd + kvh * hd..j * nkv * hd + (kvh + 1) * hd];
                for (od, &vv) in o.iter_mut().zip(vr) {
                    *od += p * f64::from(vv);
                }
            }
        }
    }
    out
}

/// Random causal-prefill inputs (`past` rows, then `t` checked rows) and their FP64 outputs,
/// with K/V rounded as the cache stores them.
struct PrefillCase {
    d: AttnDims,
    past: usize,
    q0: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    reference: Vec<f64>,
    name: String,
    tol: f64,
}

impl PrefillCase {
    #[allow(clippy::too_many_arguments)]
    fn new(
        c: &mut Ctx,
        nh: usize,
        nkv: usize,
        hd: usize,
        past: usize,
        t: usize,
        f32kv: bool,
    ) -> Self {
        let n = past + t;
        let q0 = c.rng.normals_f32(past * nh * hd, 1.0);
        let q = c.rng.normals_f32(t * nh * hd, 1.0);
        let k = c.rng.normals_f32(n * nkv * hd, 1.0);
        let v = c.rng.normals_f32(n * nkv * hd, 1.0);
        let store = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .map(|&y| if f32kv { y } else { round_bf16(y) })
                .collect()
        };
        let reference = attn_ref(&q, &store(&k), &store(&v), nh, nkv, hd, past, t);
        PrefillCase {
            d: dims(nh, nkv, hd),
            past,
            name: format!(
                "{} cache, {nh}/{nkv} heads x {hd}, {t} rows after {past}",
                if f32kv { "f32" } else { "bf16" }
            ),
            tol: tol_f32(hd + n),
            q0,
            q,
            k,
            v,
            reference,
        }
    }

    /// The checked rows' outputs on `be`, in a cache with a few rows to spare.
    fn run(&self, be: &CudaBackend) -> Result<Vec<f32>> {
        let cap = self.past + self.q.len() / (self.d.q_heads * self.d.head_dim) + 3;
        flash_run(
            be, &self.d, cap, self.past, &self.q0, &self.q, &self.k, &self.v,
        )
    }
}

pub(super) fn attn_generic(c: &mut Ctx) -> Result<()> {
    for (nh, nkv, hd, past, t, f32kv) in [
        (4, 2, 32, 150, 6, false),
        (16, 2, 256, 300, 4, false),
        (4, 2, 32, 150, 6, true),
    ] {
        let pc = PrefillCase::new(c, nh, nkv, hd, past, t, f32kv);
        triple3(c, &pc.name, pc.tol, &pc.reference, |be| pc.run(be), f32kv)?;
    }
    // batched decode: 3 lanes of different lengths, each row bitwise equal to its solo step
    let (nh, nkv, hd) = (16, 2, 256);
    let d = dims(nh, nkv, hd);
    let be = backend(c, Variant::Exact, false);
    let lens = [3usize, 40, 129];
    let w = nkv * hd;
    let hist: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = lens
        .iter()
        .map(|&l| {
            (
                c.rng.normals_f32(l * nh * hd, 1.0),
                c.rng.normals_f32(l * w, 1.0),
                c.rng.normals_f32(l * w, 1.0),
            )
        })
        .collect();
    let q = c.rng.normals_f32(3 * nh * hd, 1.0);
    let k = c.rng.normals_f32(3 * w, 1.0);
    let v = c.rng.normals_f32(3 * w, 1.0);
    let fresh = |i: usize| -> Result<crate::backend::CudaKv> {
        let mut kv = be.kv_new(200, nkv, hd)?;
        let (hq, hk, hv) = &hist[i];
        let l = lens[i];
        be.attn_prefill(
            &be.upload(hq, l, nh * hd)?,
            &be.upload(hk, l, w)?,
            &be.upload(hv, l, w)?,
            &d,
            &mut kv,
        )?;
        Ok(kv)
    };
    let mut kvs = [fresh(0)?, fresh(1)?, fresh(2)?];
    let mut refs: Vec<&mut crate::backend::CudaKv> = kvs.iter_mut().collect();
    let batch = be.download(&be.attn_step(
        &be.upload(&q, 3, nh * hd)?,
        &be.upload(&k, 3, w)?,
        &be.upload(&v, 3, w)?,
        &d,
        &mut refs,
    )?)?;
    let mut same = true;
    for i in 0..3 {
        let mut kv = fresh(i)?;
        let solo = be.download(&be.attn_step(
            &be.upload(&q[i * nh * hd..(i + 1) * nh * hd], 1, nh * hd)?,
            &be.upload(&k[i * w..(i + 1) * w], 1, w)?,
            &be.upload(&v[i * w..(i + 1) * w], 1, w)?,
            &d,
            &mut [&mut kv],
        )?)?;
        same &= bits_equal(&solo, &batch[i * nh * hd..(i + 1) * nh * hd]);
    }
    c.push(
        "3-lane decode step: each lane bitwise = its solo step",
        Kind::Check,
        same,
        format!("batch invariance {}", if same { "holds" } else { "BROKEN" }),
    );
    Ok(())
}

/// Prefill of `past` rows (outputs dropped) then of the checked `t` rows, through one lane's
/// cache of `cap` rows; returns the checked rows' outputs.
#[allow(clippy::too_many_arguments)]
fn flash_run(
    be: &CudaBackend,
    d: &AttnDims,
    cap: usize,
    past: usize,
    q0: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<Vec<f32>> {
    let (nh, nkv, hd) = (d.q_heads, d.kv_heads, d.head_dim);
    let t = q.len() / (nh * hd);
    let w = nkv * hd;
    let mut kv = be.kv_new(cap, nkv, hd)?;
    if past > 0 {
        be.attn_prefill(
            &be.upload(q0, past, nh * hd)?,
            &be.upload(&k[..past * w], past, w)?,
            &be.upload(&v[..past * w], past, w)?,
            d,
            &mut kv,
        )?;
    }
    let (qd, kd, vd) = (
        be.upload(q, t, nh * hd)?,
        be.upload(&k[past * w..(past + t) * w], t, w)?,
        be.upload(&v[past * w..(past + t) * w], t, w)?,
    );
    Ok(be.download(&be.attn_prefill(&qd, &kd, &vd, d, &mut kv)?)?)
}

/// Makes key `pos` (kv head `kvh`) score `score` for query `qrow` (`[nh·hd]` head `h`) and gives it a
/// large value; returns that value.
#[allow(clippy::too_many_arguments)]
fn plant(
    c: &mut Ctx,
    k: &mut [f32],
    v: &mut [f32],
    qrow: &[f32],
    h: usize,
    kvh: usize,
    pos: usize,
    nkv: usize,
    hd: usize,
    score: f64,
) -> Vec<f64> {
    let qh = &qrow[h * hd..(h + 1) * hd];
    let n2: f64 = qh.iter().map(|&x| f64::from(x).powi(2)).sum();
    // q·k / sqrt(hd) = score
    let a = score * (hd as f64).sqrt() / n2;
    let at = pos * nkv * hd + kvh * hd;
    let mut val = Vec::with_capacity(hd);
    for dd in 0..hd {
        k[at + dd] = (f64::from(qh[dd]) * a) as f32;
        let x = (c.rng.normal() * 4.0) as f32;
        v[at + dd] = x;
        val.push(f64::from(x));
    }
    val
}

pub(super) fn attn_flash(c: &mut Ctx) -> Result<()> {
    // (heads, kv heads, head dim, past rows, new rows, f32 cache): partial query tiles, several
    // key tiles, a first call with no past, the tiny and the Drama 3 geometries
    for (nh, nkv, hd, past, t, f32kv) in [
        (4, 2, 32, 150, 70, true),
        (4, 2, 32, 0, 45, true),
        (16, 2, 256, 40, 100, true),
        (16, 2, 256, 300, 33, false),
        (4, 2, 64, 17, 96, false),
    ] {
        let pc = PrefillCase::new(c, nh, nkv, hd, past, t, f32kv);
        let got: Vec<Vec<f32>> = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
            .iter()
            .map(|&var| pc.run(&flash_backend(c, var, f32kv)))
            .collect::<Result<_>>()?;
        c.check(&pc.name, rel_l2(&got[0], &pc.reference), pc.tol);
        c.discriminate(&pc.name, rel_l2(&got[1], &pc.reference), pc.tol);
        c.control(&pc.name, rel_l2(&got[2], &pc.reference), pc.tol);
    }

    // Long range at C = 262144 (tiny geometry): 64 checked rows after 262080. Row 5 head 0's
    // only strong key sits at position 7; row 10 head 2's strong key is the next row's own key
    // (position 262091), beyond its causal limit, and must be ignored.
    let (nh, nkv, hd, cap, t) = (4, 2, 32, 262_144, 64);
    let past = cap - t;
    let d = dims(nh, nkv, hd);
    let q0 = c.rng.normals_f32(past * nh * hd, 1.0);
    let q = c.rng.normals_f32(t * nh * hd, 1.0);
    let mut k = c.rng.normals_f32(cap * nkv * hd, 1.0);
    let mut v = c.rng.normals_f32(cap * nkv * hd, 1.0);
    let w = nh * hd;
    let early = plant(c, &mut k, &mut v, &q[5 * w..6 * w], 0, 0, 7, nkv, hd, 40.0);
    let beyond = plant(
        c,
        &mut k,
        &mut v,
        &q[10 * w..11 * w],
        2,
        1,
        past + 11,
        nkv,
        hd,
        40.0,
    );
    let reference = attn_ref(&q, &k, &v, nh, nkv, hd, past, t);
    let out = flash_run(
        &flash_backend(c, Variant::Exact, true),
        &d,
        cap,
        past,
        &q0,
        &q,
        &k,
        &v,
    )?;
    let tol = tol_f32(hd + cap);
    c.check(
        "262144 keys, 64 rows after 262080 (vs FP64)",
        rel_l2(&out, &reference),
        tol,
    );
    let o5 = &out[5 * w..5 * w + hd];
    let o10 = &out[10 * w + 2 * hd..10 * w + 3 * hd];
    let (ce, cb) = (cosine(o5, &early), cosine(o10, &beyond));
    c.push(
        "262144 keys: row 5 finds key 7, row 10 ignores key 262091",
        Kind::Check,
        ce > 0.99 && cb.abs() < 0.5,
        format!("cosine to key 7's value {ce:.5} (> 0.99), to key 262091's {cb:.4} (|.| < 0.5)"),
    );
    let planted = flash_run(
        &flash_backend(c, Variant::Planted, true),
        &d,
        cap,
        past,
        &q0,
        &q,
        &k,
        &v,
    )?;
    c.control(
        "262144 keys, off-by-one causal mask",
        rel_l2(&planted, &reference),
        tol,
    );
    for (rows, hd, f32kv) in [
        (262_144, 256, true),
        (262_144, 256, false),
        (262_144, 32, true),
    ] {
        c.limit(
            &format!(
                "{rows} rows x 16 heads x {hd}, C = 262144, {} cache",
                if f32kv { "f32" } else { "bf16" }
            ),
            crate::kernels::plan_flash(rows, 16, 1, hd, 262_144, f32kv),
        );
    }
    Ok(())
}

/// The joined prefill's attention (`attn_prefill_lanes`: `kv_append_rows_*` then
/// `attn_flash_rows_*`, two launches for all the lanes): lanes of different lengths after
/// different pasts against FP64 with the twins, every lane bitwise its own `attn_prefill`, the
/// caches it leaves bitwise (a further per-lane prefill on them gives the same bits), and the
/// launch-limit record at a 262144-row joined call.
pub(super) fn attn_flash_joined(c: &mut Ctx) -> Result<()> {
    // (heads, kv heads, head dim, f32 cache, each lane's (past, new rows))
    type Lanes = &'static [(usize, usize)];
    let cases: [(usize, usize, usize, bool, Lanes); 2] = [
        (4, 2, 32, true, &[(150, 45), (0, 2), (40, 70), (17, 33)]),
        (16, 2, 256, false, &[(40, 100), (300, 33), (0, 64)]),
    ];
    for (nh, nkv, hd, f32kv, lanes) in cases {
        let d = dims(nh, nkv, hd);
        let lens: Vec<usize> = lanes.iter().map(|l| l.1).collect();
        let cases: Vec<PrefillCase> = lanes
            .iter()
            .map(|&(past, t)| PrefillCase::new(c, nh, nkv, hd, past, t, f32kv))
            .collect();
        let reference: Vec<f64> = cases.iter().flat_map(|p| p.reference.clone()).collect();
        let tol = cases.iter().map(|p| p.tol).fold(0.0, f64::max);
        let name = format!(
            "{} cache, {nh}/{nkv} heads x {hd}, lanes of {lens:?} rows after {:?}, one joined call",
            if f32kv { "f32" } else { "bf16" },
            lanes.iter().map(|l| l.0).collect::<Vec<_>>()
        );
        let w = nkv * hd;
        // 3 more rows a lane, the same for every run
        let more: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..lanes.len())
            .map(|_| {
                (
                    c.rng.normals_f32(3 * nh * hd, 1.0),
                    c.rng.normals_f32(3 * w, 1.0),
                    c.rng.normals_f32(3 * w, 1.0),
                )
            })
            .collect();
        // every lane's past prefilled alone, then (joined or lane by lane) its new rows; the
        // outputs, and those of 3 more rows per lane prefilled alone on the caches it left
        let run = |be: &CudaBackend, joined: bool| -> Result<(Vec<f32>, Vec<f32>, usize)> {
            let mut kvs = Vec::new();
            for p in &cases {
                let t = p.q.len() / (nh * hd);
                let mut kv = be.kv_new(p.past + t + 4, nkv, hd)?;
                if p.past > 0 {
                    be.attn_prefill(
                        &be.upload(&p.q0, p.past, nh * hd)?,
                        &be.upload(&p.k[..p.past * w], p.past, w)?,
                        &be.upload(&p.v[..p.past * w], p.past, w)?,
                        &d,
                        &mut kv,
                    )?;
                }
                kvs.push(kv);
            }
            let cat = |f: &dyn Fn(&PrefillCase) -> Vec<f32>| -> Vec<f32> {
                cases.iter().flat_map(f).collect()
            };
            let q = cat(&|p| p.q.clone());
            let k = cat(&|p| p.k[p.past * w..].to_vec());
            let v = cat(&|p| p.v[p.past * w..].to_vec());
            let rows: usize = lens.iter().sum();
            let (qd, kd, vd) = (
                be.upload(&q, rows, nh * hd)?,
                be.upload(&k, rows, w)?,
                be.upload(&v, rows, w)?,
            );
            let before = be.launch_count();
            let out = if joined {
                let mut refs: Vec<&mut crate::CudaKv> = kvs.iter_mut().collect();
                be.attn_prefill_lanes(&qd, &kd, &vd, &d, &mut refs, &lens)?
                    .ok_or(crate::error::CudaError::Shape {
                        kernel: "attn_flash_rows",
                        what: "the joined attention declined these lanes".into(),
                    })?
            } else {
                let mut outs = Vec::new();
                let mut at = 0;
                for (kv, &t) in kvs.iter_mut().zip(&lens) {
                    let part = |x: &CudaBuf| be.rows(x, at, t);
                    outs.push(be.attn_prefill(&part(&qd)?, &part(&kd)?, &part(&vd)?, &d, kv)?);
                    at += t;
                }
                let refs: Vec<&CudaBuf> = outs.iter().collect();
                be.concat_rows(&refs)?
            };
            let launches = be.launch_count() - before;
            let mut after = Vec::new();
            for (kv, (q3, k3, v3)) in kvs.iter_mut().zip(&more) {
                let o = be.attn_prefill(
                    &be.upload(q3, 3, nh * hd)?,
                    &be.upload(k3, 3, w)?,
                    &be.upload(v3, 3, w)?,
                    &d,
                    kv,
                )?;
                after.extend(be.download(&o)?);
            }
            Ok((be.download(&out)?, after, launches as usize))
        };
        let joined_backend = |var| {
            let o = CudaOptions {
                flash_min_rows: 2,
                attn_joined: true,
                ..base_opts(f32kv)
            };
            CudaBackend::with_gpu(c.shared.clone(), var, o)
        };
        let mut got = Vec::new();
        for var in [Variant::Exact, Variant::LowPrecision, Variant::Planted] {
            got.push(run(&joined_backend(var), true)?);
        }
        c.check(&name, rel_l2(&got[0].0, &reference), tol);
        c.discriminate(&name, rel_l2(&got[1].0, &reference), tol);
        c.control(&name, rel_l2(&got[2].0, &reference), tol);
        let alone = run(&flash_backend(c, Variant::Exact, f32kv), false)?;
        same_bits(
            c,
            format!("{name}: bitwise = each lane's own attn_prefill"),
            &got[0].0,
            &alone.0,
        );
        same_bits(
            c,
            format!("{name}: the caches it leaves (3 more rows a lane, alone) bitwise"),
            &got[0].1,
            &alone.1,
        );
        c.push(
            format!("{name}: two launches for {} lanes", lens.len()),
            Kind::Check,
            got[0].2 == 2,
            format!("{} launch(es) joined, {} lane by lane", got[0].2, alone.2),
        );
    }
    // one lane of a joined call under the flash threshold: lane by lane (None), nothing appended
    let be = CudaBackend::with_gpu(
        c.shared.clone(),
        Variant::Exact,
        CudaOptions {
            flash_min_rows: 2,
            attn_joined: true,
            ..base_opts(true)
        },
    );
    let d = dims(4, 2, 32);
    let (mut a, mut b) = (be.kv_new(8, 2, 32)?, be.kv_new(8, 2, 32)?);
    let (q, k) = (
        c.rng.normals_f32(3 * 128, 1.0),
        c.rng.normals_f32(3 * 64, 1.0),
    );
    let (qd, kd) = (be.upload(&q, 3, 128)?, be.upload(&k, 3, 64)?);
    let none = be
        .attn_prefill_lanes(&qd, &kd, &kd, &d, &mut [&mut a, &mut b], &[2, 1])?
        .is_none();
    c.push(
        "lanes of 2 and 1 rows (1 under the flash threshold): lane by lane, caches untouched",
        Kind::Check,
        none && be.kv_len(&a) == 0 && be.kv_len(&b) == 0,
        format!(
            "joined: {}, cache lengths {} / {}",
            !none,
            be.kv_len(&a),
            be.kv_len(&b)
        ),
    );
    // a 262144-row joined call: 32 lanes of 8192 rows
    for (hd, f32kv) in [(256, true), (256, false)] {
        c.limit(
            &format!(
                "32 lanes x 8192 rows x 16 heads x {hd}, C = 262144, {} cache, joined",
                if f32kv { "f32" } else { "bf16" }
            ),
            crate::kernels::plan_flash_rows(8192, 262_144, 16, 32, hd, 262_144, f32kv),
        );
    }
    Ok(())
}

fn gdn_dims(nk: usize, nv: usize, d: usize) -> GdnDims {
    GdnDims {
        k_heads: nk,
        v_heads: nv,
        k_dim: d,
        v_dim: d,
        conv_kernel: 4,
    }
}

pub(super) fn conv_rows(c: &mut Ctx) -> Result<()> {
    let gd = gdn_dims(2, 4, 16);
    let (ch, k) = (gd.channels(), gd.conv_kernel);
    let w = c.rng.normals_f32(ch * k, 0.5);
    let x = c.rng.normals_f32(9 * ch, 1.0);
    // three calls, 5 rows, 3 and 1 (the one-row kernel), continuing the history; then the
    // final history
    let mut reference = Vec::new();
    for r in 0..9 {
        for cc in 0..ch {
            let mut acc = 0.0;
            for j in 0..k {
                let idx = r as isize + j as isize - (k as isize - 1);
                let xv = if idx < 0 {
                    0.0
                } else {
                    f64::from(x[idx as usize * ch + cc])
                };
                acc += f64::from(w[cc * k + j]) * xv;
            }
            reference.push(silu(acc));
        }
    }
    reference.extend(f64s(&x[6 * ch..9 * ch]));
    let case = "C 128, 4 taps, 5 rows, 3, then 1 (history carried)";
    let run = |be: &CudaBackend| -> Result<Vec<f32>> {
        let wd = be.vector_f32(&w)?;
        let mut st = be.gdn_new(&gd)?;
        let a = be.gdn_conv(&be.upload(&x[..5 * ch], 5, ch)?, &wd, &gd, &mut st)?;
        let b = be.gdn_conv(&be.upload(&x[5 * ch..8 * ch], 3, ch)?, &wd, &gd, &mut st)?;
        let one = be.upload(&x[8 * ch..], 1, ch)?;
        let d = be.gdn_conv_step(&one, &wd, &gd, &mut [&mut st])?;
        let mut out = be.download(&a)?;
        out.extend(be.download(&b)?);
        out.extend(be.download(&d)?);
        out.extend(be.gdn_download(&st)?.0);
        Ok(out)
    };
    triple3(c, case, tol_f32(4), &reference, run, false)?;
    // the one-row kernel (gdn_conv_one) against gdn_conv_rows then gdn_conv_shift
    let one_launch = run(&backend(c, Variant::Exact, false))?;
    let o = CudaOptions {
        gdn_generic: true,
        ..base_opts(false)
    };
    let two = run(&CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, o))?;
    same_bits(
        c,
        format!("{case}: the one-row launch bitwise = conv rows then shift"),
        &one_launch,
        &two,
    );
    Ok(())
}

struct GdnIn {
    u: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
    a_log: Vec<f32>,
    dt: Vec<f32>,
}

impl GdnIn {
    /// `t` rows of fresh normals (u, b, a) and a layer's A_log and dt_bias.
    fn random(c: &mut Ctx, g: &GdnDims, t: usize) -> GdnIn {
        let (ch, nv) = (g.channels(), g.v_heads);
        GdnIn {
            u: c.rng.normals_f32(t * ch, 1.0),
            b: c.rng.normals_f32(t * nv, 1.0),
            a: c.rng.normals_f32(t * nv, 1.0),
            a_log: c.rng.normals_f32(nv, 0.5),
            dt: c.rng.normals_f32(nv, 0.5),
        }
    }
}

/// One lane's GDN from zeros: a `gdn_prefill` of each of `pieces` (row ranges, in order), then
/// single `gdn_step`s up to row `t`; the outputs in row order, then the final state.
fn gdn_pieces(
    be: &CudaBackend,
    g: &GdnDims,
    x: &GdnIn,
    pieces: &[(usize, usize)],
    t: usize,
) -> Result<Vec<f32>> {
    let (ch, nv) = (g.channels(), g.v_heads);
    let mut st = be.gdn_new(g)?;
    let (al, dt) = (be.vector_f32(&x.a_log)?, be.vector_f32(&x.dt)?);
    let mut out = Vec::new();
    for &(r0, r1) in pieces {
        let o = be.gdn_prefill(
            &be.upload(&x.u[r0 * ch..r1 * ch], r1 - r0, ch)?,
            &be.upload(&x.b[r0 * nv..r1 * nv], r1 - r0, nv)?,
            &be.upload(&x.a[r0 * nv..r1 * nv], r1 - r0, nv)?,
            &al,
            &dt,
            g,
            &mut st,
            true,
        )?;
        out.extend(be.download(&o)?);
    }
    for r in pieces.last().map_or(0, |p| p.1)..t {
        let o = be.gdn_step(
            &be.upload(&x.u[r * ch..(r + 1) * ch], 1, ch)?,
            &be.upload(&x.b[r * nv..(r + 1) * nv], 1, nv)?,
            &be.upload(&x.a[r * nv..(r + 1) * nv], 1, nv)?,
            &al,
            &dt,
            g,
            &mut [&mut st],
        )?;
        out.extend(be.download(&o)?);
    }
    out.extend(be.gdn_download(&st)?.1);
    Ok(out)
}

/// f64 delta rule over `t` rows (DRAMA3.md §4.3 order): returns o rows then the final state.
fn delta_ref(g: &GdnDims, x: &GdnIn, t: usize) -> Vec<f64> {
    let (nk, nv, dk, dv, ch) = (g.k_heads, g.v_heads, g.k_dim, g.v_dim, g.channels());
    let mut s = vec![0.0f64; nv * dk * dv];
    let mut out = vec![0.0; t * nv * dv];
    let l2 = |v: &[f32]| -> Vec<f64> {
        let n = (v.iter().map(|&y| f64::from(y).powi(2)).sum::<f64>() + 1e-6).sqrt();
        v.iter().map(|&y| f64::from(y) / n).collect()
    };
    for r in 0..t {
        let row = &x.u[r * ch..(r + 1) * ch];
        for h in 0..nv {
            let kh = h / (nv / nk);
            let q: Vec<f64> = l2(&row[kh * dk..(kh + 1) * dk])
                .into_iter()
                .map(|y| y / (dk as f64).sqrt())
                .collect();
            let k = l2(&row[(nk + kh) * dk..(nk + kh + 1) * dk]);
            let v = &row[2 * nk * dk + h * dv..2 * nk * dk + (h + 1) * dv];
            let beta = sigmoid(f64::from(x.b[r * nv + h]));
            let xa = f64::from(x.a[r * nv + h]) + f64::from(x.dt[h]);
            let sp = if xa > 20.0 { xa } else { xa.exp().ln_1p() };
            let alpha = (-f64::from(x.a_log[h]).exp() * sp).exp();
            let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
            sh.iter_mut().for_each(|y| *y *= alpha);
            for j in 0..dv {
                let kv: f64 = (0..dk).map(|i| sh[i * dv + j] * k[i]).sum();
                let delta = beta * (f64::from(v[j]) - kv);
                for i in 0..dk {
                    sh[i * dv + j] += k[i] * delta;
                }
                out[r * nv * dv + h * dv + j] = (0..dk).map(|i| sh[i * dv + j] * q[i]).sum();
            }
        }
    }
    out.extend(s);
    out
}

pub(super) fn delta_rule(c: &mut Ctx) -> Result<()> {
    for (nk, nv, d, t) in [(2, 4, 16, 7), (4, 8, 128, 6)] {
        let gd = gdn_dims(nk, nv, d);
        let x = GdnIn::random(c, &gd, t);
        let reference = delta_ref(&gd, &x, t);
        let case = format!("{nk}/{nv} heads x {d}, {t} rows: prefill 4 then single steps (o, S)");
        let run = |be: &CudaBackend| gdn_pieces(be, &gd, &x, &[(0, 4)], t);
        triple3(c, &case, tol_f32(d * t), &reference, run, false)?;
        if d == 128 {
            // the dk 128 kernel (state column in registers) against the generic one
            let fast = run(&backend(c, Variant::Exact, false))?;
            let o = CudaOptions {
                gdn_generic: true,
                ..base_opts(false)
            };
            let generic = run(&CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, o))?;
            same_bits(
                c,
                format!("{case}: the dk 128 kernel bitwise = gdn_recur"),
                &fast,
                &generic,
            );
            delta_rule_k128_lanes(c, &gd)?;
            delta_rule_gated(c, &gd)?;
        }
    }
    Ok(())
}

/// The chunked delta rule (`gdn_chunk`, for lanes of at least `gdn_chunk_min` rows) against
/// FP64: a 20-row prompt on the recurrence (under the threshold, so the chunks start from a
/// state that is not zeros), a 150-row continuation in chunks of 64, 64 and 22, then two single
/// steps (outputs, then the final state). Its bits must differ from the recurrence's (else the
/// chunked kernel did not run); its plant is checked on its own. Joined lanes that mix it with
/// the recurrence are `gdn_prefill_lanes`' case.
pub(super) fn delta_chunked(c: &mut Ctx) -> Result<()> {
    let gd = gdn_dims(4, 8, 128);
    let (nv, p0, p1, steps) = (gd.v_heads, 20, 150, 2);
    let t = p0 + p1 + steps;
    let x = GdnIn::random(c, &gd, t);
    let reference = delta_ref(&gd, &x, t);
    let opts = |min: usize| CudaOptions {
        gdn_chunk_min: min,
        ..base_opts(false)
    };
    let run = |be: &CudaBackend| gdn_pieces(be, &gd, &x, &[(0, p0), (p0, p0 + p1)], t);
    let case = format!(
        "4/8 heads x 128: {p0} rows (recurrence), {p1} rows chunked (64, 64, 22), {steps} steps (o, S)"
    );
    let make = |c: &Ctx, v| CudaBackend::with_gpu(c.shared.clone(), v, opts(64));
    let chunked = triple_with(c, &case, tol_f32(gd.k_dim * t), &reference, true, make, run)?;
    let recur = run(&backend(c, Variant::Exact, false))?;
    let differ = chunked
        .iter()
        .zip(&recur)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    // gdn_chunk's own plant (a chunk's state decay dropped), apart from gdn_prep's (q_scale,
    // on which no state depends): the state after 150 rows chunked from zeros
    let s_len = nv * gd.k_dim * gd.v_dim;
    let s_ref = delta_ref(&gd, &x, p1);
    let s_ref = &s_ref[s_ref.len() - s_len..];
    let planted = gdn_pieces(
        &CudaBackend::with_gpu(c.shared.clone(), Variant::Planted, opts(64)),
        &gd,
        &x,
        &[(0, p1)],
        p1,
    )?;
    c.control(
        &format!("{p1} rows chunked from zeros, the state: gdn_chunk's own plant"),
        rel_l2(&planted[planted.len() - s_len..], s_ref),
        tol_f32(gd.k_dim * p1),
    );
    c.push(
        format!("{case}: the chunked kernel ran (bits unlike the recurrence's)"),
        Kind::Check,
        differ > 0 && chunked.len() == recur.len(),
        format!("{differ} of {} values differ in bits", chunked.len()),
    );
    Ok(())
}

/// `gdn_step_k128_gated` (a decode row's gdn_prep, gdn_recur_k128 and rmsnorm_silu_groups in
/// one launch) bitwise the three kernels, over a 5-row prompt then two steps of three lanes
/// (outputs and states), one launch a step; its BF16 twin and planted build against the exact
/// result (the three kernels are each checked against FP64 in their own cases).
fn delta_rule_gated(c: &mut Ctx, gd: &GdnDims) -> Result<()> {
    let (ch, nv, dv, t, lanes) = (gd.channels(), gd.v_heads, gd.v_dim, 5, 3);
    let u = c.rng.normals_f32((t + 2 * lanes) * ch, 1.0);
    let b = c.rng.normals_f32((t + 2 * lanes) * nv, 1.0);
    let a = c.rng.normals_f32((t + 2 * lanes) * nv, 1.0);
    let z = c.rng.normals_f32(2 * lanes * nv * dv, 1.0);
    let w = c.rng.normals_f32(dv, 0.5);
    let (a_log, dt) = (c.rng.normals_f32(nv, 0.5), c.rng.normals_f32(nv, 0.5));
    let run = |fused: bool, var: Variant| -> Result<(Vec<f32>, Vec<u64>)> {
        let o = CudaOptions {
            gdn_fused: fused,
            ..base_opts(false)
        };
        let be = CudaBackend::with_gpu(c.shared.clone(), var, o);
        let (al, dtv, wd) = (
            be.vector_f32(&a_log)?,
            be.vector_f32(&dt)?,
            be.vector_f32(&w)?,
        );
        let mut sts = (0..lanes)
            .map(|_| be.gdn_new(gd))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        // lane 0 starts from a prompt's state, the others from zero
        be.gdn_prefill(
            &be.upload(&u[..t * ch], t, ch)?,
            &be.upload(&b[..t * nv], t, nv)?,
            &be.upload(&a[..t * nv], t, nv)?,
            &al,
            &dtv,
            gd,
            &mut sts[0],
            true,
        )?;
        let (mut out, mut launches) = (Vec::new(), Vec::new());
        for s in 0..2 {
            let r0 = t + s * lanes;
            let (ud, bd, ad, zd) = (
                be.upload(&u[r0 * ch..(r0 + lanes) * ch], lanes, ch)?,
                be.upload(&b[r0 * nv..(r0 + lanes) * nv], lanes, nv)?,
                be.upload(&a[r0 * nv..(r0 + lanes) * nv], lanes, nv)?,
                be.upload(
                    &z[s * lanes * nv * dv..(s + 1) * lanes * nv * dv],
                    lanes,
                    nv * dv,
                )?,
            );
            let before = be.launch_count();
            let mut refs: Vec<&mut _> = sts.iter_mut().collect();
            let o = be.gdn_step_gated(&ud, &bd, &ad, &al, &dtv, gd, &mut refs, &zd, &wd, 1e-6)?;
            launches.push(be.launch_count() - before);
            out.extend(be.download(&o)?);
        }
        for st in &sts {
            out.extend(be.gdn_download(st)?.1);
        }
        Ok((out, launches))
    };
    let (fused, launches) = run(true, Variant::Exact)?;
    let (three, _) = run(false, Variant::Exact)?;
    let (lowp, _) = run(true, Variant::LowPrecision)?;
    let (planted, _) = run(true, Variant::Planted)?;
    let case = format!(
        "{}/{nv} heads x {dv}, two 3-lane steps after a {t}-row prompt (o, S)",
        gd.k_heads
    );
    same_bits(
        c,
        format!("{case}: the fused step bitwise = gdn_prep, gdn_recur_k128, rmsnorm_silu_groups"),
        &fused,
        &three,
    );
    c.push(
        format!("{case}: one launch a step"),
        Kind::Check,
        launches.iter().all(|&n| n == 1),
        format!("{launches:?} launches"),
    );
    let exact: Vec<f64> = fused.iter().map(|&x| f64::from(x)).collect();
    let tol = tol_f32(gd.k_dim * t);
    c.discriminate(&case, rel_l2(&lowp, &exact), tol);
    c.control(&case, rel_l2(&planted, &exact), tol);
    Ok(())
}

/// Several lanes' prompt rows through the GDN conv and recurrence in one call
/// (`gdn_prefill_lanes`, rows at their own offsets and counts): outputs, conv histories and
/// states bit for bit each lane's own `gdn_conv` then `gdn_prefill`, from states a first
/// prompt left (never zeros). Four ragged lanes (one of a single row, whose solo conv takes
/// `gdn_conv_one`) and 34 lanes (two launches of at most 32), on the generic kernel (16-dim
/// heads) and the dk 128 one. The arithmetic is the per-lane kernels' (FP64 in `conv_rows` and
/// `delta_rule`).
pub(super) fn gdn_prefill_lanes(c: &mut Ctx) -> Result<()> {
    for (nk, nv, d) in [(2usize, 4usize, 16usize), (4, 8, 128)] {
        let gd = gdn_dims(nk, nv, d);
        let (ch, k) = (gd.channels(), gd.conv_kernel);
        let many: Vec<usize> = (0..34).map(|i| 1 + (i * 7) % 6).collect();
        for lens in [vec![1usize, 17, 40, 3], many] {
            let warm = 3;
            let total: usize = lens.iter().sum();
            let lanes = lens.len();
            let w = c.rng.normals_f32(ch * k, 0.5);
            let (a_log, dt) = (c.rng.normals_f32(nv, 0.5), c.rng.normals_f32(nv, 0.5));
            let pre: Vec<Vec<f32>> = (0..3)
                .map(|i| {
                    let cols = if i == 0 { ch } else { nv };
                    c.rng.normals_f32(lanes * warm * cols, 1.0)
                })
                .collect();
            let x = c.rng.normals_f32(total * ch, 1.0);
            let b = c.rng.normals_f32(total * nv, 1.0);
            let a = c.rng.normals_f32(total * nv, 1.0);
            // (outputs, histories, states; launches of the GDN calls themselves)
            let run = |joined: bool, chunk_min: usize| -> Result<(Vec<f32>, u64)> {
                let o = CudaOptions {
                    gdn_chunk_min: chunk_min,
                    ..base_opts(false)
                };
                let be = CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, o);
                let wv = be.vector_f32(&w)?;
                let (al, dtv) = (be.vector_f32(&a_log)?, be.vector_f32(&dt)?);
                let mut sts = (0..lanes)
                    .map(|_| be.gdn_new(&gd))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                // a first prompt of `warm` rows per lane: histories and states not zero
                for (i, st) in sts.iter_mut().enumerate() {
                    let xr = be.upload(&pre[0][i * warm * ch..(i + 1) * warm * ch], warm, ch)?;
                    let br = be.upload(&pre[1][i * warm * nv..(i + 1) * warm * nv], warm, nv)?;
                    let ar = be.upload(&pre[2][i * warm * nv..(i + 1) * warm * nv], warm, nv)?;
                    let u = be.gdn_conv(&xr, &wv, &gd, st)?;
                    be.gdn_prefill(&u, &br, &ar, &al, &dtv, &gd, st, true)?;
                }
                let mut out = Vec::new();
                let before = be.launch_count();
                if joined {
                    let (xd, bd, ad) = (
                        be.upload(&x, total, ch)?,
                        be.upload(&b, total, nv)?,
                        be.upload(&a, total, nv)?,
                    );
                    let mut refs: Vec<&mut _> = sts.iter_mut().collect();
                    let o =
                        be.gdn_prefill_lanes(&xd, &bd, &ad, &wv, &al, &dtv, &gd, &lens, &mut refs)?;
                    out.extend(be.download(&o)?);
                } else {
                    let mut off = 0;
                    for (&n, st) in lens.iter().zip(sts.iter_mut()) {
                        let xr = be.upload(&x[off * ch..(off + n) * ch], n, ch)?;
                        let br = be.upload(&b[off * nv..(off + n) * nv], n, nv)?;
                        let ar = be.upload(&a[off * nv..(off + n) * nv], n, nv)?;
                        let u = be.gdn_conv(&xr, &wv, &gd, st)?;
                        out.extend(
                            be.download(&be.gdn_prefill(&u, &br, &ar, &al, &dtv, &gd, st, true)?)?,
                        );
                        off += n;
                    }
                }
                let launches = be.launch_count() - before;
                for st in &sts {
                    let (hist, s) = be.gdn_download(st)?;
                    out.extend(hist);
                    out.extend(s);
                }
                Ok((out, launches))
            };
            let ((joined, joined_l), (solo, solo_l)) =
                (run(true, usize::MAX)?, run(false, usize::MAX)?);
            let shown: Vec<usize> = lens.iter().take(6).copied().collect();
            same_bits(
                c,
                format!(
                    "{nk}/{nv} heads x {d}, {lanes} lanes of {shown:?}.. rows after 3: one call bitwise = each lane's conv then prefill (o, history, S)"
                ),
                &joined,
                &solo,
            );
            if d == 128 && lens.iter().any(|&n| n >= 16) {
                // lanes of 16 rows or more on gdn_chunk, the others on the recurrence, in one
                // call: still each lane's own bits
                let (jc, sc) = (run(true, 16)?.0, run(false, 16)?.0);
                same_bits(
                    c,
                    format!(
                        "{nk}/{nv} heads x {d}, {lanes} lanes of {shown:?}.., lanes from 16 rows chunked: one call bitwise = each lane's own"
                    ),
                    &jc,
                    &sc,
                );
            }
            // the joined path ran: its kernels launch once a 32-lane chunk, not once a lane,
            // so at most half the lane-by-lane launches (the exact count is not asserted)
            c.push(
                format!(
                    "{nk}/{nv} heads x {d}, {lanes} lanes: the joined path ran (at most half the lane-by-lane launches)"
                ),
                Kind::Check,
                joined_l * 2 <= solo_l,
                format!("{joined_l} launches joined, {solo_l} lane by lane"),
            );
        }
    }
    Ok(())
}

/// The dk 128 kernel (one warp a block, the next row prefetched) bit for bit the generic one
/// over a 33-row prompt (the row buffers alternate an odd number of times), then one step of
/// three lanes at once (lanes on grid.y).
fn delta_rule_k128_lanes(c: &mut Ctx, gd: &GdnDims) -> Result<()> {
    let (ch, nv, t, lanes) = (gd.channels(), gd.v_heads, 33, 3);
    let u = c.rng.normals_f32((t + lanes) * ch, 1.0);
    let b = c.rng.normals_f32((t + lanes) * nv, 1.0);
    let a = c.rng.normals_f32((t + lanes) * nv, 1.0);
    let (a_log, dt) = (c.rng.normals_f32(nv, 0.5), c.rng.normals_f32(nv, 0.5));
    let run = |be: &CudaBackend| -> Result<Vec<f32>> {
        let (al, dtv) = (be.vector_f32(&a_log)?, be.vector_f32(&dt)?);
        let mut sts = (0..lanes)
            .map(|_| be.gdn_new(gd))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let o = be.gdn_prefill(
            &be.upload(&u[..t * ch], t, ch)?,
            &be.upload(&b[..t * nv], t, nv)?,
            &be.upload(&a[..t * nv], t, nv)?,
            &al,
            &dtv,
            gd,
            &mut sts[0],
            true,
        )?;
        let mut out = be.download(&o)?;
        let mut refs: Vec<&mut _> = sts.iter_mut().collect();
        let o = be.gdn_step(
            &be.upload(&u[t * ch..], lanes, ch)?,
            &be.upload(&b[t * nv..], lanes, nv)?,
            &be.upload(&a[t * nv..], lanes, nv)?,
            &al,
            &dtv,
            gd,
            &mut refs,
        )?;
        out.extend(be.download(&o)?);
        for st in &sts {
            out.extend(be.gdn_download(st)?.1);
        }
        Ok(out)
    };
    let fast = run(&backend(c, Variant::Exact, false))?;
    let o = CudaOptions {
        gdn_generic: true,
        ..base_opts(false)
    };
    let generic = run(&CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, o))?;
    let finite = fast.iter().all(|v| v.is_finite());
    c.push(
        format!("{t}-row prompt then a 3-lane step: the dk 128 kernel's outputs are finite"),
        Kind::Check,
        finite,
        (if finite { "finite" } else { "NON-FINITE" }).to_string(),
    );
    same_bits(
        c,
        format!("{t}-row prompt then a 3-lane step: the dk 128 kernel bitwise = gdn_recur"),
        &fast,
        &generic,
    );
    Ok(())
}

pub(super) fn router_keep(c: &mut Ctx) -> Result<()> {
    let (rows, e, k) = (5, 64, 8);
    let mut logits: Vec<f32> = (0..rows * e)
        .map(|_| (c.rng.below(33) as f32 - 16.0) * 0.25)
        .collect();
    let mut keep = vec![true; e];
    for (i, kp) in keep.iter_mut().enumerate() {
        *kp = i % 5 != 2;
    }
    for r in 0..rows {
        logits[r * e + 7] = 9.0; // the strongest expert is dropped
        logits[r * e + 4] = 5.0; // a tie between 4 and 40 at the top of the kept ones
        logits[r * e + 40] = 5.0;
    }
    keep[7] = false;
    let (mut rid, mut rw) = (Vec::new(), Vec::new());
    for row in logits.chunks(e) {
        let m = row
            .iter()
            .zip(&keep)
            .filter(|(_, &kp)| kp)
            .map(|(&v, _)| f64::from(v))
            .fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = row
            .iter()
            .zip(&keep)
            .map(|(&v, &kp)| if kp { (f64::from(v) - m).exp() } else { 0.0 })
            .collect();
        let mut order: Vec<usize> = (0..e).filter(|&i| keep[i]).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
        order.truncate(k);
        let tot: f64 = order.iter().map(|&i| p[i]).sum();
        rid.extend(order.iter().map(|&i| i as u32));
        rw.extend(order.iter().map(|&i| p[i] / tot));
    }
    triple3(
        c,
        "5 rows, E 64, top-8, keep mask, tie at the top",
        tol_f32(e),
        &rw,
        |be| {
            let r = be.route(&be.upload(&logits, rows, e)?, k, Some(&keep))?;
            let h = be.route_host(&r)?;
            let ids: Vec<u32> = h.experts.concat();
            let mut w: Vec<f32> = h.weights.concat();
            if ids != rid {
                w.iter_mut().for_each(|x| *x = f32::NAN);
            }
            Ok(w)
        },
        false,
    )?;
    Ok(())
}

/// Host FP8 matrix: bytes, scales, and its f64 dequantised form.
struct Fp8Mat {
    q: Vec<u8>,
    s: Vec<f32>,
    rows: usize,
    cols: usize,
}

impl Fp8Mat {
    fn new(c: &mut Ctx, rows: usize, cols: usize) -> Self {
        let q = c.rng.fp8_bytes(rows * cols);
        let s = (0..rows.div_ceil(128) * cols.div_ceil(128))
            .map(|_| (c.rng.range(0.5, 2.0) * 1e-2) as f32)
            .collect();
        Fp8Mat { q, s, rows, cols }
    }
    fn at(&self, r: usize, col: usize) -> f64 {
        fp8_e4m3(self.q[r * self.cols + col])
            * f64::from(self.s[(r / 128) * self.cols.div_ceil(128) + col / 128])
    }
    fn apply(&self, x: &[f64]) -> Vec<f64> {
        (0..self.rows)
            .map(|r| (0..self.cols).map(|col| self.at(r, col) * x[col]).sum())
            .collect()
    }
    /// The f64 matrix (row-major), through `lut` (fp8_e4m3 of each byte).
    fn dequant(&self, lut: &[f64]) -> Vec<f64> {
        let sc = self.cols.div_ceil(128);
        (0..self.rows * self.cols)
            .map(|n| {
                let (r, col) = (n / self.cols, n % self.cols);
                lut[self.q[n] as usize] * f64::from(self.s[(r / 128) * sc + col / 128])
            })
            .collect()
    }
    /// `w x` for a dequantised row-major `w` of `cols` columns.
    fn apply_dense(w: &[f64], cols: usize, x: &[f64]) -> Vec<f64> {
        w.chunks(cols)
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }
    fn upload(&self, be: &CudaBackend) -> Result<crate::backend::CudaWeight> {
        Ok(be.weight_fp8(self.rows, self.cols, &self.q, &self.s)?)
    }
}

/// `e` routed FP8 experts of fresh random weights: gate and up `[i, h]`, down `[h, i]`.
fn fp8_experts(c: &mut Ctx, e: usize, i: usize, h: usize) -> Vec<[Fp8Mat; 3]> {
    (0..e)
        .map(|_| {
            [
                Fp8Mat::new(c, i, h),
                Fp8Mat::new(c, i, h),
                Fp8Mat::new(c, h, i),
            ]
        })
        .collect()
}

/// The experts on `be`'s device, `pruned` (if any) as a missing expert.
fn upload_experts(
    be: &CudaBackend,
    mats: &[[Fp8Mat; 3]],
    pruned: Option<usize>,
) -> Result<Vec<Option<Expert<crate::backend::CudaWeight>>>> {
    mats.iter()
        .enumerate()
        .map(|(j, m)| {
            if Some(j) == pruned {
                return Ok(None);
            }
            Ok(Some(Expert {
                gate: m[0].upload(be)?,
                up: m[1].upload(be)?,
                down: m[2].upload(be)?,
            }))
        })
        .collect()
}

/// FP64 routed experts: row r sums `w · down(silu(gate x) ⊙ up x)` over its routing. Each
/// routed expert is dequantised once (a 256-entry table) and applied to all its slots, so the
/// Drama 3 cases (256 experts of 3 MiB, hundreds of slots) take seconds, not minutes.
fn experts_reference(mats: &[[Fp8Mat; 3]], x: &[f32], h: usize, route: &model::Route) -> Vec<f64> {
    let lut: Vec<f64> = (0..=255u8).map(fp8_e4m3).collect();
    let mut slots: Vec<Vec<(usize, f64)>> = vec![Vec::new(); mats.len()];
    for (r, (ids, wts)) in route.experts.iter().zip(&route.weights).enumerate() {
        for (&id, &wt) in ids.iter().zip(wts) {
            slots[id as usize].push((r, f64::from(wt)));
        }
    }
    let mut y = vec![0.0; route.experts.len() * h];
    for (m, list) in mats.iter().zip(&slots) {
        if list.is_empty() {
            continue;
        }
        let (gate, up, down) = (m[0].dequant(&lut), m[1].dequant(&lut), m[2].dequant(&lut));
        for &(r, wt) in list {
            let xr = f64s(&x[r * h..(r + 1) * h]);
            let g = Fp8Mat::apply_dense(&gate, m[0].cols, &xr);
            let u = Fp8Mat::apply_dense(&up, m[1].cols, &xr);
            let hv: Vec<f64> = g.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect();
            let d = Fp8Mat::apply_dense(&down, m[2].cols, &hv);
            for (yy, dd) in y[r * h..(r + 1) * h].iter_mut().zip(d) {
                *yy += wt * dd;
            }
        }
    }
    y
}

pub(super) fn experts_rows(c: &mut Ctx) -> Result<()> {
    let (e, i, h, rows, k) = (12, 256, 512, 5, 4);
    let mats = fp8_experts(c, e, i, h);
    let x = c.rng.normals_f32(rows * h, 1.0);
    let logits = c.rng.normals_f32(rows * e, 1.0);
    // the routing comes from the device router (checked on its own); the reference uses it
    let be0 = backend(c, Variant::Exact, false);
    let route = be0.route_host(&be0.route(&be0.upload(&logits, rows, e)?, k, None)?)?;
    let reference = experts_reference(&mats, &x, h, &route);
    let run_rows = |be: &CudaBackend, r0: usize, n: usize| -> Result<Vec<f32>> {
        let experts = upload_experts(be, &mats, None)?;
        let rt = be.route(&be.upload(&logits[r0 * e..(r0 + n) * e], n, e)?, k, None)?;
        let xd = be.upload(&x[r0 * h..(r0 + n) * h], n, h)?;
        Ok(be.download(&be.moe_experts(&xd, &rt, &experts, Rows::Exact)?)?)
    };
    triple3(
        c,
        "5 rows, top-4 of 12 experts, I 256, H 512",
        tol_f32(h * k),
        &reference,
        |be| run_rows(be, 0, rows),
        false,
    )?;
    let batch = run_rows(&be0, 0, rows)?;
    let mut same = true;
    for r in 0..rows {
        same &= bits_equal(&run_rows(&be0, r, 1)?, &batch[r * h..(r + 1) * h]);
    }
    c.push(
        "5 rows: each row bitwise = its 1-row launch",
        Kind::Check,
        same,
        format!("batch invariance {}", if same { "holds" } else { "BROKEN" }),
    );
    Ok(())
}

/// The per-row FP8 experts' down projection with a row's k experts in k warps of one block
/// (`moe_down_tab4_split`) and their gate/up with two key steps unrolled (`moe_gate_up_tab4u2`):
/// against FP64 with low-precision and planted twins, bitwise equal to `moe_gate_up_tab4` +
/// `moe_down_tab4` (one warp walking the k experts), and the split shown to have run (its planted build
/// also sums the experts in reverse rank order, so its planted bits differ from
/// `moe_down_tab4`'s). The Drama 3 layer (256 experts, top-8, I 512, H 2048) at 32 rows, a
/// small table at 5 rows, and k = 10 (blocks of 320 threads) over 7 rows.
pub(super) fn experts_rows_split4(c: &mut Ctx) -> Result<()> {
    for (e, i, h, rows, k) in [
        (256, 512, 2048, 32, 8),
        (12, 256, 512, 5, 4),
        (20, 256, 384, 7, 10),
    ] {
        let mats = fp8_experts(c, e, i, h);
        let x = c.rng.normals_f32(rows * h, 1.0);
        let logits = c.rng.normals_f32(rows * e, 1.0);
        let be0 = backend(c, Variant::Exact, true);
        let rt = be0.route(&be0.upload(&logits, rows, e)?, k, None)?;
        let route = be0.route_host(&rt)?;
        let reference = experts_reference(&mats, &x, h, &route);
        let make = |c: &Ctx, v: Variant, split: bool| {
            let o = CudaOptions {
                moe_down_split4: split,
                moe_gate_up_u2: split,
                ..base_opts(true)
            };
            CudaBackend::with_gpu(c.shared.clone(), v, o)
        };
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let experts = upload_experts(be, &mats, None)?;
            let xd = be.upload(&x, rows, h)?;
            Ok(be.download(&be.moe_experts(&xd, &rt, &experts, Rows::Exact)?)?)
        };
        let case = format!("{rows} rows, top-{k} of {e} experts, I {i}, H {h}, down split");
        let case = case.as_str();
        let got: Vec<Vec<f32>> = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
            .iter()
            .map(|&v| run(&make(c, v, true)))
            .collect::<Result<_>>()?;
        let tol = tol_f32(h * k);
        c.check(case, rel_l2(&got[0], &reference), tol);
        c.discriminate(case, rel_l2(&got[1], &reference), tol);
        c.control(case, rel_l2(&got[2], &reference), tol);
        let walked = run(&make(c, Variant::Exact, false))?;
        same_bits(
            c,
            format!("{case}: bitwise = moe_gate_up_tab4 + moe_down_tab4"),
            &got[0],
            &walked,
        );
        let walked_planted = run(&make(c, Variant::Planted, false))?;
        ran_check(
            c,
            format!("{case}: the split kernel ran"),
            &got[2],
            &walked_planted,
        );
    }
    Ok(())
}

pub(super) fn gemv_fp8(c: &mut Ctx) -> Result<()> {
    let (n, kk, rows) = (300, 512, 3);
    let m = Fp8Mat::new(c, n, kk);
    let x = c.rng.normals_f32(rows * kk, 1.0);
    let mut reference = Vec::new();
    for r in 0..rows {
        reference.extend(m.apply(&f64s(&x[r * kk..(r + 1) * kk])));
    }
    triple3(
        c,
        "3 rows, W 300 x 512 fp8, block scales",
        tol_f32(kk),
        &reference,
        |be| {
            let w = m.upload(be)?;
            Ok(be.download(&be.linear(&be.upload(&x, rows, kk)?, &w, Rows::Exact)?)?)
        },
        false,
    )?;
    Ok(())
}

/// Router policy with non-finite logits and a keep mask (model::Backend::route): NaN as -inf,
/// +inf experts sharing the mass, -inf experts chosen last with weight 0, pruned experts never
/// chosen even when +inf, ties to the lower index, ranking by logit where probabilities
/// underflow; then a row with no finite kept logit must come back as NonFinite, and the
/// backend must keep working after reporting it.
pub(super) fn router_nonfinite(c: &mut Ctx) -> Result<()> {
    let (e, k) = (64, 8);
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let keep: Vec<bool> = (0..e).map(|i| i % 7 != 3).collect();
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let base = |c: &mut Ctx| -> Vec<f32> {
        (0..e)
            .map(|_| (c.rng.below(33) as f32 - 16.0) * 0.25)
            .collect()
    };
    // NaNs (one on the strongest kept expert) and a tie at the top
    let mut r = base(c);
    for i in [0, 5, 20, 41] {
        r[i] = nan;
    }
    r[6] = 6.0;
    r[30] = 6.0;
    rows.push(r);
    // +inf on kept experts 9 and 40 and on pruned expert 3: 9 and 40 share the mass
    let mut r = base(c);
    r[3] = inf;
    r[9] = inf;
    r[40] = inf;
    r[12] = nan;
    rows.push(r);
    // only 5 finite kept logits: the top 8 ends with -inf experts in index order, weight 0
    let mut r: Vec<f32> = (0..e)
        .map(|i| if i % 2 == 0 { -f32::INFINITY } else { nan })
        .collect();
    for (i, v) in [(1, 0.5), (2, 1.5), (8, 1.0), (13, 1.5), (60, -2.0)] {
        r[i] = v;
    }
    rows.push(r);
    // probabilities underflow to 0 in f32: the rank still follows the logit
    let mut r: Vec<f32> = (0..e).map(|i| -150.0 - (i % 13) as f32 * 3.0).collect();
    r[50] = 0.0;
    r[11] = -0.5;
    rows.push(r);
    // every logit equal: the k lowest kept indices
    rows.push(vec![1.25; e]);
    let n = rows.len();
    let logits: Vec<f32> = rows.concat();
    let (mut rid, mut rw) = (Vec::new(), Vec::new());
    for row in &rows {
        let (ids, w) =
            crate::reference::router_policy(row, k, Some(&keep)).expect("a finite kept logit");
        rid.extend(ids);
        rw.extend(w);
    }
    triple3(
        c,
        "5 rows, E 64, top-8, keep, NaN/+-inf/ties/underflow",
        tol_f32(e),
        &rw,
        |be| {
            let r = be.route(&be.upload(&logits, n, e)?, k, Some(&keep))?;
            let h = be.route_host(&r)?;
            let ids: Vec<u32> = h.experts.concat();
            let mut w: Vec<f32> = h.weights.concat();
            if ids != rid {
                w.iter_mut().for_each(|x| *x = f32::NAN);
            }
            Ok(w)
        },
        false,
    )?;
    // a row with every kept logit NaN/-inf (its only finite logit is on a pruned expert)
    let be = backend(c, Variant::Exact, false);
    let mut dead: Vec<f32> = (0..e)
        .map(|i| if i % 2 == 0 { nan } else { -f32::INFINITY })
        .collect();
    dead[3] = 2.0;
    let two: Vec<f32> = [rows[0].clone(), dead].concat();
    let got = be
        .route(&be.upload(&two, 2, e)?, k, Some(&keep))
        .and_then(|r| be.route_host(&r));
    let reported = matches!(got, Err(model::BackendError::NonFinite { .. }));
    // the flag is cleared once reported: the next routing of finite rows succeeds
    let after = be
        .route(&be.upload(&logits, n, e)?, k, Some(&keep))
        .and_then(|r| be.route_host(&r))
        .map(|h| h.experts.concat() == rid)
        .unwrap_or(false);
    c.push(
        "all kept logits NaN/-inf -> NonFinite, then recovers",
        Kind::Check,
        reported && after,
        format!(
            "{} ; next routing {}",
            match &got {
                Err(e) => format!("error: {e}"),
                Ok(h) => format!("no error (ids {:?})", h.experts.get(1)),
            },
            if after { "matches" } else { "WRONG" }
        ),
    );
    Ok(())
}

/// Host NVFP4 matrix: packed codes, E4M3 scales, global, and its f64 dequantised form.
struct Nvfp4Mat {
    codes: Vec<u8>,
    scales: Vec<u8>,
    global: f32,
    rows: usize,
    cols: usize,
}

impl Nvfp4Mat {
    fn new(c: &mut Ctx, rows: usize, cols: usize) -> Self {
        Nvfp4Mat {
            codes: c.rng.bytes(rows * cols / 2),
            scales: c.rng.e4m3_scales(rows * cols / 16),
            global: (c.rng.range(0.5, 2.0) * 1e-2) as f32,
            rows,
            cols,
        }
    }
    fn apply(&self, x: &[f64]) -> Vec<f64> {
        (0..self.rows)
            .map(|r| {
                (0..self.cols)
                    .map(|col| {
                        crate::reference::nvfp4_weight(
                            &self.codes,
                            &self.scales,
                            self.global,
                            self.cols,
                            r,
                            col,
                        ) * x[col]
                    })
                    .sum()
            })
            .collect()
    }
    fn upload(&self, be: &CudaBackend) -> Result<crate::backend::CudaWeight> {
        Ok(be.weight_nvfp4(self.rows, self.cols, &self.codes, &self.scales, self.global)?)
    }
}

/// Routed NVFP4 experts over a pruned layer (pointer table with null entries, keep mask in the
/// router): gate/up rows of 512 columns (16-byte code loads), down rows of 272 (the 8-byte path).
pub(super) fn experts_rows_nvfp4(c: &mut Ctx) -> Result<()> {
    let (e, i, h, rows, k) = (12, 272, 512, 5, 4);
    let keep: Vec<bool> = (0..e).map(|x| x % 4 != 1).collect();
    let mats: Vec<Option<[Nvfp4Mat; 3]>> = (0..e)
        .map(|x| {
            keep[x].then(|| {
                [
                    Nvfp4Mat::new(c, i, h),
                    Nvfp4Mat::new(c, i, h),
                    Nvfp4Mat::new(c, h, i),
                ]
            })
        })
        .collect();
    let x = c.rng.normals_f32(rows * h, 1.0);
    let logits = c.rng.normals_f32(rows * e, 1.0);
    let be0 = backend(c, Variant::Exact, false);
    let route = be0.route_host(&be0.route(&be0.upload(&logits, rows, e)?, k, Some(&keep))?)?;
    let mut reference = Vec::new();
    for r in 0..rows {
        let xr = f64s(&x[r * h..(r + 1) * h]);
        let mut y = vec![0.0; h];
        for (&id, &wt) in route.experts[r].iter().zip(&route.weights[r]) {
            let Some(m) = &mats[id as usize] else {
                return Err(crate::error::CudaError::Shape {
                    kernel: "moe_router",
                    what: format!("routed to pruned expert {id}"),
                });
            };
            let g = m[0].apply(&xr);
            let u = m[1].apply(&xr);
            let hv: Vec<f64> = g.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect();
            for (yy, d) in y.iter_mut().zip(m[2].apply(&hv)) {
                *yy += f64::from(wt) * d;
            }
        }
        reference.extend(y);
    }
    let run_rows = |be: &CudaBackend, r0: usize, n: usize| -> Result<Vec<f32>> {
        let experts = mats
            .iter()
            .map(|m| {
                m.as_ref()
                    .map(|m| {
                        Ok(Expert {
                            gate: m[0].upload(be)?,
                            up: m[1].upload(be)?,
                            down: m[2].upload(be)?,
                        })
                    })
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let rt = be.route(
            &be.upload(&logits[r0 * e..(r0 + n) * e], n, e)?,
            k,
            Some(&keep),
        )?;
        let xd = be.upload(&x[r0 * h..(r0 + n) * h], n, h)?;
        Ok(be.download(&be.moe_experts(&xd, &rt, &experts, Rows::Exact)?)?)
    };
    triple3(
        c,
        "5 rows, top-4 of 12 (3 pruned), I 272, H 512",
        tol_f32(h * k),
        &reference,
        |be| run_rows(be, 0, rows),
        false,
    )?;
    let batch = run_rows(&be0, 0, rows)?;
    let mut same = true;
    for r in 0..rows {
        same &= bits_equal(&run_rows(&be0, r, 1)?, &batch[r * h..(r + 1) * h]);
    }
    c.push(
        "5 rows: each row bitwise = its 1-row launch",
        Kind::Check,
        same,
        format!("batch invariance {}", if same { "holds" } else { "BROKEN" }),
    );
    Ok(())
}

pub(super) fn gemv_nvfp4(c: &mut Ctx) -> Result<()> {
    for (n, kk) in [(300, 512), (300, 528)] {
        let rows = 3;
        let m = Nvfp4Mat::new(c, n, kk);
        let x = c.rng.normals_f32(rows * kk, 1.0);
        let mut reference = Vec::new();
        for r in 0..rows {
            reference.extend(m.apply(&f64s(&x[r * kk..(r + 1) * kk])));
        }
        triple3(
            c,
            &format!("3 rows, W {n} x {kk} nvfp4"),
            tol_f32(kk),
            &reference,
            |be| {
                let w = m.upload(be)?;
                Ok(be.download(&be.linear(&be.upload(&x, rows, kk)?, &w, Rows::Exact)?)?)
            },
            false,
        )?;
    }
    Ok(())
}

/// The cuBLASLt BF16 GEMM of `Rows::Bulk` linears (split activations, `lt.rs`): against FP64,
/// with row, output and depth tails, a row count past one 8192-row slice, and a check that
/// cuBLASLt ran (a backend without it would run the tiled GEMM and pass the numbers). The low-
/// precision build casts the activations to BF16 (lo dropped); the planted one flips lo's sign.
pub(super) fn gemm_lt(c: &mut Ctx) -> Result<()> {
    gemm_tiles(
        c,
        BulkGemm::Lt,
        &[(100, 2048, 1000), (70, 200, 130), (8200, 512, 64)],
    )
}

/// The tiled BF16 GEMM of `Rows::Bulk` linears: against FP64, with row, output and depth tails.
pub(super) fn gemm_tiled(c: &mut Ctx) -> Result<()> {
    gemm_tiles(c, BulkGemm::Fma, &[(100, 2048, 1000), (70, 200, 130)])?;
    c.limit(
        "4096 rows x 2048 into 8192",
        crate::kernels::plan_gemm(4096, 2048, 8192),
    );
    Ok(())
}

/// The same tiles on TF32 tensor cores (`gemm_bf16_tc`, K a multiple of 32): against FP64 with
/// row and output tails, and in other bits than the FMA tile (so the tensor-core kernel ran).
pub(super) fn gemm_tc(c: &mut Ctx) -> Result<()> {
    gemm_tiles(
        c,
        BulkGemm::Tc,
        &[(100, 2048, 1000), (70, 224, 130), (130, 4096, 64)],
    )?;
    c.limit(
        "4096 rows x 2048 into 8192",
        crate::kernels::plan_gemm_tc(4096, 2048, 8192),
    );
    Ok(())
}

/// Which GEMM a `Rows::Bulk` linear takes from 2 rows on.
#[derive(Clone, Copy, PartialEq)]
enum BulkGemm {
    Fma,
    Tc,
    Lt,
}

/// One dense bulk GEMM against FP64 on each shape, with its low-precision and planted twins,
/// and a check that the kernel under test ran (not a fallback with numbers just as good).
fn gemm_tiles(c: &mut Ctx, kind: BulkGemm, shapes: &[(usize, usize, usize)]) -> Result<()> {
    for &(rows, k, n) in shapes {
        let x = c.rng.normals_f32(rows * k, 1.0);
        let w = c.rng.normals_bf16(n * k, 0.05);
        let reference = gemv_ref(&w, &x, k, rows, n);
        let run = |be: &CudaBackend| -> Result<Vec<f32>> {
            let wd = be.weight_bf16(n, k, &w)?;
            Ok(be.download(&be.linear(&be.upload(&x, rows, k)?, &wd, Rows::Bulk)?)?)
        };
        let case = format!("{rows} rows x {k} into {n}");
        let bes = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
            .map(|v| bulk_backend(c, v, kind));
        let got: Vec<Vec<f32>> = bes.iter().map(run).collect::<Result<_>>()?;
        let tol = tol_f32(k);
        c.check(&case, rel_l2(&got[0], &reference), tol);
        c.discriminate(&case, rel_l2(&got[1], &reference), tol);
        c.control(&case, rel_l2(&got[2], &reference), tol);
        match kind {
            BulkGemm::Fma => {}
            BulkGemm::Tc => {
                let fma = run(&bulk_backend(c, Variant::Exact, BulkGemm::Fma))?;
                ran_check(
                    c,
                    format!("{case}: the tensor-core tile ran"),
                    &got[0],
                    &fma,
                );
            }
            BulkGemm::Lt => {
                // every build ran it (a build without it would fall back to the tiled GEMM,
                // whose own low-precision and planted variants would stand in for cuBLASLt's)
                let ran = bes
                    .iter()
                    .map(|b| b.lt_status())
                    .find(|r| r.is_err())
                    .unwrap_or(Ok(()));
                c.push(
                    format!("{case}: cuBLASLt ran"),
                    Kind::Check,
                    ran.is_ok(),
                    ran.err().unwrap_or_else(|| "cuBLASLt made and used".into()),
                );
            }
        }
    }
    Ok(())
}

/// The path under test ran: its result is not the bits of the path it would fall back to
/// (`fallback`), which on these random inputs it differs from only if it ran.
fn ran_check(c: &mut Ctx, label: String, tested: &[f32], fallback: &[f32]) {
    let differ = !bits_equal(tested, fallback);
    c.push(
        label,
        Kind::Check,
        differ,
        if differ {
            "bits differ from the fallback's".to_string()
        } else {
            "bits equal the fallback's: the path under test did not run".to_string()
        },
    );
}

/// The routed FP8 experts of many rows, grouped by expert: against FP64, with a pruned expert
/// that no row names, and the same bits on a second run (the grouping's atomics order rows
/// differently; each output is still one thread's fixed sum).
pub(super) fn experts_grouped(c: &mut Ctx) -> Result<()> {
    // a small table, and the Drama 3 layer (256 experts, top-8, I 512, H 2048) with mostly
    // part-filled tiles
    for (e, i, h, rows, k) in [(12, 256, 512, 150, 4), (256, 512, 2048, 64, 8)] {
        experts_grouped_case(c, e, i, h, rows, k, Grouped::Tiles { tc: false })?;
    }
    Ok(())
}

/// The grouped experts' tiles on TF32 tensor cores (`moe_group_{gate_up,down}_tc`): the same
/// cases, Drama 3's expert shape with full tiles (16 experts, about 100 slots each), and other
/// bits than the FMA tiles.
pub(super) fn experts_grouped_tc(c: &mut Ctx) -> Result<()> {
    for (e, i, h, rows, k) in [
        (12, 256, 512, 150, 4),
        (256, 512, 2048, 64, 8),
        (16, 512, 2048, 400, 4),
    ] {
        experts_grouped_case(c, e, i, h, rows, k, Grouped::Tiles { tc: true })?;
    }
    Ok(())
}

/// Which grouped path a case runs: the 64-row GEMM tiles (FMA or tensor cores) of
/// `Rows::Bulk`, or the slot groups with the per-row arithmetic (`moe_slots_*`).
#[derive(Clone, Copy, PartialEq)]
enum Grouped {
    Tiles { tc: bool },
    Slots,
}

/// A backend that takes `path` from 2 rows on.
fn grouped_backend(c: &Ctx, v: Variant, path: Grouped) -> CudaBackend {
    match path {
        Grouped::Tiles { tc } => gemm_backend_tc(c, v, tc),
        Grouped::Slots => CudaBackend::with_gpu(
            c.shared.clone(),
            v,
            CudaOptions {
                slots_min_rows: 2,
                ..base_opts(true)
            },
        ),
    }
}

/// The routed FP8 experts grouped by expert with the per-row kernels' arithmetic
/// (`moe_slots_*` + `moe_group_combine`): against FP64 with low-precision and planted twins,
/// and bitwise equal to the per-row kernels (`moe_*_tab4`) on the same rows; a small table
/// with many slots per expert (several slot groups each) and the Drama 3 layer at 32 rows.
pub(super) fn experts_slots(c: &mut Ctx) -> Result<()> {
    for (e, i, h, rows, k) in [(12, 256, 512, 40, 4), (256, 512, 2048, 32, 8)] {
        experts_grouped_case(c, e, i, h, rows, k, Grouped::Slots)?;
    }
    Ok(())
}

fn experts_grouped_case(
    c: &mut Ctx,
    e: usize,
    i: usize,
    h: usize,
    rows: usize,
    k: usize,
    path: Grouped,
) -> Result<()> {
    let mats = fp8_experts(c, e, i, h);
    let x = c.rng.normals_f32(rows * h, 1.0);
    let logits = c.rng.normals_f32(rows * e, 1.0);
    // expert 5 is pruned: the keep mask routes around it
    let keep: Vec<bool> = (0..e).map(|j| j != 5).collect();
    let be0 = gemm_backend(c, Variant::Exact);
    // one routing for every variant (the backends share the device), so that the planted and
    // low-precision runs differ in the expert kernels only, not in the router's builds
    let rt = be0.route(&be0.upload(&logits, rows, e)?, k, Some(&keep))?;
    let route = be0.route_host(&rt)?;
    let reference = experts_reference(&mats, &x, h, &route);
    let run = |be: &CudaBackend| -> Result<Vec<f32>> {
        let experts = upload_experts(be, &mats, Some(5))?;
        let xd = be.upload(&x, rows, h)?;
        let kind = match path {
            Grouped::Tiles { .. } => Rows::Bulk,
            Grouped::Slots => Rows::Exact,
        };
        Ok(be.download(&be.moe_experts(&xd, &rt, &experts, kind)?)?)
    };
    let case = format!("{rows} rows, top-{k} of {e} experts (one pruned), I {i}, H {h}");
    let case = case.as_str();
    let got: Vec<Vec<f32>> = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
        .iter()
        .map(|&v| run(&grouped_backend(c, v, path)))
        .collect::<Result<_>>()?;
    let tol = tol_f32(h * k);
    c.check(case, rel_l2(&got[0], &reference), tol);
    c.discriminate(case, rel_l2(&got[1], &reference), tol);
    c.control(case, rel_l2(&got[2], &reference), tol);
    match path {
        Grouped::Tiles { tc: true } => ran_check(
            c,
            format!("{case}: the tensor-core tile ran"),
            &got[0],
            &run(&be0)?,
        ),
        Grouped::Tiles { tc: false } => {}
        Grouped::Slots => {
            // the slot path ran: its planted build (the combine sums in reverse rank order) is
            // not the per-row kernels' planted build, whose exact bits it otherwise shares
            let rows_planted = run(&backend(c, Variant::Planted, true))?;
            ran_check(
                c,
                format!("{case}: the slot kernels ran"),
                &got[2],
                &rows_planted,
            );
            // the per-row kernels on the same rows (a backend without the slot path)
            let rows_path = run(&backend(c, Variant::Exact, true))?;
            same_bits(
                c,
                format!("{case}: bitwise = the per-row kernels"),
                &got[0],
                &rows_path,
            );
        }
    }
    let be0 = grouped_backend(c, Variant::Exact, path);
    let again = run(&be0)?;
    let same = bits_equal(&again, &got[0]);
    c.push(
        format!("{rows} rows, {e} experts: a second run gives the same bits"),
        Kind::Check,
        same,
        format!(
            "grouping {}",
            if same {
                "deterministic"
            } else {
                "NOT deterministic"
            }
        ),
    );
    Ok(())
}

/// A backend whose routed FP8 experts run on tensor cores (`moe_tc_*`), grouped by expert
/// from `group_rows` rows on (one slot a tile below).
fn tc_experts_backend(c: &Ctx, v: Variant, group_rows: usize) -> CudaBackend {
    let o = CudaOptions {
        moe_tc: true,
        moe_tc_group_rows: group_rows,
        ..base_opts(true)
    };
    CudaBackend::with_gpu(c.shared.clone(), v, o)
}

/// The routed FP8 experts on tensor cores (`moe_tc_gate_up`, `moe_tc_down_rows`, and grouped
/// `moe_tc_down` + `moe_group_combine`): against FP64 with low-precision and planted twins, one
/// slot a tile and grouped by expert bitwise equal, each row bitwise equal to its one-row
/// launch, other bits than the per-row FMA kernels (so it ran), and a pruned expert that no
/// row names. A small table with many slots per expert (several 8-slot tiles each), the
/// Drama 3 layer (256 experts, top-8, I 512, H 2048) at one row and at 32, and 16 experts of
/// Drama 3's shape with about 10 slots each, and a shape whose warps loop over key blocks.
pub(super) fn experts_tc(c: &mut Ctx) -> Result<()> {
    for (e, i, h, rows, k) in [
        (12, 256, 512, 40, 4),
        (256, 512, 2048, 1, 8),
        (256, 512, 2048, 32, 8),
        (16, 512, 2048, 40, 4),
        // 20 key blocks over 16 warps (gate/up warps loop) and 40 (slot, key block) pairs
        // over 32 warps in moe_tc_down_rows, against 5 warps in the grouped moe_tc_down
        (12, 640, 2560, 9, 8),
    ] {
        experts_tc_case(c, e, i, h, rows, k)?;
    }
    Ok(())
}

fn experts_tc_case(c: &mut Ctx, e: usize, i: usize, h: usize, rows: usize, k: usize) -> Result<()> {
    let mats = fp8_experts(c, e, i, h);
    let x = c.rng.normals_f32(rows * h, 1.0);
    let logits = c.rng.normals_f32(rows * e, 1.0);
    // expert 5 is pruned: the keep mask routes around it
    let keep: Vec<bool> = (0..e).map(|j| j != 5).collect();
    let be0 = tc_experts_backend(c, Variant::Exact, usize::MAX);
    let route_of = |be: &CudaBackend, r0: usize, n: usize| {
        be.route(
            &be.upload(&logits[r0 * e..(r0 + n) * e], n, e)?,
            k,
            Some(&keep),
        )
    };
    let route = be0.route_host(&route_of(&be0, 0, rows)?)?;
    let reference = experts_reference(&mats, &x, h, &route);
    let run_rows = |be: &CudaBackend, r0: usize, n: usize| -> Result<Vec<f32>> {
        let experts = upload_experts(be, &mats, Some(5))?;
        let rt = route_of(be, r0, n)?;
        let xd = be.upload(&x[r0 * h..(r0 + n) * h], n, h)?;
        Ok(be.download(&be.moe_experts(&xd, &rt, &experts, Rows::Exact)?)?)
    };
    let run = |be: &CudaBackend| run_rows(be, 0, rows);
    let case = format!("{rows} rows, top-{k} of {e} experts (one pruned), I {i}, H {h}");
    let case = case.as_str();
    let got: Vec<Vec<f32>> = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
        .iter()
        .map(|&v| run(&tc_experts_backend(c, v, usize::MAX)))
        .collect::<Result<_>>()?;
    let tol = tol_f32(h * k);
    c.check(case, rel_l2(&got[0], &reference), tol);
    c.discriminate(case, rel_l2(&got[1], &reference), tol);
    c.control(case, rel_l2(&got[2], &reference), tol);
    ran_check(
        c,
        format!("{case}: the tensor-core experts ran"),
        &got[0],
        &run(&backend(c, Variant::Exact, true))?,
    );
    let grouped = tc_experts_backend(c, Variant::Exact, 1);
    let g = run(&grouped)?;
    same_bits(
        c,
        format!("{case}: grouped by expert = one slot a tile"),
        &g,
        &got[0],
    );
    c.control(
        &format!("{case}, grouped"),
        rel_l2(
            &run(&tc_experts_backend(c, Variant::Planted, 1))?,
            &reference,
        ),
        tol,
    );
    let again = run(&grouped)?;
    same_bits(c, format!("{case}: grouped, a second run"), &again, &g);
    // the down projection one 16-output tile a block against four (the default), and gate/up
    // without the next key block's weights loaded ahead
    for (label, down4, prefetch) in [
        ("the down projection one tile a block = four", false, true),
        (
            "gate/up without the loads a key block ahead = with",
            true,
            false,
        ),
    ] {
        let o = CudaOptions {
            moe_tc: true,
            moe_tc_group_rows: 1,
            moe_tc_down4: down4,
            moe_tc_prefetch: prefetch,
            ..base_opts(true)
        };
        let other = run(&CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, o))?;
        same_bits(c, format!("{case}: grouped, {label}"), &other, &g);
    }
    // fewer warps a block only share the key blocks out differently: the same bits
    // (only counts whose blocks differ from the default's for this shape: others launch the same)
    let default_warps = base_opts(true).moe_tc_warps;
    let blocks = |w| crate::backend::tc_expert_blocks(w, i, h);
    for warps in [16, 2, 1]
        .into_iter()
        .filter(|&w| blocks(w) != blocks(default_warps))
    {
        let o = CudaOptions {
            moe_tc: true,
            moe_tc_group_rows: 1,
            moe_tc_warps: warps,
            ..base_opts(true)
        };
        let few = run(&CudaBackend::with_gpu(c.shared.clone(), Variant::Exact, o))?;
        same_bits(
            c,
            format!(
                "{case}: grouped, {warps} warps a block (gate/up: a thread a scale at least) = {default_warps}"
            ),
            &few,
            &g,
        );
    }
    // a routing (no keep mask) whose first row's strongest expert is the pruned one: both
    // forms must report it at the next download (error bit 1), and the backend must then
    // compute the masked routing as before
    let mut bad_logits = logits.clone();
    bad_logits[5] = 1e3;
    for (label, be) in [("one slot a tile", &be0), ("grouped", &grouped)] {
        let experts = upload_experts(be, &mats, Some(5))?;
        let rt = be.route(&be.upload(&bad_logits, rows, e)?, k, None)?;
        let xd = be.upload(&x, rows, h)?;
        let got = be
            .moe_experts(&xd, &rt, &experts, Rows::Exact)
            .and_then(|y| be.download(&y));
        let reported = matches!(got, Err(model::BackendError::NonFinite { .. }));
        let after = run(be).map(|y| bits_equal(&y, &g)).unwrap_or(false);
        c.push(
            format!(
                "{case}, {label}: a slot routed to the pruned expert is reported, then recovers"
            ),
            Kind::Check,
            reported && after,
            format!(
                "{} ; next call {}",
                match &got {
                    Err(e) => format!("error: {e}"),
                    Ok(_) => "no error".to_string(),
                },
                if after {
                    "same bits as before"
                } else {
                    "WRONG"
                }
            ),
        );
    }
    if rows > 1 {
        let mut same = true;
        for r in [0, rows / 2, rows - 1] {
            same &= bits_equal(&run_rows(&be0, r, 1)?, &got[0][r * h..(r + 1) * h]);
        }
        c.push(
            format!("{case}: rows bitwise = their 1-row launches"),
            Kind::Check,
            same,
            format!("batch invariance {}", if same { "holds" } else { "BROKEN" }),
        );
    }
    Ok(())
}

/// A backend whose decode (one row per lane) takes the split-key kernel at any length, with
/// head groups split over blocks where blocks are few (short cases: a block per head; the
/// 262144-key cases: whole groups), and whose prefill takes the flash kernel.
fn decode_backend(
    gpu: &std::sync::Arc<crate::runtime::Gpu>,
    v: Variant,
    kv_f32: bool,
) -> CudaBackend {
    decode_backend_split(gpu, v, kv_f32, true)
}

/// [`decode_backend`] with the head split on (the default of `CudaOptions::from_env`) or off
/// (whole groups per block).
fn decode_backend_split(
    gpu: &std::sync::Arc<crate::runtime::Gpu>,
    v: Variant,
    kv_f32: bool,
    head_split: bool,
) -> CudaBackend {
    let o = CudaOptions {
        split_min_keys: 1,
        flash_min_rows: 2,
        decode_head_split: head_split,
        ..base_opts(kv_f32)
    };
    CudaBackend::with_gpu(gpu.clone(), v, o)
}

/// A cache of `cap` rows holding the K/V rows `k`, `v` (`[rows][nkv·hd]`), written by `be`'s
/// prefill (its outputs are dropped).
fn filled_cache(
    be: &CudaBackend,
    d: &AttnDims,
    k: &[f32],
    v: &[f32],
    cap: usize,
) -> Result<crate::backend::CudaKv> {
    let w = d.kv_heads * d.head_dim;
    let rows = k.len() / w;
    let mut kv = be.kv_new(cap, d.kv_heads, d.head_dim)?;
    let q = vec![0.5f32; rows * d.q_heads * d.head_dim];
    be.attn_prefill(
        &be.upload(&q, rows, d.q_heads * d.head_dim)?,
        &be.upload(k, rows, w)?,
        &be.upload(v, rows, w)?,
        d,
        &mut kv,
    )?;
    Ok(kv)
}

/// `attn_decode_{f32,bf16}`: split-key decode of one row per lane over caches the exact prefill
/// filled. Each case holds a strong key one past the limit that only the planted build sees;
/// the chunk size grows past 32768 keys, so the 40000-key cases take 256-key chunks.
pub(super) fn attn_decode_split(c: &mut Ctx) -> Result<()> {
    for (nh, nkv, hd, keys, f32kv) in [
        (4, 2, 32, 150, true),
        (16, 2, 256, 300, true),
        (16, 2, 256, 300, false),
        (4, 1, 64, 1000, true),
        (8, 8, 128, 77, false),
        (16, 2, 256, 5000, true),
        (4, 2, 32, 40_000, true),
    ] {
        let d = dims(nh, nkv, hd);
        let w = nkv * hd;
        let q = c.rng.normals_f32(nh * hd, 1.0);
        let mut k = c.rng.normals_f32((keys + 1) * w, 1.0);
        let mut v = c.rng.normals_f32((keys + 1) * w, 1.0);
        plant(c, &mut k, &mut v, &q, 0, 0, keys, nkv, hd, 40.0);
        let store = |x: &[f32]| -> Vec<f32> {
            x.iter()
                .map(|&y| if f32kv { y } else { round_bf16(y) })
                .collect()
        };
        let reference = attn_ref(&q, &store(&k), &store(&v), nh, nkv, hd, keys - 1, 1);
        let maker = flash_backend(c, Variant::Exact, f32kv);
        let kv = filled_cache(&maker, &d, &k, &v, keys + 3)?;
        // both block layouts: head groups split over blocks, and whole groups (the default)
        for split in [true, false] {
            let got: Vec<Vec<f32>> = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
                .iter()
                .map(|&var| {
                    let be = decode_backend_split(c.shared, var, f32kv, split);
                    let qd = be.upload(&q, 1, nh * hd)?;
                    Ok(be.download(&be.attn_decode_only(&qd, &d, &[&kv], &[keys])?)?)
                })
                .collect::<Result<_>>()?;
            let name = format!(
                "{} cache, {nh}/{nkv} heads x {hd}, {keys} keys (+1 strong past the limit), {}",
                if f32kv { "f32" } else { "bf16" },
                if split {
                    "head groups split"
                } else {
                    "whole groups"
                }
            );
            let tol = tol_f32(hd + keys);
            c.check(&name, rel_l2(&got[0], &reference), tol);
            c.discriminate(&name, rel_l2(&got[1], &reference), tol);
            c.control(&name, rel_l2(&got[2], &reference), tol);
        }
    }

    // the whole decode path (append, then the split kernel) through attn_prefill of one row
    for (nh, nkv, hd, past, f32kv) in [(16, 2, 256, 700, true), (4, 2, 32, 90, false)] {
        let pc = PrefillCase::new(c, nh, nkv, hd, past, 1, f32kv);
        let got: Vec<Vec<f32>> = [Variant::Exact, Variant::LowPrecision, Variant::Planted]
            .iter()
            .map(|&var| pc.run(&decode_backend(c.shared, var, f32kv)))
            .collect::<Result<_>>()?;
        let name = format!("append + split: {}", pc.name);
        c.check(&name, rel_l2(&got[0], &pc.reference), pc.tol);
        c.discriminate(&name, rel_l2(&got[1], &pc.reference), pc.tol);
        c.control(&name, rel_l2(&got[2], &pc.reference), pc.tol);
    }

    // batch invariance: lanes of 5, 700 and 40000 keys (chunks of 128 and 256) in caches of
    // different capacities, each lane's row bitwise equal to its solo call
    let (nh, nkv, hd) = (16, 2, 256);
    let d = dims(nh, nkv, hd);
    let w = nkv * hd;
    let lens = [5usize, 700, 40_000];
    let maker = flash_backend(c, Variant::Exact, true);
    let mut kvs = Vec::new();
    let mut refs_f64 = Vec::new();
    let q = c.rng.normals_f32(3 * nh * hd, 1.0);
    for (i, &l) in lens.iter().enumerate() {
        let k = c.rng.normals_f32(l * w, 1.0);
        let v = c.rng.normals_f32(l * w, 1.0);
        // each lane's cache of its own capacity (a request's P + F + 1 rows): the kernels
        // stride each lane by its own
        kvs.push(filled_cache(&maker, &d, &k, &v, l + 1 + 37 * i)?);
        refs_f64.push(attn_ref(
            &q[i * nh * hd..(i + 1) * nh * hd],
            &k,
            &v,
            nh,
            nkv,
            hd,
            l - 1,
            1,
        ));
    }
    let be = decode_backend(c.shared, Variant::Exact, true);
    let refs: Vec<&crate::backend::CudaKv> = kvs.iter().collect();
    let batch =
        be.download(&be.attn_decode_only(&be.upload(&q, 3, nh * hd)?, &d, &refs, &lens)?)?;
    let mut same = true;
    for i in 0..3 {
        let qi = be.upload(&q[i * nh * hd..(i + 1) * nh * hd], 1, nh * hd)?;
        let solo = be.download(&be.attn_decode_only(&qi, &d, &[&kvs[i]], &[lens[i]])?)?;
        same &= bits_equal(&solo, &batch[i * nh * hd..(i + 1) * nh * hd]);
    }
    for (i, r) in refs_f64.iter().enumerate() {
        c.check(
            &format!("3 lanes batched: lane {i} ({} keys) vs FP64", lens[i]),
            rel_l2(&batch[i * nh * hd..(i + 1) * nh * hd], r),
            tol_f32(hd + lens[i]),
        );
    }
    c.push(
        "3 lanes of 5 / 700 / 40000 keys, caches of 3 capacities: each lane bitwise = its solo call",
        Kind::Check,
        same,
        format!("batch invariance {}", if same { "holds" } else { "BROKEN" }),
    );
    drop(kvs);

    // Long range at C = 262144 (tiny geometry): one row seeing 262143 keys. Head 0's only strong
    // key sits at position 7; head 2's strong key is at 262143, one past the limit, and must be
    // ignored.
    let (nh, nkv, hd, cap) = (4, 2, 32, 262_144);
    let keys = cap - 1;
    let d = dims(nh, nkv, hd);
    let q = c.rng.normals_f32(nh * hd, 1.0);
    let mut k = c.rng.normals_f32(cap * nkv * hd, 1.0);
    let mut v = c.rng.normals_f32(cap * nkv * hd, 1.0);
    let early = plant(c, &mut k, &mut v, &q, 0, 0, 7, nkv, hd, 40.0);
    let beyond = plant(c, &mut k, &mut v, &q, 2, 1, keys, nkv, hd, 40.0);
    let reference = attn_ref(&q, &k, &v, nh, nkv, hd, keys - 1, 1);
    let kv = filled_cache(&flash_backend(c, Variant::Exact, true), &d, &k, &v, cap)?;
    let shared = c.shared.clone();
    let run = |var: Variant| -> Result<Vec<f32>> {
        let be = decode_backend(&shared, var, true);
        let qd = be.upload(&q, 1, nh * hd)?;
        Ok(be.download(&be.attn_decode_only(&qd, &d, &[&kv], &[keys])?)?)
    };
    let out = run(Variant::Exact)?;
    let tol = tol_f32(hd + cap);
    c.check(
        "262143 keys of C = 262144, one row (vs FP64)",
        rel_l2(&out, &reference),
        tol,
    );
    let (ce, cb) = (
        cosine(&out[..hd], &early),
        cosine(&out[2 * hd..3 * hd], &beyond),
    );
    c.push(
        "262143 keys: head 0 finds key 7, head 2 ignores key 262143",
        Kind::Check,
        ce > 0.99 && cb.abs() < 0.5,
        format!("cosine to key 7's value {ce:.5} (> 0.99), to key 262143's {cb:.4} (|.| < 0.5)"),
    );
    let planted = run(Variant::Planted)?;
    c.control(
        "262143 keys, one key past the limit",
        rel_l2(&planted, &reference),
        tol,
    );
    // The same at Drama 3 geometry (16/2 heads x 256), the cache written directly (a prefill of
    // 262144 rows at this geometry would take minutes): head 0's only strong key at position 7,
    // head 8's (kv head 1) at 262143, one past the limit; both block layouts.
    let (nh, nkv, hd) = (16, 2, 256);
    let d = dims(nh, nkv, hd);
    let q = c.rng.normals_f32(nh * hd, 1.0);
    let mut k = c.rng.normals_f32(cap * nkv * hd, 1.0);
    let mut v = c.rng.normals_f32(cap * nkv * hd, 1.0);
    let early = plant(c, &mut k, &mut v, &q, 0, 0, 7, nkv, hd, 40.0);
    let beyond = plant(c, &mut k, &mut v, &q, 8, 1, keys, nkv, hd, 40.0);
    let reference = attn_ref(&q, &k, &v, nh, nkv, hd, keys - 1, 1);
    let filler = decode_backend(c.shared, Variant::Exact, true);
    let mut kv = filler.kv_new(cap, nkv, hd)?;
    filler.kv_fill_f32(&mut kv, &k, &v)?;
    drop((k, v));
    let tol = tol_f32(hd + cap);
    for split in [true, false] {
        let run = |var: Variant| -> Result<Vec<f32>> {
            let be = decode_backend_split(&shared, var, true, split);
            let qd = be.upload(&q, 1, nh * hd)?;
            Ok(be.download(&be.attn_decode_only(&qd, &d, &[&kv], &[keys])?)?)
        };
        let layout = if split {
            "head groups split"
        } else {
            "whole groups"
        };
        let out = run(Variant::Exact)?;
        c.check(
            &format!("16/2 heads x 256: 262143 keys of C = 262144, one row (vs FP64), {layout}"),
            rel_l2(&out, &reference),
            tol,
        );
        let (ce, cb) = (
            cosine(&out[..hd], &early),
            cosine(&out[8 * hd..9 * hd], &beyond),
        );
        c.push(
            format!("16/2 heads x 256, 262143 keys: head 0 finds key 7, head 8 ignores key 262143, {layout}"),
            Kind::Check,
            ce > 0.99 && cb.abs() < 0.5,
            format!(
                "cosine to key 7's value {ce:.5} (> 0.99), to key 262143's {cb:.4} (|.| < 0.5)"
            ),
        );
        let planted = run(Variant::Planted)?;
        c.control(
            &format!("16/2 heads x 256, 262143 keys, one key past the limit, {layout}"),
            rel_l2(&planted, &reference),
            tol,
        );
    }
    let nchunks = crate::kernels::decode_chunks([cap], true);
    for (lanes, nh, nkv, hd, f32kv) in [
        (32, 16, 2, 256, true),
        (32, 16, 2, 256, false),
        (32, 4, 2, 32, true),
    ] {
        c.limit(
            &format!(
                "{lanes} lanes x {nh}/{nkv} heads x {hd}, C = 262144, {} cache",
                if f32kv { "f32" } else { "bf16" }
            ),
            crate::kernels::plan_decode(lanes, nh, nkv, hd, cap, nchunks, f32kv, 1),
        );
    }
    Ok(())
}

/// Frame-round draws (`round_sample`) against the CPU sampler, index for index: every draw of
/// the exact build must equal `sampling::sample_main` / `sample_head` (the same Philox
/// counters, sort order and f64 arithmetic), over lanes of peaky, flat, tied and masked logits
/// and mixed settings (greedy, top-k, top-p, RAS against a recent repeat). Half the lanes draw
/// from flat distributions over every token, where f32 sums (the low-precision build) move a
/// few draws in a hundred; the planted build draws from the next step's counter. The last
/// `uncond` lanes are the unconditional branches of the first ones (classifier-free guidance):
/// those lanes draw from `sampling::cfg_mix` of the two rows, the branches draw nothing.
pub(super) fn round_draws(c: &mut Ctx) -> Result<()> {
    use model::backend::{Branch, RoundLane, RoundSpec, Slot};
    use model::sampling::{cfg_mix, sample_head, sample_main, SamplingParams};
    let (lanes, uncond, cb, sem0, eos) = (32usize, 8usize, 4096usize, 1000u32, 7u32);
    let leaders = lanes - uncond;
    let cands: Vec<u32> = (0..cb as u32).map(|i| sem0 + i).chain([eos]).collect();
    let spec = RoundSpec {
        candidates: cands.clone(),
        semantic_start: sem0,
        semantic_end: sem0 + cb as u32 - 1,
    };
    let is_sem = |t: u32| t >= sem0 && t < sem0 + cb as u32;
    struct Rep {
        inputs: Vec<RoundLane>,
        main: Vec<f32>,
        head: Vec<f32>,
        r: usize,
        want: Vec<(i64, i64)>,
    }
    let reps = 100;
    let mut all = Vec::with_capacity(reps);
    for rep in 0..reps {
        let r = rep % 9;
        let mut inputs = Vec::with_capacity(lanes);
        let (mut main, mut head) = (Vec::new(), Vec::new());
        for lane in 0..lanes {
            let flat = lane % 2 == 0;
            let scale = if flat {
                0.05
            } else {
                [1.0, 4.0, 0.3][lane % 3]
            };
            let mut m = c.rng.normals_f32(cb + 1, scale);
            let mut h = c.rng.normals_f32(cb, scale);
            if lane % 7 == 1 {
                // ties and masked entries
                for i in (0..cb - 1).step_by(3) {
                    m[i + 1] = m[i];
                    h[i + 1] = h[i];
                }
                m[5] = f32::NEG_INFINITY;
                h[9] = f32::NEG_INFINITY;
            }
            let params = if flat {
                SamplingParams {
                    temperature: 1.0,
                    top_k: 0,
                    top_p: 1.0,
                    ras: false,
                }
            } else {
                SamplingParams {
                    temperature: [0.0, 0.5, 1.0, 1.3][c.rng.below(4)],
                    // 64 and 65: either side of the kernel's selection (SELECT_MAX)
                    top_k: [0, 1, 30, 64, 65, 500][c.rng.below(6)],
                    top_p: [0.6, 0.9, 1.0][c.rng.below(3)] as f32,
                    ras: c.rng.below(2) == 0,
                }
            };
            // a recent repeat of the likeliest token for a third of the lanes (RAS fires)
            let top = cands[model::sampling::argmax(&m)];
            let mut recent = [0i64; model::RAS_WINDOW];
            let n_recent = c.rng.below(model::RAS_WINDOW + 1);
            for (i, x) in recent.iter_mut().enumerate().take(n_recent) {
                *x = i64::from(sem0) + c.rng.below(cb) as i64;
                if i == 0 && lane % 3 == 0 {
                    *x = i64::from(top);
                }
            }
            // lanes 0..uncond are guided by the last `uncond` lanes (γ 0 included: no mix)
            let branch = if lane < uncond {
                Branch::Guided {
                    uncond: leaders + lane,
                    gamma: [0.0, 0.5, 1.5, 3.0][(rep + lane) % 4],
                }
            } else if lane >= leaders {
                Branch::Uncond { of: lane - leaders }
            } else {
                Branch::Own
            };
            inputs.push(RoundLane {
                rows: 0,
                tower_rows: 0,
                last: [0; model::ROW_WIDTH],
                params,
                seed: c.rng.below(1 << 30) as u64 * 0x9E37,
                step: rep as u64 * 3 + lane as u64,
                recent,
                n_recent,
                branch,
            });
            main.extend_from_slice(&m);
            if lane < leaders {
                head.extend_from_slice(&h);
            }
        }
        let want = (0..leaders)
            .map(|i| {
                let l = &inputs[i];
                let mut row = main[i * (cb + 1)..(i + 1) * (cb + 1)].to_vec();
                if let Branch::Guided { uncond, gamma } = l.branch {
                    cfg_mix(
                        &mut row,
                        &main[uncond * (cb + 1)..(uncond + 1) * (cb + 1)],
                        gamma,
                    );
                }
                let mc = sample_main(
                    &row,
                    &cands,
                    is_sem,
                    l.recent[..l.n_recent].iter().copied(),
                    &l.params,
                    l.seed,
                    l.step,
                );
                let hc = sample_head(&head[i * cb..(i + 1) * cb], &l.params, l.seed, l.step, r);
                (i64::from(cands[mc]), hc as i64)
            })
            .collect();
        all.push(Rep {
            inputs,
            main,
            head,
            r,
            want,
        });
    }
    let draws = 2 * leaders * reps;
    let mismatches = |c: &Ctx, v: Variant| -> Result<usize> {
        let be = backend(c, v, true);
        let mut round = be.round_new(lanes, &spec)?;
        let mut bad = 0;
        for rep in &all {
            be.round_write(&mut round, &rep.inputs)?;
            let m = be.upload(&rep.main, lanes, cb + 1)?;
            be.round_sample(&m, &mut round, Slot::Main)?;
            let h = be.upload(&rep.head, leaders, cb)?;
            be.round_sample(&h, &mut round, Slot::Head(rep.r))?;
            let frames = be.round_frames(&round)?;
            for (f, w) in frames.iter().zip(&rep.want) {
                bad += usize::from(f[0] != w.0 || f[1] != w.0 - i64::from(sem0))
                    + usize::from(f[2 + rep.r] != w.1);
            }
        }
        Ok(bad)
    };
    let case = format!(
        "{draws} draws over {leaders} lanes ({uncond} guided by {uncond} more) of {cb}/{} logits",
        cb + 1
    );
    let e = mismatches(c, Variant::Exact)?;
    c.push(
        case.clone(),
        Kind::Check,
        e == 0,
        format!("{e} of {draws} draws differ from the CPU sampler (must be 0)"),
    );
    let l = mismatches(c, Variant::LowPrecision)?;
    c.push(
        format!("{case} [low precision must fail]"),
        Kind::Discriminate,
        l > 0,
        format!("{l} of {draws} draws differ with f32 exps and sums"),
    );
    let p = mismatches(c, Variant::Planted)?;
    c.push(
        format!("{case} [planted]"),
        Kind::Control,
        p > 0,
        format!("{p} of {draws} draws differ (next step's counter)"),
    );
    c.limit(
        "round_sample at 32 lanes of 4097 candidates",
        crate::kernels::plan_round_sample(lanes, cb + 1),
    );
    Ok(())
}

/// `round_embed`: rows gathered from the round's frames (greedy draws, so every build draws
/// the same frames) against an FP64 sum of the BF16 rows, with the guard on each frame's main
/// token and the semantic scale.
pub(super) fn round_embed(c: &mut Ctx) -> Result<()> {
    use model::backend::{CodeTerm, Frame, RoundLane, RoundSpec, Slot};
    use model::sampling::SamplingParams;
    let (lanes, cb, cols, sem0) = (12usize, 64usize, 96usize, 500u32);
    let cands: Vec<u32> = (0..cb as u32).map(|i| sem0 + i).chain([3]).collect();
    let spec = RoundSpec {
        candidates: cands.clone(),
        semantic_start: sem0,
        semantic_end: sem0 + cb as u32 - 1,
    };
    let t0 = c.rng.normals_bf16(cb * cols, 1.0);
    let t1 = c.rng.normals_bf16(3 * cb * cols, 1.0);
    let main = c.rng.normals_f32(lanes * (cb + 1), 2.0);
    let head = c.rng.normals_f32(lanes * cb, 2.0);
    let inputs: Vec<RoundLane> = (0..lanes)
        .map(|i| {
            let mut last = [0i64; model::ROW_WIDTH];
            // a semantic or a non-semantic previous row (whose guarded terms drop out)
            last[0] = if i % 3 == 0 {
                3
            } else {
                i64::from(sem0) + i as i64
            };
            for x in last.iter_mut().skip(1) {
                *x = c.rng.below(cb) as i64;
            }
            RoundLane {
                rows: 0,
                tower_rows: 0,
                last,
                params: SamplingParams::greedy(),
                seed: 1,
                step: 0,
                recent: [0; model::RAS_WINDOW],
                n_recent: 0,
                branch: model::backend::Branch::Own,
            }
        })
        .collect();
    let terms = [
        CodeTerm {
            table: 0,
            frame: Frame::Current,
            col: 1,
            offset: 0,
            guarded: true,
        },
        CodeTerm {
            table: 1,
            frame: Frame::Current,
            col: 4,
            offset: cb as u32,
            guarded: true,
        },
        CodeTerm {
            table: 1,
            frame: Frame::Last,
            col: 5,
            offset: 2 * cb as u32,
            guarded: true,
        },
        CodeTerm {
            table: 1,
            frame: Frame::Last,
            col: 6,
            offset: 0,
            guarded: false,
        },
    ];
    let scale = 0.37f32;
    // the greedy frames, as the CPU draws them
    let mut frames = vec![[0i64; model::ROW_WIDTH]; lanes];
    for (i, f) in frames.iter_mut().enumerate() {
        let tok = cands[model::sampling::argmax(&main[i * (cb + 1)..(i + 1) * (cb + 1)])];
        f[0] = i64::from(tok);
        f[1] = i64::from(tok) - i64::from(sem0);
        f[4] = model::sampling::argmax(&head[i * cb..(i + 1) * cb]) as i64;
    }
    let mut reference = Vec::with_capacity(lanes * cols);
    for (i, f) in frames.iter().enumerate() {
        let sem = |t: i64| t >= i64::from(sem0) && t < i64::from(sem0) + cb as i64;
        for col in 0..cols {
            let mut s = 0.0f64;
            for t in &terms {
                let fr = match t.frame {
                    Frame::Current => f,
                    Frame::Last => &inputs[i].last,
                };
                if t.guarded && !sem(fr[0]) {
                    continue;
                }
                let row = i64::from(t.offset) + fr[t.col];
                let tab = if t.table == 0 { &t0 } else { &t1 };
                s += bf16(tab[row as usize * cols + col]);
            }
            reference.push(s * if sem(f[0]) { f64::from(scale) } else { 1.0 });
        }
    }
    // the round's greedy frames embedded on `be`
    let embed = |be: &CudaBackend| -> Result<Vec<f32>> {
        let a = be.weight_bf16(cb, cols, &t0)?;
        let b = be.weight_bf16(3 * cb, cols, &t1)?;
        let mut round = be.round_new(lanes, &spec)?;
        be.round_write(&mut round, &inputs)?;
        be.round_sample(&be.upload(&main, lanes, cb + 1)?, &mut round, Slot::Main)?;
        be.round_sample(&be.upload(&head, lanes, cb)?, &mut round, Slot::Head(2))?;
        Ok(be.download(&be.round_embed(
            &[&a, &b],
            &round,
            &terms,
            scale,
            model::backend::Counter::Backbone,
        )?)?)
    };
    triple3(
        c,
        "12 lanes, 4 guarded/unguarded terms of the current and previous frames",
        tol_f32(4),
        &reference,
        embed,
        false,
    )?;
    // The model relies on round_embed giving gather_sum's bits for the same picks.
    let be = backend(c, Variant::Exact, false);
    let kept = embed(&be)?;
    let a = be.weight_bf16(cb, cols, &t0)?;
    let b = be.weight_bf16(3 * cb, cols, &t1)?;
    let sem = |t: i64| t >= i64::from(sem0) && t < i64::from(sem0) + cb as i64;
    // the picks the host path makes for the same frames (`embed_rows`, `tower_embed`)
    let rows: Vec<GatherRow> = frames
        .iter()
        .zip(&inputs)
        .map(|(f, l)| model::backend::gather_row(&terms, scale, f, &l.last, sem))
        .collect();
    let gathered = be.download(&be.gather_sum(&[&a, &b], &rows)?)?;
    same_bits(
        c,
        "12 lanes: round_embed bitwise = gather_sum of the same picks".into(),
        &kept,
        &gathered,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `gemv_tt` and `gemv_tw` cases compare the tiles with `gemv_tc2`: their options must
    /// send every shape to their kernel (`gemv_tw` in 32-row tiles), and with the tiles off to
    /// `gemv_tc2`, or the bitwise checks compare a kernel with itself.
    #[test]
    fn gemv_tt_case_runs_the_tiles() {
        for (walk, kernel, tile) in [(false, "gemv_tt", 64), (true, "gemv_tw", 32)] {
            for (n, k, rows) in GEMV_TT_SHAPES {
                assert_eq!(
                    crate::backend::bf16_gemv_grid(&tt_opts(1, walk), rows, k, n),
                    (
                        kernel,
                        (n.div_ceil(64) as u32, rows.div_ceil(tile) as u32, 1)
                    ),
                    "{rows} x {k} into {n}"
                );
                assert!(
                    crate::backend::bf16_gemv_grid(&tt_opts(usize::MAX, walk), rows, k, n)
                        .0
                        .starts_with("gemv_tc2_"),
                    "{rows} x {k} into {n}"
                );
            }
            let total = crate::backend::tiled_outputs(MANY_OUTS);
            assert_eq!(
                crate::backend::bf16_gemv_grid(&tt_opts(1, walk), 77, 2048, total).0,
                kernel
            );
        }
    }

    /// The `gemv_ts` case compares the split tiles with `gemv_tc2`: its options must send every
    /// shape to `gemv_ts` with the chunks the case names, and with the split off to `gemv_tc2`.
    #[test]
    fn gemv_ts_case_runs_the_split_tiles() {
        for (n, k, rows, chunks) in GEMV_TS_SHAPES {
            assert_eq!(
                crate::backend::bf16_gemv_grid(&ts_opts(true), rows, k, n),
                (
                    "gemv_ts",
                    (
                        n.div_ceil(64) as u32,
                        rows.div_ceil(32) as u32,
                        chunks as u32
                    )
                ),
                "{rows} x {k} into {n}"
            );
            assert!(
                crate::backend::bf16_gemv_grid(&ts_opts(false), rows, k, n)
                    .0
                    .starts_with("gemv_tc2_"),
                "{rows} x {k} into {n}"
            );
        }
        let total = crate::backend::tiled_outputs(MANY_OUTS);
        assert_eq!(
            crate::backend::bf16_gemv_multi(&ts_opts(true), 32, 2048, total),
            "gemv_ts_multi"
        );
    }

    /// The grouped FP64 expert reference equals the plain per-row sum over each routing.
    #[test]
    fn experts_reference_equals_the_per_row_sum() {
        let mut rng = crate::rng::Rng::new(11);
        let (e, i, h, rows) = (5, 130, 260, 4);
        let mut mat = |rows: usize, cols: usize| Fp8Mat {
            q: rng.fp8_bytes(rows * cols),
            s: (0..rows.div_ceil(128) * cols.div_ceil(128))
                .map(|_| rng.range(0.5, 2.0) as f32 * 1e-2)
                .collect(),
            rows,
            cols,
        };
        let mats: Vec<[Fp8Mat; 3]> = (0..e).map(|_| [mat(i, h), mat(i, h), mat(h, i)]).collect();
        let x = crate::rng::Rng::new(12).normals_f32(rows * h, 1.0);
        let route = model::Route {
            experts: vec![vec![0, 3], vec![3, 1], vec![4, 0], vec![2, 4]],
            weights: vec![
                vec![0.7, 0.3],
                vec![0.5, 0.5],
                vec![0.9, 0.1],
                vec![0.25, 0.75],
            ],
        };
        let got = experts_reference(&mats, &x, h, &route);
        for r in 0..rows {
            let xr = f64s(&x[r * h..(r + 1) * h]);
            let mut y = vec![0.0; h];
            for (&id, &wt) in route.experts[r].iter().zip(&route.weights[r]) {
                let m = &mats[id as usize];
                let (g, u) = (m[0].apply(&xr), m[1].apply(&xr));
                let hv: Vec<f64> = g.iter().zip(&u).map(|(a, b)| silu(*a) * b).collect();
                for (yy, d) in y.iter_mut().zip(m[2].apply(&hv)) {
                    *yy += f64::from(wt) * d;
                }
            }
            for (a, b) in got[r * h..(r + 1) * h].iter().zip(&y) {
                assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
            }
        }
    }
}

//! FP64 CPU references for every kernel, written from DRAMA3.md's equations and independent of
//! the kernels (their own bf16 and e4m3 decoding, plain loops, no shared code with the GPU path).

use rayon::prelude::*;

/// bf16 bits to f64.
pub fn bf16(bits: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(bits) << 16))
}

/// f64 to bf16 bits, round to nearest even.
pub fn to_bf16(x: f64) -> u16 {
    half::bf16::from_f64(x).to_bits()
}

/// e4m3fn byte to f64: sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities.
pub fn fp8_e4m3(b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((b >> 3) & 0xf);
    let m = f64::from(b & 0x7);
    if e == 0xf && m == 7.0 {
        return f64::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * 2f64.powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * 2f64.powi(e - 7)
    }
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// RMSNorm over rows of length n with w' = 1 + w or w.
pub fn rmsnorm(x: &[f32], w: &[u16], n: usize, eps: f64, add_one: bool) -> Vec<f64> {
    x.chunks(n)
        .flat_map(|row| {
            let ms = row.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / n as f64;
            let r = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(&v, &wb)| {
                    f64::from(v) * r * (bf16(wb) + if add_one { 1.0 } else { 0.0 })
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// y[r, n] = W[row(n)] . x[r]; W [*, k] bf16.
pub fn gemv(w: &[u16], x: &[f32], k: usize, rows: usize, row_ids: &[usize]) -> Vec<f64> {
    let n_out = row_ids.len();
    let mut y = vec![0.0; rows * n_out];
    y.par_chunks_mut(n_out).enumerate().for_each(|(r, yr)| {
        let xr = &x[r * k..(r + 1) * k];
        for (o, &id) in yr.iter_mut().zip(row_ids) {
            let wr = &w[id * k..(id + 1) * k];
            *o = wr
                .iter()
                .zip(xr)
                .map(|(&a, &b)| bf16(a) * f64::from(b))
                .sum();
        }
    });
    y
}

/// Router: softmax over E, top-k by probability with ties to the lower index, renormalised.
pub fn router(logits: &[f32], e: usize, k: usize) -> (Vec<u32>, Vec<f64>) {
    let mut ids = Vec::new();
    let mut wts = Vec::new();
    for row in logits.chunks(e) {
        let m = row
            .iter()
            .map(|&v| f64::from(v))
            .fold(f64::NEG_INFINITY, f64::max);
        let ex: Vec<f64> = row.iter().map(|&v| (f64::from(v) - m).exp()).collect();
        let s: f64 = ex.iter().sum();
        let mut order: Vec<usize> = (0..e).collect();
        // stable sort: equal probabilities keep ascending index order
        order.sort_by(|&a, &b| {
            ex[b]
                .partial_cmp(&ex[a])
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        let top = &order[..k];
        let tot: f64 = top.iter().map(|&i| ex[i] / s).sum();
        for &i in top {
            ids.push(i as u32);
            wts.push(ex[i] / s / tot);
        }
    }
    (ids, wts)
}

/// Router under `model::Backend::route`'s policy, in f64, for one row: the kept experts ranked
/// by logit (NaN as -inf) with ties to the lower index; weights softmax over the kept experts
/// (the +inf ones sharing the mass equally when there are any), renormalised over the top k.
/// `None` when every kept logit is NaN or -inf.
pub fn router_policy(row: &[f32], k: usize, keep: Option<&[bool]>) -> Option<(Vec<u32>, Vec<f64>)> {
    let kept = |i: usize| keep.is_none_or(|m| m[i]);
    let key = |i: usize| {
        let v = f64::from(row[i]);
        if v.is_nan() {
            f64::NEG_INFINITY
        } else {
            v
        }
    };
    let idx: Vec<usize> = (0..row.len()).filter(|&i| kept(i)).collect();
    let m = idx
        .iter()
        .map(|&i| key(i))
        .fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return None;
    }
    let p = |i: usize| {
        if m == f64::INFINITY {
            if key(i) == f64::INFINITY {
                1.0
            } else {
                0.0
            }
        } else {
            (key(i) - m).exp()
        }
    };
    let mut order = idx;
    // descending key, then ascending index (explicit, not relying on sort stability)
    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    order.truncate(k);
    let tot: f64 = order.iter().map(|&i| p(i)).sum();
    Some((
        order.iter().map(|&i| i as u32).collect(),
        order.iter().map(|&i| p(i) / tot).collect(),
    ))
}

/// E2M1 (FP4) code to f64: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa; exponent 0
/// is subnormal (0 or 0.5).
pub fn e2m1(code: u8) -> f64 {
    let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
    let e = i32::from((code >> 1) & 3);
    let m = f64::from(code & 1);
    if e == 0 {
        sign * m * 0.5
    } else {
        sign * (1.0 + m / 2.0) * 2f64.powi(e - 1)
    }
}

/// Dequantised NVFP4 weight (r, c) of a `[rows, cols]` matrix: codes `[rows, cols/2]` (low
/// nibble = even column), E4M3 scales `[rows, cols/16]`, global: e2m1 · e4m3 · global.
pub fn nvfp4_weight(
    codes: &[u8],
    scales: &[u8],
    global: f32,
    cols: usize,
    r: usize,
    c: usize,
) -> f64 {
    let b = codes[r * cols / 2 + c / 2];
    let q = if c.is_multiple_of(2) { b & 15 } else { b >> 4 };
    e2m1(q) * fp8_e4m3(scales[r * cols / 16 + c / 16]) * f64::from(global)
}

/// Dequantised FP8 weight: q[r, c] * scale_inv[r/128, c/128] of one [rows, cols] matrix.
pub fn fp8_weight(q: &[u8], s: &[f32], cols: usize, r: usize, c: usize) -> f64 {
    let sb_cols = cols.div_ceil(128);
    fp8_e4m3(q[r * cols + c]) * f64::from(s[(r / 128) * sb_cols + c / 128])
}

/// Experts' gate/up + SiLU-mul for one row: h[j, i] for the selected experts.
/// gate, up [E, I, H]; scales [E, I/128, H/128].
#[allow(clippy::too_many_arguments)]
pub fn expert_gate_up(
    gate: &[u8],
    up: &[u8],
    gs: &[f32],
    us: &[f32],
    ids: &[u32],
    x: &[f32],
    i_dim: usize,
    h_dim: usize,
) -> Vec<f64> {
    let mat = i_dim * h_dim;
    let smat = i_dim.div_ceil(128) * h_dim.div_ceil(128);
    ids.iter()
        .flat_map(|&e| {
            let e = e as usize;
            let (g, u) = (&gate[e * mat..(e + 1) * mat], &up[e * mat..(e + 1) * mat]);
            let (sg, su) = (&gs[e * smat..(e + 1) * smat], &us[e * smat..(e + 1) * smat]);
            (0..i_dim)
                .into_par_iter()
                .map(|i| {
                    let (mut a, mut b) = (0.0, 0.0);
                    for (c, &xv) in x.iter().enumerate().take(h_dim) {
                        a += fp8_weight(g, sg, h_dim, i, c) * f64::from(xv);
                        b += fp8_weight(u, su, h_dim, i, c) * f64::from(xv);
                    }
                    silu(a) * b
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Experts' down projection summed with routing weights: y[n] = sum_j w_j down_{e_j}[n] . h[j].
/// down [E, H, I]; scales [E, H/128, I/128].
pub fn expert_down(
    down: &[u8],
    ds: &[f32],
    ids: &[u32],
    wts: &[f32],
    h: &[f32],
    i_dim: usize,
    h_dim: usize,
) -> Vec<f64> {
    let mat = i_dim * h_dim;
    let smat = i_dim.div_ceil(128) * h_dim.div_ceil(128);
    (0..h_dim)
        .into_par_iter()
        .map(|n| {
            let mut y = 0.0;
            for (j, &e) in ids.iter().enumerate() {
                let e = e as usize;
                let (d, s) = (&down[e * mat..(e + 1) * mat], &ds[e * smat..(e + 1) * smat]);
                let hj = &h[j * i_dim..(j + 1) * i_dim];
                let dot: f64 = (0..i_dim)
                    .map(|c| fp8_weight(d, s, i_dim, n, c) * f64::from(hj[c]))
                    .sum();
                y += f64::from(wts[j]) * dot;
            }
            y
        })
        .collect()
}

/// Causal depthwise conv step + SiLU; returns (u, new state [3, C]).
pub fn conv_step(x: &[f32], state: &[f32], w: &[u16]) -> (Vec<f64>, Vec<f32>) {
    let c_dim = x.len();
    let u = (0..c_dim)
        .map(|c| {
            let hist = [state[c], state[c_dim + c], state[2 * c_dim + c], x[c]];
            silu(
                (0..4)
                    .map(|j| bf16(w[4 * c + j]) * f64::from(hist[j]))
                    .sum(),
            )
        })
        .collect();
    let mut ns = Vec::with_capacity(3 * c_dim);
    ns.extend_from_slice(&state[c_dim..]);
    ns.extend_from_slice(x);
    (u, ns)
}

/// l2-norm of q and k heads ([q; k], each nk x dk); q also times q_scale.
pub fn l2norm(qk: &[f32], nk: usize, dk: usize, q_scale: f64) -> Vec<f64> {
    qk.chunks(dk)
        .enumerate()
        .flat_map(|(h, v)| {
            let r = 1.0 / (v.iter().map(|&a| f64::from(a).powi(2)).sum::<f64>() + 1e-6).sqrt();
            let r = if h < nk { r * q_scale } else { r };
            v.iter().map(move |&a| f64::from(a) * r).collect::<Vec<_>>()
        })
        .collect()
}

/// Inputs of one Gated DeltaNet recurrent step.
pub struct DeltaStep<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub b: &'a [f32],
    pub a: &'a [f32],
    pub a_log: &'a [u16],
    pub dt_bias: &'a [u16],
    pub nk: usize,
    pub nv: usize,
    pub d: usize,
}

/// One recurrent step on state [nv, dk, dv] (updated in place); returns o [nv, dv].
pub fn delta_step(s: &DeltaStep, state: &mut [f64]) -> Vec<f64> {
    let d = s.d;
    let mut o = vec![0.0; s.nv * d];
    for h in 0..s.nv {
        let kh = h / (s.nv / s.nk);
        let k = &s.k[kh * d..(kh + 1) * d];
        let q = &s.q[kh * d..(kh + 1) * d];
        let beta = sigmoid(f64::from(s.b[h]));
        let xa = f64::from(s.a[h]) + bf16(s.dt_bias[h]);
        let sp = if xa > 20.0 { xa } else { xa.exp().ln_1p() };
        let alpha = (-bf16(s.a_log[h]).exp() * sp).exp();
        let st = &mut state[h * d * d..(h + 1) * d * d];
        st.iter_mut().for_each(|v| *v *= alpha);
        for j in 0..d {
            let sk: f64 = (0..d).map(|i| st[i * d + j] * f64::from(k[i])).sum();
            let delta = beta * (f64::from(s.v[h * d + j]) - sk);
            for i in 0..d {
                st[i * d + j] += f64::from(k[i]) * delta;
            }
            o[h * d + j] = (0..d).map(|i| st[i * d + j] * f64::from(q[i])).sum();
        }
    }
    o
}

/// Gated RMSNorm: o / sqrt(mean(o^2) + eps) * w * silu(z), plain w, per head of dv.
pub fn gated_norm(o: &[f32], z: &[f32], w: &[u16], dv: usize, eps: f64) -> Vec<f64> {
    o.chunks(dv)
        .zip(z.chunks(dv))
        .flat_map(|(oh, zh)| {
            let r = 1.0
                / (oh.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / dv as f64 + eps).sqrt();
            (0..dv)
                .map(|i| f64::from(oh[i]) * r * bf16(w[i]) * silu(f64::from(zh[i])))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// ||a - b|| / ||b||; infinite when any element of `a` is not finite.
pub fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.iter().any(|v| !v.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_decoding_known_values() {
        assert_eq!(fp8_e4m3(0x38), 1.0);
        assert_eq!(fp8_e4m3(0x7e), 448.0);
        assert_eq!(fp8_e4m3(0xfe), -448.0);
        assert_eq!(fp8_e4m3(0x01), 2f64.powi(-9));
        assert_eq!(fp8_e4m3(0x08), 2f64.powi(-6));
        assert_eq!(fp8_e4m3(0x40), 2.0);
        assert!(fp8_e4m3(0x7f).is_nan());
    }

    #[test]
    fn e2m1_decoding_known_values() {
        let want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for (q, w) in want.iter().enumerate() {
            assert_eq!(e2m1(q as u8), *w);
            assert_eq!(e2m1(q as u8 | 8), -*w);
        }
        // low nibble = even column; one scale per 16 columns
        let codes = [0x21u8, 0x00, 0, 0, 0, 0, 0, 0, 0x07, 0, 0, 0, 0, 0, 0, 0];
        let scales = [0x38u8, 0x40]; // 1.0, 2.0
        assert_eq!(nvfp4_weight(&codes, &scales, 0.5, 32, 0, 0), 0.25);
        assert_eq!(nvfp4_weight(&codes, &scales, 0.5, 32, 0, 1), 0.5);
        assert_eq!(nvfp4_weight(&codes, &scales, 0.5, 32, 0, 16), 6.0);
    }

    #[test]
    fn router_policy_agrees_with_the_cpu_backend() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let keep: Vec<bool> = (0..10).map(|i| i != 3).collect();
        let rows: [[f32; 10]; 5] = [
            [1.0, nan, 2.0, 9.0, 2.0, -1.0, 0.0, 0.5, 2.0, -3.0],
            [inf, 0.0, 1.0, inf, -inf, inf, 2.0, nan, 0.0, 1.0],
            [-inf, nan, 1.0, 2.0, -inf, nan, -inf, 0.0, -inf, nan],
            [
                0.0, -150.0, -160.0, 5.0, -170.0, -149.0, -200.0, -151.0, -300.0, -152.0,
            ],
            [1.0; 10],
        ];
        for row in &rows {
            for mask in [None, Some(&keep[..])] {
                let (ids, w) = router_policy(row, 6, mask).unwrap();
                let (cids, cw) = backend_cpu::route_row(row, 6, mask).unwrap();
                assert_eq!(ids, cids, "{row:?}");
                for (a, b) in w.iter().zip(&cw) {
                    assert!((a - f64::from(*b)).abs() < 1e-6, "{w:?} {cw:?}");
                }
            }
        }
        let dead = [nan, -inf, 5.0, nan];
        assert!(router_policy(&dead, 1, Some(&[true, true, false, true])).is_none());
        assert!(backend_cpu::route_row(&dead, 1, Some(&[true, true, false, true])).is_none());
    }

    #[test]
    fn router_breaks_ties_to_lower_index_and_renormalises() {
        let logits = [1.0f32, 3.0, 3.0, 0.0, 3.0, 2.0];
        let (ids, w) = router(&logits, 6, 2);
        assert_eq!(ids, vec![1, 2]);
        assert!((w[0] - 0.5).abs() < 1e-15 && (w[1] - 0.5).abs() < 1e-15);
    }

    #[test]
    fn rmsnorm_plain_and_one_plus_w() {
        let x = [3.0f32, 4.0];
        let w = [to_bf16(0.5), to_bf16(0.5)];
        let ms = (12.5f64 + 1e-6).sqrt();
        let plain = rmsnorm(&x, &w, 2, 1e-6, false);
        let shifted = rmsnorm(&x, &w, 2, 1e-6, true);
        assert!((plain[0] - 3.0 / ms * 0.5).abs() < 1e-12);
        assert!((shifted[1] - 4.0 / ms * 1.5).abs() < 1e-12);
    }

    #[test]
    fn delta_rule_matches_closed_form_for_one_step() {
        // zero state: o = beta * v * (k . q)
        let d = 2;
        let (q, k, v) = ([1.0f32, 2.0], [0.5f32, 0.25], [3.0f32, -1.0]);
        let step = DeltaStep {
            q: &q,
            k: &k,
            v: &v,
            b: &[0.0],
            a: &[0.0],
            a_log: &[0],
            dt_bias: &[0],
            nk: 1,
            nv: 1,
            d,
        };
        let mut st = vec![0.0; 4];
        let o = delta_step(&step, &mut st);
        let kq = 0.5 + 0.5;
        assert!((o[0] - 0.5 * 3.0 * kq).abs() < 1e-12 && (o[1] + 0.5 * kq).abs() < 1e-12);
        assert!((st[0] - 0.5 * 0.5 * 3.0).abs() < 1e-12);
    }

    #[test]
    fn rel_l2_rejects_non_finite() {
        assert_eq!(rel_l2(&[f32::NAN], &[1.0]), f64::INFINITY);
        assert!(rel_l2(&[1.0], &[1.0]) == 0.0);
    }
}

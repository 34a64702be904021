//! Each CPU op against a naive f64 implementation on random non-zero inputs, plus the
//! equalities the model relies on: chunked == recurrent delta rule, cached == uncached
//! attention, row-exact linear independent of the batch, MoE tie-breaking.

use backend_cpu::{Bytes, CpuBackend, CpuGdn, CpuKv, CpuVector, CpuWeight, Format};
use checkpoint::dtype::{bf16_to_f32, f32_to_bf16, f8e4m3_to_f32};
use model::{AttnDims, Backend, Expert, GatherRow, GdnDims, Rope, Rows};

mod common;
use common::{buf, Rng};

fn bf16_weight(rng: &mut Rng, rows: usize, cols: usize) -> (CpuWeight, Vec<f64>) {
    let mut bytes = Vec::with_capacity(rows * cols * 2);
    let mut deq = Vec::with_capacity(rows * cols);
    for _ in 0..rows * cols {
        let b = f32_to_bf16(rng.f() * 0.5);
        bytes.extend_from_slice(&b.to_le_bytes());
        deq.push(f64::from(bf16_to_f32(b)));
    }
    let w = CpuWeight {
        bytes: Bytes::Owned(bytes),
        format: Format::Bf16,
        rows,
        cols,
    };
    (w, deq)
}

/// FP8 with distinct scales per 128x128 block, so a wrong block index is caught.
fn fp8_weight(rng: &mut Rng, rows: usize, cols: usize) -> (CpuWeight, Vec<f64>) {
    let (sr, sc) = (rows.div_ceil(128), cols.div_ceil(128));
    let scale: Vec<f32> = (0..sr * sc).map(|i| 0.01 * (i + 1) as f32).collect();
    let mut bytes = Vec::with_capacity(rows * cols);
    let mut deq = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let mut b = (rng.next() >> 56) as u8;
            if b & 0x7f == 0x7f {
                b = 0x38; // E4M3 NaN codes replaced by 1.0
            }
            bytes.push(b);
            deq.push(f64::from(f8e4m3_to_f32(b)) * f64::from(scale[(r / 128) * sc + c / 128]));
        }
    }
    let w = CpuWeight {
        bytes: Bytes::Owned(bytes),
        format: Format::Fp8 {
            scale,
            scale_cols: sc,
        },
        rows,
        cols,
    };
    (w, deq)
}

fn naive_linear(x: &[f32], n: usize, w: &[f64], out: usize, k: usize) -> Vec<f64> {
    let mut y = vec![0f64; n * out];
    for i in 0..n {
        for j in 0..out {
            y[i * out + j] = (0..k).map(|c| f64::from(x[i * k + c]) * w[j * k + c]).sum();
        }
    }
    y
}

#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0f64, f64::max);
    assert!(
        worst <= tol * scale,
        "{what}: max |diff| {worst:e} exceeds {tol:e} x max |want| {scale:e}"
    );
}

#[test]
fn linear_bf16_and_fp8_against_f64_both_paths() {
    let mut rng = Rng(1);
    let (n, out, k) = (19, 200, 300);
    let x = rng.vec(n * k, 1.0);
    for (name, (w, deq)) in [
        ("bf16", bf16_weight(&mut rng, out, k)),
        ("fp8", fp8_weight(&mut rng, out, k)),
    ] {
        let want = naive_linear(&x, n, &deq, out, k);
        for rows in [Rows::Exact, Rows::Bulk] {
            let y = CpuBackend.linear(&buf(n, k, x.clone()), &w, rows).unwrap();
            assert_close(&format!("{name} {rows:?}"), &y.data, &want, 1e-5);
        }
    }
}

#[test]
fn exact_linear_row_is_independent_of_the_batch() {
    let mut rng = Rng(2);
    let (n, out, k) = (9, 150, 260);
    let x = rng.vec(n * k, 1.0);
    let (w, _) = fp8_weight(&mut rng, out, k);
    let all = CpuBackend
        .linear(&buf(n, k, x.clone()), &w, Rows::Exact)
        .unwrap();
    for i in 0..n {
        let one = CpuBackend
            .linear(&buf(1, k, x[i * k..(i + 1) * k].to_vec()), &w, Rows::Exact)
            .unwrap();
        assert_eq!(one.data, all.data[i * out..(i + 1) * out], "row {i}");
    }
}

#[test]
fn rms_norm_plus_one_and_plain() {
    let mut rng = Rng(3);
    let (n, cols, group) = (5, 96, 32);
    let x = rng.vec(n * cols, 2.0);
    let w = rng.vec(group, 0.3);
    for plus_one in [true, false] {
        let y = CpuBackend
            .rms_norm(
                &buf(n, cols, x.clone()),
                &CpuVector(w.clone()),
                group,
                1e-6,
                plus_one,
            )
            .unwrap();
        let mut want = vec![0f64; n * cols];
        for (g, chunk) in x.chunks(group).enumerate() {
            let ms = chunk.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / group as f64;
            let inv = 1.0 / (ms + 1e-6).sqrt();
            for (c, v) in chunk.iter().enumerate() {
                let wp = f64::from(w[c]) + if plus_one { 1.0 } else { 0.0 };
                want[g * group + c] = f64::from(*v) * inv * wp;
            }
        }
        assert_close(&format!("rms plus_one={plus_one}"), &y.data, &want, 1e-6);
    }
}

#[test]
fn rope_neox_and_interleaved() {
    let mut rng = Rng(4);
    let (hd, rot, heads) = (32, 8, 3);
    let cols = hd * heads;
    let positions = [0usize, 7, 113, 5000];
    let x = rng.vec(positions.len() * cols, 1.0);
    for style in [Rope::Neox, Rope::Interleaved] {
        let y = CpuBackend
            .rope(
                &buf(positions.len(), cols, x.clone()),
                hd,
                rot,
                1e7,
                style,
                &positions,
            )
            .unwrap();
        let mut want: Vec<f64> = x.iter().map(|v| f64::from(*v)).collect();
        for (r, &p) in positions.iter().enumerate() {
            for h in 0..heads {
                let base = r * cols + h * hd;
                for i in 0..rot / 2 {
                    let ang = p as f64 * 1e7f64.powf(-2.0 * i as f64 / rot as f64);
                    let (a, b) = match style {
                        Rope::Neox => (i, i + rot / 2),
                        Rope::Interleaved => (2 * i, 2 * i + 1),
                    };
                    let (x0, x1) = (f64::from(x[base + a]), f64::from(x[base + b]));
                    want[base + a] = x0 * ang.cos() - x1 * ang.sin();
                    want[base + b] = x1 * ang.cos() + x0 * ang.sin();
                }
            }
        }
        assert_close(&format!("rope {style:?}"), &y.data, &want, 1e-6);
    }
}

fn naive_attention(q: &[f32], k: &[f32], v: &[f32], t: usize, d: &AttnDims) -> Vec<f64> {
    let (hq, hkv, hd) = (d.q_heads, d.kv_heads, d.head_dim);
    let mut out = vec![0f64; t * hq * hd];
    for i in 0..t {
        for h in 0..hq {
            let kh = h / (hq / hkv);
            let s: Vec<f64> = (0..=i)
                .map(|j| {
                    (0..hd)
                        .map(|c| {
                            f64::from(q[i * hq * hd + h * hd + c])
                                * f64::from(k[j * hkv * hd + kh * hd + c])
                        })
                        .sum::<f64>()
                        / (hd as f64).sqrt()
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for c in 0..hd {
                out[i * hq * hd + h * hd + c] = (0..=i)
                    .map(|j| e[j] * f64::from(v[j * hkv * hd + kh * hd + c]))
                    .sum::<f64>()
                    / z;
            }
        }
    }
    out
}

#[test]
fn attention_with_cache_equals_without_and_f64() {
    let mut rng = Rng(5);
    let d = AttnDims {
        q_heads: 4,
        kv_heads: 2,
        head_dim: 16,
        rot_dims: 4,
        theta: 1e7,
        rope: Rope::Neox,
    };
    let t = 23;
    let (qw, kw) = (64, 32);
    let (q, k, v) = (
        rng.vec(t * qw, 2.0),
        rng.vec(t * kw, 2.0),
        rng.vec(t * kw, 1.0),
    );
    let want = naive_attention(&q, &k, &v, t, &d);
    // Whole prompt at once.
    let mut c0 = CpuKv::new(t, 2, 16).unwrap();
    let whole = CpuBackend
        .attn_prefill(
            &buf(t, qw, q.clone()),
            &buf(t, kw, k.clone()),
            &buf(t, kw, v.clone()),
            &d,
            &mut c0,
        )
        .unwrap();
    assert_close("attention prefill", &whole.data, &want, 1e-5);
    // 10 rows prefilled, then the rest one step at a time through the cache.
    let mut c1 = CpuKv::new(t, 2, 16).unwrap();
    let mut got = CpuBackend
        .attn_prefill(
            &buf(10, qw, q[..10 * qw].to_vec()),
            &buf(10, kw, k[..10 * kw].to_vec()),
            &buf(10, kw, v[..10 * kw].to_vec()),
            &d,
            &mut c1,
        )
        .unwrap()
        .data;
    for i in 10..t {
        let o = CpuBackend
            .attn_step(
                &buf(1, qw, q[i * qw..(i + 1) * qw].to_vec()),
                &buf(1, kw, k[i * kw..(i + 1) * kw].to_vec()),
                &buf(1, kw, v[i * kw..(i + 1) * kw].to_vec()),
                &d,
                &mut [&mut c1],
            )
            .unwrap();
        got.extend(o.data);
    }
    // Same per-row kernel either way: equal bit for bit.
    assert_eq!(got, whole.data);
    // The cache refuses a row past its capacity, naming the figures.
    let e = CpuBackend
        .attn_step(
            &buf(1, qw, q[..qw].to_vec()),
            &buf(1, kw, k[..kw].to_vec()),
            &buf(1, kw, v[..kw].to_vec()),
            &d,
            &mut [&mut c1],
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("23"), "{e}");
}

fn gdn_dims() -> GdnDims {
    GdnDims {
        k_heads: 2,
        v_heads: 4,
        k_dim: 8,
        v_dim: 6,
        conv_kernel: 4,
    }
}

#[test]
fn conv_sequence_equals_steps_and_f64() {
    let mut rng = Rng(6);
    let d = gdn_dims();
    let (c, kk, t) = (d.channels(), d.conv_kernel, 9);
    let x = rng.vec(t * c, 1.0);
    let w = rng.vec(c * kk, 1.0);
    let mut s0 = CpuGdn::new(&d);
    let seq = CpuBackend
        .gdn_conv(&buf(t, c, x.clone()), &CpuVector(w.clone()), &d, &mut s0)
        .unwrap();
    let mut want = vec![0f64; t * c];
    for r in 0..t {
        for ch in 0..c {
            let mut acc = 0f64;
            for j in 0..kk {
                let src = r as isize - (kk - 1) as isize + j as isize;
                if src >= 0 {
                    acc += f64::from(w[ch * kk + j]) * f64::from(x[src as usize * c + ch]);
                }
            }
            want[r * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    assert_close("conv", &seq.data, &want, 1e-6);
    // 4 rows as a sequence, then single steps: the history carries over exactly.
    let mut s1 = CpuGdn::new(&d);
    let mut got = CpuBackend
        .gdn_conv(
            &buf(4, c, x[..4 * c].to_vec()),
            &CpuVector(w.clone()),
            &d,
            &mut s1,
        )
        .unwrap()
        .data;
    for r in 4..t {
        got.extend(
            CpuBackend
                .gdn_conv_step(
                    &buf(1, c, x[r * c..(r + 1) * c].to_vec()),
                    &CpuVector(w.clone()),
                    &d,
                    &mut [&mut s1],
                )
                .unwrap()
                .data,
        );
    }
    assert_eq!(got, seq.data);
    assert_eq!(s0.conv, s1.conv);
}

/// The gated delta rule in f64, straight from DRAMA3.md §4.3 steps 3–6.
#[allow(clippy::too_many_arguments)]
fn naive_delta(
    u: &[f32],
    b: &[f32],
    a: &[f32],
    a_log: &[f32],
    dt: &[f32],
    d: &GdnDims,
    t: usize,
    s: &mut [f64],
) -> Vec<f64> {
    let (nk, nv, dk, dv) = (d.k_heads, d.v_heads, d.k_dim, d.v_dim);
    let c = d.channels();
    let mut out = vec![0f64; t * nv * dv];
    let l2 = |x: &[f32]| -> Vec<f64> {
        let n = (x.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() + 1e-6).sqrt();
        x.iter().map(|v| f64::from(*v) / n).collect()
    };
    for r in 0..t {
        let row = &u[r * c..(r + 1) * c];
        for h in 0..nv {
            let kh = h / (nv / nk);
            let q: Vec<f64> = l2(&row[kh * dk..(kh + 1) * dk])
                .iter()
                .map(|v| v / (dk as f64).sqrt())
                .collect();
            let k = l2(&row[nk * dk + kh * dk..nk * dk + (kh + 1) * dk]);
            let v: Vec<f64> = row[2 * nk * dk + h * dv..2 * nk * dk + (h + 1) * dv]
                .iter()
                .map(|x| f64::from(*x))
                .collect();
            let beta = 1.0 / (1.0 + (-f64::from(b[r * nv + h])).exp());
            let x = f64::from(a[r * nv + h]) + f64::from(dt[h]);
            let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
            let alpha = (-f64::from(a_log[h]).exp() * sp).exp();
            let sh = &mut s[h * dk * dv..(h + 1) * dk * dv];
            sh.iter_mut().for_each(|x| *x *= alpha);
            for j in 0..dv {
                let kv: f64 = (0..dk).map(|i| sh[i * dv + j] * k[i]).sum();
                let delta = beta * (v[j] - kv);
                for i in 0..dk {
                    sh[i * dv + j] += k[i] * delta;
                }
            }
            for j in 0..dv {
                out[r * nv * dv + h * dv + j] = (0..dk).map(|i| sh[i * dv + j] * q[i]).sum();
            }
        }
    }
    out
}

#[test]
fn delta_rule_chunked_equals_recurrent_across_chunk_boundaries() {
    let mut rng = Rng(7);
    let d = gdn_dims();
    let (c, nv) = (d.channels(), d.v_heads);
    // 150 rows, fed as 70 + 80 so both calls cross a 64-row chunk boundary with carried state.
    let t = 150;
    let u = rng.vec(t * c, 1.0);
    let b = rng.vec(t * nv, 2.0);
    let a = rng.vec(t * nv, 2.0);
    let a_log = rng.vec(nv, 1.0);
    let dt = rng.vec(nv, 1.0);
    let mut s64 = vec![0f64; nv * d.k_dim * d.v_dim];
    let want = naive_delta(&u, &b, &a, &a_log, &dt, &d, t, &mut s64);
    let run = |chunked: bool, split: usize| {
        let mut st = CpuGdn::new(&d);
        let mut out = Vec::new();
        for (lo, hi) in [(0, split), (split, t)] {
            let o = CpuBackend
                .gdn_prefill(
                    &buf(hi - lo, c, u[lo * c..hi * c].to_vec()),
                    &buf(hi - lo, nv, b[lo * nv..hi * nv].to_vec()),
                    &buf(hi - lo, nv, a[lo * nv..hi * nv].to_vec()),
                    &CpuVector(a_log.clone()),
                    &CpuVector(dt.clone()),
                    &d,
                    &mut st,
                    chunked,
                )
                .unwrap();
            out.extend(o.data);
        }
        (out, st.s)
    };
    let (rec, rec_s) = run(false, 70);
    let (chk, chk_s) = run(true, 70);
    assert_close("recurrent vs f64", &rec, &want, 1e-5);
    assert_close("chunked vs f64", &chk, &want, 1e-5);
    assert_close("chunked state vs f64", &chk_s, &s64, 1e-5);
    let rec64: Vec<f64> = rec.iter().map(|v| f64::from(*v)).collect();
    assert_close("chunked vs recurrent", &chk, &rec64, 1e-5);
    let rs64: Vec<f64> = rec_s.iter().map(|v| f64::from(*v)).collect();
    assert_close("chunked vs recurrent state", &chk_s, &rs64, 1e-5);
    // Decode steps after a chunked prefill continue the same sequence.
    let mut st = CpuGdn::new(&d);
    let mut out = CpuBackend
        .gdn_prefill(
            &buf(100, c, u[..100 * c].to_vec()),
            &buf(100, nv, b[..100 * nv].to_vec()),
            &buf(100, nv, a[..100 * nv].to_vec()),
            &CpuVector(a_log.clone()),
            &CpuVector(dt.clone()),
            &d,
            &mut st,
            true,
        )
        .unwrap()
        .data;
    for r in 100..t {
        out.extend(
            CpuBackend
                .gdn_step(
                    &buf(1, c, u[r * c..(r + 1) * c].to_vec()),
                    &buf(1, nv, b[r * nv..(r + 1) * nv].to_vec()),
                    &buf(1, nv, a[r * nv..(r + 1) * nv].to_vec()),
                    &CpuVector(a_log.clone()),
                    &CpuVector(dt.clone()),
                    &d,
                    &mut [&mut st],
                )
                .unwrap()
                .data,
        );
    }
    assert_close("chunked prefill + steps vs f64", &out, &want, 1e-5);
}

#[test]
fn router_ties_go_to_the_lower_index_and_renormalise() {
    // Experts 1, 3 and 5 tie for second place; top-3 must take 1 and 3.
    let logits = vec![0.0f32, 2.0, 1.0, 2.0, 3.0, 2.0];
    let r = CpuBackend
        .route(&buf(1, 6, logits.clone()), 3, None)
        .unwrap();
    assert_eq!(r.experts[0], vec![4, 1, 3]);
    let e: Vec<f64> = [3.0f64, 2.0, 2.0].iter().map(|x| x.exp()).collect();
    let z: f64 = e.iter().sum();
    let want: Vec<f64> = e.iter().map(|x| x / z).collect();
    assert_close("router weights", &r.weights[0], &want, 1e-6);
    // A keep mask removes expert 4 before normalisation: 1, 3, 5 remain on top.
    let keep = [true, true, true, true, false, true];
    let r = CpuBackend
        .route(&buf(1, 6, logits), 3, Some(&keep))
        .unwrap();
    assert_eq!(r.experts[0], vec![1, 3, 5]);
    assert_close("masked weights", &r.weights[0], &[1.0 / 3.0; 3], 1e-6);
}

#[test]
fn moe_experts_against_f64() {
    let mut rng = Rng(8);
    let (n, h, inter, ne) = (12, 130, 140, 5);
    let x = rng.vec(n * h, 1.0);
    let mut experts = Vec::new();
    let mut deq = Vec::new();
    for _ in 0..ne {
        let (g, gd) = fp8_weight(&mut rng, inter, h);
        let (u, ud) = fp8_weight(&mut rng, inter, h);
        let (d, dd) = fp8_weight(&mut rng, h, inter);
        experts.push(Some(Expert {
            gate: g,
            up: u,
            down: d,
        }));
        deq.push((gd, ud, dd));
    }
    let logits = rng.vec(n * ne, 3.0);
    let route = CpuBackend.route(&buf(n, ne, logits), 2, None).unwrap();
    let mut want = vec![0f64; n * h];
    for i in 0..n {
        let xi = &x[i * h..(i + 1) * h];
        for (&e, &w) in route.experts[i].iter().zip(&route.weights[i]) {
            let (gd, ud, dd) = &deq[e as usize];
            let g = naive_linear(xi, 1, gd, inter, h);
            let u = naive_linear(xi, 1, ud, inter, h);
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| (g / (1.0 + (-g).exp()) * u) as f32)
                .collect();
            let y = naive_linear(&act, 1, dd, h, inter);
            for c in 0..h {
                want[i * h + c] += f64::from(w) * y[c];
            }
        }
    }
    for rows in [Rows::Exact, Rows::Bulk] {
        let y = CpuBackend
            .moe_experts(&buf(n, h, x.clone()), &route, &experts, rows)
            .unwrap();
        assert_close(&format!("moe {rows:?}"), &y.data, &want, 1e-4);
    }
}

#[test]
fn gather_sum_mixes_tables() {
    let mut rng = Rng(9);
    let (t0, d0) = bf16_weight(&mut rng, 10, 8);
    let (t1, d1) = bf16_weight(&mut rng, 30, 8);
    let rows = vec![
        GatherRow {
            picks: vec![(0, 3)],
            scale: 1.0,
        },
        GatherRow {
            picks: vec![(0, 9), (1, 12), (1, 29)],
            scale: 0.5,
        },
        GatherRow {
            picks: vec![],
            scale: 1.0,
        },
    ];
    let y = CpuBackend.gather_sum(&[&t0, &t1], &rows).unwrap();
    let mut want = vec![0f64; 24];
    for c in 0..8 {
        want[c] = d0[3 * 8 + c];
        want[8 + c] = 0.5 * (d0[9 * 8 + c] + d1[12 * 8 + c] + d1[29 * 8 + c]);
    }
    assert_close("gather_sum", &y.data, &want, 1e-6);
    assert!(CpuBackend
        .gather_sum(
            &[&t0],
            &[GatherRow {
                picks: vec![(0, 10)],
                scale: 1.0
            }]
        )
        .is_err());
}

/// `gdn_prefill_lanes` (the lane-by-lane default) equals each lane's own conv and prefill bit
/// for bit, and refuses row counts that do not match its inputs before any lane's history or
/// state moves.
#[test]
fn gdn_prefill_lanes_equals_each_lane_and_checks_first() {
    let be = CpuBackend::new();
    let d = GdnDims {
        k_heads: 2,
        v_heads: 4,
        k_dim: 8,
        v_dim: 8,
        conv_kernel: 4,
    };
    let (ch, nv) = (d.channels(), d.v_heads);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rnd = |n: usize| rng.vec(n, 1.0);
    let lens = [3usize, 1, 5];
    let total: usize = lens.iter().sum();
    let (conv, a_log, dt) = (
        CpuVector(rnd(ch * d.conv_kernel)),
        CpuVector(rnd(nv)),
        CpuVector(rnd(nv)),
    );
    let (x, b, a) = (rnd(total * ch), rnd(total * nv), rnd(total * nv));
    // states after a first 2-row prompt each, so nothing starts from zeros
    let warm = |be: &CpuBackend| {
        let mut sts = Vec::new();
        for _ in &lens {
            let mut st = be.gdn_new(&d).unwrap();
            let (wx, wb, wa) = (
                Rng(3).vec(2 * ch, 1.0),
                Rng(5).vec(2 * nv, 1.0),
                Rng(7).vec(2 * nv, 1.0),
            );
            let u = be
                .gdn_conv(&be.upload(&wx, 2, ch).unwrap(), &conv, &d, &mut st)
                .unwrap();
            be.gdn_prefill(
                &u,
                &be.upload(&wb, 2, nv).unwrap(),
                &be.upload(&wa, 2, nv).unwrap(),
                &a_log,
                &dt,
                &d,
                &mut st,
                true,
            )
            .unwrap();
            sts.push(st);
        }
        sts
    };
    let mut joined = warm(&be);
    let mut refs: Vec<&mut _> = joined.iter_mut().collect();
    let (xd, bd, ad) = (
        be.upload(&x, total, ch).unwrap(),
        be.upload(&b, total, nv).unwrap(),
        be.upload(&a, total, nv).unwrap(),
    );
    let o = be
        .gdn_prefill_lanes(&xd, &bd, &ad, &conv, &a_log, &dt, &d, &lens, &mut refs)
        .unwrap();
    let got = be.download(&o).unwrap();
    let mut solo = warm(&be);
    let mut want = Vec::new();
    let mut off = 0;
    for (&n, st) in lens.iter().zip(solo.iter_mut()) {
        let u = be
            .gdn_conv(
                &be.upload(&x[off * ch..(off + n) * ch], n, ch).unwrap(),
                &conv,
                &d,
                st,
            )
            .unwrap();
        let o = be
            .gdn_prefill(
                &u,
                &be.upload(&b[off * nv..(off + n) * nv], n, nv).unwrap(),
                &be.upload(&a[off * nv..(off + n) * nv], n, nv).unwrap(),
                &a_log,
                &dt,
                &d,
                st,
                true,
            )
            .unwrap();
        want.extend(be.download(&o).unwrap());
        off += n;
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&got), bits(&want));
    for (j, s) in joined.iter().zip(&solo) {
        assert_eq!(bits(&j.conv), bits(&s.conv));
        assert_eq!(bits(&j.s), bits(&s.s));
    }
    // b one row short: refused with the figures, and no lane moved
    let mut fresh = warm(&be);
    let before: Vec<(Vec<f32>, Vec<f32>)> = fresh
        .iter()
        .map(|s| (s.conv.clone(), s.s.clone()))
        .collect();
    let short = be.upload(&b[..(total - 1) * nv], total - 1, nv).unwrap();
    let mut refs: Vec<&mut _> = fresh.iter_mut().collect();
    let err = be
        .gdn_prefill_lanes(&xd, &short, &ad, &conv, &a_log, &dt, &d, &lens, &mut refs)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("9 rows in all") && err.contains("b of 8 rows"),
        "{err}"
    );
    for (s, (c, m)) in fresh.iter().zip(&before) {
        assert_eq!(bits(&s.conv), bits(c));
        assert_eq!(bits(&s.s), bits(m));
    }
}

/// Joined prompts' GDN (`gdn_prefill_lanes`, the trait's lane-by-lane default on the CPU): a
/// bad input is refused before any lane's conv history or state moves, so the same call with
/// good inputs afterwards equals one on fresh states (joined = lane by lane is the test above).
#[test]
fn gdn_prefill_lanes_checks_every_input_before_any_lane_moves() {
    let mut rng = Rng(11);
    let d = gdn_dims();
    let (c, nv) = (d.channels(), d.v_heads);
    let lens = [5usize, 9];
    let t: usize = lens.iter().sum();
    let qkv = rng.vec(t * c, 1.0);
    let (b, a) = (rng.vec(t * nv, 2.0), rng.vec(t * nv, 2.0));
    let conv = CpuVector(rng.vec(c * d.conv_kernel, 0.5));
    let (a_log, dt) = (CpuVector(rng.vec(nv, 1.0)), CpuVector(rng.vec(nv, 1.0)));
    let be = CpuBackend;
    let call = |states: &mut [CpuGdn], a_log: &CpuVector, dt: &CpuVector, conv: &CpuVector| {
        let mut refs: Vec<&mut CpuGdn> = states.iter_mut().collect();
        be.gdn_prefill_lanes(
            &buf(t, c, qkv.clone()),
            &buf(t, nv, b.clone()),
            &buf(t, nv, a.clone()),
            conv,
            a_log,
            dt,
            &d,
            &lens,
            &mut refs,
        )
    };
    let fresh = || vec![CpuGdn::new(&d), CpuGdn::new(&d)];
    let want = call(&mut fresh(), &a_log, &dt, &conv).unwrap().data;
    // bad a_log, dt_bias or conv lengths: refused, and nothing moved
    let short = CpuVector(rng.vec(nv - 1, 1.0));
    let short_conv = CpuVector(rng.vec(c * d.conv_kernel - 1, 0.5));
    for (al, dv, cv) in [
        (&short, &dt, &conv),
        (&a_log, &short, &conv),
        (&a_log, &dt, &short_conv),
    ] {
        let mut states = fresh();
        let err = call(&mut states, al, dv, cv).unwrap_err().to_string();
        assert!(
            err.contains("gated delta rule") || err.contains("gdn_conv"),
            "{err}"
        );
        assert!(
            states
                .iter()
                .all(|s| s.conv.iter().all(|&v| v == 0.0) && s.s.iter().all(|&v| v == 0.0)),
            "a refused call moved a lane's state: {err}"
        );
        assert_eq!(call(&mut states, &a_log, &dt, &conv).unwrap().data, want);
    }
    // a lane state of another layer's dims (the last lane's): refused before the first moves
    let other = GdnDims {
        v_dim: d.v_dim + 1,
        ..d
    };
    let mut states = vec![CpuGdn::new(&d), CpuGdn::new(&other)];
    let err = call(&mut states, &a_log, &dt, &conv)
        .unwrap_err()
        .to_string();
    assert!(err.contains("lane 1's state"), "{err}");
    assert!(
        states[0].conv.iter().all(|&v| v == 0.0) && states[0].s.iter().all(|&v| v == 0.0),
        "a refused call moved lane 0's state: {err}"
    );
}

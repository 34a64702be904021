//! Each operator against a naive f64 implementation on random inputs, and streaming (history)
//! against one-shot application, bit for bit.

use super::*;
use crate::ops::{gelu, window_attention};

/// xorshift64*: uniform in [-scale, scale).
struct Rng(u64);
impl Rng {
    fn f(&mut self, scale: f32) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let u = (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32;
        (2.0 * u - 1.0) * scale
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f(scale)).collect()
    }
}

fn to64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Max |a − b| / (1 + |b|).
fn rel_err(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "length");
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f64::max)
}

/// Applies `f` to `x` (`[L, c]`) in chunks of `chunk` rows, carrying the history.
fn chunked(x: &[f32], c: usize, chunk: usize, mut f: impl FnMut(&[f32]) -> Vec<f32>) -> Vec<f32> {
    let mut out = Vec::new();
    for part in x.chunks(chunk * c) {
        out.extend(f(part));
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn naive_conv(
    x: &[f64],
    w: &[f64],
    b: &[f64],
    cin: usize,
    cout: usize,
    k: usize,
    s: usize,
    d: usize,
) -> Vec<f64> {
    let l = x.len() / cin;
    let pad = (k - 1) * d + 1 - s;
    let t = l / s;
    let mut y = vec![0.0; t * cout];
    for r in 0..t {
        for co in 0..cout {
            let mut acc = b[co];
            for ci in 0..cin {
                for j in 0..k {
                    let idx = (r * s + j * d) as isize - pad as isize;
                    if idx >= 0 {
                        acc += w[(co * cin + ci) * k + j] * x[idx as usize * cin + ci];
                    }
                }
            }
            y[r * cout + co] = acc;
        }
    }
    y
}

#[test]
fn snake_vs_naive() {
    let mut rng = Rng(1);
    let (c, l) = (5, 40);
    let alpha = rng
        .vec(c, 2.0)
        .iter()
        .map(|a| a.abs() + 0.1)
        .collect::<Vec<_>>();
    let x = rng.vec(c * l, 3.0);
    let mut y = x.clone();
    Snake::new(alpha.clone()).forward(&mut y);
    let want: Vec<f64> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let (v, a) = (f64::from(v), f64::from(alpha[i % c]));
            v + (a * v).sin().powi(2) / (a + 1e-9)
        })
        .collect();
    assert!(rel_err(&y, &want) < 1e-5, "{}", rel_err(&y, &want));
}

#[test]
fn causal_conv_vs_naive_and_streaming() {
    let mut rng = Rng(2);
    for &(cin, cout, k, s, d) in &[
        (3, 4, 7, 1, 1),
        (3, 4, 7, 1, 3),
        (2, 5, 7, 1, 9),
        (4, 6, 4, 2, 1),
        (4, 3, 16, 8, 1),
        (3, 3, 2, 2, 1),
        (5, 2, 1, 1, 1),
        (4, 4, 3, 1, 1),
    ] {
        let l = 8 * 12;
        let w = rng.vec(cout * cin * k, 0.5);
        let b = rng.vec(cout, 0.5);
        let x = rng.vec(l * cin, 1.0);
        let conv = Conv1d::new(&w, b.clone(), cout, cin, k, s, d);
        let y = conv.forward(&mut conv.new_history(), &x);
        let want = naive_conv(&to64(&x), &to64(&w), &to64(&b), cin, cout, k, s, d);
        assert!(
            rel_err(&y, &want) < 1e-5,
            "conv {cin}->{cout} k{k} s{s} d{d}"
        );
        for chunk in [s, 2 * s, 3 * s, 40] {
            let mut h = conv.new_history();
            let yc = chunked(&x, cin, chunk, |p| conv.forward(&mut h, p));
            assert_eq!(yc, y, "conv k{k} s{s} d{d} chunk {chunk}");
        }
    }
}

#[test]
fn conv_transpose_vs_naive_and_streaming() {
    let mut rng = Rng(3);
    for &(cin, cout, k, s) in &[(4, 3, 16, 8), (3, 5, 4, 2), (4, 4, 2, 2), (2, 3, 6, 2)] {
        let l = 13;
        let w = rng.vec(cin * cout * k, 0.5);
        let b = rng.vec(cout, 0.5);
        let x = rng.vec(l * cin, 1.0);
        let ct = ConvTranspose1d::new(&w, b.clone(), cin, cout, k, s);
        let y = ct.forward(&mut ct.new_history(), &x);
        // torch ConvTranspose1d: out[i·s + j] += x[i]·w[:, :, j], length (L−1)s + k, then the
        // causal module drops the last k − s.
        let full = (l - 1) * s + k;
        let mut want = vec![0.0f64; full * cout];
        for i in 0..l {
            for j in 0..k {
                for co in 0..cout {
                    let mut acc = 0.0;
                    for ci in 0..cin {
                        acc += f64::from(x[i * cin + ci]) * f64::from(w[(ci * cout + co) * k + j]);
                    }
                    want[(i * s + j) * cout + co] += acc;
                }
            }
        }
        want.truncate(l * s * cout);
        for (i, v) in want.iter_mut().enumerate() {
            *v += f64::from(b[i % cout]);
        }
        assert!(rel_err(&y, &want) < 1e-5, "convT k{k} s{s}");
        for chunk in [1, 2, 5] {
            let mut h = ct.new_history();
            let yc = chunked(&x, cin, chunk, |p| ct.forward(&mut h, p));
            assert_eq!(yc, y, "convT chunk {chunk}");
        }
    }
}

fn random_convnext(rng: &mut Rng, c: usize) -> (ConvNeXt, Vec<f32>) {
    let hidden = 4 * c;
    let dw_w = rng.vec(c * 7, 0.5);
    let nx = ConvNeXt {
        dw: DwConv1d::new(&dw_w, rng.vec(c, 0.2), c, 7),
        ln_w: rng.vec(c, 1.0),
        ln_b: rng.vec(c, 0.3),
        pw1_w: rng.vec(hidden * c, 0.4),
        pw1_b: rng.vec(hidden, 0.2),
        pw2_w: rng.vec(c * hidden, 0.4),
        pw2_b: rng.vec(c, 0.2),
        gamma: rng.vec(c, 1.0),
        hidden,
    };
    (nx, dw_w)
}

#[test]
fn convnext_vs_naive_and_streaming() {
    let mut rng = Rng(4);
    let (c, l) = (6, 30);
    let (nx, dw_w) = random_convnext(&mut rng, c);
    let x = rng.vec(l * c, 1.0);
    let y = nx.forward(&mut nx.dw.new_history(), x.clone());

    // Naive f64: depthwise causal conv, LayerNorm(1e-6), Linear, erf-GELU, Linear, γ, residual.
    let (dw_w, dw_b) = (to64(&dw_w), to64(&nx.dw.bias));
    let h = nx.hidden;
    let mut want = Vec::with_capacity(l * c);
    for t in 0..l {
        let mut u = vec![0.0f64; c];
        for ch in 0..c {
            let mut acc = dw_b[ch];
            for j in 0..7 {
                let idx = t as isize + j as isize - 6;
                if idx >= 0 {
                    acc += dw_w[ch * 7 + j] * f64::from(x[idx as usize * c + ch]);
                }
            }
            u[ch] = acc;
        }
        let mean = u.iter().sum::<f64>() / c as f64;
        let var = u.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / c as f64;
        let n: Vec<f64> = (0..c)
            .map(|i| {
                (u[i] - mean) / (var + 1e-6).sqrt() * f64::from(nx.ln_w[i]) + f64::from(nx.ln_b[i])
            })
            .collect();
        let a: Vec<f64> = (0..h)
            .map(|o| {
                let z = f64::from(nx.pw1_b[o])
                    + (0..c)
                        .map(|i| f64::from(nx.pw1_w[o * c + i]) * n[i])
                        .sum::<f64>();
                0.5 * z * (1.0 + libm::erf(z / 2f64.sqrt()))
            })
            .collect();
        for o in 0..c {
            let z = f64::from(nx.pw2_b[o])
                + (0..h)
                    .map(|i| f64::from(nx.pw2_w[o * h + i]) * a[i])
                    .sum::<f64>();
            want.push(f64::from(x[t * c + o]) + f64::from(nx.gamma[o]) * z);
        }
    }
    assert!(rel_err(&y, &want) < 1e-5, "{}", rel_err(&y, &want));
    for chunk in [1, 4, 7] {
        let mut hist = nx.dw.new_history();
        let yc = chunked(&x, c, chunk, |p| nx.forward(&mut hist, p.to_vec()));
        assert_eq!(yc, y, "convnext chunk {chunk}");
    }
}

#[test]
fn gelu_is_exact_erf() {
    for &x in &[-3.0f32, -0.5, 0.0, 0.7, 2.5] {
        let want = 0.5 * f64::from(x) * (1.0 + libm::erf(f64::from(x) / 2f64.sqrt()));
        assert!((f64::from(gelu(x)) - want).abs() < 1e-6);
    }
}

#[test]
fn window_attention_vs_naive() {
    let mut rng = Rng(5);
    let (heads, hd, t) = (2, 4, 20);
    let w = heads * hd;
    let q = rng.vec(t * w, 1.0);
    let k = rng.vec(t * w, 1.0);
    let v = rng.vec(t * w, 1.0);
    for window in [1, 3, 7, 20, 64] {
        let y = window_attention(&q, &k, &v, 0, heads, hd, window);
        let mut want = vec![0.0f64; t * w];
        for r in 0..t {
            for h in 0..heads {
                let lo = (r + 1).saturating_sub(window);
                let s: Vec<f64> = (lo..=r)
                    .map(|j| {
                        (0..hd)
                            .map(|i| {
                                f64::from(q[r * w + h * hd + i]) * f64::from(k[j * w + h * hd + i])
                            })
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    want[r * w + h * hd + i] = (lo..=r)
                        .zip(&e)
                        .map(|(j, p)| p / z * f64::from(v[j * w + h * hd + i]))
                        .sum();
                }
            }
        }
        assert!(rel_err(&y, &want) < 1e-5, "window {window}");
        // Rows 12.. with the 12 earlier rows as history give the same rows, bit for bit.
        let yh = window_attention(&q[12 * w..], &k, &v, 12, heads, hd, window);
        assert_eq!(yh, y[12 * w..], "window {window} with history");
    }
}

fn random_transformer(
    rng: &mut Rng,
    dim: usize,
    heads: usize,
    hd: usize,
    window: usize,
) -> Transformer {
    let w = heads * hd;
    let ffn = 3 * dim;
    let layers = (0..2)
        .map(|_| TfLayer {
            attn_norm: rng.vec(dim, 1.0),
            wqkv: rng.vec(3 * w * dim, 0.5),
            wo: rng.vec(dim * w, 0.5),
            ffn_norm: rng.vec(dim, 1.0),
            w1: rng.vec(ffn * dim, 0.5),
            w3: rng.vec(ffn * dim, 0.5),
            w2: rng.vec(dim * ffn, 0.5),
            gamma_attn: rng.vec(dim, 0.5),
            gamma_ffn: rng.vec(dim, 0.5),
        })
        .collect();
    Transformer {
        layers,
        norm: rng.vec(dim, 1.0),
        dim,
        heads,
        hd,
        ffn,
        eps: 1e-5,
        window,
        rope: Rope::new(hd, 10000.0),
    }
}

/// The whole WindowLimitedTransformer in f64 from its definition (RoPE tables shared).
fn naive_transformer(tf: &Transformer, x: &[f32], pos0: u64) -> Vec<f64> {
    let (dim, heads, hd) = (tf.dim, tf.heads, tf.hd);
    let w = heads * hd;
    let t = x.len() / dim;
    let lin = |x: &[f64], wt: &[f32], cin: usize, cout: usize| -> Vec<f64> {
        let rows = x.len() / cin;
        let mut y = vec![0.0; rows * cout];
        for r in 0..rows {
            for o in 0..cout {
                y[r * cout + o] = (0..cin)
                    .map(|i| f64::from(wt[o * cin + i]) * x[r * cin + i])
                    .sum();
            }
        }
        y
    };
    let rms = |x: &[f64], wt: &[f32]| -> Vec<f64> {
        x.chunks(dim)
            .flat_map(|r| {
                let inv = 1.0
                    / (r.iter().map(|v| v * v).sum::<f64>() / dim as f64 + f64::from(tf.eps))
                        .sqrt();
                r.iter()
                    .zip(wt)
                    .map(move |(v, &g)| v * inv * f64::from(g))
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let mut x = to64(x);
    for layer in &tf.layers {
        let h = rms(&x, &layer.attn_norm);
        let qkv = lin(&h, &layer.wqkv, dim, 3 * w);
        let mut q = vec![0.0; t * w];
        let mut k = vec![0.0; t * w];
        let mut v = vec![0.0; t * w];
        for r in 0..t {
            let (cos, sin) = tf.rope.table(pos0 + r as u64);
            for hh in 0..heads {
                for p in 0..hd / 2 {
                    let (c, s) = (f64::from(cos[p]), f64::from(sin[p]));
                    for (dst, off) in [(&mut q, 0), (&mut k, w)] {
                        let a = qkv[r * 3 * w + off + hh * hd + 2 * p];
                        let b = qkv[r * 3 * w + off + hh * hd + 2 * p + 1];
                        dst[r * w + hh * hd + 2 * p] = a * c - b * s;
                        dst[r * w + hh * hd + 2 * p + 1] = b * c + a * s;
                    }
                }
            }
            v[r * w..(r + 1) * w].copy_from_slice(&qkv[r * 3 * w + 2 * w..(r + 1) * 3 * w]);
        }
        let mut att = vec![0.0; t * w];
        for r in 0..t {
            let lo = (r + 1).saturating_sub(tf.window);
            for hh in 0..heads {
                let s: Vec<f64> = (lo..=r)
                    .map(|j| {
                        (0..hd)
                            .map(|i| q[r * w + hh * hd + i] * k[j * w + hh * hd + i])
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for i in 0..hd {
                    att[r * w + hh * hd + i] = (lo..=r)
                        .zip(&e)
                        .map(|(j, p)| p / z * v[j * w + hh * hd + i])
                        .sum();
                }
            }
        }
        let o = lin(&att, &layer.wo, w, dim);
        for (i, xv) in x.iter_mut().enumerate() {
            *xv += o[i] * f64::from(layer.gamma_attn[i % dim]);
        }
        let h2 = rms(&x, &layer.ffn_norm);
        let a = lin(&h2, &layer.w1, dim, tf.ffn);
        let b = lin(&h2, &layer.w3, dim, tf.ffn);
        let ab: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(a, b)| a / (1.0 + (-a).exp()) * b)
            .collect();
        let f = lin(&ab, &layer.w2, tf.ffn, dim);
        for (i, xv) in x.iter_mut().enumerate() {
            *xv += f[i] * f64::from(layer.gamma_ffn[i % dim]);
        }
    }
    rms(&x, &tf.norm)
}

#[test]
fn transformer_vs_naive_and_streaming() {
    let mut rng = Rng(6);
    let (dim, heads, hd, window, t) = (8, 2, 4, 5, 17);
    let tf = random_transformer(&mut rng, dim, heads, hd, window);
    let x = rng.vec(t * dim, 1.0);
    let y = tf.forward(&mut tf.new_state(), &x);
    let want = naive_transformer(&tf, &x, 0);
    assert!(rel_err(&y, &want) < 1e-4, "{}", rel_err(&y, &want));
    for chunk in [1, 2, 3, 4, 16] {
        let mut st = tf.new_state();
        let yc = chunked(&x, dim, chunk, |p| tf.forward(&mut st, p));
        assert_eq!(yc, y, "transformer chunk {chunk}");
    }
}

#[test]
fn rope_table_is_bf16_of_the_reference_angle() {
    let rope = Rope::new(64, 10000.0);
    for pos in [0u64, 1, 127, 128, 2047, 5000, 262_141] {
        let (cos, sin) = rope.table(pos);
        for (i, (&c, &s)) in cos.iter().zip(&sin).enumerate() {
            assert_eq!(
                half::bf16::from_f32(c).to_f32(),
                c,
                "cos not on the bf16 grid"
            );
            assert_eq!(
                half::bf16::from_f32(s).to_f32(),
                s,
                "sin not on the bf16 grid"
            );
            let f = 1.0 / 10000f64.powf(2.0 * i as f64 / 64.0);
            let a = pos as f64 * f;
            // bf16 rounding (2^-8 relative) plus the f32 angle's rounding at large positions.
            let tol = 4e-3 + a * 2f64.powi(-23);
            assert!((f64::from(c) - a.cos()).abs() <= tol, "pos {pos} i {i}");
            assert!((f64::from(s) - a.sin()).abs() <= tol, "pos {pos} i {i}");
        }
    }
    assert_eq!(rope.table(0).0, vec![1.0; 32]);
}

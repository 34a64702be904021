//! Gated DeltaNet on the CPU: causal conv with history, the per-token recurrence (decode and
//! reference) and the chunk-64 form (prefill), DRAMA3.md §4.3.

use model::GdnDims;
use rayon::prelude::*;

use crate::linear::dot;

/// Chunk length of the chunked prefill (transformers' `torch_chunk_gated_delta_rule`).
pub const CHUNK: usize = 64;
const L2_EPS: f32 = 1e-6;

/// One lane's state of one GDN layer.
pub struct CpuGdn {
    /// The last K-1 pre-conv rows, oldest first, `[(K-1), C]` (zeros before the start).
    pub conv: Vec<f32>,
    /// Per value head, S `[dk, dv]` row-major.
    pub s: Vec<f32>,
}

impl CpuGdn {
    pub fn new(d: &GdnDims) -> Self {
        Self {
            conv: vec![0.0; (d.conv_kernel - 1) * d.channels()],
            s: vec![0.0; d.v_heads * d.k_dim * d.v_dim],
        }
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (beta 1, threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Causal depthwise conv + SiLU over `t` rows `[t, C]`, continuing `state.conv`.
pub fn conv(x: &[f32], t: usize, w: &[f32], d: &GdnDims, state: &mut CpuGdn) -> Vec<f32> {
    let (c, k) = (d.channels(), d.conv_kernel);
    let hist = k - 1;
    // Extended input: history rows then the new rows.
    let mut ext = Vec::with_capacity((hist + t) * c);
    ext.extend_from_slice(&state.conv);
    ext.extend_from_slice(&x[..t * c]);
    let mut y = vec![0f32; t * c];
    y.par_chunks_mut(c).enumerate().for_each(|(r, out)| {
        for (ch, o) in out.iter_mut().enumerate() {
            let mut acc = 0f32;
            for j in 0..k {
                acc += w[ch * k + j] * ext[(r + j) * c + ch];
            }
            *o = silu(acc);
        }
    });
    state
        .conv
        .copy_from_slice(&ext[(hist + t - hist) * c..(hist + t) * c]);
    y
}

/// Per-row inputs of one value head after the gates: normalised q (scaled), k, v, β, g.
struct HeadRow {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    beta: f32,
    g: f32,
}

fn l2norm(x: &[f32]) -> Vec<f32> {
    let inv = 1.0 / (dot(x, x) + L2_EPS).sqrt();
    x.iter().map(|v| v * inv).collect()
}

/// Gates of row `r`, value head `h`, from the conv output `u` (`[t, C]`), `b`, `a` (`[t, nv]`).
#[allow(clippy::too_many_arguments)]
fn head_row(
    u: &[f32],
    b: &[f32],
    a: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    d: &GdnDims,
    r: usize,
    h: usize,
) -> HeadRow {
    let c = d.channels();
    let (nk, nv, dk, dv) = (d.k_heads, d.v_heads, d.k_dim, d.v_dim);
    let kh = h / (nv / nk);
    let row = &u[r * c..(r + 1) * c];
    let scale = 1.0 / (dk as f32).sqrt();
    let q: Vec<f32> = l2norm(&row[kh * dk..(kh + 1) * dk])
        .into_iter()
        .map(|x| x * scale)
        .collect();
    let k = l2norm(&row[nk * dk + kh * dk..nk * dk + (kh + 1) * dk]);
    let v = row[2 * nk * dk + h * dv..2 * nk * dk + (h + 1) * dv].to_vec();
    HeadRow {
        q,
        k,
        v,
        beta: sigmoid(b[r * nv + h]),
        g: -a_log[h].exp() * softplus(a[r * nv + h] + dt_bias[h]),
    }
}

/// The recurrence for rows `0..t` of one value head: `S ← αS; δ = β(v − Sᵀk); S += kδᵀ;
/// o = Sᵀq`. Writes `o` rows into `out` (`[t, dv]` with stride `stride`).
fn recur_head(
    rows: &[HeadRow],
    s: &mut [f32],
    dk: usize,
    dv: usize,
    out: &mut [f32],
    stride: usize,
) {
    let mut kv = vec![0f32; dv];
    for (t, hr) in rows.iter().enumerate() {
        let alpha = hr.g.exp();
        s.iter_mut().for_each(|x| *x *= alpha);
        kv.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..dk {
            let ki = hr.k[i];
            for (acc, sv) in kv.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                *acc += sv * ki;
            }
        }
        for i in 0..dk {
            let ki = hr.k[i];
            for j in 0..dv {
                s[i * dv + j] += ki * (hr.v[j] - kv[j]) * hr.beta;
            }
        }
        let o = &mut out[t * stride..t * stride + dv];
        o.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..dk {
            let qi = hr.q[i];
            for (acc, sv) in o.iter_mut().zip(&s[i * dv..(i + 1) * dv]) {
                *acc += sv * qi;
            }
        }
    }
}

/// The chunked form over one value head (DRAMA3.md §4.3): within a chunk of L ≤ 64 rows,
/// `U = (I+M)⁻¹ βV`, `W = (I+M)⁻¹ (βK ⊙ e^G)` with `M_ij = β_i k_i·k_j e^{G_i−G_j}` (j < i);
/// `V' = U − W S`; `O = (Q ⊙ e^G) S + (QKᵀ ⊙ D) V'`; `S ← e^{G_L} S + Σ_j e^{G_L−G_j} k_j v'_jᵀ`.
fn chunked_head(
    rows: &[HeadRow],
    s: &mut [f32],
    dk: usize,
    dv: usize,
    out: &mut [f32],
    stride: usize,
) {
    for (ci, ch) in rows.chunks(CHUNK).enumerate() {
        let l = ch.len();
        let mut gc = vec![0f32; l];
        let mut acc = 0f32;
        for (i, r) in ch.iter().enumerate() {
            acc += r.g;
            gc[i] = acc;
        }
        // M (strictly lower), then forward substitution for U and W.
        let mut m = vec![0f32; l * l];
        for i in 0..l {
            for j in 0..i {
                m[i * l + j] = ch[i].beta * dot(&ch[i].k, &ch[j].k) * (gc[i] - gc[j]).exp();
            }
        }
        let mut u = vec![0f32; l * dv];
        let mut w = vec![0f32; l * dk];
        for i in 0..l {
            let (done_u, rest_u) = u.split_at_mut(i * dv);
            let ui = &mut rest_u[..dv];
            for (x, v) in ui.iter_mut().zip(&ch[i].v) {
                *x = ch[i].beta * v;
            }
            let (done_w, rest_w) = w.split_at_mut(i * dk);
            let wi = &mut rest_w[..dk];
            let eg = gc[i].exp();
            for (x, k) in wi.iter_mut().zip(&ch[i].k) {
                *x = ch[i].beta * k * eg;
            }
            for j in 0..i {
                let mij = m[i * l + j];
                for (x, y) in ui.iter_mut().zip(&done_u[j * dv..(j + 1) * dv]) {
                    *x -= mij * y;
                }
                for (x, y) in wi.iter_mut().zip(&done_w[j * dk..(j + 1) * dk]) {
                    *x -= mij * y;
                }
            }
        }
        // V' = U − W S.
        let mut vn = u;
        for i in 0..l {
            for a in 0..dk {
                let wa = w[i * dk + a];
                for (x, sv) in vn[i * dv..(i + 1) * dv]
                    .iter_mut()
                    .zip(&s[a * dv..(a + 1) * dv])
                {
                    *x -= wa * sv;
                }
            }
        }
        // O rows.
        for i in 0..l {
            let o = &mut out[(ci * CHUNK + i) * stride..(ci * CHUNK + i) * stride + dv];
            o.iter_mut().for_each(|x| *x = 0.0);
            let eg = gc[i].exp();
            for a in 0..dk {
                let qa = ch[i].q[a] * eg;
                for (x, sv) in o.iter_mut().zip(&s[a * dv..(a + 1) * dv]) {
                    *x += qa * sv;
                }
            }
            for j in 0..=i {
                let c = dot(&ch[i].q, &ch[j].k) * (gc[i] - gc[j]).exp();
                for (x, y) in o.iter_mut().zip(&vn[j * dv..(j + 1) * dv]) {
                    *x += c * y;
                }
            }
        }
        // State update.
        let gl = gc[l - 1];
        let el = gl.exp();
        s.iter_mut().for_each(|x| *x *= el);
        for j in 0..l {
            let f = (gl - gc[j]).exp();
            for a in 0..dk {
                let ka = ch[j].k[a] * f;
                for (x, y) in s[a * dv..(a + 1) * dv]
                    .iter_mut()
                    .zip(&vn[j * dv..(j + 1) * dv])
                {
                    *x += ka * y;
                }
            }
        }
    }
}

/// The delta rule over `t` rows of one lane; `o` is `[t, nv·dv]`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    u: &[f32],
    b: &[f32],
    a: &[f32],
    a_log: &[f32],
    dt_bias: &[f32],
    d: &GdnDims,
    t: usize,
    s: &mut [f32],
    chunked: bool,
) -> Vec<f32> {
    let (nv, dk, dv) = (d.v_heads, d.k_dim, d.v_dim);
    // Per head: its state slice and a [t, dv] output, computed in parallel.
    let outs: Vec<Vec<f32>> = s
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(h, sh)| {
            let rows: Vec<HeadRow> = (0..t)
                .map(|r| head_row(u, b, a, a_log, dt_bias, d, r, h))
                .collect();
            let mut o = vec![0f32; t * dv];
            if chunked {
                chunked_head(&rows, sh, dk, dv, &mut o, dv);
            } else {
                recur_head(&rows, sh, dk, dv, &mut o, dv);
            }
            o
        })
        .collect();
    let mut y = vec![0f32; t * nv * dv];
    for (h, o) in outs.iter().enumerate() {
        for r in 0..t {
            y[r * nv * dv + h * dv..r * nv * dv + (h + 1) * dv]
                .copy_from_slice(&o[r * dv..(r + 1) * dv]);
        }
    }
    y
}

//! Operators of the codec on time-major f32 activations (`[rows, channels]`, channels
//! contiguous). Every stateful operator takes its causal history explicitly, so one code path
//! serves the whole decode, the streaming decode and the encoder; each output element is computed
//! with the same operations whatever the chunking, which makes streaming bit-exact.

use rayon::prelude::*;

/// Pointer wrapper for writing disjoint column blocks of one matrix from several threads.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used for disjoint column ranges of one output, each written by one task.
unsafe impl Send for SendPtr {}
// SAFETY: as above; the pointer itself is never used to create overlapping references.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// By-value access, so closures capture the wrapper rather than the raw pointer field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Rows per parallel tile: about four tiles per thread, at least `min` rows.
pub(crate) fn tile_rows(rows: usize, min: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    rows.div_ceil(threads * 4).max(min).max(1)
}

/// `C[m×n] = A[m×k] · B[k×n]` with A and B strided (strides in elements) and C row-major.
/// Rows (or, for few wide rows, columns) are split across rayon; matrixmultiply computes each
/// element with the same k-order whatever the split, so results do not depend on it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    rsa: usize,
    csa: usize,
    b: &[f32],
    rsb: usize,
    csb: usize,
    c: &mut [f32],
) {
    assert_eq!(c.len(), m * n, "gemm: C has the wrong size");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.fill(0.0);
        return;
    }
    assert!(
        (m - 1) * rsa + (k - 1) * csa < a.len(),
        "gemm: A out of bounds"
    );
    assert!(
        (k - 1) * rsb + (n - 1) * csb < b.len(),
        "gemm: B out of bounds"
    );
    let threads = rayon::current_num_threads().max(1);
    if m >= 16 || n < 256 || threads == 1 {
        let rows = tile_rows(m, 8);
        c.par_chunks_mut(rows * n).enumerate().for_each(|(i, cc)| {
            let mm = cc.len() / n;
            // SAFETY: rows i*rows..i*rows+mm of A are in bounds (checked above for all m rows),
            // B is in bounds, and `cc` is exactly mm×n contiguous.
            unsafe {
                matrixmultiply::sgemm(
                    mm,
                    k,
                    n,
                    1.0,
                    a.as_ptr().add(i * rows * rsa),
                    rsa as isize,
                    csa as isize,
                    b.as_ptr(),
                    rsb as isize,
                    csb as isize,
                    0.0,
                    cc.as_mut_ptr(),
                    n as isize,
                    1,
                )
            }
        });
    } else {
        let cols = n.div_ceil(threads * 2).max(64);
        let cp = SendPtr(c.as_mut_ptr());
        (0..n.div_ceil(cols)).into_par_iter().for_each(|j| {
            let c0 = j * cols;
            let nn = cols.min(n - c0);
            // SAFETY: columns c0..c0+nn of B and C are in bounds; tasks write disjoint columns.
            unsafe {
                matrixmultiply::sgemm(
                    m,
                    k,
                    nn,
                    1.0,
                    a.as_ptr(),
                    rsa as isize,
                    csa as isize,
                    b.as_ptr().add(c0 * csb),
                    rsb as isize,
                    csb as isize,
                    0.0,
                    cp.get().add(c0),
                    n as isize,
                    1,
                )
            }
        });
    }
}

/// `y[rows, out] = x[rows, in] · Wᵀ (+ b)` with `w` stored `[out, in]` as torch's Linear.
pub(crate) fn linear(x: &[f32], cin: usize, w: &[f32], cout: usize, b: Option<&[f32]>) -> Vec<f32> {
    let rows = x.len() / cin;
    let mut y = vec![0.0f32; rows * cout];
    gemm(rows, cin, cout, x, cin, 1, w, 1, cin, &mut y);
    if let Some(b) = b {
        add_bias(&mut y, b);
    }
    y
}

pub(crate) fn add_bias(y: &mut [f32], b: &[f32]) {
    let c = b.len();
    y.par_chunks_mut(tile_rows(y.len() / c, 16) * c)
        .for_each(|ch| {
            ch.chunks_exact_mut(c)
                .for_each(|r| r.iter_mut().zip(b).for_each(|(v, b)| *v += b))
        });
}

/// Replaces the history (the last `keep` rows of `hist ++ x`) for the next call.
fn roll_history(hist: &mut Vec<f32>, x: &[f32], keep_elems: usize) {
    if keep_elems == 0 {
        hist.clear();
        return;
    }
    if x.len() >= keep_elems {
        hist.clear();
        hist.extend_from_slice(&x[x.len() - keep_elems..]);
    } else {
        let drop = hist.len() + x.len() - keep_elems;
        hist.drain(..drop);
        hist.extend_from_slice(x);
    }
}

/// Snake1d: `x + sin²(αx)/(α + 1e-9)`, α per channel; `inv` holds `1/(α + 1e-9)`.
#[derive(Debug, Clone)]
pub struct Snake {
    pub alpha: Vec<f32>,
    inv: Vec<f32>,
}

impl Snake {
    pub fn new(alpha: Vec<f32>) -> Self {
        let inv = alpha.iter().map(|&a| 1.0 / (a + 1e-9)).collect();
        Self { alpha, inv }
    }

    pub fn forward(&self, x: &mut [f32]) {
        let c = self.alpha.len();
        x.par_chunks_mut(tile_rows(x.len() / c, 64) * c)
            .for_each(|ch| {
                for row in ch.chunks_exact_mut(c) {
                    for ((v, &a), &inv) in row.iter_mut().zip(&self.alpha).zip(&self.inv) {
                        let s = (a * *v).sin();
                        *v += inv * (s * s);
                    }
                }
            });
    }
}

/// Causal Conv1d (groups 1): left context `(k−1)·d + 1 − stride` rows carried in a history.
#[derive(Debug, Clone)]
pub struct Conv1d {
    pub cin: usize,
    pub cout: usize,
    pub k: usize,
    pub stride: usize,
    pub dil: usize,
    /// `[k·cin, cout]`: row `j·cin + ci`, column `co` = torch `w[co, ci, j]`.
    wmat: Vec<f32>,
    pub bias: Vec<f32>,
}

impl Conv1d {
    /// `w` in torch layout `[cout, cin, k]`.
    pub fn new(
        w: &[f32],
        bias: Vec<f32>,
        cout: usize,
        cin: usize,
        k: usize,
        stride: usize,
        dil: usize,
    ) -> Self {
        let mut wmat = vec![0.0f32; k * cin * cout];
        for co in 0..cout {
            for ci in 0..cin {
                for j in 0..k {
                    wmat[(j * cin + ci) * cout + co] = w[(co * cin + ci) * k + j];
                }
            }
        }
        Self {
            cin,
            cout,
            k,
            stride,
            dil,
            wmat,
            bias,
        }
    }

    /// History rows kept between calls.
    pub fn history_rows(&self) -> usize {
        (self.k - 1) * self.dil + 1 - self.stride
    }

    /// A zeroed history (the causal left padding).
    pub fn new_history(&self) -> Vec<f32> {
        vec![0.0; self.history_rows() * self.cin]
    }

    /// `x`: `[L, cin]` with L a multiple of the stride; returns `[L/stride, cout]`.
    pub fn forward(&self, hist: &mut Vec<f32>, x: &[f32]) -> Vec<f32> {
        let (cin, cout, s, d, k) = (self.cin, self.cout, self.stride, self.dil, self.k);
        let l = x.len() / cin;
        debug_assert_eq!(l % s, 0);
        let t = l / s;
        let h = self.history_rows();
        debug_assert_eq!(hist.len(), h * cin);
        let mut buf = Vec::with_capacity((h + l) * cin);
        buf.extend_from_slice(hist);
        buf.extend_from_slice(x);
        let mut y = vec![0.0f32; t * cout];
        if d == 1 || k == 1 {
            // Output row r reads rows r·s..r·s+k of buf: contiguous, so A is buf itself.
            gemm(
                t,
                k * cin,
                cout,
                &buf,
                s * cin,
                1,
                &self.wmat,
                cout,
                1,
                &mut y,
            );
        } else {
            let rows = tile_rows(t, 32);
            let buf = &buf;
            y.par_chunks_mut(rows * cout)
                .enumerate()
                .for_each(|(i, yc)| {
                    let r0 = i * rows;
                    let mr = yc.len() / cout;
                    let mut col = vec![0.0f32; mr * k * cin];
                    for r in 0..mr {
                        let base = (r0 + r) * s;
                        for j in 0..k {
                            let src = (base + j * d) * cin;
                            col[(r * k + j) * cin..(r * k + j + 1) * cin]
                                .copy_from_slice(&buf[src..src + cin]);
                        }
                    }
                    gemm(mr, k * cin, cout, &col, k * cin, 1, &self.wmat, cout, 1, yc);
                });
        }
        add_bias(&mut y, &self.bias);
        roll_history(hist, x, h * cin);
        y
    }
}

/// Causal ConvTranspose1d with `k = m·stride`: the last `k − stride` outputs are dropped, so
/// input row i yields output rows `i·s..(i+1)·s` from inputs `i−m+1..=i`.
#[derive(Debug, Clone)]
pub struct ConvTranspose1d {
    pub cin: usize,
    pub cout: usize,
    pub stride: usize,
    /// Taps per output (`k / stride`).
    pub m: usize,
    /// `[m·cin, s·cout]`: row `jj·cin + ci` (input `i − (m−1−jj)`), column `r·cout + co`.
    wmat: Vec<f32>,
    pub bias: Vec<f32>,
}

impl ConvTranspose1d {
    /// `w` in torch layout `[cin, cout, k]`; `k` must be a multiple of `stride`.
    pub fn new(
        w: &[f32],
        bias: Vec<f32>,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
    ) -> Self {
        let m = k / stride;
        let mut wmat = vec![0.0f32; m * cin * stride * cout];
        for jj in 0..m {
            let j = m - 1 - jj;
            for ci in 0..cin {
                for r in 0..stride {
                    for co in 0..cout {
                        wmat[(jj * cin + ci) * stride * cout + r * cout + co] =
                            w[(ci * cout + co) * k + r + j * stride];
                    }
                }
            }
        }
        Self {
            cin,
            cout,
            stride,
            m,
            wmat,
            bias,
        }
    }

    pub fn history_rows(&self) -> usize {
        self.m - 1
    }

    pub fn new_history(&self) -> Vec<f32> {
        vec![0.0; self.history_rows() * self.cin]
    }

    /// `x`: `[L, cin]`; returns `[L·stride, cout]`.
    pub fn forward(&self, hist: &mut Vec<f32>, x: &[f32]) -> Vec<f32> {
        let (cin, cout, s, m) = (self.cin, self.cout, self.stride, self.m);
        let l = x.len() / cin;
        let mut buf = Vec::with_capacity((m - 1 + l) * cin);
        buf.extend_from_slice(hist);
        buf.extend_from_slice(x);
        let mut y = vec![0.0f32; l * s * cout];
        gemm(
            l,
            m * cin,
            s * cout,
            &buf,
            cin,
            1,
            &self.wmat,
            s * cout,
            1,
            &mut y,
        );
        add_bias(&mut y, &self.bias);
        roll_history(hist, x, (m - 1) * cin);
        y
    }
}

/// Causal depthwise Conv1d (groups = channels, stride 1, dilation 1).
#[derive(Debug, Clone)]
pub struct DwConv1d {
    pub c: usize,
    pub k: usize,
    /// `[k, c]`: tap-major so the inner loop runs over channels.
    w: Vec<f32>,
    pub bias: Vec<f32>,
}

impl DwConv1d {
    /// `w` in torch layout `[c, 1, k]`.
    pub fn new(w: &[f32], bias: Vec<f32>, c: usize, k: usize) -> Self {
        let mut wt = vec![0.0f32; k * c];
        for ch in 0..c {
            for j in 0..k {
                wt[j * c + ch] = w[ch * k + j];
            }
        }
        Self { c, k, w: wt, bias }
    }

    pub fn history_rows(&self) -> usize {
        self.k - 1
    }

    pub fn new_history(&self) -> Vec<f32> {
        vec![0.0; self.history_rows() * self.c]
    }

    pub fn forward(&self, hist: &mut Vec<f32>, x: &[f32]) -> Vec<f32> {
        let (c, k) = (self.c, self.k);
        let l = x.len() / c;
        let mut buf = Vec::with_capacity((k - 1 + l) * c);
        buf.extend_from_slice(hist);
        buf.extend_from_slice(x);
        let mut y = vec![0.0f32; l * c];
        let rows = tile_rows(l, 16);
        let buf = &buf;
        y.par_chunks_mut(rows * c).enumerate().for_each(|(i, yc)| {
            for (r, out) in yc.chunks_exact_mut(c).enumerate() {
                let t = i * rows + r;
                let mut acc = vec![0.0f32; c];
                for j in 0..k {
                    let src = &buf[(t + j) * c..(t + j + 1) * c];
                    let w = &self.w[j * c..(j + 1) * c];
                    for ((a, &xv), &wv) in acc.iter_mut().zip(src).zip(w) {
                        *a += xv * wv;
                    }
                }
                for ((o, a), b) in out.iter_mut().zip(acc).zip(&self.bias) {
                    *o = a + b;
                }
            }
        });
        roll_history(hist, x, (k - 1) * c);
        y
    }
}

/// Exact (erf) GELU.
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// LayerNorm over each row (biased variance), in place.
pub(crate) fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let c = w.len();
    x.par_chunks_mut(tile_rows(x.len() / c, 16) * c)
        .for_each(|ch| {
            for row in ch.chunks_exact_mut(c) {
                let mean = row.iter().sum::<f32>() / c as f32;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / c as f32;
                let inv = 1.0 / (var + eps).sqrt();
                for ((v, &wv), &bv) in row.iter_mut().zip(w).zip(b) {
                    *v = (*v - mean) * inv * wv + bv;
                }
            }
        });
}

/// RMSNorm over each row: `x · rsqrt(mean(x²) + eps) · w`.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let c = w.len();
    let mut y = x.to_vec();
    y.par_chunks_mut(tile_rows(x.len() / c, 16) * c)
        .for_each(|ch| {
            for row in ch.chunks_exact_mut(c) {
                let ms = row.iter().map(|v| v * v).sum::<f32>() / c as f32;
                let inv = 1.0 / (ms + eps).sqrt();
                for (v, &wv) in row.iter_mut().zip(w) {
                    *v = *v * inv * wv;
                }
            }
        });
    y
}

/// RoPE for one transformer: inverse frequencies as the reference computes them in f32.
#[derive(Debug, Clone)]
pub struct Rope {
    freqs: Vec<f32>,
}

impl Rope {
    pub fn new(head_dim: usize, base: f64) -> Self {
        // torch: 1 / base ** (arange(0, hd, 2).float() / hd), all in f32.
        let freqs = (0..head_dim / 2)
            .map(|i| {
                let e = (2 * i) as f32 / head_dim as f32;
                let p = base.powf(f64::from(e)) as f32;
                1.0 / p
            })
            .collect();
        Self { freqs }
    }

    /// `(cos, sin)` for absolute position `pos`, rounded to bf16 as the reference's table is.
    /// The angle is the exact product `pos · freq` rounded to f32 (the reference's f32 outer
    /// product), its cosine taken in f64: deterministic for any position.
    /// (An unrounded f64 angle flips some bf16 entries and misses the long golden: 3.8e-4.)
    pub fn table(&self, pos: u64) -> (Vec<f32>, Vec<f32>) {
        let mut cos = Vec::with_capacity(self.freqs.len());
        let mut sin = Vec::with_capacity(self.freqs.len());
        for &f in &self.freqs {
            let angle = f64::from((pos as f64 * f64::from(f)) as f32);
            cos.push(half::bf16::from_f32(angle.cos() as f32).to_f32());
            sin.push(half::bf16::from_f32(angle.sin() as f32).to_f32());
        }
        (cos, sin)
    }
}

/// Interleaved-pair rotation of one head vector in place.
pub(crate) fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (p, (&c, &s)) in x.chunks_exact_mut(2).zip(cos.iter().zip(sin)) {
        let (a, b) = (p[0], p[1]);
        p[0] = a * c - b * s;
        p[1] = b * c + a * s;
    }
}

/// Causal windowed attention for `q` rows at positions `pos0..`, keys/values `k_all`/`v_all`
/// whose last `q` rows are the same positions and whose first `hist` rows precede them.
/// Row t attends to the last `window` positions up to itself. Layout `[rows, heads·hd]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn window_attention(
    q: &[f32],
    k_all: &[f32],
    v_all: &[f32],
    hist: usize,
    heads: usize,
    hd: usize,
    window: usize,
) -> Vec<f32> {
    let w = heads * hd;
    let t = q.len() / w;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; t * w];
    out.par_chunks_mut(w).enumerate().for_each(|(r, orow)| {
        let me = hist + r;
        let lo = (me + 1).saturating_sub(window);
        let mut p = vec![0.0f32; me + 1 - lo];
        for h in 0..heads {
            let qh = &q[r * w + h * hd..r * w + (h + 1) * hd];
            let mut mx = f32::NEG_INFINITY;
            for (j, pj) in p.iter_mut().enumerate() {
                let kr = &k_all[(lo + j) * w + h * hd..(lo + j) * w + (h + 1) * hd];
                let s = qh.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>() * scale;
                *pj = s;
                mx = mx.max(s);
            }
            let mut sum = 0.0f32;
            for pj in p.iter_mut() {
                *pj = (*pj - mx).exp();
                sum += *pj;
            }
            let oh = &mut orow[h * hd..(h + 1) * hd];
            oh.fill(0.0);
            for (j, &pj) in p.iter().enumerate() {
                let pw = pj / sum;
                let vr = &v_all[(lo + j) * w + h * hd..(lo + j) * w + (h + 1) * hd];
                for (o, &v) in oh.iter_mut().zip(vr) {
                    *o += pw * v;
                }
            }
        }
    });
    out
}

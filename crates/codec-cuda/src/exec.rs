//! The operations the decoder and the encoder are made of, over an executor: [`HostExec`] runs
//! them with plain loops on the CPU (the same semantics as `kernels/codec.cu`, so the codec's
//! bookkeeping — layouts, histories, the KV ring, positions — is tested without a GPU), and
//! [`crate::cuda::CudaExec`] launches the kernels.

use std::cell::RefCell;

use crate::Result;

/// A place in an executor buffer: buffer id and f32 element offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P {
    pub buf: usize,
    pub off: usize,
}

impl P {
    /// `n` elements further on.
    pub fn at(self, n: usize) -> P {
        P {
            buf: self.buf,
            off: self.off + n,
        }
    }
}

/// `C[M, N] = epilogue(A · B)`, A read through an implicit im2col:
/// `A(r, kk) = a[r·rsa + (kk / cin)·jstride + kk % cin]`, B `[K, N]` row-major, C and `res`
/// `[M, N]`. Epilogue: `v = acc (+ bias[c % bias_n]) (· gamma[c]); v = res + v; tanh?`.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: P,
    pub rsa: usize,
    pub cin: usize,
    pub jstride: usize,
    pub b: P,
    pub c: P,
    pub bias: Option<P>,
    pub bias_n: usize,
    pub gamma: Option<P>,
    pub res: Option<P>,
    pub tanh: bool,
}

/// One stream's rows in a transformer step over several streams: rows `row0..row0 + rows` of
/// the step's `qkv` and attention output, its RoPE table `cs` (`rows` cos rows then `rows` sin
/// rows, as [`Exec::rope_kv_many`] reads them), its K and V rings of `ring` slots and the absolute
/// position of its first row.
#[derive(Clone, Copy, Debug)]
pub struct StreamRows {
    pub row0: usize,
    pub rows: usize,
    pub cs: P,
    pub kring: P,
    pub vring: P,
    pub ring: usize,
    pub pos0: u64,
}

/// Split-K segment length of a GEMM: a function of the layer's K and N only (never of the row
/// count), so every chunking sums the same segments in the same order.
pub fn split_len(k: usize, n: usize) -> usize {
    if n == 1 || k <= 512 {
        k.max(1)
    } else {
        256
    }
}

/// One back end for the codec's operations (all asynchronous on the GPU; `read` syncs).
pub trait Exec {
    /// A zeroed buffer of `n` f32.
    fn alloc(&self, n: usize) -> Result<usize>;
    fn free(&self, buf: usize);
    fn write(&self, dst: P, data: &[f32]) -> Result<()>;
    fn read(&self, src: P, n: usize) -> Result<Vec<f32>>;
    fn copy(&self, dst: P, src: P, n: usize) -> Result<()>;
    fn gemm(&self, g: &Gemm) -> Result<()>;
    /// `out = x + inv·sin²(αx)` over `n` elements of `c` channels.
    fn snake(&self, x: P, alpha: P, inv: P, out: P, n: usize, c: usize) -> Result<()>;
    /// `buf [k−1+l, c]` → `out [l, c]`.
    #[allow(clippy::too_many_arguments)]
    fn dwconv(&self, buf: P, w: P, b: P, out: P, l: usize, c: usize, k: usize) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(&self, x: P, w: P, b: P, out: P, rows: usize, c: usize, eps: f32) -> Result<()>;
    fn rms_norm(&self, x: P, w: P, out: P, rows: usize, c: usize, eps: f32) -> Result<()>;
    fn gelu(&self, x: P, n: usize) -> Result<()>;
    fn swiglu(&self, ab: P, out: P, rows: usize, f: usize) -> Result<()>;
    /// [`Exec::copy`] of each `(dst, src, n)`, in one launch where the back end can.
    fn copy_many(&self, list: &[(P, P, usize)]) -> Result<()> {
        for &(d, s, n) in list {
            self.copy(d, s, n)?;
        }
        Ok(())
    }
    /// Rotates each stream's rows of `qkv` (`[rows, 3·heads·hd]`: q, k, v) by RoPE with its
    /// table (cos `[rows, hd/2]` then sin), in place for q, and writes its rotated k and its v
    /// into its rings at slots `(pos0 + r) % ring`. One launch on the GPU.
    fn rope_kv_many(&self, qkv: P, streams: &[StreamRows], heads: usize, hd: usize) -> Result<()>;
    /// Causal window attention of each stream's rows over its rings (row `r` at position
    /// `pos0 + r` attends to the last `window` positions up to itself), into the same rows of
    /// `out` (`[rows, heads·hd]`). One launch on the GPU.
    fn attention_many(
        &self,
        qkv: P,
        out: P,
        streams: &[StreamRows],
        heads: usize,
        hd: usize,
        window: usize,
    ) -> Result<()>;
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;
    /// The encoder's nearest-code search, for each of `t` rows `e` of `ze` `[t, cb]`: `en =
    /// e / max(‖e‖, 1e-12)`, `dist_j = Σen² − 2·(en · book_n[j]) + cn2[j]` (sums in element
    /// order, every product and sum rounded, no fma: the CPU codec's formula), the smallest
    /// `dist_j` with ties (and all-NaN rows) to the lower index; writes the index to `codes[r]`
    /// (as f32) and `st[r] = e + (book[j] − e)` (the straight-through value). `book_n` `[n, cb]`
    /// is the l2-normalised codebook, `cn2` `[n]` its rows' Σv², `book` `[n, cb]` the codebook.
    #[allow(clippy::too_many_arguments)]
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
    ) -> Result<()>;
}

/// One row of [`Exec::vq_nearest`]: the code and the straight-through row.
pub(crate) fn vq_nearest_row(
    e: &[f32],
    book_n: &[f32],
    cn2: &[f32],
    book: &[f32],
) -> (usize, Vec<f32>) {
    let cb = e.len();
    let code = codec::nearest_code(e, book_n, cn2);
    let q = &book[code * cb..(code + 1) * cb];
    let st = e.iter().zip(q).map(|(&ze, &zq)| ze + (zq - ze)).collect();
    (code, st)
}

/// The CPU executor: every operation as a plain loop with the kernels' semantics.
#[derive(Default)]
pub struct HostExec {
    bufs: RefCell<Vec<Vec<f32>>>,
}

impl HostExec {
    pub fn new() -> Self {
        Self::default()
    }
    fn get(&self, p: P, n: usize) -> Vec<f32> {
        self.bufs.borrow()[p.buf][p.off..p.off + n].to_vec()
    }
    fn put(&self, p: P, v: &[f32]) {
        self.bufs.borrow_mut()[p.buf][p.off..p.off + v.len()].copy_from_slice(v);
    }
    fn buf_len(&self, p: P) -> usize {
        self.bufs.borrow()[p.buf].len() - p.off
    }
    /// One stream of [`Exec::rope_kv_many`] (its rows of `qkv`, its table, rings and position).
    fn rope_kv(&self, qkv: P, st: &StreamRows, heads: usize, hd: usize) -> Result<()> {
        let w = heads * hd;
        let (cs, kring, vring, t) = (st.cs, st.kring, st.vring, st.rows);
        let (pos0, ring, qkv) = (st.pos0, st.ring, qkv.at(st.row0 * 3 * w));
        let half = hd / 2;
        let mut x = self.get(qkv, t * 3 * w);
        let cs = self.get(cs, 2 * t * half);
        for r in 0..t {
            let slot = ((pos0 + r as u64) % ring as u64) as usize * w;
            let row = &mut x[r * 3 * w..(r + 1) * 3 * w];
            for h in 0..heads {
                for p in 0..half {
                    let (c, s) = (cs[r * half + p], cs[t * half + r * half + p]);
                    let o = h * hd + 2 * p;
                    let (a, b) = (row[o], row[o + 1]);
                    row[o] = a * c - b * s;
                    row[o + 1] = b * c + a * s;
                    let (ka, kb) = (row[w + o], row[w + o + 1]);
                    self.put(kring.at(slot + o), &[ka * c - kb * s, kb * c + ka * s]);
                    self.put(vring.at(slot + o), &row[2 * w + o..2 * w + o + 2]);
                }
            }
        }
        self.put(qkv, &x);
        Ok(())
    }
    /// One stream of [`Exec::attention_many`] (its rows of `qkv` into its rows of `out`).
    fn attention(
        &self,
        qkv: P,
        out: P,
        st: &StreamRows,
        heads: usize,
        hd: usize,
        window: usize,
    ) -> Result<()> {
        let w = heads * hd;
        let (kring, vring, t, pos0, ring) = (st.kring, st.vring, st.rows, st.pos0, st.ring);
        let (qkv, out) = (qkv.at(st.row0 * 3 * w), out.at(st.row0 * w));
        let x = self.get(qkv, t * 3 * w);
        let kr = self.get(kring, ring * w);
        let vr = self.get(vring, ring * w);
        let scale = 1.0 / (hd as f32).sqrt();
        let mut o = vec![0.0f32; t * w];
        for r in 0..t {
            let me = pos0 + r as u64;
            let lo = (me + 1).saturating_sub(window as u64);
            let slots: Vec<usize> = (lo..=me).map(|j| (j % ring as u64) as usize * w).collect();
            for h in 0..heads {
                let q = &x[r * 3 * w + h * hd..r * 3 * w + (h + 1) * hd];
                let mut p: Vec<f32> = slots
                    .iter()
                    .map(|&s| {
                        let k = &kr[s + h * hd..s + (h + 1) * hd];
                        q.iter().zip(k).fold(0.0f32, |a, (x, y)| x.mul_add(*y, a)) * scale
                    })
                    .collect();
                let mx = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                p.iter_mut().for_each(|v| *v = (*v - mx).exp());
                let sum = block_sum(p.iter().copied());
                for d in 0..hd {
                    let mut acc = 0.0f32;
                    for (j, &s) in slots.iter().enumerate() {
                        acc = (p[j] / sum).mul_add(vr[s + h * hd + d], acc);
                    }
                    o[r * w + h * hd + d] = acc;
                }
            }
        }
        self.put(out, &o);
        Ok(())
    }
}

fn block_sum(v: impl Iterator<Item = f32>) -> f32 {
    v.fold(0.0, |a, b| a + b)
}

impl Exec for HostExec {
    fn alloc(&self, n: usize) -> Result<usize> {
        let mut b = self.bufs.borrow_mut();
        b.push(vec![0.0; n]);
        Ok(b.len() - 1)
    }
    fn free(&self, buf: usize) {
        self.bufs.borrow_mut()[buf] = Vec::new();
    }
    fn write(&self, dst: P, data: &[f32]) -> Result<()> {
        self.put(dst, data);
        Ok(())
    }
    fn read(&self, src: P, n: usize) -> Result<Vec<f32>> {
        Ok(self.get(src, n))
    }
    fn copy(&self, dst: P, src: P, n: usize) -> Result<()> {
        let v = self.get(src, n);
        self.put(dst, &v);
        Ok(())
    }
    fn gemm(&self, g: &Gemm) -> Result<()> {
        let alen = self.buf_len(g.a);
        let a = self.get(g.a, alen);
        let b = self.get(g.b, g.k * g.n);
        let bias = g.bias.map(|p| self.get(p, g.bias_n));
        let gamma = g.gamma.map(|p| self.get(p, g.n));
        let res = g.res.map(|p| self.get(p, g.m * g.n));
        let mut c = vec![0.0f32; g.m * g.n];
        for r in 0..g.m {
            let arow: Vec<f32> = (0..g.k)
                .map(|kk| a[r * g.rsa + (kk / g.cin) * g.jstride + kk % g.cin])
                .collect();
            for col in 0..g.n {
                let ks = split_len(g.k, g.n);
                let mut v = 0.0f32;
                for (z, k0) in (0..g.k).step_by(ks).enumerate() {
                    let mut acc = 0.0f32;
                    for (kk, &av) in arow.iter().enumerate().take((k0 + ks).min(g.k)).skip(k0) {
                        acc = av.mul_add(b[kk * g.n + col], acc);
                    }
                    v = if z == 0 { acc } else { v + acc };
                }
                if let Some(bias) = &bias {
                    v += bias[col % g.bias_n];
                }
                if let Some(gm) = &gamma {
                    v *= gm[col];
                }
                if let Some(res) = &res {
                    v += res[r * g.n + col];
                }
                if g.tanh {
                    v = v.tanh();
                }
                c[r * g.n + col] = v;
            }
        }
        self.put(g.c, &c);
        Ok(())
    }
    fn snake(&self, x: P, alpha: P, inv: P, out: P, n: usize, c: usize) -> Result<()> {
        let (a, iv) = (self.get(alpha, c), self.get(inv, c));
        let mut v = self.get(x, n);
        for (i, v) in v.iter_mut().enumerate() {
            let s = (a[i % c] * *v).sin();
            *v += iv[i % c] * (s * s);
        }
        self.put(out, &v);
        Ok(())
    }
    fn dwconv(&self, buf: P, w: P, b: P, out: P, l: usize, c: usize, k: usize) -> Result<()> {
        let x = self.get(buf, (k - 1 + l) * c);
        let (w, b) = (self.get(w, k * c), self.get(b, c));
        let mut y = vec![0.0f32; l * c];
        for t in 0..l {
            for ch in 0..c {
                let mut acc = 0.0f32;
                for j in 0..k {
                    acc = x[(t + j) * c + ch].mul_add(w[j * c + ch], acc);
                }
                y[t * c + ch] = acc + b[ch];
            }
        }
        self.put(out, &y);
        Ok(())
    }
    fn layer_norm(&self, x: P, w: P, b: P, out: P, rows: usize, c: usize, eps: f32) -> Result<()> {
        let mut v = self.get(x, rows * c);
        let (w, b) = (self.get(w, c), self.get(b, c));
        for row in v.chunks_exact_mut(c) {
            let mean = block_sum(row.iter().copied()) / c as f32;
            let var = block_sum(row.iter().map(|v| (v - mean) * (v - mean))) / c as f32;
            let inv = 1.0 / (var + eps).sqrt();
            for ((v, &wv), &bv) in row.iter_mut().zip(&w).zip(&b) {
                *v = (*v - mean) * inv * wv + bv;
            }
        }
        self.put(out, &v);
        Ok(())
    }
    fn rms_norm(&self, x: P, w: P, out: P, rows: usize, c: usize, eps: f32) -> Result<()> {
        let mut v = self.get(x, rows * c);
        let w = self.get(w, c);
        for row in v.chunks_exact_mut(c) {
            let ms = block_sum(row.iter().map(|v| v * v)) / c as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for (v, &wv) in row.iter_mut().zip(&w) {
                *v = *v * inv * wv;
            }
        }
        self.put(out, &v);
        Ok(())
    }
    fn gelu(&self, x: P, n: usize) -> Result<()> {
        let mut v = self.get(x, n);
        for v in &mut v {
            *v = 0.5 * *v * (1.0 + libm::erff(*v * std::f32::consts::FRAC_1_SQRT_2));
        }
        self.put(x, &v);
        Ok(())
    }
    fn swiglu(&self, ab: P, out: P, rows: usize, f: usize) -> Result<()> {
        let v = self.get(ab, rows * 2 * f);
        let mut o = vec![0.0f32; rows * f];
        for r in 0..rows {
            for j in 0..f {
                let (a, b) = (v[r * 2 * f + j], v[r * 2 * f + f + j]);
                o[r * f + j] = a / (1.0 + (-a).exp()) * b;
            }
        }
        self.put(out, &o);
        Ok(())
    }
    fn rope_kv_many(&self, qkv: P, streams: &[StreamRows], heads: usize, hd: usize) -> Result<()> {
        for st in streams {
            self.rope_kv(qkv, st, heads, hd)?;
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
        for st in streams {
            self.attention(qkv, out, st, heads, hd, window)?;
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
        let e = self.get(e, t * q * cb);
        let w = self.get(w, q * cb * dim);
        let b = self.get(b, q * dim);
        let mut o = vec![0.0f32; t * dim];
        for r in 0..t {
            for c in 0..dim {
                let (mut z, mut zr) = (0.0f32, 0.0f32);
                for qq in 0..q {
                    let mut a = 0.0f32;
                    for k in 0..cb {
                        a = e[r * q * cb + qq * cb + k].mul_add(w[(qq * cb + k) * dim + c], a);
                    }
                    a += b[qq * dim + c];
                    match qq {
                        0 => z = a,
                        1 => zr = a,
                        _ => zr += a,
                    }
                }
                o[r * dim + c] = if q > 1 { z + zr } else { z };
            }
        }
        self.put(out, &o);
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
        let e = self.get(ze, t * cb);
        let (bn, c2, bk) = (
            self.get(book_n, n * cb),
            self.get(cn2, n),
            self.get(book, n * cb),
        );
        let mut out_codes = Vec::with_capacity(t);
        let mut out_st = Vec::with_capacity(t * cb);
        for row in e.chunks_exact(cb) {
            let (j, s) = vq_nearest_row(row, &bn, &c2, &bk);
            out_codes.push(j as f32);
            out_st.extend(s);
        }
        self.put(codes, &out_codes);
        self.put(st, &out_st);
        Ok(())
    }
}

//! The decoder over an [`Exec`]: weights read from `codec.pth` (the names, shape checks and
//! weight-norm folding of `codec`'s loader), laid out as GEMM operands `[K, N]`, and the
//! streaming step (VQ sum, the windowed post-module transformer with a KV ring, upsampling
//! ConvNeXts, the DAC decoder), every causal history kept in device buffers.

use checkpoint::pth::PthStateDict;
use codec::ops::Rope;
use codec::CodecConfig;

use crate::exec::{Exec, Gemm, P};
use crate::{CudaCodecError, Result};

/// Frames one internal step decodes at most (longer pushes are split; any split gives the
/// same samples).
pub const STEP_FRAMES: usize = 16;

fn miss(name: &str) -> CudaCodecError {
    CudaCodecError::Weights(format!("tensor {name} is missing"))
}

/// Reads tensors with `codec`'s rules: f64 values rounded to f32, shapes checked, weight norm
/// (`parametrizations.weight.original0/1`, `weight_g/weight_v`) folded in f64.
struct Reader<'a> {
    sd: &'a PthStateDict,
}

impl Reader<'_> {
    fn get64(&self, name: &str, shape: &[usize]) -> Result<Vec<f64>> {
        let t = self.sd.get(name).ok_or_else(|| miss(name))?;
        if t.shape != shape {
            return Err(CudaCodecError::Weights(format!(
                "tensor {name} has shape {:?}, expected {shape:?}",
                t.shape
            )));
        }
        Ok(t.to_f64())
    }
    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self
            .get64(name, shape)?
            .into_iter()
            .map(|v| v as f32)
            .collect())
    }
    fn has(&self, name: &str) -> bool {
        self.sd.get(name).is_some()
    }
    fn conv_weight(&self, prefix: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let param = format!("{prefix}.parametrizations.weight.original0");
        let (gname, vname) = if self.has(&param) {
            (param, format!("{prefix}.parametrizations.weight.original1"))
        } else if self.has(&format!("{prefix}.weight_g")) {
            (format!("{prefix}.weight_g"), format!("{prefix}.weight_v"))
        } else {
            return self.get(&format!("{prefix}.weight"), shape);
        };
        let mut gshape = vec![1; shape.len()];
        gshape[0] = shape[0];
        let g = self.get64(&gname, &gshape)?;
        let v = self.get64(&vname, shape)?;
        let per = (v.len() / shape[0].max(1)).max(1);
        let mut w = Vec::with_capacity(v.len());
        for (o, chunk) in v.chunks_exact(per).enumerate() {
            let norm = chunk.iter().map(|x| x * x).sum::<f64>().sqrt();
            let scale = g[o] / norm;
            w.extend(chunk.iter().map(|x| (x * scale) as f32));
        }
        Ok(w)
    }
}

/// torch Linear `[out, in]` → GEMM operand `[in, out]`.
pub(crate) fn transpose(w: &[f32], out: usize, cin: usize) -> Vec<f32> {
    let mut t = vec![0.0f32; w.len()];
    for o in 0..out {
        for i in 0..cin {
            t[i * out + o] = w[o * cin + i];
        }
    }
    t
}

/// Causal Conv1d: B `[k·cin, cout]`, history `(k−1)·dil + 1 − stride` rows.
pub(crate) struct ConvW {
    w: P,
    b: P,
    cin: usize,
    cout: usize,
    k: usize,
    stride: usize,
    dil: usize,
    hist: usize,
}

impl ConvW {
    fn hist_rows(&self) -> usize {
        (self.k - 1) * self.dil + 1 - self.stride
    }
}

/// Causal ConvTranspose1d with `k = m·stride`: B `[m·cin, s·cout]`, history `m − 1` rows.
pub(crate) struct ConvTW {
    w: P,
    b: P,
    cin: usize,
    cout: usize,
    s: usize,
    m: usize,
    hist: usize,
}

pub(crate) struct SnakeW {
    alpha: P,
    inv: P,
    c: usize,
}

pub(crate) struct NextW {
    dw_w: P,
    dw_b: P,
    ln_w: P,
    ln_b: P,
    pw1: P,
    pw1_b: P,
    pw2: P,
    pw2_b: P,
    gamma: P,
    c: usize,
    hidden: usize,
    hist: usize,
}

const DW_K: usize = 7;

pub(crate) struct LayerW {
    attn_norm: P,
    wqkv: P,
    wo: P,
    ffn_norm: P,
    w13: P,
    w2: P,
    g_attn: P,
    g_ffn: P,
}

pub(crate) struct ResW {
    s1: SnakeW,
    c1: ConvW,
    s2: SnakeW,
    c2: ConvW,
}

pub(crate) struct BlockW {
    snake: SnakeW,
    convt: ConvTW,
    res: Vec<ResW>,
}

/// Every decoder weight, uploaded; plus the host codebooks (gathered on the host per push).
pub(crate) struct Weights {
    cfg: CodecConfig,
    codebooks: Vec<(Vec<f32>, usize)>,
    cb: usize,
    vq_w: P,
    vq_b: P,
    layers: Vec<LayerW>,
    norm: P,
    heads: usize,
    hd: usize,
    ffn: usize,
    eps: f32,
    window: usize,
    rope: Rope,
    up: Vec<(ConvTW, NextW)>,
    dec_in: ConvW,
    blocks: Vec<BlockW>,
    dec_snake: SnakeW,
    dec_out: ConvW,
    /// `(rows, channels)` of every history, indexed by the layers' `hist`.
    pub(crate) hists: Vec<(usize, usize)>,
}

struct Builder<'a, E: Exec> {
    r: Reader<'a>,
    e: &'a E,
    hists: Vec<(usize, usize)>,
    bufs: Vec<usize>,
}

impl<E: Exec> Builder<'_, E> {
    fn up(&mut self, v: &[f32]) -> Result<P> {
        let b = self.e.alloc(v.len().max(1))?;
        self.bufs.push(b);
        let p = P { buf: b, off: 0 };
        self.e.write(p, v)?;
        Ok(p)
    }
    fn hist(&mut self, rows: usize, c: usize) -> usize {
        self.hists.push((rows, c));
        self.hists.len() - 1
    }
    fn snake(&mut self, prefix: &str, c: usize) -> Result<SnakeW> {
        let alpha = self.r.get(&format!("{prefix}.alpha"), &[1, c, 1])?;
        let inv: Vec<f32> = alpha.iter().map(|&a| 1.0 / (a + 1e-9)).collect();
        Ok(SnakeW {
            alpha: self.up(&alpha)?,
            inv: self.up(&inv)?,
            c,
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &mut self,
        prefix: &str,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        dil: usize,
    ) -> Result<ConvW> {
        let w = self.r.conv_weight(prefix, &[cout, cin, k])?;
        let b = self.r.get(&format!("{prefix}.bias"), &[cout])?;
        let mut wmat = vec![0.0f32; k * cin * cout];
        for co in 0..cout {
            for ci in 0..cin {
                for j in 0..k {
                    wmat[(j * cin + ci) * cout + co] = w[(co * cin + ci) * k + j];
                }
            }
        }
        let rows = (k - 1) * dil + 1 - stride;
        Ok(ConvW {
            w: self.up(&wmat)?,
            b: self.up(&b)?,
            cin,
            cout,
            k,
            stride,
            dil,
            hist: self.hist(rows, cin),
        })
    }
    fn convt(
        &mut self,
        prefix: &str,
        cin: usize,
        cout: usize,
        k: usize,
        s: usize,
    ) -> Result<ConvTW> {
        if k < s || !k.is_multiple_of(s) {
            return Err(CudaCodecError::Weights(format!(
                "{prefix}: transposed conv kernel {k} is not a multiple of its stride {s}"
            )));
        }
        let m = k / s;
        let w = self.r.conv_weight(prefix, &[cin, cout, k])?;
        let b = self.r.get(&format!("{prefix}.bias"), &[cout])?;
        let mut wmat = vec![0.0f32; m * cin * s * cout];
        for jj in 0..m {
            let j = m - 1 - jj;
            for ci in 0..cin {
                for r in 0..s {
                    for co in 0..cout {
                        wmat[(jj * cin + ci) * s * cout + r * cout + co] =
                            w[(ci * cout + co) * k + r + j * s];
                    }
                }
            }
        }
        Ok(ConvTW {
            w: self.up(&wmat)?,
            b: self.up(&b)?,
            cin,
            cout,
            s,
            m,
            hist: self.hist(m - 1, cin),
        })
    }
    fn convnext(&mut self, prefix: &str, c: usize) -> Result<NextW> {
        let hidden = 4 * c;
        let p = |s: &str| format!("{prefix}.{s}");
        let dw = self.r.get(&p("dwconv.conv.weight"), &[c, 1, DW_K])?;
        let mut wt = vec![0.0f32; DW_K * c];
        for ch in 0..c {
            for j in 0..DW_K {
                wt[j * c + ch] = dw[ch * DW_K + j];
            }
        }
        let pw1 = self.r.get(&p("pwconv1.weight"), &[hidden, c])?;
        let pw2 = self.r.get(&p("pwconv2.weight"), &[c, hidden])?;
        Ok(NextW {
            dw_w: self.up(&wt)?,
            dw_b: self.up(&self.r.get(&p("dwconv.conv.bias"), &[c])?)?,
            ln_w: self.up(&self.r.get(&p("norm.weight"), &[c])?)?,
            ln_b: self.up(&self.r.get(&p("norm.bias"), &[c])?)?,
            pw1: self.up(&transpose(&pw1, hidden, c))?,
            pw1_b: self.up(&self.r.get(&p("pwconv1.bias"), &[hidden])?)?,
            pw2: self.up(&transpose(&pw2, c, hidden))?,
            pw2_b: self.up(&self.r.get(&p("pwconv2.bias"), &[c])?)?,
            gamma: self.up(&self.r.get(&p("gamma"), &[c])?)?,
            c,
            hidden,
            hist: self.hist(DW_K - 1, c),
        })
    }
}

impl Weights {
    /// Uploads the decoder half of `sd` for `cfg`; returns the weights and the buffers made.
    pub(crate) fn load<E: Exec>(
        e: &E,
        sd: &PthStateDict,
        cfg: &CodecConfig,
    ) -> Result<(Weights, Vec<usize>)> {
        let mut b = Builder {
            r: Reader { sd },
            e,
            hists: Vec::new(),
            bufs: Vec::new(),
        };
        let q = &cfg.quantizer;
        let (dim, cb) = (q.dim, cfg.codebook_dim);
        let nq = cfg.num_codebooks();
        let mut codebooks = Vec::with_capacity(nq);
        let mut vq_w = Vec::with_capacity(nq * cb * dim);
        let mut vq_b = Vec::with_capacity(nq * dim);
        for i in 0..nq {
            let (prefix, n) = if i == 0 {
                (
                    "quantizer.semantic_quantizer.quantizers.0".to_string(),
                    cfg.semantic_codebook_size,
                )
            } else {
                (
                    format!("quantizer.quantizer.quantizers.{}", i - 1),
                    cfg.codebook_size,
                )
            };
            let out_w =
                b.r.conv_weight(&format!("{prefix}.out_proj"), &[dim, cb, 1])?;
            vq_w.extend(transpose(&out_w, dim, cb));
            vq_b.extend(b.r.get(&format!("{prefix}.out_proj.bias"), &[dim])?);
            codebooks.push((b.r.get(&format!("{prefix}.codebook.weight"), &[n, cb])?, n));
        }
        let vq_w = b.up(&vq_w)?;
        let vq_b = b.up(&vq_b)?;

        let (heads, hd, ffn) = (q.n_head, q.head_dim, q.intermediate_size);
        let w = heads * hd;
        let mut layers = Vec::with_capacity(q.n_layer);
        for l in 0..q.n_layer {
            let p = |s: &str| format!("quantizer.post_module.layers.{l}.{s}");
            let wqkv = b.r.get(&p("attention.wqkv.weight"), &[3 * w, dim])?;
            let wo = b.r.get(&p("attention.wo.weight"), &[dim, w])?;
            let w1 = b.r.get(&p("feed_forward.w1.weight"), &[ffn, dim])?;
            let w3 = b.r.get(&p("feed_forward.w3.weight"), &[ffn, dim])?;
            let w2 = b.r.get(&p("feed_forward.w2.weight"), &[dim, ffn])?;
            let mut w13 = vec![0.0f32; dim * 2 * ffn];
            for j in 0..ffn {
                for k in 0..dim {
                    w13[k * 2 * ffn + j] = w1[j * dim + k];
                    w13[k * 2 * ffn + ffn + j] = w3[j * dim + k];
                }
            }
            layers.push(LayerW {
                attn_norm: b.up(&b.r.get(&p("attention_norm.weight"), &[dim])?)?,
                wqkv: b.up(&transpose(&wqkv, 3 * w, dim))?,
                wo: b.up(&transpose(&wo, dim, w))?,
                ffn_norm: b.up(&b.r.get(&p("ffn_norm.weight"), &[dim])?)?,
                w13: b.up(&w13)?,
                w2: b.up(&transpose(&w2, dim, ffn))?,
                g_attn: b.up(&b.r.get(&p("attention_layer_scale.gamma"), &[dim])?)?,
                g_ffn: b.up(&b.r.get(&p("ffn_layer_scale.gamma"), &[dim])?)?,
            });
        }
        let extra = format!(
            "quantizer.post_module.layers.{}.attention.wqkv.weight",
            q.n_layer
        );
        if b.r.has(&extra) {
            return Err(CudaCodecError::Weights(format!(
                "post_module has more than the configured {} layers",
                q.n_layer
            )));
        }
        let norm = b.up(&b.r.get("quantizer.post_module.norm.weight", &[dim])?)?;

        let mut up = Vec::new();
        for (j, &f) in cfg.downsample_factor.iter().rev().enumerate() {
            let p = format!("quantizer.upsample.{j}");
            let ct = b.convt(&format!("{p}.0.conv"), dim, dim, f, f)?;
            let nx = b.convnext(&format!("{p}.1"), dim)?;
            up.push((ct, nx));
        }
        let dd = cfg.decoder_dim;
        let dec_in = b.conv("decoder.model.0.conv", cfg.latent_dim(), dd, 7, 1, 1)?;
        let mut blocks = Vec::new();
        let mut cin = dd;
        for (i, &stride) in cfg.decoder_rates.iter().enumerate() {
            let p = format!("decoder.model.{}", i + 1);
            let cout = dd >> (i + 1);
            let snake = b.snake(&format!("{p}.block.0"), cin)?;
            let convt = b.convt(&format!("{p}.block.1.conv"), cin, cout, 2 * stride, stride)?;
            let mut res = Vec::new();
            for (j, &dil) in [1usize, 3, 9].iter().enumerate() {
                let rp = format!("{p}.block.{}", j + 2);
                res.push(ResW {
                    s1: b.snake(&format!("{rp}.block.0"), cout)?,
                    c1: b.conv(&format!("{rp}.block.1.conv"), cout, cout, 7, 1, dil)?,
                    s2: b.snake(&format!("{rp}.block.2"), cout)?,
                    c2: b.conv(&format!("{rp}.block.3.conv"), cout, cout, 1, 1, 1)?,
                });
            }
            blocks.push(BlockW { snake, convt, res });
            cin = cout;
        }
        let nd = cfg.decoder_rates.len();
        let dec_snake = b.snake(&format!("decoder.model.{}", nd + 1), cin)?;
        let dec_out = b.conv(&format!("decoder.model.{}.conv", nd + 2), cin, 1, 7, 1, 1)?;
        let hists = std::mem::take(&mut b.hists);
        let bufs = std::mem::take(&mut b.bufs);
        Ok((
            Weights {
                cfg: cfg.clone(),
                codebooks,
                cb,
                vq_w,
                vq_b,
                layers,
                norm,
                heads,
                hd,
                ffn,
                eps: q.norm_eps,
                window: q.window,
                rope: Rope::new(hd, q.rope_base),
                up,
                dec_in,
                blocks,
                dec_snake,
                dec_out,
                hists,
            },
            bufs,
        ))
    }

    pub(crate) fn frame_length(&self) -> usize {
        self.cfg.frame_length()
    }
    pub(crate) fn num_codebooks(&self) -> usize {
        self.cfg.num_codebooks()
    }
    fn ring(&self) -> usize {
        self.window - 1 + STEP_FRAMES
    }

    /// Scratch sizes (f32) for a step of `t` frames: (work, activation, hidden).
    fn sizes(&self, t: usize) -> (usize, usize, usize) {
        let dim = self.cfg.quantizer.dim;
        let w = self.heads * self.hd;
        let mut work = 0;
        let mut act = t
            * (3 * w)
                .max(2 * self.ffn)
                .max(dim)
                .max(self.num_codebooks() * self.cb);
        let mut hid = t * self.ffn;
        let mut r = t;
        for (ct, nx) in &self.up {
            work = work.max((ct.m - 1 + r) * ct.cin);
            r *= ct.s;
            work = work.max((DW_K - 1 + r) * nx.c);
            act = act.max(r * nx.c);
            hid = hid.max(r * nx.hidden);
        }
        work = work.max((self.dec_in.hist_rows() + r) * self.dec_in.cin);
        act = act.max(r * self.dec_in.cout);
        for blk in &self.blocks {
            work = work.max((blk.convt.m - 1 + r) * blk.convt.cin);
            r *= blk.convt.s;
            act = act.max(r * blk.convt.cout);
            for ru in &blk.res {
                work = work.max((ru.c1.hist_rows() + r) * ru.c1.cin);
            }
        }
        work = work.max((self.dec_out.hist_rows() + r) * self.dec_out.cin);
        act = act.max(r);
        (work, act, hid)
    }
}

/// Per-stream device state: histories, KV rings, position, and the step scratch.
pub(crate) struct StateBufs {
    pub(crate) pos: u64,
    hists: Vec<P>,
    kring: Vec<P>,
    vring: Vec<P>,
    w0: P,
    w1: P,
    a0: P,
    a1: P,
    a2: P,
    y: P,
    hid: P,
    rope: P,
    pub(crate) bufs: Vec<usize>,
}

impl StateBufs {
    pub(crate) fn new<E: Exec>(e: &E, wt: &Weights) -> Result<StateBufs> {
        let mut bufs = Vec::new();
        let mut mk = |n: usize| -> Result<P> {
            let b = e.alloc(n.max(1))?;
            bufs.push(b);
            Ok(P { buf: b, off: 0 })
        };
        let hists = wt
            .hists
            .iter()
            .map(|&(r, c)| mk(r * c))
            .collect::<Result<Vec<_>>>()?;
        let kv = wt.ring() * wt.heads * wt.hd;
        let kring = (0..wt.layers.len())
            .map(|_| mk(kv))
            .collect::<Result<Vec<_>>>()?;
        let vring = (0..wt.layers.len())
            .map(|_| mk(kv))
            .collect::<Result<Vec<_>>>()?;
        let (work, act, hid) = wt.sizes(STEP_FRAMES);
        Ok(StateBufs {
            pos: 0,
            hists,
            kring,
            vring,
            w0: mk(work)?,
            w1: mk(work)?,
            a0: mk(act)?,
            a1: mk(act)?,
            a2: mk(act)?,
            y: mk(act)?,
            hid: mk(hid)?,
            rope: mk(STEP_FRAMES * wt.hd)?,
            bufs,
        })
    }
}

/// `A·B` through a convolution's implicit im2col, reading `work` (history then input).
#[allow(clippy::too_many_arguments)]
fn conv_gemm<E: Exec>(
    e: &E,
    cv: &ConvW,
    work: P,
    l: usize,
    out: P,
    res: Option<P>,
    tanh: bool,
) -> Result<()> {
    e.gemm(&Gemm {
        m: l / cv.stride,
        n: cv.cout,
        k: cv.k * cv.cin,
        a: work,
        rsa: cv.stride * cv.cin,
        cin: cv.cin,
        jstride: cv.dil * cv.cin,
        b: cv.w,
        c: out,
        bias: Some(cv.b),
        bias_n: cv.cout,
        gamma: None,
        res,
        tanh,
    })
}

fn linear<E: Exec>(e: &E, x: P, rows: usize, k: usize, w: P, n: usize, out: P) -> Result<()> {
    e.gemm(&Gemm {
        m: rows,
        n,
        k,
        a: x,
        rsa: k,
        cin: k,
        jstride: 0,
        b: w,
        c: out,
        bias: None,
        bias_n: 1,
        gamma: None,
        res: None,
        tanh: false,
    })
}

/// History in: `work[0..H)` = history. Returns where the input rows go.
fn hist_in<E: Exec>(e: &E, st: &StateBufs, wt: &Weights, h: usize, work: P) -> Result<P> {
    let (rows, c) = wt.hists[h];
    if rows > 0 {
        e.copy(work, st.hists[h], rows * c)?;
    }
    Ok(work.at(rows * c))
}

/// History out: the last H rows of `work` (H history + `l` input rows).
fn hist_out<E: Exec>(
    e: &E,
    st: &StateBufs,
    wt: &Weights,
    h: usize,
    work: P,
    l: usize,
) -> Result<()> {
    let (rows, c) = wt.hists[h];
    if rows > 0 {
        e.copy(st.hists[h], work.at(l * c), rows * c)?;
    }
    Ok(())
}

/// Decodes `codes` (`[num_codebooks, t]`, `t ≤ STEP_FRAMES`) into `t · frame_length` samples.
pub(crate) fn step<E: Exec>(
    e: &E,
    wt: &Weights,
    st: &mut StateBufs,
    codes: &codec::Codes,
) -> Result<Vec<f32>> {
    let t = codes.frames();
    debug_assert!(t > 0 && t <= STEP_FRAMES);
    let cfg = &wt.cfg;
    let dim = cfg.quantizer.dim;
    let (heads, hd, ffn) = (wt.heads, wt.hd, wt.ffn);
    let w = heads * hd;
    let nq = wt.num_codebooks();
    let cb = wt.cb;

    // Codebook rows gathered on the host (codes clamped to n − 1), summed on the device.
    let mut rows = vec![0.0f32; t * nq * cb];
    for f in 0..t {
        for (q, (book, n)) in wt.codebooks.iter().enumerate() {
            let c = (codes.get(q, f) as usize).min(n - 1);
            rows[(f * nq + q) * cb..(f * nq + q + 1) * cb]
                .copy_from_slice(&book[c * cb..(c + 1) * cb]);
        }
    }
    e.write(st.a2, &rows)?;
    let x = st.a0;
    e.vq_sum(st.a2, wt.vq_w, wt.vq_b, x, t, nq, cb, dim)?;

    // post_module: RoPE tables at absolute positions, exactly as the CPU codec makes them.
    let half = hd / 2;
    let mut cs = vec![0.0f32; 2 * t * half];
    for r in 0..t {
        let (c, s) = wt.rope.table(st.pos + r as u64);
        cs[r * half..(r + 1) * half].copy_from_slice(&c);
        cs[t * half + r * half..t * half + (r + 1) * half].copy_from_slice(&s);
    }
    e.write(st.rope, &cs)?;
    let ring = wt.ring();
    let (h, qkv, att) = (st.a1, st.a2, st.y);
    for (l, ly) in wt.layers.iter().enumerate() {
        e.rms_norm(x, ly.attn_norm, h, t, dim, wt.eps)?;
        linear(e, h, t, dim, ly.wqkv, 3 * w, qkv)?;
        e.rope_kv(
            qkv,
            st.rope,
            st.kring[l],
            st.vring[l],
            t,
            heads,
            hd,
            st.pos,
            ring,
        )?;
        e.attention(
            qkv,
            st.kring[l],
            st.vring[l],
            att,
            t,
            heads,
            hd,
            st.pos,
            wt.window,
            ring,
        )?;
        e.gemm(&Gemm {
            m: t,
            n: dim,
            k: w,
            a: att,
            rsa: w,
            cin: w,
            jstride: 0,
            b: ly.wo,
            c: x,
            bias: None,
            bias_n: 1,
            gamma: Some(ly.g_attn),
            res: Some(x),
            tanh: false,
        })?;
        e.rms_norm(x, ly.ffn_norm, h, t, dim, wt.eps)?;
        linear(e, h, t, dim, ly.w13, 2 * ffn, qkv)?;
        e.swiglu(qkv, st.hid, t, ffn)?;
        e.gemm(&Gemm {
            m: t,
            n: dim,
            k: ffn,
            a: st.hid,
            rsa: ffn,
            cin: ffn,
            jstride: 0,
            b: ly.w2,
            c: x,
            bias: None,
            bias_n: 1,
            gamma: Some(ly.g_ffn),
            res: Some(x),
            tanh: false,
        })?;
    }
    st.pos += t as u64;

    // Final norm straight into the first upsampler's input rows (or dec_in's).
    let mut r = t;
    let first_in = match wt.up.first() {
        Some((ct, _)) => hist_in(e, st, wt, ct.hist, st.w0)?,
        None => hist_in(e, st, wt, wt.dec_in.hist, st.w0)?,
    };
    e.rms_norm(x, wt.norm, first_in, t, dim, wt.eps)?;

    for (i, (ct, nx)) in wt.up.iter().enumerate() {
        // ConvTranspose (work w0) → dwconv input rows (work w1).
        let dw_in = hist_in(e, st, wt, nx.hist, st.w1)?;
        e.gemm(&Gemm {
            m: r,
            n: ct.s * ct.cout,
            k: ct.m * ct.cin,
            a: st.w0,
            rsa: ct.cin,
            cin: ct.cin,
            jstride: ct.cin,
            b: ct.w,
            c: dw_in,
            bias: Some(ct.b),
            bias_n: ct.cout,
            gamma: None,
            res: None,
            tanh: false,
        })?;
        hist_out(e, st, wt, ct.hist, st.w0, r)?;
        r *= ct.s;
        let c = nx.c;
        e.dwconv(st.w1, nx.dw_w, nx.dw_b, st.y, r, c, DW_K)?;
        hist_out(e, st, wt, nx.hist, st.w1, r)?;
        e.layer_norm(st.y, nx.ln_w, nx.ln_b, st.y, r, c, 1e-6)?;
        e.gemm(&Gemm {
            m: r,
            n: nx.hidden,
            k: c,
            a: st.y,
            rsa: c,
            cin: c,
            jstride: 0,
            b: nx.pw1,
            c: st.hid,
            bias: Some(nx.pw1_b),
            bias_n: nx.hidden,
            gamma: None,
            res: None,
            tanh: false,
        })?;
        e.gelu(st.hid, r * nx.hidden)?;
        let next_in = match wt.up.get(i + 1) {
            Some((ct2, _)) => hist_in(e, st, wt, ct2.hist, st.w0)?,
            None => hist_in(e, st, wt, wt.dec_in.hist, st.w0)?,
        };
        e.gemm(&Gemm {
            m: r,
            n: c,
            k: nx.hidden,
            a: st.hid,
            rsa: nx.hidden,
            cin: nx.hidden,
            jstride: 0,
            b: nx.pw2,
            c: next_in,
            bias: Some(nx.pw2_b),
            bias_n: c,
            gamma: Some(nx.gamma),
            res: Some(dw_in),
            tanh: false,
        })?;
    }

    // DAC decoder.
    let (mut cur, mut other) = (st.a0, st.a1);
    conv_gemm(e, &wt.dec_in, st.w0, r, cur, None, false)?;
    hist_out(e, st, wt, wt.dec_in.hist, st.w0, r)?;
    for blk in &wt.blocks {
        let ct = &blk.convt;
        let ct_in = hist_in(e, st, wt, ct.hist, st.w0)?;
        e.snake(
            cur,
            blk.snake.alpha,
            blk.snake.inv,
            ct_in,
            r * blk.snake.c,
            blk.snake.c,
        )?;
        e.gemm(&Gemm {
            m: r,
            n: ct.s * ct.cout,
            k: ct.m * ct.cin,
            a: st.w0,
            rsa: ct.cin,
            cin: ct.cin,
            jstride: ct.cin,
            b: ct.w,
            c: other,
            bias: Some(ct.b),
            bias_n: ct.cout,
            gamma: None,
            res: None,
            tanh: false,
        })?;
        hist_out(e, st, wt, ct.hist, st.w0, r)?;
        r *= ct.s;
        std::mem::swap(&mut cur, &mut other);
        let c = ct.cout;
        for ru in &blk.res {
            let c1_in = hist_in(e, st, wt, ru.c1.hist, st.w1)?;
            e.snake(cur, ru.s1.alpha, ru.s1.inv, c1_in, r * c, c)?;
            conv_gemm(e, &ru.c1, st.w1, r, st.y, None, false)?;
            hist_out(e, st, wt, ru.c1.hist, st.w1, r)?;
            e.snake(st.y, ru.s2.alpha, ru.s2.inv, st.y, r * c, c)?;
            conv_gemm(e, &ru.c2, st.y, r, cur, Some(cur), false)?;
        }
    }
    let c = wt.dec_snake.c;
    let out_in = hist_in(e, st, wt, wt.dec_out.hist, st.w0)?;
    e.snake(cur, wt.dec_snake.alpha, wt.dec_snake.inv, out_in, r * c, c)?;
    conv_gemm(e, &wt.dec_out, st.w0, r, st.a2, None, true)?;
    hist_out(e, st, wt, wt.dec_out.hist, st.w0, r)?;
    debug_assert_eq!(r, t * wt.frame_length());
    e.read(st.a2, r)
}

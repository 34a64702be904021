//! The decoder over an [`Exec`]: weights read from `codec.pth` (the names, shape checks and
//! weight-norm folding of `codec`'s loader), laid out as GEMM operands `[K, N]`, and the
//! streaming step (VQ sum, the windowed post-module transformer with a KV ring, upsampling
//! ConvNeXts, the DAC decoder), every causal history kept in device buffers.

use checkpoint::pth::PthStateDict;
use codec::ops::Rope;
use codec::CodecConfig;

use crate::exec::{Exec, Gemm, StreamRows, P};
use crate::{CudaCodecError, Result};

/// Frames one internal step decodes at most by default (longer pushes are split; any split
/// gives the same samples), and the encoder's step.
pub const STEP_FRAMES: usize = 16;

/// The most frames a decoder step may be set to take ([`crate::CudaDecoder::set_step_frames`]):
/// the engine's largest decoder call. A step's fixed cost (its ~150 launches and the
/// post-module's weights read once) is paid once per step, so a call of more frames than the
/// step pays it again.
pub const MAX_STEP_FRAMES: usize = 64;

fn miss(name: &str) -> CudaCodecError {
    CudaCodecError::Weights(format!("tensor {name} is missing"))
}

/// Reads tensors with `codec`'s rules: f64 values rounded to f32, shapes checked, weight norm
/// (`parametrizations.weight.original0/1`, `weight_g/weight_v`) folded in f64.
pub(crate) struct Reader<'a> {
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
    pub(crate) fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Ok(self
            .get64(name, shape)?
            .into_iter()
            .map(|v| v as f32)
            .collect())
    }
    pub(crate) fn has(&self, name: &str) -> bool {
        self.sd.get(name).is_some()
    }
    pub(crate) fn conv_weight(&self, prefix: &str, shape: &[usize]) -> Result<Vec<f32>> {
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
    pub(crate) cin: usize,
    pub(crate) cout: usize,
    k: usize,
    pub(crate) stride: usize,
    dil: usize,
    pub(crate) hist: usize,
}

impl ConvW {
    pub(crate) fn hist_rows(&self) -> usize {
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
    pub(crate) alpha: P,
    pub(crate) inv: P,
    pub(crate) c: usize,
}

/// ConvNeXt block: causal depthwise conv (history `DW_K − 1` rows), LayerNorm, pw1, GELU, pw2,
/// LayerScale, residual.
pub(crate) struct NextW {
    pub(crate) dw_w: P,
    pub(crate) dw_b: P,
    pub(crate) ln_w: P,
    pub(crate) ln_b: P,
    pub(crate) pw1: P,
    pub(crate) pw1_b: P,
    pub(crate) pw2: P,
    pub(crate) pw2_b: P,
    pub(crate) gamma: P,
    pub(crate) c: usize,
    pub(crate) hidden: usize,
    pub(crate) hist: usize,
}

/// Taps of the ConvNeXt depthwise convolution.
pub(crate) const DW_K: usize = 7;

/// The rest of a ConvNeXt block once its depthwise output `y` `[r, c]` is in place:
/// `out = x + γ ⊙ pw2(GELU(pw1(LayerNorm(y))))`, `hid` the `[r, hidden]` scratch (the encoder's
/// and decoder's blocks alike).
#[allow(clippy::too_many_arguments)]
pub(crate) fn convnext_mlp<E: Exec>(
    e: &E,
    nx: &NextW,
    y: P,
    hid: P,
    x: P,
    out: P,
    r: usize,
) -> Result<()> {
    let c = nx.c;
    e.layer_norm(y, nx.ln_w, nx.ln_b, y, r, c, 1e-6)?;
    e.gemm(&Gemm {
        m: r,
        n: nx.hidden,
        k: c,
        a: y,
        rsa: c,
        cin: c,
        jstride: 0,
        b: nx.pw1,
        c: hid,
        bias: Some(nx.pw1_b),
        bias_n: nx.hidden,
        gamma: None,
        res: None,
        tanh: false,
    })?;
    e.gelu(hid, r * nx.hidden)?;
    e.gemm(&Gemm {
        m: r,
        n: c,
        k: nx.hidden,
        a: hid,
        rsa: nx.hidden,
        cin: nx.hidden,
        jstride: 0,
        b: nx.pw2,
        c: out,
        bias: Some(nx.pw2_b),
        bias_n: c,
        gamma: Some(nx.gamma),
        res: Some(x),
        tanh: false,
    })
}

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

/// A WindowLimitedTransformer: causal, RoPE at absolute positions (the CPU codec's table),
/// attention over the last `window` rows (self included) kept in a KV ring, final RMSNorm.
pub(crate) struct TfW {
    layers: Vec<LayerW>,
    pub(crate) norm: P,
    pub(crate) dim: usize,
    pub(crate) heads: usize,
    pub(crate) hd: usize,
    pub(crate) ffn: usize,
    pub(crate) eps: f32,
    pub(crate) window: usize,
    rope: Rope,
}

impl TfW {
    /// Layers (one K ring and one V ring each).
    pub(crate) fn n_layers(&self) -> usize {
        self.layers.len()
    }
    /// Ring slots for steps of at most `rows` rows: the window's history plus one step.
    pub(crate) fn ring(&self, rows: usize) -> usize {
        self.window - 1 + rows
    }
    /// Scratch sizes (f32) for a step of `t` rows: (h, qkv / w1‖w3 output, attention, hidden).
    pub(crate) fn scratch(&self, t: usize) -> (usize, usize, usize, usize) {
        let w = self.heads * self.hd;
        (
            t * self.dim,
            t * (3 * w).max(2 * self.ffn),
            t * w,
            t * self.ffn,
        )
    }
}

/// Where a transformer step keeps its intermediates (none may alias the rows `x`).
pub(crate) struct TfScratch {
    pub(crate) h: P,
    pub(crate) qkv: P,
    pub(crate) att: P,
    pub(crate) hid: P,
    /// `t · hd` floats: the RoPE cos then sin tables of the step's rows.
    pub(crate) rope: P,
}

/// Residual unit: `x + Conv1x1(Snake(Conv7_dil(Snake(x))))`.
pub(crate) struct ResW {
    pub(crate) s1: SnakeW,
    pub(crate) c1: ConvW,
    pub(crate) s2: SnakeW,
    pub(crate) c2: ConvW,
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
    pub(crate) post: TfW,
    up: Vec<(ConvTW, NextW)>,
    dec_in: ConvW,
    blocks: Vec<BlockW>,
    dec_snake: SnakeW,
    dec_out: ConvW,
    /// `(rows, channels)` of every history, indexed by the layers' `hist`.
    pub(crate) hists: Vec<(usize, usize)>,
}

/// Uploads weights read through a [`Reader`], recording the buffers made and every causal
/// history a layer needs (`(rows, channels)`, indexed by the layer's `hist`).
pub(crate) struct Builder<'a, E: Exec> {
    pub(crate) r: Reader<'a>,
    e: &'a E,
    pub(crate) hists: Vec<(usize, usize)>,
    pub(crate) bufs: Vec<usize>,
}

impl<'a, E: Exec> Builder<'a, E> {
    pub(crate) fn new(e: &'a E, sd: &'a PthStateDict) -> Self {
        Builder {
            r: Reader { sd },
            e,
            hists: Vec::new(),
            bufs: Vec::new(),
        }
    }
    pub(crate) fn up(&mut self, v: &[f32]) -> Result<P> {
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
    pub(crate) fn snake(&mut self, prefix: &str, c: usize) -> Result<SnakeW> {
        let alpha = self.r.get(&format!("{prefix}.alpha"), &[1, c, 1])?;
        let inv: Vec<f32> = alpha.iter().map(|&a| 1.0 / (a + 1e-9)).collect();
        Ok(SnakeW {
            alpha: self.up(&alpha)?,
            inv: self.up(&inv)?,
            c,
        })
    }
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn conv(
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
    pub(crate) fn convnext(&mut self, prefix: &str, c: usize) -> Result<NextW> {
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

impl<E: Exec> Builder<'_, E> {
    /// A residual unit at `prefix` (`.block.0` … `.block.3`) on `c` channels.
    pub(crate) fn res_unit(&mut self, prefix: &str, c: usize, dil: usize) -> Result<ResW> {
        Ok(ResW {
            s1: self.snake(&format!("{prefix}.block.0"), c)?,
            c1: self.conv(&format!("{prefix}.block.1.conv"), c, c, 7, 1, dil)?,
            s2: self.snake(&format!("{prefix}.block.2"), c)?,
            c2: self.conv(&format!("{prefix}.block.3.conv"), c, c, 1, 1, 1)?,
        })
    }

    /// The transformer at `prefix` (`.layers.{l}.…`, `.norm.weight`); a checkpoint with more
    /// layers than `n_layer` is refused.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn transformer(
        &mut self,
        prefix: &str,
        n_layer: usize,
        dim: usize,
        heads: usize,
        hd: usize,
        ffn: usize,
        eps: f32,
        window: usize,
        rope_base: f64,
    ) -> Result<TfW> {
        let w = heads * hd;
        let mut layers = Vec::with_capacity(n_layer);
        for l in 0..n_layer {
            let p = |s: &str| format!("{prefix}.layers.{l}.{s}");
            let wqkv = self.r.get(&p("attention.wqkv.weight"), &[3 * w, dim])?;
            let wo = self.r.get(&p("attention.wo.weight"), &[dim, w])?;
            let w1 = self.r.get(&p("feed_forward.w1.weight"), &[ffn, dim])?;
            let w3 = self.r.get(&p("feed_forward.w3.weight"), &[ffn, dim])?;
            let w2 = self.r.get(&p("feed_forward.w2.weight"), &[dim, ffn])?;
            let mut w13 = vec![0.0f32; dim * 2 * ffn];
            for j in 0..ffn {
                for k in 0..dim {
                    w13[k * 2 * ffn + j] = w1[j * dim + k];
                    w13[k * 2 * ffn + ffn + j] = w3[j * dim + k];
                }
            }
            layers.push(LayerW {
                attn_norm: self.up(&self.r.get(&p("attention_norm.weight"), &[dim])?)?,
                wqkv: self.up(&transpose(&wqkv, 3 * w, dim))?,
                wo: self.up(&transpose(&wo, dim, w))?,
                ffn_norm: self.up(&self.r.get(&p("ffn_norm.weight"), &[dim])?)?,
                w13: self.up(&w13)?,
                w2: self.up(&transpose(&w2, dim, ffn))?,
                g_attn: self.up(&self.r.get(&p("attention_layer_scale.gamma"), &[dim])?)?,
                g_ffn: self.up(&self.r.get(&p("ffn_layer_scale.gamma"), &[dim])?)?,
            });
        }
        let extra = format!("{prefix}.layers.{n_layer}.attention.wqkv.weight");
        if self.r.has(&extra) {
            return Err(CudaCodecError::Weights(format!(
                "{prefix} has more than the configured {n_layer} layers ({extra})"
            )));
        }
        Ok(TfW {
            layers,
            norm: self.up(&self.r.get(&format!("{prefix}.norm.weight"), &[dim])?)?,
            dim,
            heads,
            hd,
            ffn,
            eps,
            window,
            rope: Rope::new(hd, rope_base),
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
        let mut b = Builder::new(e, sd);
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

        let post = b.transformer(
            "quantizer.post_module",
            q.n_layer,
            dim,
            q.n_head,
            q.head_dim,
            q.intermediate_size,
            q.norm_eps,
            q.window,
            q.rope_base,
        )?;

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
                post,
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
    /// Scratch sizes (f32) for a step of `frames` frames in all over `streams` streams (each
    /// level's rows: the frames' and a gap a stream, [`step`]'s layout), and the most split-K
    /// partial sums one of its GEMMs can hold (K segments x rows x columns, whether or not the
    /// executor splits it: `CudaExec`'s partials buffer).
    pub(crate) fn scratch_sizes(&self, frames: usize, streams: usize) -> ScratchSizes {
        let levels = self.levels();
        let rows = |l: usize| levels[l].rows(frames, streams);
        let mut part = 0;
        let mut gemm = |m: usize, k: usize, n: usize| {
            let nseg = k.div_ceil(crate::exec::split_len(k, n));
            if n > 1 && nseg > 1 {
                part = part.max(nseg * m * n);
            }
        };
        let p = &self.post;
        let (w, t0) = (p.heads * p.hd, rows(0));
        let (h, qkv, att, mut hid) = p.scratch(t0);
        for (k, n) in [
            (p.dim, 3 * w),
            (w, p.dim),
            (p.dim, 2 * p.ffn),
            (p.ffn, p.dim),
        ] {
            gemm(t0, k, n);
        }
        let mut work = t0 * p.dim;
        let mut act = h.max(qkv).max(att).max(t0 * self.num_codebooks() * self.cb);
        let mut l = 0;
        for (ct, nx) in &self.up {
            // the ConvTranspose's rows (from level l) before they go to their places
            let ct_rows = rows(l) - levels[l].gap;
            gemm(ct_rows, ct.m * ct.cin, ct.s * ct.cout);
            work = work.max(rows(l) * ct.cin);
            act = act.max(ct_rows * ct.s * ct.cout);
            l += 1;
            gemm(rows(l), nx.c, nx.hidden);
            gemm(rows(l), nx.hidden, nx.c);
            work = work.max(rows(l) * nx.c);
            act = act.max(rows(l) * nx.c);
            hid = hid.max(rows(l) * nx.hidden);
        }
        let conv = |l: usize, cv: &ConvW| (rows(l), cv.k * cv.cin, cv.cout);
        let (m, k, n) = conv(l, &self.dec_in);
        gemm(m, k, n);
        work = work.max(rows(l) * self.dec_in.cin);
        act = act.max(rows(l) * self.dec_in.cout);
        for blk in &self.blocks {
            let ct = &blk.convt;
            let ct_rows = rows(l) - levels[l].gap;
            gemm(ct_rows, ct.m * ct.cin, ct.s * ct.cout);
            work = work.max(rows(l) * ct.cin);
            act = act.max(ct_rows * ct.s * ct.cout);
            l += 1;
            act = act.max(rows(l) * ct.cout);
            for ru in &blk.res {
                for cv in [&ru.c1, &ru.c2] {
                    let (m, k, n) = conv(l, cv);
                    gemm(m, k, n);
                }
                work = work.max(rows(l) * ru.c1.cin);
            }
        }
        let (m, k, n) = conv(l, &self.dec_out);
        gemm(m, k, n);
        work = work.max(rows(l) * self.dec_out.cin);
        act = act.max(rows(l) * self.dec_out.cout);
        ScratchSizes {
            work,
            act,
            hid,
            rope: frames * p.hd,
            part,
        }
    }
}

/// Per-stream device state: histories, KV rings and position (a step's scratch is the
/// decoder's, [`Scratch`], shared by its streams: one push runs at a time).
pub(crate) struct StateBufs {
    pub(crate) pos: u64,
    /// KV ring slots: the window's history plus the largest step this state takes.
    ring: usize,
    hists: Vec<P>,
    kring: Vec<P>,
    vring: Vec<P>,
    pub(crate) bufs: Vec<usize>,
}

impl StateBufs {
    /// The most frames a step of this state may take (its ring's room).
    pub(crate) fn max_step(&self, wt: &Weights) -> usize {
        self.ring + 1 - wt.post.window
    }

    /// For steps of up to `step` frames (1 to [`MAX_STEP_FRAMES`]).
    pub(crate) fn new<E: Exec>(e: &E, wt: &Weights, step: usize) -> Result<StateBufs> {
        let ring = wt.post.ring(step.clamp(1, MAX_STEP_FRAMES));
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
        let kv = ring * wt.post.heads * wt.post.hd;
        let kring = (0..wt.post.n_layers())
            .map(|_| mk(kv))
            .collect::<Result<Vec<_>>>()?;
        let vring = (0..wt.post.n_layers())
            .map(|_| mk(kv))
            .collect::<Result<Vec<_>>>()?;
        Ok(StateBufs {
            pos: 0,
            ring,
            hists,
            kring,
            vring,
            bufs,
        })
    }
}

/// A step's scratch for up to `frames` frames: the work buffers (history then input rows), the
/// activations and the ConvNeXt hidden rows. One a decoder, whichever stream it steps: before,
/// every stream held its own, ~76 MB at 16 frames and Drama 3 geometry (2.4 GB at 32 lanes, none
/// of it in the memory plan).
pub(crate) struct Scratch {
    pub(crate) sizes: ScratchSizes,
    w0: P,
    w1: P,
    a0: P,
    a1: P,
    a2: P,
    y: P,
    hid: P,
    rope: P,
    bufs: Vec<usize>,
}

/// Elements of a [`Scratch`]'s buffers: two work buffers, four activations, the ConvNeXt
/// hidden rows and the RoPE tables; and of the most split-K partial sums a step's GEMM can
/// hold (the executor's buffer, not the scratch's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ScratchSizes {
    pub(crate) work: usize,
    pub(crate) act: usize,
    pub(crate) hid: usize,
    pub(crate) rope: usize,
    pub(crate) part: usize,
}

impl ScratchSizes {
    /// Every buffer at least as large as both.
    pub(crate) fn max(self, o: ScratchSizes) -> ScratchSizes {
        ScratchSizes {
            work: self.work.max(o.work),
            act: self.act.max(o.act),
            hid: self.hid.max(o.hid),
            rope: self.rope.max(o.rope),
            part: self.part.max(o.part),
        }
    }
    /// Whether every buffer holds `o`'s.
    pub(crate) fn holds(self, o: ScratchSizes) -> bool {
        self.max(o) == self
    }
    /// Elements in all, the partial sums included.
    pub(crate) fn elems(self) -> usize {
        2 * self.work + 4 * self.act + self.hid + self.rope + self.part
    }
}

impl Scratch {
    /// Buffers of `sizes`; none left allocated if one cannot be.
    pub(crate) fn new<E: Exec>(e: &E, sizes: ScratchSizes) -> Result<Scratch> {
        let mut bufs = Vec::new();
        let mut mk = |n: usize| -> Result<P> {
            let b = e.alloc(n.max(1))?;
            bufs.push(b);
            Ok(P { buf: b, off: 0 })
        };
        let made = (|| {
            Ok::<_, CudaCodecError>([
                mk(sizes.work)?,
                mk(sizes.work)?,
                mk(sizes.act)?,
                mk(sizes.act)?,
                mk(sizes.act)?,
                mk(sizes.act)?,
                mk(sizes.hid)?,
                mk(sizes.rope)?,
            ])
        })();
        match made {
            Ok([w0, w1, a0, a1, a2, y, hid, rope]) => Ok(Scratch {
                sizes,
                w0,
                w1,
                a0,
                a1,
                a2,
                y,
                hid,
                rope,
                bufs,
            }),
            Err(err) => {
                for b in bufs {
                    e.free(b);
                }
                Err(err)
            }
        }
    }

    /// Frees the buffers; the sizes they had.
    pub(crate) fn free<E: Exec>(self, e: &E) -> ScratchSizes {
        for b in self.bufs {
            e.free(b);
        }
        self.sizes
    }
}

/// `A·B` through a convolution's implicit im2col, reading `work` (history then input).
#[allow(clippy::too_many_arguments)]
pub(crate) fn conv_gemm<E: Exec>(
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

/// `out [rows, n] = x [rows, k] · w [k, n]`, no bias.
pub(crate) fn linear<E: Exec>(
    e: &E,
    x: P,
    rows: usize,
    k: usize,
    w: P,
    n: usize,
    out: P,
) -> Result<()> {
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

/// History in: `work[0..H)` = the history `hist` of `rows × c`. Returns where the input rows go.
pub(crate) fn copy_hist_in<E: Exec>(
    e: &E,
    hist: P,
    (rows, c): (usize, usize),
    work: P,
) -> Result<P> {
    if rows > 0 {
        e.copy(work, hist, rows * c)?;
    }
    Ok(work.at(rows * c))
}

/// History out: the last H rows of `work` (H history + `l` input rows) into `hist`.
pub(crate) fn copy_hist_out<E: Exec>(
    e: &E,
    hist: P,
    (rows, c): (usize, usize),
    work: P,
    l: usize,
) -> Result<()> {
    if rows > 0 {
        e.copy(hist, work.at(l * c), rows * c)?;
    }
    Ok(())
}

/// One stream's rows in a transformer step: rows `row0..row0 + rows` of the step's `x`, at
/// absolute positions `pos..pos + rows`, keys and values kept in its per-layer rings (`ring`
/// slots, at least `window − 1 + rows`).
pub(crate) struct TfStream<'a> {
    pub(crate) row0: usize,
    pub(crate) rows: usize,
    pub(crate) pos: u64,
    pub(crate) kring: &'a [P],
    pub(crate) vring: &'a [P],
    pub(crate) ring: usize,
}

/// The layers of transformer `tw` over `t` rows `x` (`[t, dim]`, updated in place) holding the
/// rows of `streams` (rows of none, a step's gaps, go through the row-wise layers and are
/// left out of RoPE and attention). The final RMSNorm is left to the caller (it picks the
/// output).
pub(crate) fn transformer_layers<E: Exec>(
    e: &E,
    tw: &TfW,
    streams: &[TfStream],
    s: &TfScratch,
    x: P,
    t: usize,
) -> Result<()> {
    let (dim, heads, hd, ffn) = (tw.dim, tw.heads, tw.hd, tw.ffn);
    let w = heads * hd;
    // RoPE tables at absolute positions, exactly as the CPU codec makes them: a stream's cos
    // rows then its sin rows, the streams one after another.
    let half = hd / 2;
    let mut cs = Vec::with_capacity(streams.iter().map(|st| st.rows * hd).sum());
    let mut cs_at = Vec::with_capacity(streams.len());
    for st in streams {
        debug_assert!(st.rows + tw.window - 1 <= st.ring && st.row0 + st.rows <= t);
        cs_at.push(cs.len());
        let tables: Vec<_> = (0..st.rows)
            .map(|r| tw.rope.table(st.pos + r as u64))
            .collect();
        for (c, _) in &tables {
            cs.extend_from_slice(&c[..half]);
        }
        for (_, sn) in &tables {
            cs.extend_from_slice(&sn[..half]);
        }
    }
    e.write(s.rope, &cs)?;
    for (l, ly) in tw.layers.iter().enumerate() {
        let rows: Vec<StreamRows> = streams
            .iter()
            .zip(&cs_at)
            .map(|(st, &at)| StreamRows {
                row0: st.row0,
                rows: st.rows,
                cs: s.rope.at(at),
                kring: st.kring[l],
                vring: st.vring[l],
                ring: st.ring,
                pos0: st.pos,
            })
            .collect();
        e.rms_norm(x, ly.attn_norm, s.h, t, dim, tw.eps)?;
        linear(e, s.h, t, dim, ly.wqkv, 3 * w, s.qkv)?;
        e.rope_kv_many(s.qkv, &rows, heads, hd)?;
        e.attention_many(s.qkv, s.att, &rows, heads, hd, tw.window)?;
        e.gemm(&Gemm {
            m: t,
            n: dim,
            k: w,
            a: s.att,
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
        e.rms_norm(x, ly.ffn_norm, s.h, t, dim, tw.eps)?;
        linear(e, s.h, t, dim, ly.w13, 2 * ffn, s.qkv)?;
        e.swiglu(s.qkv, s.hid, t, ffn)?;
        e.gemm(&Gemm {
            m: t,
            n: dim,
            k: ffn,
            a: s.hid,
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
    Ok(())
}

/// A level of a decoder step: the rows one frame makes at it, and the gap left before each
/// stream's rows (the most history rows a layer reading it takes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Level {
    factor: usize,
    gap: usize,
}

/// Where each stream's rows sit at one level of a step over several streams: stream `b`'s
/// `rows[b]` rows from row `start[b]`, each after a gap of `gap` rows (which holds, before a
/// layer reads it, the history that layer keeps for the stream); `total` rows in all.
struct Lay {
    gap: usize,
    start: Vec<usize>,
    rows: Vec<usize>,
    total: usize,
}

impl Level {
    /// Rows at this level of a step of `frames` frames in all over `streams` streams.
    fn rows(self, frames: usize, streams: usize) -> usize {
        frames * self.factor + streams * self.gap
    }
}

impl Lay {
    fn new(level: Level, frames: &[usize]) -> Lay {
        let (mut start, mut rows, mut at) = (Vec::new(), Vec::new(), 0);
        for &t in frames {
            at += level.gap;
            start.push(at);
            rows.push(t * level.factor);
            at += t * level.factor;
        }
        Lay {
            gap: level.gap,
            start,
            rows,
            total: at,
        }
    }
}

impl Weights {
    /// The history rows of what reads the decoder's input at `dec_in`'s level: `dec_in`, and
    /// the first block's ConvTranspose (or `dec_out`) once `dec_in` has run.
    fn dec_in_gap(&self) -> usize {
        let next = match self.blocks.first() {
            Some(b) => b.convt.m - 1,
            None => self.dec_out.hist_rows(),
        };
        self.dec_in.hist_rows().max(next)
    }

    /// A step's levels: the frame rate, after each upsampler, after each decoder block.
    pub(crate) fn levels(&self) -> Vec<Level> {
        let mut out = Vec::new();
        let mut factor = 1;
        out.push(Level {
            factor,
            gap: match self.up.first() {
                Some((ct, _)) => ct.m - 1,
                None => self.dec_in_gap(),
            },
        });
        for (i, (ct, _)) in self.up.iter().enumerate() {
            factor *= ct.s;
            let next = match self.up.get(i + 1) {
                Some((ct2, _)) => ct2.m - 1,
                None => self.dec_in_gap(),
            };
            out.push(Level {
                factor,
                gap: (DW_K - 1).max(next),
            });
        }
        for (j, blk) in self.blocks.iter().enumerate() {
            factor *= blk.convt.s;
            let mut gap = match self.blocks.get(j + 1) {
                Some(b) => b.convt.m - 1,
                None => self.dec_out.hist_rows(),
            };
            for ru in &blk.res {
                gap = gap.max(ru.c1.hist_rows()).max(ru.c2.hist_rows());
            }
            out.push(Level { factor, gap });
        }
        out
    }
}

/// History in for every stream: its history `h` into the gap before its rows of `work`.
fn hists_in<E: Exec>(
    e: &E,
    sts: &[&mut StateBufs],
    wt: &Weights,
    h: usize,
    work: P,
    lay: &Lay,
) -> Result<()> {
    let (rows, c) = wt.hists[h];
    debug_assert!(rows <= lay.gap);
    if rows == 0 {
        return Ok(());
    }
    let list: Vec<_> = sts
        .iter()
        .zip(&lay.start)
        .map(|(st, &s0)| (work.at((s0 - rows) * c), st.hists[h], rows * c))
        .collect();
    e.copy_many(&list)
}

/// History out for every stream: the last rows of its history-then-rows in `work` (its new
/// rows, reaching back into the gap's history when it has fewer) into its history `h`.
fn hists_out<E: Exec>(
    e: &E,
    sts: &[&mut StateBufs],
    wt: &Weights,
    h: usize,
    work: P,
    lay: &Lay,
) -> Result<()> {
    let (rows, c) = wt.hists[h];
    if rows == 0 {
        return Ok(());
    }
    let list: Vec<_> = sts
        .iter()
        .enumerate()
        .map(|(b, st)| {
            let end = lay.start[b] + lay.rows[b];
            (st.hists[h], work.at((end - rows) * c), rows * c)
        })
        .collect();
    e.copy_many(&list)
}

/// A stride-1 causal convolution over every stream's rows at a level: `work` holds each
/// stream's history in its gap, `out` (and `res`) the same layout, their gaps left with rows
/// of no stream.
fn conv_many<E: Exec>(
    e: &E,
    cv: &ConvW,
    work: P,
    lay: &Lay,
    out: P,
    res: Option<P>,
    tanh: bool,
) -> Result<()> {
    let h = cv.hist_rows();
    debug_assert!(cv.stride == 1 && h <= lay.gap);
    conv_gemm(
        e,
        cv,
        work.at((lay.gap - h) * cv.cin),
        lay.total - lay.gap,
        out.at(lay.gap * cv.cout),
        res.map(|r| r.at(lay.gap * cv.cout)),
        tanh,
    )
}

/// A causal ConvTranspose from level `lay` (each stream's history in its gap of `work`) to
/// `next`'s rows of `out`. One stream's outputs land in place; several streams' go to `tmp`
/// first (the rows between them belong to none) and are copied to their places.
#[allow(clippy::too_many_arguments)]
fn convt_many<E: Exec>(
    e: &E,
    ct: &ConvTW,
    work: P,
    lay: &Lay,
    tmp: P,
    out: P,
    next: &Lay,
) -> Result<()> {
    let h = ct.m - 1;
    debug_assert!(h <= lay.gap);
    let one = lay.start.len() == 1;
    let dst = if one {
        out.at(next.start[0] * ct.cout)
    } else {
        tmp
    };
    e.gemm(&Gemm {
        m: lay.total - lay.gap,
        n: ct.s * ct.cout,
        k: ct.m * ct.cin,
        a: work.at((lay.gap - h) * ct.cin),
        rsa: ct.cin,
        cin: ct.cin,
        jstride: ct.cin,
        b: ct.w,
        c: dst,
        bias: Some(ct.b),
        bias_n: ct.cout,
        gamma: None,
        res: None,
        tanh: false,
    })?;
    if one {
        return Ok(());
    }
    // input row q makes output rows (q − gap)·s ..: stream b's from (start[b] − gap)·s
    let list: Vec<_> = (0..lay.start.len())
        .map(|b| {
            let from = (lay.start[b] - lay.gap) * ct.s;
            (
                out.at(next.start[b] * ct.cout),
                tmp.at(from * ct.cout),
                next.rows[b] * ct.cout,
            )
        })
        .collect();
    e.copy_many(&list)
}

/// Decodes each stream's `codes` (`[num_codebooks, t_b]`, `t_b` at most what its KV ring holds
/// a step; the scratch sized by [`Weights::scratch_sizes`] for the frames in all and the
/// streams) into `t_b · frame_length` samples, in one pass through the layers: every layer's
/// rows of all streams in one launch, each stream's rows after a gap that holds its history.
/// Every row's arithmetic is the one-stream step's, so each stream's samples are bit for bit
/// those of decoding it alone, in any steps.
pub(crate) fn step<E: Exec>(
    e: &E,
    wt: &Weights,
    sts: &mut [&mut StateBufs],
    sc: &Scratch,
    codes: &[codec::Codes],
) -> Result<Vec<Vec<f32>>> {
    let frames: Vec<usize> = codes.iter().map(|c| c.frames()).collect();
    debug_assert!(frames.iter().all(|&t| t > 0) && sts.len() == codes.len());
    debug_assert!(sc
        .sizes
        .holds(wt.scratch_sizes(frames.iter().sum(), frames.len())));
    let cfg = &wt.cfg;
    let dim = cfg.quantizer.dim;
    let nq = wt.num_codebooks();
    let cb = wt.cb;
    let levels = wt.levels();
    let mut lay = Lay::new(levels[0], &frames);

    // Codebook rows gathered on the host (codes clamped to n − 1), summed on the device.
    let mut rows = vec![0.0f32; lay.total * nq * cb];
    for (b, c) in codes.iter().enumerate() {
        for f in 0..frames[b] {
            let r = lay.start[b] + f;
            for (q, (book, n)) in wt.codebooks.iter().enumerate() {
                let code = (c.get(q, f) as usize).min(n - 1);
                rows[(r * nq + q) * cb..(r * nq + q + 1) * cb]
                    .copy_from_slice(&book[code * cb..(code + 1) * cb]);
            }
        }
    }
    e.write(sc.a2, &rows)?;
    let x = sc.a0;
    e.vq_sum(sc.a2, wt.vq_w, wt.vq_b, x, lay.total, nq, cb, dim)?;

    // post_module over each stream's KV rings at its absolute positions.
    let scratch = TfScratch {
        h: sc.a1,
        qkv: sc.a2,
        att: sc.y,
        hid: sc.hid,
        rope: sc.rope,
    };
    let streams: Vec<TfStream> = sts
        .iter()
        .enumerate()
        .map(|(b, st)| TfStream {
            row0: lay.start[b],
            rows: frames[b],
            pos: st.pos,
            kring: &st.kring,
            vring: &st.vring,
            ring: st.ring,
        })
        .collect();
    transformer_layers(e, &wt.post, &streams, &scratch, x, lay.total)?;
    for (st, &t) in sts.iter_mut().zip(&frames) {
        st.pos += t as u64;
    }

    // Final norm into the first upsampler's input (or dec_in's), then its histories.
    e.rms_norm(x, wt.post.norm, sc.w0, lay.total, dim, wt.post.eps)?;
    let first = match wt.up.first() {
        Some((ct, _)) => ct.hist,
        None => wt.dec_in.hist,
    };
    hists_in(e, sts, wt, first, sc.w0, &lay)?;

    for (i, (ct, nx)) in wt.up.iter().enumerate() {
        // ConvTranspose (work w0) → dwconv input rows (work w1), through y.
        let next = Lay::new(levels[i + 1], &frames);
        convt_many(e, ct, sc.w0, &lay, sc.y, sc.w1, &next)?;
        hists_out(e, sts, wt, ct.hist, sc.w0, &lay)?;
        lay = next;
        let c = nx.c;
        hists_in(e, sts, wt, nx.hist, sc.w1, &lay)?;
        let dw = DW_K - 1;
        e.dwconv(
            sc.w1.at((lay.gap - dw) * c),
            nx.dw_w,
            nx.dw_b,
            sc.y.at(lay.gap * c),
            lay.total - lay.gap,
            c,
            DW_K,
        )?;
        hists_out(e, sts, wt, nx.hist, sc.w1, &lay)?;
        convnext_mlp(e, nx, sc.y, sc.hid, sc.w1, sc.w0, lay.total)?;
        let next_hist = match wt.up.get(i + 1) {
            Some((ct2, _)) => ct2.hist,
            None => wt.dec_in.hist,
        };
        hists_in(e, sts, wt, next_hist, sc.w0, &lay)?;
    }

    // DAC decoder.
    let mut l = wt.up.len();
    let (mut cur, mut other) = (sc.a0, sc.a1);
    conv_many(e, &wt.dec_in, sc.w0, &lay, cur, None, false)?;
    hists_out(e, sts, wt, wt.dec_in.hist, sc.w0, &lay)?;
    for blk in &wt.blocks {
        let ct = &blk.convt;
        e.snake(
            cur,
            blk.snake.alpha,
            blk.snake.inv,
            sc.w0,
            lay.total * blk.snake.c,
            blk.snake.c,
        )?;
        hists_in(e, sts, wt, ct.hist, sc.w0, &lay)?;
        l += 1;
        let next = Lay::new(levels[l], &frames);
        convt_many(e, ct, sc.w0, &lay, sc.y, other, &next)?;
        hists_out(e, sts, wt, ct.hist, sc.w0, &lay)?;
        lay = next;
        std::mem::swap(&mut cur, &mut other);
        let c = ct.cout;
        for ru in &blk.res {
            e.snake(cur, ru.s1.alpha, ru.s1.inv, sc.w1, lay.total * c, c)?;
            hists_in(e, sts, wt, ru.c1.hist, sc.w1, &lay)?;
            conv_many(e, &ru.c1, sc.w1, &lay, sc.y, None, false)?;
            hists_out(e, sts, wt, ru.c1.hist, sc.w1, &lay)?;
            e.snake(sc.y, ru.s2.alpha, ru.s2.inv, sc.y, lay.total * c, c)?;
            conv_many(e, &ru.c2, sc.y, &lay, cur, Some(cur), false)?;
        }
    }
    let c = wt.dec_snake.c;
    e.snake(
        cur,
        wt.dec_snake.alpha,
        wt.dec_snake.inv,
        sc.w0,
        lay.total * c,
        c,
    )?;
    hists_in(e, sts, wt, wt.dec_out.hist, sc.w0, &lay)?;
    conv_many(e, &wt.dec_out, sc.w0, &lay, sc.a2, None, true)?;
    hists_out(e, sts, wt, wt.dec_out.hist, sc.w0, &lay)?;
    let fl = wt.frame_length();
    debug_assert!(lay.rows.iter().zip(&frames).all(|(&r, &t)| r == t * fl));
    let pcm = e.read(sc.a2, lay.total)?;
    Ok((0..frames.len())
        .map(|b| pcm[lay.start[b]..lay.start[b] + lay.rows[b]].to_vec())
        .collect())
}

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
    /// Scratch sizes (f32) for a step of `t` frames: (work, activation, hidden).
    pub(crate) fn sizes(&self, t: usize) -> (usize, usize, usize) {
        let (h, qkv, att, mut hid) = self.post.scratch(t);
        let mut work = 0;
        let mut act = h.max(qkv).max(att).max(t * self.num_codebooks() * self.cb);
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
    pub(crate) frames: usize,
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

impl Scratch {
    /// For steps of up to `frames` frames (at most [`MAX_STEP_FRAMES`]).
    pub(crate) fn new<E: Exec>(e: &E, wt: &Weights, frames: usize) -> Result<Scratch> {
        let frames = frames.clamp(1, MAX_STEP_FRAMES);
        let mut bufs = Vec::new();
        let mut mk = |n: usize| -> Result<P> {
            let b = e.alloc(n.max(1))?;
            bufs.push(b);
            Ok(P { buf: b, off: 0 })
        };
        let (work, act, hid) = wt.sizes(frames);
        Ok(Scratch {
            frames,
            w0: mk(work)?,
            w1: mk(work)?,
            a0: mk(act)?,
            a1: mk(act)?,
            a2: mk(act)?,
            y: mk(act)?,
            hid: mk(hid)?,
            rope: mk(frames * wt.post.hd)?,
            bufs,
        })
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

/// History in for the decoder's layer history `h`.
fn hist_in<E: Exec>(e: &E, st: &StateBufs, wt: &Weights, h: usize, work: P) -> Result<P> {
    copy_hist_in(e, st.hists[h], wt.hists[h], work)
}

/// History out for the decoder's layer history `h`.
fn hist_out<E: Exec>(
    e: &E,
    st: &StateBufs,
    wt: &Weights,
    h: usize,
    work: P,
    l: usize,
) -> Result<()> {
    copy_hist_out(e, st.hists[h], wt.hists[h], work, l)
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

/// Decodes `codes` (`[num_codebooks, t]`, `t` at most the scratch's frames) into
/// `t · frame_length` samples.
pub(crate) fn step<E: Exec>(
    e: &E,
    wt: &Weights,
    st: &mut StateBufs,
    sc: &Scratch,
    codes: &codec::Codes,
) -> Result<Vec<f32>> {
    let t = codes.frames();
    debug_assert!(t > 0 && t <= sc.frames);
    let cfg = &wt.cfg;
    let dim = cfg.quantizer.dim;
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
    e.write(sc.a2, &rows)?;
    let x = sc.a0;
    e.vq_sum(sc.a2, wt.vq_w, wt.vq_b, x, t, nq, cb, dim)?;

    // post_module over the KV ring at absolute positions.
    let scratch = TfScratch {
        h: sc.a1,
        qkv: sc.a2,
        att: sc.y,
        hid: sc.hid,
        rope: sc.rope,
    };
    let one = TfStream {
        row0: 0,
        rows: t,
        pos: st.pos,
        kring: &st.kring,
        vring: &st.vring,
        ring: st.ring,
    };
    transformer_layers(e, &wt.post, &[one], &scratch, x, t)?;
    st.pos += t as u64;

    // Final norm straight into the first upsampler's input rows (or dec_in's).
    let mut r = t;
    let first_in = match wt.up.first() {
        Some((ct, _)) => hist_in(e, st, wt, ct.hist, sc.w0)?,
        None => hist_in(e, st, wt, wt.dec_in.hist, sc.w0)?,
    };
    e.rms_norm(x, wt.post.norm, first_in, t, dim, wt.post.eps)?;

    for (i, (ct, nx)) in wt.up.iter().enumerate() {
        // ConvTranspose (work w0) → dwconv input rows (work w1).
        let dw_in = hist_in(e, st, wt, nx.hist, sc.w1)?;
        e.gemm(&Gemm {
            m: r,
            n: ct.s * ct.cout,
            k: ct.m * ct.cin,
            a: sc.w0,
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
        hist_out(e, st, wt, ct.hist, sc.w0, r)?;
        r *= ct.s;
        let c = nx.c;
        e.dwconv(sc.w1, nx.dw_w, nx.dw_b, sc.y, r, c, DW_K)?;
        hist_out(e, st, wt, nx.hist, sc.w1, r)?;
        let next_in = match wt.up.get(i + 1) {
            Some((ct2, _)) => hist_in(e, st, wt, ct2.hist, sc.w0)?,
            None => hist_in(e, st, wt, wt.dec_in.hist, sc.w0)?,
        };
        convnext_mlp(e, nx, sc.y, sc.hid, dw_in, next_in, r)?;
    }

    // DAC decoder.
    let (mut cur, mut other) = (sc.a0, sc.a1);
    conv_gemm(e, &wt.dec_in, sc.w0, r, cur, None, false)?;
    hist_out(e, st, wt, wt.dec_in.hist, sc.w0, r)?;
    for blk in &wt.blocks {
        let ct = &blk.convt;
        let ct_in = hist_in(e, st, wt, ct.hist, sc.w0)?;
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
            a: sc.w0,
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
        hist_out(e, st, wt, ct.hist, sc.w0, r)?;
        r *= ct.s;
        std::mem::swap(&mut cur, &mut other);
        let c = ct.cout;
        for ru in &blk.res {
            let c1_in = hist_in(e, st, wt, ru.c1.hist, sc.w1)?;
            e.snake(cur, ru.s1.alpha, ru.s1.inv, c1_in, r * c, c)?;
            conv_gemm(e, &ru.c1, sc.w1, r, sc.y, None, false)?;
            hist_out(e, st, wt, ru.c1.hist, sc.w1, r)?;
            e.snake(sc.y, ru.s2.alpha, ru.s2.inv, sc.y, r * c, c)?;
            conv_gemm(e, &ru.c2, sc.y, r, cur, Some(cur), false)?;
        }
    }
    let c = wt.dec_snake.c;
    let out_in = hist_in(e, st, wt, wt.dec_out.hist, sc.w0)?;
    e.snake(cur, wt.dec_snake.alpha, wt.dec_snake.inv, out_in, r * c, c)?;
    conv_gemm(e, &wt.dec_out, sc.w0, r, sc.a2, None, true)?;
    hist_out(e, st, wt, wt.dec_out.hist, sc.w0, r)?;
    debug_assert_eq!(r, t * wt.frame_length());
    e.read(sc.a2, r)
}

//! The encoder over an [`Exec`]: PCM → codes (voice cloning), the semantics of
//! [`codec::Codec::encode`]. Weights are read from `codec.pth` with the decoder's reader (names,
//! shape checks, weight-norm folding of `codec`'s loader) and laid out as GEMM operands; the
//! streaming step runs the DAC encoder (residual units, Snake, strided causal convs as GEMMs
//! with `rsa = stride·cin` over `[history + input]` rows, the windowed transformer of the last
//! blocks on a KV ring), `enc_out`, the downsampling ConvNeXts, the `pre_module` transformer
//! and the VQ search (semantic, then residual on what is left). Every causal history and ring
//! lives in the state, so any split into whole frames gives the codes of one call.

use checkpoint::pth::PthStateDict;
use codec::{CodecConfig, CodecError, Codes};

use crate::decoder::{
    conv_gemm, convnext_mlp, copy_hist_in, copy_hist_out, transformer_layers, transpose, Builder,
    ConvW, NextW, ResW, SnakeW, TfScratch, TfStream, TfW, DW_K, STEP_FRAMES,
};
use crate::exec::{Exec, Gemm, P};
use crate::{CudaCodecError, Result};

/// Codes are carried through f32 buffers: exact for codebooks of at most 2²⁴ rows.
const MAX_CODEBOOK: usize = 1 << 24;

/// One encoder block: residual units, Snake, the strided conv, the optional transformer.
struct EncBlockW {
    res: Vec<ResW>,
    snake: SnakeW,
    conv: ConvW,
    /// The transformer and its rows per code frame (positions advance by that per frame).
    tf: Option<(TfW, usize)>,
}

/// One vector quantizer: `in_proj` (dim → cb), the codebook (raw, l2-normalised, and its
/// normalised rows' Σv²), `out_proj` (cb → dim).
struct VqW {
    in_w: P,
    in_b: P,
    out_w: P,
    out_b: P,
    book: P,
    book_n: P,
    cn2: P,
    n: usize,
}

/// Every encoder weight, uploaded.
pub(crate) struct EncWeights {
    cfg: CodecConfig,
    enc_in: ConvW,
    blocks: Vec<EncBlockW>,
    enc_snake: SnakeW,
    enc_out: ConvW,
    down: Vec<(ConvW, NextW)>,
    pre: TfW,
    vqs: Vec<VqW>,
    /// `dim` values of −1 (the LayerScale of "residual −= out_proj(…)").
    neg: P,
    cb: usize,
    /// `(rows, channels)` of every history, indexed by the layers' `hist`.
    hists: Vec<(usize, usize)>,
}

impl EncWeights {
    /// Uploads the encoder half of `sd` for `cfg`; returns the weights and the buffers made.
    pub(crate) fn load<E: Exec>(
        e: &E,
        sd: &PthStateDict,
        cfg: &CodecConfig,
    ) -> Result<(EncWeights, Vec<usize>)> {
        let mut b = Builder::new(e, sd);
        let fl = cfg.frame_length();

        // Encoder: Conv7(1→d) → blocks [RU×3, Snake, Conv(k=2s, s), transformer?] → Snake → Conv3.
        let mut d = cfg.encoder_dim;
        let enc_in = b.conv("encoder.block.0.conv", 1, d, 7, 1, 1)?;
        let mut blocks = Vec::with_capacity(cfg.encoder_rates.len());
        let mut hop = 1;
        for (i, (&stride, &n_t)) in cfg
            .encoder_rates
            .iter()
            .zip(&cfg.encoder_transformer_layers)
            .enumerate()
        {
            let p = format!("encoder.block.{}", i + 1);
            let (half, full) = (d, 2 * d);
            let res = [1usize, 3, 9]
                .iter()
                .enumerate()
                .map(|(j, &dil)| b.res_unit(&format!("{p}.block.{j}"), half, dil))
                .collect::<Result<Vec<_>>>()?;
            let snake = b.snake(&format!("{p}.block.3"), half)?;
            let conv = b.conv(
                &format!("{p}.block.4.conv"),
                half,
                full,
                2 * stride,
                stride,
                1,
            )?;
            hop *= stride;
            let tf = if n_t > 0 {
                let (heads, ffn) = cfg
                    .encoder_transformer_shape(full)
                    .map_err(|e| CudaCodecError::Weights(format!("{p}: {e}")))?;
                let tw = b.transformer(
                    &format!("{p}.block.5"),
                    n_t,
                    full,
                    heads,
                    cfg.encoder_head_dim,
                    ffn,
                    cfg.encoder_norm_eps,
                    cfg.encoder_window,
                    cfg.encoder_rope_base,
                )?;
                Some((tw, fl / hop))
            } else {
                None
            };
            blocks.push(EncBlockW {
                res,
                snake,
                conv,
                tf,
            });
            d = full;
        }
        let nb = cfg.encoder_rates.len();
        let enc_snake = b.snake(&format!("encoder.block.{}", nb + 1), d)?;
        let latent = cfg.latent_dim();
        let enc_out = b.conv(
            &format!("encoder.block.{}.conv", nb + 2),
            d,
            latent,
            3,
            1,
            1,
        )?;

        // Quantizer: downsampling, pre_module, then the VQs.
        let q = &cfg.quantizer;
        let (dim, cb) = (q.dim, cfg.codebook_dim);
        let mut down = Vec::with_capacity(cfg.downsample_factor.len());
        for (i, &f) in cfg.downsample_factor.iter().enumerate() {
            let p = format!("quantizer.downsample.{i}");
            let conv = b.conv(&format!("{p}.0.conv"), dim, dim, f, f, 1)?;
            let nx = b.convnext(&format!("{p}.1"), dim)?;
            down.push((conv, nx));
        }
        let pre = b.transformer(
            "quantizer.pre_module",
            q.n_layer,
            dim,
            q.n_head,
            q.head_dim,
            q.intermediate_size,
            q.norm_eps,
            q.window,
            q.rope_base,
        )?;
        let nq = cfg.num_codebooks();
        let mut vqs = Vec::with_capacity(nq);
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
            if n > MAX_CODEBOOK {
                return Err(CudaCodecError::Weights(format!(
                    "{prefix}: a codebook of {n} rows; the GPU encoder carries codes as f32, \
                     exact for at most {MAX_CODEBOOK} rows"
                )));
            }
            let in_w =
                b.r.conv_weight(&format!("{prefix}.in_proj"), &[cb, dim, 1])?;
            let in_b = b.r.get(&format!("{prefix}.in_proj.bias"), &[cb])?;
            let out_w =
                b.r.conv_weight(&format!("{prefix}.out_proj"), &[dim, cb, 1])?;
            let out_b = b.r.get(&format!("{prefix}.out_proj.bias"), &[dim])?;
            let book = b.r.get(&format!("{prefix}.codebook.weight"), &[n, cb])?;
            // the normalised rows and their Σv², as the CPU codec searches them
            let (book_n, cn2) = codec::normalised_codebook(&book, cb);
            vqs.push(VqW {
                in_w: b.up(&transpose(&in_w, cb, dim))?,
                in_b: b.up(&in_b)?,
                out_w: b.up(&transpose(&out_w, dim, cb))?,
                out_b: b.up(&out_b)?,
                book: b.up(&book)?,
                book_n: b.up(&book_n)?,
                cn2: b.up(&cn2)?,
                n,
            });
        }
        let neg = b.up(&vec![-1.0f32; dim])?;
        let hists = std::mem::take(&mut b.hists);
        let bufs = std::mem::take(&mut b.bufs);
        Ok((
            EncWeights {
                cfg: cfg.clone(),
                enc_in,
                blocks,
                enc_snake,
                enc_out,
                down,
                pre,
                vqs,
                neg,
                cb,
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

    /// The transformers with their rows per code frame: the blocks' in order, then `pre_module`.
    fn transformers(&self) -> impl Iterator<Item = (&TfW, usize)> {
        self.blocks
            .iter()
            .filter_map(|b| b.tf.as_ref().map(|(t, rows)| (t, *rows)))
            .chain(std::iter::once((&self.pre, 1)))
    }

    /// Scratch sizes (f32) for a step of `t` frames: (work, activation, hidden).
    fn sizes(&self, t: usize) -> (usize, usize, usize) {
        let conv_work = |cv: &ConvW, rows: usize| (cv.hist_rows() + rows) * cv.cin;
        let mut r = t * self.frame_length();
        let mut work = conv_work(&self.enc_in, r);
        let mut act = r * self.enc_in.cout;
        let mut hid = 0;
        for blk in &self.blocks {
            for ru in &blk.res {
                work = work.max(conv_work(&ru.c1, r));
                act = act.max(r * ru.c1.cout);
            }
            work = work.max(conv_work(&blk.conv, r));
            r /= blk.conv.stride;
            act = act.max(r * blk.conv.cout);
        }
        work = work.max(conv_work(&self.enc_out, r));
        act = act.max(r * self.enc_out.cout);
        for (cv, nx) in &self.down {
            work = work.max(conv_work(cv, r));
            r /= cv.stride;
            work = work.max((DW_K - 1 + r) * nx.c);
            act = act.max(r * nx.c);
            hid = hid.max(r * nx.hidden);
        }
        (work, act, hid)
    }
}

/// One transformer's KV rings.
struct Rings {
    k: Vec<P>,
    v: Vec<P>,
    ring: usize,
}

/// A transformer's one stream: `rows` rows from row 0 at position `pos`, on rings `rg`.
fn alone(rg: &Rings, rows: usize, pos: u64) -> TfStream<'_> {
    TfStream {
        row0: 0,
        rows,
        pos,
        kring: &rg.k,
        vring: &rg.v,
        ring: rg.ring,
    }
}

/// Per-stream device state: histories, KV rings, frames encoded, and the step scratch.
pub(crate) struct EncStateBufs {
    /// Frames encoded so far (transformer positions are this times their rows per frame).
    pub(crate) frames: u64,
    hists: Vec<P>,
    /// The blocks' transformers in order, then `pre_module`'s.
    rings: Vec<Rings>,
    w0: P,
    w1: P,
    a0: P,
    a1: P,
    y: P,
    hid: P,
    tf: TfScratch,
    ze: P,
    st: P,
    codes: P,
    pub(crate) bufs: Vec<usize>,
}

impl EncStateBufs {
    pub(crate) fn new<E: Exec>(e: &E, wt: &EncWeights) -> Result<EncStateBufs> {
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
        let mut rings = Vec::new();
        let (mut th, mut tq, mut ta, mut tf_hid, mut rope) = (0, 0, 0, 0, 0);
        for (tw, rows) in wt.transformers() {
            let t = STEP_FRAMES * rows;
            let ring = tw.ring(t);
            let kv = ring * tw.heads * tw.hd;
            let k = (0..tw.n_layers())
                .map(|_| mk(kv))
                .collect::<Result<Vec<_>>>()?;
            let v = (0..tw.n_layers())
                .map(|_| mk(kv))
                .collect::<Result<Vec<_>>>()?;
            rings.push(Rings { k, v, ring });
            let (h, q, a, hd) = tw.scratch(t);
            th = th.max(h);
            tq = tq.max(q);
            ta = ta.max(a);
            tf_hid = tf_hid.max(hd);
            rope = rope.max(t * tw.hd);
        }
        let (work, act, hid) = wt.sizes(STEP_FRAMES);
        // The transformers' hidden rows share the ConvNeXts' buffer (never live together).
        let hid = mk(hid.max(tf_hid))?;
        let tf = TfScratch {
            h: mk(th)?,
            qkv: mk(tq)?,
            att: mk(ta)?,
            hid,
            rope: mk(rope)?,
        };
        let nq = wt.num_codebooks();
        Ok(EncStateBufs {
            frames: 0,
            hists,
            rings,
            w0: mk(work)?,
            w1: mk(work)?,
            a0: mk(act)?,
            a1: mk(act)?,
            y: mk(act)?,
            hid,
            tf,
            ze: mk(STEP_FRAMES * wt.cb)?,
            st: mk(STEP_FRAMES * wt.cb)?,
            codes: mk(STEP_FRAMES * nq)?,
            bufs,
        })
    }
}

/// History in for the encoder's layer history `h`.
fn hist_in<E: Exec>(e: &E, st: &EncStateBufs, wt: &EncWeights, h: usize, work: P) -> Result<P> {
    copy_hist_in(e, st.hists[h], wt.hists[h], work)
}

/// History out for the encoder's layer history `h`.
fn hist_out<E: Exec>(
    e: &E,
    st: &EncStateBufs,
    wt: &EncWeights,
    h: usize,
    work: P,
    l: usize,
) -> Result<()> {
    copy_hist_out(e, st.hists[h], wt.hists[h], work, l)
}

/// Encodes `pcm` (`t · frame_length` samples, `0 < t ≤ STEP_FRAMES`) into codes
/// `[num_codebooks, t]` row-major.
pub(crate) fn step<E: Exec>(
    e: &E,
    wt: &EncWeights,
    st: &mut EncStateBufs,
    pcm: &[f32],
) -> Result<Vec<u32>> {
    let fl = wt.frame_length();
    let t = pcm.len() / fl;
    debug_assert!(t > 0 && t <= STEP_FRAMES && pcm.len() == t * fl);
    let dim = wt.cfg.quantizer.dim;
    let cb = wt.cb;

    // enc_in (work w0).
    let mut r = pcm.len();
    let x_in = hist_in(e, st, wt, wt.enc_in.hist, st.w0)?;
    e.write(x_in, pcm)?;
    let (mut cur, mut other) = (st.a0, st.a1);
    conv_gemm(e, &wt.enc_in, st.w0, r, cur, None, false)?;
    hist_out(e, st, wt, wt.enc_in.hist, st.w0, r)?;

    // Encoder blocks.
    let mut ring_i = 0;
    for blk in &wt.blocks {
        let c = blk.snake.c;
        for ru in &blk.res {
            let c1_in = hist_in(e, st, wt, ru.c1.hist, st.w1)?;
            e.snake(cur, ru.s1.alpha, ru.s1.inv, c1_in, r * c, c)?;
            conv_gemm(e, &ru.c1, st.w1, r, st.y, None, false)?;
            hist_out(e, st, wt, ru.c1.hist, st.w1, r)?;
            e.snake(st.y, ru.s2.alpha, ru.s2.inv, st.y, r * c, c)?;
            conv_gemm(e, &ru.c2, st.y, r, cur, Some(cur), false)?;
        }
        let conv_in = hist_in(e, st, wt, blk.conv.hist, st.w0)?;
        e.snake(cur, blk.snake.alpha, blk.snake.inv, conv_in, r * c, c)?;
        conv_gemm(e, &blk.conv, st.w0, r, other, None, false)?;
        hist_out(e, st, wt, blk.conv.hist, st.w0, r)?;
        r /= blk.conv.stride;
        std::mem::swap(&mut cur, &mut other);
        if let Some((tw, rows)) = &blk.tf {
            let rg = &st.rings[ring_i];
            ring_i += 1;
            debug_assert_eq!(r, t * rows);
            let one = alone(rg, r, st.frames * *rows as u64);
            transformer_layers(e, tw, &[one], &st.tf, cur, r)?;
            e.rms_norm(cur, tw.norm, cur, r, tw.dim, tw.eps)?;
        }
    }

    // Snake, enc_out (work w1) straight into the first downsampler's input rows (work w0).
    let c = wt.enc_snake.c;
    let out_in = hist_in(e, st, wt, wt.enc_out.hist, st.w1)?;
    e.snake(cur, wt.enc_snake.alpha, wt.enc_snake.inv, out_in, r * c, c)?;
    let z_dst = match wt.down.first() {
        Some((cv, _)) => hist_in(e, st, wt, cv.hist, st.w0)?,
        None => cur,
    };
    conv_gemm(e, &wt.enc_out, st.w1, r, z_dst, None, false)?;
    hist_out(e, st, wt, wt.enc_out.hist, st.w1, r)?;

    // Downsampling: strided conv (work w0) → ConvNeXt (dwconv work w1) → the next one's input.
    for (i, (cv, nx)) in wt.down.iter().enumerate() {
        let dw_in = hist_in(e, st, wt, nx.hist, st.w1)?;
        conv_gemm(e, cv, st.w0, r, dw_in, None, false)?;
        hist_out(e, st, wt, cv.hist, st.w0, r)?;
        r /= cv.stride;
        let c = nx.c;
        e.dwconv(st.w1, nx.dw_w, nx.dw_b, st.y, r, c, DW_K)?;
        hist_out(e, st, wt, nx.hist, st.w1, r)?;
        let next_in = match wt.down.get(i + 1) {
            Some((cv2, _)) => hist_in(e, st, wt, cv2.hist, st.w0)?,
            None => cur,
        };
        convnext_mlp(e, nx, st.y, st.hid, dw_in, next_in, r)?;
    }
    debug_assert_eq!(r, t);

    // pre_module; its final norm gives the first residual (in `other`).
    let one = alone(&st.rings[ring_i], t, st.frames);
    transformer_layers(e, &wt.pre, &[one], &st.tf, cur, t)?;
    let resid = other;
    e.rms_norm(cur, wt.pre.norm, resid, t, dim, wt.pre.eps)?;

    // VQs: semantic, then residual on what is left (residual −= out_proj(z_q)).
    let nq = wt.vqs.len();
    for (q, vq) in wt.vqs.iter().enumerate() {
        e.gemm(&Gemm {
            m: t,
            n: cb,
            k: dim,
            a: resid,
            rsa: dim,
            cin: dim,
            jstride: 0,
            b: vq.in_w,
            c: st.ze,
            bias: Some(vq.in_b),
            bias_n: cb,
            gamma: None,
            res: None,
            tanh: false,
        })?;
        e.vq_nearest(
            st.ze,
            vq.book_n,
            vq.cn2,
            vq.book,
            st.codes.at(q * t),
            st.st,
            t,
            vq.n,
            cb,
        )?;
        if q + 1 < nq {
            // −(out_proj(st) + b) added to the residual: r − z exactly as the CPU subtracts.
            e.gemm(&Gemm {
                m: t,
                n: dim,
                k: cb,
                a: st.st,
                rsa: cb,
                cin: cb,
                jstride: 0,
                b: vq.out_w,
                c: resid,
                bias: Some(vq.out_b),
                bias_n: dim,
                gamma: Some(wt.neg),
                res: Some(resid),
                tanh: false,
            })?;
        }
    }
    st.frames += t as u64;
    let raw = e.read(st.codes, nq * t)?;
    let mut codes = Vec::with_capacity(nq * t);
    for (q, vq) in wt.vqs.iter().enumerate() {
        for &v in &raw[q * t..(q + 1) * t] {
            if !(v >= 0.0 && v < vq.n as f32 && v.fract() == 0.0) {
                return Err(CudaCodecError::Shape(format!(
                    "codebook {q} gave code {v}, outside 0..{}",
                    vq.n
                )));
            }
            codes.push(v as u32);
        }
    }
    Ok(codes)
}

/// The encoder over any executor (weights uploaded, buffers owned).
pub(crate) struct EncCore<E: Exec> {
    pub(crate) exec: E,
    weights: EncWeights,
    bufs: Vec<usize>,
}

impl<E: Exec> EncCore<E> {
    pub(crate) fn new(exec: E, sd: &PthStateDict, cfg: &CodecConfig) -> Result<Self> {
        let (weights, bufs) = EncWeights::load(&exec, sd, cfg)?;
        Ok(Self {
            exec,
            weights,
            bufs,
        })
    }

    pub(crate) fn frame_length(&self) -> usize {
        self.weights.frame_length()
    }

    /// A fresh state (zero histories, position 0).
    pub(crate) fn state(&self) -> Result<EncStateBufs> {
        EncStateBufs::new(&self.exec, &self.weights)
    }

    /// Frees a state's buffers.
    pub(crate) fn release(&self, st: EncStateBufs) {
        for &b in &st.bufs {
            self.exec.free(b);
        }
    }

    /// Encodes the next whole frames of `pcm` (a multiple of `frame_length` samples, all
    /// finite), `STEP_FRAMES` at a time.
    pub(crate) fn push(&self, st: &mut EncStateBufs, pcm: &[f32]) -> Result<Codes> {
        let fl = self.frame_length();
        if !pcm.len().is_multiple_of(fl) {
            return Err(CodecError::Audio(format!(
                "{} samples pushed, not a whole number of {fl}-sample frames",
                pcm.len()
            ))
            .into());
        }
        if let Some(p) = pcm.iter().position(|v| !v.is_finite()) {
            let at = st.frames.saturating_mul(fl as u64) + p as u64;
            return Err(CodecError::Audio(format!("sample {at} is not finite")).into());
        }
        let nq = self.weights.num_codebooks();
        let frames = pcm.len() / fl;
        let mut data = vec![0u32; nq * frames];
        let mut f = 0;
        for chunk in pcm.chunks(STEP_FRAMES * fl) {
            let t = chunk.len() / fl;
            let codes = step(&self.exec, &self.weights, st, chunk)?;
            for q in 0..nq {
                data[q * frames + f..q * frames + f + t]
                    .copy_from_slice(&codes[q * t..(q + 1) * t]);
            }
            f += t;
        }
        Ok(Codes::new(nq, frames, data)?)
    }

    /// Whole encode, as [`codec::Codec::encode`]: the same errors for empty or non-finite
    /// input, right-padded with zeros to whole frames, through a fresh state.
    pub(crate) fn encode(&self, pcm: &[f32]) -> Result<Codes> {
        if pcm.is_empty() {
            return Err(CodecError::Audio("no samples to encode".into()).into());
        }
        // a non-finite sample is refused by the push, at its index in the clip
        let mut st = self.state()?;
        let out = self.encode_padded(&mut st, pcm);
        self.release(st);
        out
    }

    /// `pcm` zero-padded to whole frames, through `st` (as `Codec::encode` pads).
    fn encode_padded(&self, st: &mut EncStateBufs, pcm: &[f32]) -> Result<Codes> {
        let fl = self.frame_length();
        let mut x = pcm.to_vec();
        x.resize(pcm.len().div_ceil(fl) * fl, 0.0);
        self.push(st, &x)
    }
}

impl<E: Exec> Drop for EncCore<E> {
    fn drop(&mut self) {
        for &b in &self.bufs {
            self.exec.free(b);
        }
    }
}

//! codec: the Drama 3 ModifiedDAC codec on the CPU (DRAMA3.md §8), f32.
//!
//! Decoder: codes `[num_codebooks, T]` → 44.1 kHz mono PCM (`frame_length` samples per frame),
//! whole or streamed through a [`DecoderState`]; streamed PCM equals the whole decode bit for bit
//! for any chunking (all convolutions keep causal histories, the window-128 `post_module` keeps
//! its last keys and values, and RoPE uses absolute positions). Encoder: PCM → codes (voice
//! cloning). Weights come from `codec.pth` via [`checkpoint::pth`]; weight norm is folded at load.
//!
//! Not here: resampling (callers feed 44.1 kHz), GPU kernels, and the backbone.

mod config;
pub mod ops;
pub mod synth;
mod weights;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use config::{CodecConfig, TransformerConfig};
use ops::{gelu, layer_norm, linear, rms_norm, rotate, window_attention};
use ops::{Conv1d, ConvTranspose1d, DwConv1d, Rope, Snake};
use weights::Store;

/// Frames decoded per internal step of [`Codec::decode`]; bounds its working memory.
const DECODE_CHUNK_FRAMES: usize = 32;

/// Errors of loading and running the codec.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error(transparent)]
    Pth(#[from] checkpoint::pth::PthError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("codec config: {0}")]
    Config(String),
    #[error("codec.pth: tensor {name} is missing")]
    Missing { name: String },
    #[error("codec.pth: tensor {name} has shape {found:?}, the config implies {expected:?}")]
    Shape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("codes: {0}")]
    Codes(String),
    #[error("audio: {0}")]
    Audio(String),
}

/// Codes `[num_codebooks, frames]`, row-major (codebook 0 is the semantic one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Codes {
    num_codebooks: usize,
    frames: usize,
    data: Vec<u32>,
}

impl Codes {
    /// `data` is `[num_codebooks, frames]` row-major.
    pub fn new(num_codebooks: usize, frames: usize, data: Vec<u32>) -> Result<Self, CodecError> {
        let need = num_codebooks
            .checked_mul(frames)
            .ok_or_else(|| CodecError::Codes(format!("{num_codebooks} × {frames} overflows")))?;
        if data.len() != need {
            return Err(CodecError::Codes(format!(
                "{} values for {num_codebooks} codebooks × {frames} frames ({need})",
                data.len()
            )));
        }
        Ok(Self {
            num_codebooks,
            frames,
            data,
        })
    }

    /// From signed codes (as stored in goldens); negative codes are an error.
    pub fn from_i64(num_codebooks: usize, frames: usize, data: &[i64]) -> Result<Self, CodecError> {
        let v = data
            .iter()
            .map(|&c| {
                u32::try_from(c).map_err(|_| CodecError::Codes(format!("code {c} out of range")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(num_codebooks, frames, v)
    }

    /// From frames `[frames][num_codebooks]` (the order the generator produces them).
    pub fn from_frames(num_codebooks: usize, frames: &[Vec<u32>]) -> Result<Self, CodecError> {
        let mut data = vec![0u32; num_codebooks * frames.len()];
        for (f, row) in frames.iter().enumerate() {
            if row.len() != num_codebooks {
                return Err(CodecError::Codes(format!(
                    "frame {f} has {} codes, expected {num_codebooks}",
                    row.len()
                )));
            }
            for (c, &v) in row.iter().enumerate() {
                data[c * frames.len() + f] = v;
            }
        }
        Self::new(num_codebooks, frames.len(), data)
    }

    pub fn num_codebooks(&self) -> usize {
        self.num_codebooks
    }
    pub fn frames(&self) -> usize {
        self.frames
    }
    /// `[num_codebooks, frames]` row-major.
    pub fn data(&self) -> &[u32] {
        &self.data
    }
    /// Code of codebook `c` at frame `f`.
    pub fn get(&self, c: usize, f: usize) -> u32 {
        self.data[c * self.frames + f]
    }
    /// Frames `start..end` as new codes.
    pub fn slice(&self, start: usize, end: usize) -> Codes {
        let end = end.min(self.frames);
        let start = start.min(end);
        let mut data = Vec::with_capacity(self.num_codebooks * (end - start));
        for c in 0..self.num_codebooks {
            data.extend_from_slice(&self.data[c * self.frames + start..c * self.frames + end]);
        }
        Codes {
            num_codebooks: self.num_codebooks,
            frames: end - start,
            data,
        }
    }
}

/// Max |a − b| over two equally long signals (for golden checks); `None` if lengths differ.
pub fn max_abs_diff(a: &[f32], b: &[f64]) -> Option<f64> {
    (a.len() == b.len()).then(|| {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (f64::from(x) - y).abs())
            .fold(0.0, f64::max)
    })
}

// ---------------------------------------------------------------- layers

#[derive(Debug)]
struct ResUnit {
    snake1: Snake,
    conv1: Conv1d,
    snake2: Snake,
    conv2: Conv1d,
}

impl ResUnit {
    /// `x + Conv1x1(Snake(Conv7_dil(Snake(x))))`; `hist` is the dilated conv's history.
    fn forward(&self, hist: &mut Vec<f32>, x: Vec<f32>) -> Vec<f32> {
        let mut y = x.clone();
        self.snake1.forward(&mut y);
        let mut y = self.conv1.forward(hist, &y);
        self.snake2.forward(&mut y);
        let mut y = self.conv2.forward(&mut Vec::new(), &y);
        y.iter_mut().zip(&x).for_each(|(a, b)| *a += b);
        y
    }
}

#[derive(Debug)]
struct ConvNeXt {
    dw: DwConv1d,
    ln_w: Vec<f32>,
    ln_b: Vec<f32>,
    pw1_w: Vec<f32>,
    pw1_b: Vec<f32>,
    pw2_w: Vec<f32>,
    pw2_b: Vec<f32>,
    gamma: Vec<f32>,
    hidden: usize,
}

impl ConvNeXt {
    /// `x + γ ⊙ pw2(GELU(pw1(LayerNorm(dwconv7(x)))))`.
    fn forward(&self, hist: &mut Vec<f32>, x: Vec<f32>) -> Vec<f32> {
        let c = self.gamma.len();
        let mut y = self.dw.forward(hist, &x);
        layer_norm(&mut y, &self.ln_w, &self.ln_b, 1e-6);
        let mut h = linear(&y, c, &self.pw1_w, self.hidden, Some(&self.pw1_b));
        h.iter_mut().for_each(|v| *v = gelu(*v));
        let y = linear(&h, self.hidden, &self.pw2_w, c, Some(&self.pw2_b));
        let mut out = x;
        for (row, yr) in out.chunks_exact_mut(c).zip(y.chunks_exact(c)) {
            for ((o, &v), &g) in row.iter_mut().zip(yr).zip(&self.gamma) {
                *o += g * v;
            }
        }
        out
    }
}

#[derive(Debug)]
struct TfLayer {
    attn_norm: Vec<f32>,
    wqkv: Vec<f32>,
    wo: Vec<f32>,
    ffn_norm: Vec<f32>,
    w1: Vec<f32>,
    w3: Vec<f32>,
    w2: Vec<f32>,
    gamma_attn: Vec<f32>,
    gamma_ffn: Vec<f32>,
}

/// WindowLimitedTransformer: causal, RoPE at absolute positions, attention over the last
/// `window` rows (self included), final RMSNorm. Input/output projections are identity.
#[derive(Debug)]
struct Transformer {
    layers: Vec<TfLayer>,
    norm: Vec<f32>,
    dim: usize,
    heads: usize,
    hd: usize,
    ffn: usize,
    eps: f32,
    window: usize,
    rope: Rope,
}

/// Keys/values of the last `window − 1` rows per layer, and the next absolute position.
#[derive(Debug, Clone)]
struct TfState {
    pos: u64,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Transformer {
    fn new_state(&self) -> TfState {
        TfState {
            pos: 0,
            k: vec![Vec::new(); self.layers.len()],
            v: vec![Vec::new(); self.layers.len()],
        }
    }

    fn state_bytes(&self) -> usize {
        2 * self.layers.len() * (self.window - 1) * self.heads * self.hd * 4
    }

    fn forward(&self, st: &mut TfState, x: &[f32]) -> Vec<f32> {
        let (dim, w, hd) = (self.dim, self.heads * self.hd, self.hd);
        let t = x.len() / dim;
        let tables: Vec<(Vec<f32>, Vec<f32>)> =
            (0..t).map(|r| self.rope.table(st.pos + r as u64)).collect();
        let mut x = x.to_vec();
        for (l, layer) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &layer.attn_norm, self.eps);
            let qkv = linear(&h, dim, &layer.wqkv, 3 * w, None);
            let mut q = Vec::with_capacity(t * w);
            let mut k = Vec::with_capacity(t * w);
            let mut v = Vec::with_capacity(t * w);
            for (r, row) in qkv.chunks_exact(3 * w).enumerate() {
                let (cos, sin) = &tables[r];
                let mut qr = row[..w].to_vec();
                let mut kr = row[w..2 * w].to_vec();
                for h in 0..self.heads {
                    rotate(&mut qr[h * hd..(h + 1) * hd], cos, sin);
                    rotate(&mut kr[h * hd..(h + 1) * hd], cos, sin);
                }
                q.extend_from_slice(&qr);
                k.extend_from_slice(&kr);
                v.extend_from_slice(&row[2 * w..]);
            }
            let hist = st.k[l].len() / w;
            let mut k_all = std::mem::take(&mut st.k[l]);
            k_all.extend_from_slice(&k);
            let mut v_all = std::mem::take(&mut st.v[l]);
            v_all.extend_from_slice(&v);
            let att = window_attention(&q, &k_all, &v_all, hist, self.heads, hd, self.window);
            let o = linear(&att, w, &layer.wo, dim, None);
            add_scaled(&mut x, &o, &layer.gamma_attn);
            let h2 = rms_norm(&x, &layer.ffn_norm, self.eps);
            let mut a = linear(&h2, dim, &layer.w1, self.ffn, None);
            let b = linear(&h2, dim, &layer.w3, self.ffn, None);
            a.iter_mut()
                .zip(&b)
                .for_each(|(a, &b)| *a = *a / (1.0 + (-*a).exp()) * b);
            let f = linear(&a, self.ffn, &layer.w2, dim, None);
            add_scaled(&mut x, &f, &layer.gamma_ffn);
            let keep = (self.window - 1).min(hist + t) * w;
            st.k[l] = k_all[k_all.len() - keep..].to_vec();
            st.v[l] = v_all[v_all.len() - keep..].to_vec();
        }
        st.pos += t as u64;
        rms_norm(&x, &self.norm, self.eps)
    }
}

/// `x += γ ⊙ y` row-wise (LayerScale).
fn add_scaled(x: &mut [f32], y: &[f32], gamma: &[f32]) {
    let c = gamma.len();
    for (xr, yr) in x.chunks_exact_mut(c).zip(y.chunks_exact(c)) {
        for ((a, &b), &g) in xr.iter_mut().zip(yr).zip(gamma) {
            *a += b * g;
        }
    }
}

/// One vector quantizer: `in_proj` (dim → cb), codebook `[n, cb]`, `out_proj` (cb → dim).
/// The reference's cosine VQ tables of a codebook `[n, cb]`: each row scaled to unit length
/// (its norm clamped at 1e-12) and each scaled row's Σv², in f32 and in order, as the CPU codec
/// and the GPU encoder both search them.
pub fn normalised_codebook(book: &[f32], cb: usize) -> (Vec<f32>, Vec<f32>) {
    let book_n: Vec<f32> = book
        .chunks_exact(cb)
        .flat_map(|row| {
            let norm = row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
            row.iter().map(move |v| v / norm).collect::<Vec<_>>()
        })
        .collect();
    let cn2 = book_n
        .chunks_exact(cb)
        .map(|c| c.iter().map(|v| v * v).sum())
        .collect();
    (book_n, cn2)
}

/// The nearest row of a normalised codebook ([`normalised_codebook`]) to `e` by cosine
/// distance, ‖ê‖² − 2ê·c + ‖c‖² with ê = e / max(‖e‖, 1e-12), every product and sum in f32 in
/// order; ties (and NaN rows) go to the lower index.
pub fn nearest_code(e: &[f32], book_n: &[f32], cn2: &[f32]) -> usize {
    let cb = e.len();
    let norm = e.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-12);
    let en: Vec<f32> = e.iter().map(|v| v / norm).collect();
    let en2: f32 = en.iter().map(|v| v * v).sum();
    let mut best = (f32::INFINITY, 0usize);
    for (j, c) in book_n.chunks_exact(cb).enumerate() {
        let dot: f32 = en.iter().zip(c).map(|(a, b)| a * b).sum();
        let dist = en2 - 2.0 * dot + cn2[j];
        if dist < best.0 {
            best = (dist, j);
        }
    }
    best.1
}

#[derive(Debug)]
struct Vq {
    in_w: Vec<f32>,
    in_b: Vec<f32>,
    out_w: Vec<f32>,
    out_b: Vec<f32>,
    codebook: Vec<f32>,
    /// Rows of the codebook, l2-normalised, and their Σv² ([`normalised_codebook`]).
    codebook_n: Vec<f32>,
    cn2: Vec<f32>,
    n: usize,
    cb: usize,
    dim: usize,
}

impl Vq {
    /// `out_proj(codebook[code])` for codes clamped to `n − 1`; `[T, dim]`.
    fn decode(&self, codes: impl Iterator<Item = u32>) -> Vec<f32> {
        let mut rows = Vec::new();
        for c in codes {
            let c = (c as usize).min(self.n - 1);
            rows.extend_from_slice(&self.codebook[c * self.cb..(c + 1) * self.cb]);
        }
        linear(&rows, self.cb, &self.out_w, self.dim, Some(&self.out_b))
    }

    /// Nearest codebook row by cosine similarity for every row of `r` `[T, dim]`; returns the
    /// codes and `out_proj(z_e + (z_q − z_e))` (the reference's straight-through value).
    fn quantize(&self, r: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let cb = self.cb;
        let z_e = linear(r, self.dim, &self.in_w, cb, Some(&self.in_b));
        let mut codes = Vec::with_capacity(z_e.len() / cb);
        let mut st = Vec::with_capacity(z_e.len());
        for e in z_e.chunks_exact(cb) {
            let code = nearest_code(e, &self.codebook_n, &self.cn2);
            codes.push(code as u32);
            let q = &self.codebook[code * cb..(code + 1) * cb];
            st.extend(e.iter().zip(q).map(|(&ze, &zq)| ze + (zq - ze)));
        }
        let out = linear(&st, cb, &self.out_w, self.dim, Some(&self.out_b));
        (codes, out)
    }
}

#[derive(Debug)]
struct EncBlock {
    res: Vec<ResUnit>,
    snake: Snake,
    conv: Conv1d,
    transformer: Option<Transformer>,
}

#[derive(Debug)]
struct DecBlock {
    snake: Snake,
    convt: ConvTranspose1d,
    res: Vec<ResUnit>,
}

#[derive(Debug)]
struct Inner {
    cfg: CodecConfig,
    enc_in: Conv1d,
    enc_blocks: Vec<EncBlock>,
    enc_snake: Snake,
    enc_out: Conv1d,
    semantic: Vq,
    residual: Vec<Vq>,
    down: Vec<(Conv1d, ConvNeXt)>,
    pre: Transformer,
    post: Transformer,
    up: Vec<(ConvTranspose1d, ConvNeXt)>,
    dec_in: Conv1d,
    dec_blocks: Vec<DecBlock>,
    dec_snake: Snake,
    dec_out: Conv1d,
}

/// The loaded codec. Cheap to clone (weights are shared).
#[derive(Debug, Clone)]
pub struct Codec {
    inner: Arc<Inner>,
}

impl Codec {
    /// Loads `codec.pth` from a directory (with its `codec_config.json` if present) or from the
    /// file itself (a `codec_config.json` beside it is used). `config` overrides both; with none
    /// found the real Drama 3 values apply. Every tensor shape is checked against the config.
    pub fn load(path: &Path, config: Option<CodecConfig>) -> Result<Codec, CodecError> {
        let (pth, dir) = if path.is_dir() {
            (path.join("codec.pth"), path.to_owned())
        } else {
            (
                path.to_owned(),
                path.parent().map(Path::to_owned).unwrap_or_default(),
            )
        };
        let cfg = match config {
            Some(c) => {
                c.validate()?;
                c
            }
            None => {
                let json = dir.join("codec_config.json");
                if json.is_file() {
                    let text = std::fs::read_to_string(&json).map_err(|source| CodecError::Io {
                        path: json.clone(),
                        source,
                    })?;
                    CodecConfig::from_json(&text)?
                } else {
                    CodecConfig::default()
                }
            }
        };
        let sd = checkpoint::pth::read_pth(&pth)?;
        let inner = weights::build(&Store::new(sd), cfg)?;
        Ok(Codec {
            inner: Arc::new(inner),
        })
    }

    pub fn config(&self) -> &CodecConfig {
        &self.inner.cfg
    }
    pub fn sample_rate(&self) -> u32 {
        self.inner.cfg.sample_rate
    }
    /// Samples per code frame (2048).
    pub fn frame_length(&self) -> usize {
        self.inner.cfg.frame_length()
    }
    /// Codebooks per frame (semantic + residual, 10).
    pub fn num_codebooks(&self) -> usize {
        self.inner.cfg.num_codebooks()
    }

    /// A fresh streaming decoder (position 0, zero histories).
    pub fn decoder_state(&self) -> DecoderState {
        let i = &self.inner;
        DecoderState {
            codec: self.clone(),
            post: i.post.new_state(),
            up: i
                .up
                .iter()
                .map(|(ct, nx)| (ct.new_history(), nx.dw.new_history()))
                .collect(),
            dec_in: i.dec_in.new_history(),
            blocks: i
                .dec_blocks
                .iter()
                .map(|b| {
                    (
                        b.convt.new_history(),
                        b.res.iter().map(|r| r.conv1.new_history()).collect(),
                    )
                })
                .collect(),
            dec_out: i.dec_out.new_history(),
        }
    }

    /// Bytes a decoder state holds at most (conv histories and the full attention window), per
    /// lane; computed from the config, nothing allocated.
    pub fn decoder_state_bytes(&self) -> usize {
        let i = &self.inner;
        let conv = |rows: usize, c: usize| rows * c * 4;
        let mut b = i.post.state_bytes();
        for (ct, nx) in &i.up {
            b += conv(ct.history_rows(), ct.cin) + conv(nx.dw.history_rows(), nx.dw.c);
        }
        b += conv(i.dec_in.history_rows(), i.dec_in.cin);
        for blk in &i.dec_blocks {
            b += conv(blk.convt.history_rows(), blk.convt.cin);
            for r in &blk.res {
                b += conv(r.conv1.history_rows(), r.conv1.cin);
            }
        }
        b + conv(i.dec_out.history_rows(), i.dec_out.cin)
    }

    /// Bytes a stream's decoder state holds beyond [`Codec::decoder_state_bytes`] for each frame
    /// of its largest step, where its post-module keeps keys and values in a ring of the
    /// window's history plus one step (the GPU decoder's).
    pub fn decoder_ring_bytes_per_step_frame(&self) -> usize {
        let p = &self.inner.post;
        2 * p.layers.len() * p.heads * p.hd * 4
    }

    /// Transient bytes one push of `frames` frames needs (the widest activations, a few live at
    /// once, and the GPU decoder's split-K partial sums); a planning estimate, not a bound
    /// enforced anywhere. The GPU decoder holds one step's scratch whatever its streams, sized
    /// for the engine's largest call, which the plan's lanes x per-lane frames covers.
    pub fn decoder_workspace_bytes(&self, frames: usize) -> usize {
        let i = &self.inner;
        let mut rows = frames * i.cfg.downsample_factor.iter().product::<usize>();
        let mut widest = rows * i.cfg.decoder_dim.max(i.cfg.quantizer.intermediate_size);
        for blk in &i.dec_blocks {
            rows *= blk.convt.stride;
            widest = widest.max(rows * blk.convt.cout);
        }
        // Six copies (the GPU decoder's step scratch: two work buffers, history then input, and
        // four activations; on the host, input, output and residual copies, im2col tiles and
        // GEMM packing), its split-K partial sums, up to six more (a 16-frame step's 6-segment
        // stage-3 convolution at Drama 3 geometry: 6.0x the widest), and one for the rest of
        // the scratch (ConvNeXt hidden rows, RoPE tables, and each stream's history rows in a
        // call over several): at Drama 3 geometry the GPU decoder's scratch and partials for 8
        // frames a lane over 1-64 lanes, or one stream's 16-64 frames, are 1.0-1.02x twelve
        // copies (codec-cuda's `plan_holds_the_step_scratch_drama3`).
        widest.saturating_mul(13 * 4)
    }

    /// Decodes codes `[num_codebooks, T]` to `T · frame_length` PCM samples (streamed
    /// internally in fixed chunks; identical to any other chunking).
    pub fn decode(&self, codes: &Codes) -> Result<Vec<f32>, CodecError> {
        let samples = codes
            .frames()
            .checked_mul(self.frame_length())
            .ok_or_else(|| CodecError::Codes(format!("{} frames overflow", codes.frames())))?;
        let mut st = self.decoder_state();
        let mut pcm = Vec::with_capacity(samples);
        let mut f = 0;
        while f < codes.frames() {
            let end = (f + DECODE_CHUNK_FRAMES).min(codes.frames());
            pcm.extend(st.push(&codes.slice(f, end))?);
            f = end;
        }
        Ok(pcm)
    }

    /// Encodes 44.1 kHz mono PCM to codes; the audio is right-padded with zeros to a multiple
    /// of `frame_length`.
    pub fn encode(&self, pcm: &[f32]) -> Result<Codes, CodecError> {
        let i = &self.inner;
        let fl = self.frame_length();
        if pcm.is_empty() {
            return Err(CodecError::Audio("no samples to encode".into()));
        }
        if let Some(p) = pcm.iter().position(|v| !v.is_finite()) {
            return Err(CodecError::Audio(format!("sample {p} is not finite")));
        }
        let frames = pcm.len().div_ceil(fl);
        let mut x = pcm.to_vec();
        x.resize(frames * fl, 0.0);

        let mut x = i.enc_in.forward(&mut i.enc_in.new_history(), &x);
        for blk in &i.enc_blocks {
            for r in &blk.res {
                x = r.forward(&mut r.conv1.new_history(), x);
            }
            blk.snake.forward(&mut x);
            x = blk.conv.forward(&mut blk.conv.new_history(), &x);
            if let Some(t) = &blk.transformer {
                x = t.forward(&mut t.new_state(), &x);
            }
        }
        i.enc_snake.forward(&mut x);
        let mut z = i.enc_out.forward(&mut i.enc_out.new_history(), &x);
        for (conv, nx) in &i.down {
            z = conv.forward(&mut conv.new_history(), &z);
            z = nx.forward(&mut nx.dw.new_history(), z);
        }
        let z = i.pre.forward(&mut i.pre.new_state(), &z);
        debug_assert_eq!(z.len(), frames * i.cfg.quantizer.dim);

        let nc = self.num_codebooks();
        let mut data = vec![0u32; nc * frames];
        let (sem_codes, z_sem) = i.semantic.quantize(&z);
        data[..frames].copy_from_slice(&sem_codes);
        let mut residual: Vec<f32> = z.iter().zip(&z_sem).map(|(a, b)| a - b).collect();
        for (q, vq) in i.residual.iter().enumerate() {
            let (codes, zq) = vq.quantize(&residual);
            data[(q + 1) * frames..(q + 2) * frames].copy_from_slice(&codes);
            residual.iter_mut().zip(&zq).for_each(|(r, z)| *r -= z);
        }
        Codes::new(nc, frames, data)
    }
}

/// Streaming decoder of one utterance: push code frames, get their PCM. Holds every causal
/// history, so any chunking gives the same samples as [`Codec::decode`].
#[derive(Debug, Clone)]
pub struct DecoderState {
    codec: Codec,
    post: TfState,
    up: Vec<(Vec<f32>, Vec<f32>)>,
    dec_in: Vec<f32>,
    blocks: Vec<(Vec<f32>, Vec<Vec<f32>>)>,
    dec_out: Vec<f32>,
}

impl DecoderState {
    /// Frames decoded so far.
    pub fn frames(&self) -> u64 {
        self.post.pos
    }

    /// Bytes this state holds now.
    pub fn bytes(&self) -> usize {
        let v = |x: &Vec<f32>| x.len() * 4;
        let mut b: usize = self.post.k.iter().chain(&self.post.v).map(v).sum();
        b += self.up.iter().map(|(a, c)| v(a) + v(c)).sum::<usize>();
        b += v(&self.dec_in) + v(&self.dec_out);
        for (a, r) in &self.blocks {
            b += v(a) + r.iter().map(v).sum::<usize>();
        }
        b
    }

    /// Decodes the next frames: `frame_length · codes.frames()` samples.
    pub fn push(&mut self, codes: &Codes) -> Result<Vec<f32>, CodecError> {
        let codec = self.codec.clone();
        let i = &codec.inner;
        let nc = i.cfg.num_codebooks();
        if codes.num_codebooks() != nc {
            return Err(CodecError::Codes(format!(
                "{} codebooks given, the codec has {nc}",
                codes.num_codebooks()
            )));
        }
        let t = codes.frames();
        if t == 0 {
            return Ok(Vec::new());
        }
        // z = Σ out_proj_i(codebook_i[clamp(code_i)]): residual sum first, then the semantic.
        let z_sem = i.semantic.decode((0..t).map(|f| codes.get(0, f)));
        let mut z_res: Option<Vec<f32>> = None;
        for (q, vq) in i.residual.iter().enumerate() {
            let zq = vq.decode((0..t).map(|f| codes.get(q + 1, f)));
            z_res = Some(match z_res {
                None => zq,
                Some(mut acc) => {
                    acc.iter_mut().zip(&zq).for_each(|(a, b)| *a += b);
                    acc
                }
            });
        }
        let mut z = z_sem;
        if let Some(r) = z_res {
            z.iter_mut().zip(&r).for_each(|(a, b)| *a += b);
        }
        let mut x = i.post.forward(&mut self.post, &z);
        for ((ct, nx), (h_ct, h_nx)) in i.up.iter().zip(self.up.iter_mut()) {
            x = ct.forward(h_ct, &x);
            x = nx.forward(h_nx, x);
        }
        let mut x = i.dec_in.forward(&mut self.dec_in, &x);
        for (blk, (h_ct, h_res)) in i.dec_blocks.iter().zip(self.blocks.iter_mut()) {
            blk.snake.forward(&mut x);
            x = blk.convt.forward(h_ct, &x);
            for (r, h) in blk.res.iter().zip(h_res.iter_mut()) {
                x = r.forward(h, x);
            }
        }
        i.dec_snake.forward(&mut x);
        let mut y = i.dec_out.forward(&mut self.dec_out, &x);
        y.iter_mut().for_each(|v| *v = v.tanh());
        Ok(y)
    }
}

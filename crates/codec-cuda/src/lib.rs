//! codec-cuda: the Drama 3 ModifiedDAC codec on the GPU (DRAMA3.md §8), f32, streaming: the
//! decoder, and the encoder (voice cloning).
//!
//! [`CudaDecoder`] holds the decoder weights on the device (read from the same `codec.pth` as
//! [`codec::Codec`], with its shape checks and weight-norm folding, uploaded once as f32);
//! [`CudaDecoderState::push`] has the semantics of [`codec::DecoderState::push`]: causal conv
//! histories (ConvNeXt depthwise ones included), transposed-conv overlap, the window-limited
//! `post_module` transformer with a KV ring and absolute RoPE positions (the CPU codec's own
//! table), Snake, tanh. Convolutions are GEMMs through an implicit im2col in our own tiled
//! kernels, whose every output's bits depend on K and N alone, never on the tile or row count
//! (one fma chain in k order on the FMA tiles; on the tensor-core tiles, the decoder's default,
//! 3xTF32 steps in order inside split-K segments fixed by K and N, the segments summed in order),
//! so streamed PCM equals whole-decode PCM bit for bit for any chunking.
//!
//! [`CudaEncoder`] has the semantics of [`codec::Codec::encode`] (PCM → codes, the same errors,
//! right-padding to whole frames); [`CudaEncoderState::push`] streams whole frames with every
//! causal history, the encoder transformer's and `pre_module`'s KV rings and positions kept, so
//! any split gives the codes of one call. The VQ search is one kernel with the CPU codec's float
//! formula (cosine distance to the normalised codebook, ties to the lower index).
//!
//! Both are written once over [`exec::Exec`]; [`exec::HostExec`] runs the same operations on the
//! CPU, which is how the bookkeeping is tested without a GPU.

pub mod check;
pub mod cuda;
mod decoder;
mod encoder;
pub mod exec;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use backend_cuda::Gpu;
use checkpoint::pth::PthStateDict;
use codec::{Codec, CodecConfig, Codes};

pub use cuda::CudaExec;
use decoder::{Scratch, StateBufs, Weights};
pub use decoder::{MAX_STEP_FRAMES, STEP_FRAMES};
use encoder::{EncCore, EncStateBufs};
use exec::{Exec, HostExec};

/// Errors of loading and running the GPU codec.
#[derive(Debug, thiserror::Error)]
pub enum CudaCodecError {
    #[error(transparent)]
    Cuda(#[from] backend_cuda::CudaError),
    #[error(transparent)]
    Codec(#[from] codec::CodecError),
    #[error(transparent)]
    Pth(#[from] checkpoint::pth::PthError),
    #[error("codec weights: {0}")]
    Weights(String),
    #[error("NVRTC failed to compile codec.cu: {0}")]
    Compile(String),
    #[error("codec-cuda: {0}")]
    Shape(String),
}

pub type Result<T> = std::result::Result<T, CudaCodecError>;

/// `codec.pth` for a path given to [`Codec::load`] (a directory or the file itself).
pub fn pth_path(path: &Path) -> PathBuf {
    if path.is_dir() {
        path.join("codec.pth")
    } else {
        path.to_owned()
    }
}

/// A decoder over any executor (weights uploaded, buffers owned, and one step's scratch for
/// all its streams, made at the first push).
struct Core<E: Exec> {
    exec: E,
    weights: Weights,
    bufs: Vec<usize>,
    scratch: std::cell::RefCell<Option<Scratch>>,
    /// The most frames a step takes of a stream: [`STEP_FRAMES`] unless set.
    step_frames: std::cell::Cell<usize>,
}

impl<E: Exec> Core<E> {
    fn new(exec: E, sd: &PthStateDict, cfg: &CodecConfig) -> Result<Self> {
        let (weights, bufs) = Weights::load(&exec, sd, cfg)?;
        Ok(Self {
            exec,
            weights,
            bufs,
            scratch: std::cell::RefCell::new(None),
            step_frames: std::cell::Cell::new(STEP_FRAMES),
        })
    }

    /// Steps of at most `frames` frames a stream (1 to [`MAX_STEP_FRAMES`]); the scratch is
    /// remade for them at the next push, and states made before take steps of at most what
    /// their KV rings were made for. The same samples whatever the step (any chunking is).
    fn set_step_frames(&self, frames: usize) {
        self.step_frames.set(frames.clamp(1, MAX_STEP_FRAMES));
        if let Some(old) = self.scratch.borrow_mut().take() {
            old.free(&self.exec);
        }
    }

    /// A stream's state, its KV rings made for the current step.
    fn state(&self) -> Result<StateBufs> {
        StateBufs::new(&self.exec, &self.weights, self.step_frames.get())
    }

    /// Elements of the scratch for a step of `frames` frames over `streams` streams, and the
    /// most split-K partial sums one of its GEMMs can hold.
    fn scratch_elems(&self, frames: usize, streams: usize) -> usize {
        self.weights.scratch_sizes(frames, streams).elems()
    }

    fn push(&self, st: &mut StateBufs, codes: &Codes) -> Result<Vec<f32>> {
        let mut out = self.push_many(&mut [st], &[codes])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// Decodes each stream's next frames, in steps that take every stream's next frames (at
    /// most the decoder's step and what its KV ring holds) in one pass through the layers:
    /// each stream's samples are bit for bit those of pushing it alone.
    fn push_many(&self, sts: &mut [&mut StateBufs], codes: &[&Codes]) -> Result<Vec<Vec<f32>>> {
        let nc = self.weights.num_codebooks();
        if sts.len() != codes.len() {
            return Err(CudaCodecError::Shape(format!(
                "{} decoder states for {} streams of codes",
                sts.len(),
                codes.len()
            )));
        }
        if let Some(c) = codes.iter().find(|c| c.num_codebooks() != nc) {
            return Err(CudaCodecError::Codec(codec::CodecError::Codes(format!(
                "{} codebooks given, the codec has {nc}",
                c.num_codebooks()
            ))));
        }
        let step = self.step_frames.get();
        let fl = self.weights.frame_length();
        let mut pcm: Vec<Vec<f32>> = codes
            .iter()
            .map(|c| Vec::with_capacity(c.frames() * fl))
            .collect();
        let mut done = vec![0; codes.len()];
        loop {
            // this step: each unfinished stream's next frames
            let mut parts = Vec::new();
            let mut chosen = Vec::new();
            for (b, st) in sts.iter_mut().enumerate() {
                let left = codes[b].frames() - done[b];
                if left > 0 {
                    let t = left.min(step).min(st.max_step(&self.weights));
                    parts.push(codes[b].slice(done[b], done[b] + t));
                    chosen.push((b, &mut **st));
                }
            }
            if parts.is_empty() {
                return Ok(pcm);
            }
            let frames = parts.iter().map(|c| c.frames()).sum();
            let need = self.weights.scratch_sizes(frames, parts.len());
            // a scratch too small for this step is remade at least as large as it was in
            // every buffer (call shapes that each outgrow the other in some buffer do not
            // remake it every step)
            let mut scratch = self.scratch.borrow_mut();
            let mut had = self.weights.scratch_sizes(step, 1);
            if scratch.as_ref().is_some_and(|s| !s.sizes.holds(need)) {
                if let Some(old) = scratch.take() {
                    had = had.max(old.free(&self.exec));
                }
            }
            if scratch.is_none() {
                *scratch = Some(Scratch::new(&self.exec, need.max(had))?);
            }
            let sc = scratch.as_ref().expect("made above");
            let (idx, mut states): (Vec<usize>, Vec<&mut StateBufs>) = chosen.into_iter().unzip();
            let out = decoder::step(&self.exec, &self.weights, &mut states, sc, &parts)?;
            for ((b, p), part) in idx.into_iter().zip(out).zip(&parts) {
                pcm[b].extend(p);
                done[b] += part.frames();
            }
        }
    }
}

impl<E: Exec> Drop for Core<E> {
    fn drop(&mut self) {
        for &b in &self.bufs {
            self.exec.free(b);
        }
        if let Some(sc) = self.scratch.get_mut().take() {
            sc.free(&self.exec);
        }
    }
}

/// The codec decoder on the GPU. Cheap to clone; states made from it share its weights.
#[derive(Clone)]
pub struct CudaDecoder {
    core: Arc<Mutex<Core<CudaExec>>>,
    frame_length: usize,
}

impl CudaDecoder {
    /// Loads the decoder of `codec` from the path it was loaded from (directory or
    /// `codec.pth`), on device 0.
    pub fn load(path: &Path, codec: &Codec) -> Result<Self> {
        let gpu = Arc::new(Gpu::new(0)?);
        Self::load_on(gpu, path, codec)
    }

    /// As [`CudaDecoder::load`], on an opened device (its stream carries every launch).
    pub fn load_on(gpu: Arc<Gpu>, path: &Path, codec: &Codec) -> Result<Self> {
        let sd = checkpoint::pth::read_pth(&pth_path(path))?;
        Self::from_state_dict(gpu, &sd, codec.config())
    }

    /// From a read `codec.pth` state dict and the codec's config.
    pub fn from_state_dict(gpu: Arc<Gpu>, sd: &PthStateDict, cfg: &CodecConfig) -> Result<Self> {
        let exec = CudaExec::with(gpu, backend_cuda::Variant::Exact, cuda::decoder_tc())?;
        let core = Core::new(exec, sd, cfg)?;
        core.exec.sync()?;
        Ok(Self {
            frame_length: cfg.frame_length(),
            core: Arc::new(Mutex::new(core)),
        })
    }

    /// Samples per code frame.
    pub fn frame_length(&self) -> usize {
        self.frame_length
    }

    /// A fresh streaming state (position 0, zero histories), with its own device buffers.
    pub fn state(&self) -> Result<CudaDecoderState> {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        let st = core.state()?;
        drop(core);
        Ok(CudaDecoderState {
            core: self.core.clone(),
            st: Some(st),
        })
    }

    /// Whole decode (a fresh state, pushed once).
    pub fn decode(&self, codes: &Codes) -> Result<Vec<f32>> {
        self.state()?.push(codes)
    }

    /// Decodes several streams' next frames together (`codes[b]` for `states[b]`, each a state
    /// of this decoder): each step takes every stream's next frames in one pass through the
    /// layers, so a layer's weights are read and its launches made once for all of them.
    /// Each stream's samples are bit for bit those of pushing it alone.
    pub fn push_many(
        &self,
        states: &mut [&mut CudaDecoderState],
        codes: &[&Codes],
    ) -> Result<Vec<Vec<f32>>> {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        let mut sts = Vec::with_capacity(states.len());
        for s in states.iter_mut() {
            if !Arc::ptr_eq(&s.core, &self.core) {
                return Err(CudaCodecError::Shape(
                    "a decoder state pushed with another decoder".into(),
                ));
            }
            sts.push(
                s.st.as_mut()
                    .ok_or_else(|| CudaCodecError::Shape("state already released".into()))?,
            );
        }
        core.push_many(&mut sts, codes)
    }

    /// Steps of at most `frames` frames (1 to [`MAX_STEP_FRAMES`]; [`STEP_FRAMES`] by default):
    /// the decoder's one scratch, shared by its streams, and the KV rings of the streams made
    /// after are sized for them. The engine sets its largest decoder call, which its memory
    /// plan counts. The same samples whatever the step.
    pub fn set_step_frames(&self, frames: usize) {
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .set_step_frames(frames);
    }

    /// Bytes of the decoder's step scratch for a step of `frames` frames over `streams` streams
    /// (one scratch a decoder, grown to the largest step it has taken) and of the most split-K
    /// partial sums its GEMMs can hold: the device memory a decoder call needs beyond the
    /// weights and the streams' states.
    pub fn scratch_bytes(&self, frames: usize, streams: usize) -> usize {
        4 * self
            .core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .scratch_elems(frames, streams)
    }

    /// The wide tensor-core kernel its GEMMs of many rows use (`None`: `gemm_tc64`; see
    /// [`cuda::wide_kernel`]): the same bits either way, for measuring one against the other.
    pub fn set_wide(&self, kernel: Option<&'static str>) {
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .exec
            .set_wide(kernel);
    }

    /// Whether its GEMMs of up to 16 rows take `gemm_tcs` (see [`cuda::small_tiles`]): the
    /// same bits either way.
    pub fn set_small(&self, on: bool) {
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .exec
            .set_small(on);
    }

    /// Launches of the wide tiles and of `gemm_tcs` so far.
    pub fn launch_counts(&self) -> (u64, u64) {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        (core.exec.wide_launches(), core.exec.small_launches())
    }

    /// The device this decoder runs on.
    pub fn gpu(&self) -> Arc<Gpu> {
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .exec
            .gpu
            .clone()
    }
}

/// Streaming GPU decoder of one utterance; any chunking gives the same samples.
pub struct CudaDecoderState {
    core: Arc<Mutex<Core<CudaExec>>>,
    st: Option<StateBufs>,
}

impl CudaDecoderState {
    /// Frames decoded so far.
    pub fn frames(&self) -> u64 {
        self.st.as_ref().map_or(0, |s| s.pos)
    }

    /// Decodes the next frames: `frame_length · codes.frames()` samples (returns once they are
    /// on the host).
    pub fn push(&mut self, codes: &Codes) -> Result<Vec<f32>> {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        let st = self
            .st
            .as_mut()
            .ok_or_else(|| CudaCodecError::Shape("state already released".into()))?;
        core.push(st, codes)
    }
}

impl Drop for CudaDecoderState {
    fn drop(&mut self) {
        if let Some(st) = self.st.take() {
            let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
            for &b in &st.bufs {
                core.exec.free(b);
            }
        }
    }
}

/// The same decoder on the CPU executor (plain loops with the kernels' semantics): a slow
/// reference for the decoder's bookkeeping, usable without a GPU.
pub struct HostDecoder {
    core: Core<HostExec>,
}

/// A [`HostDecoder`] stream.
pub struct HostDecoderState {
    st: StateBufs,
}

impl HostDecoder {
    pub fn from_state_dict(sd: &PthStateDict, cfg: &CodecConfig) -> Result<Self> {
        Ok(Self {
            core: Core::new(HostExec::new(), sd, cfg)?,
        })
    }
    pub fn state(&self) -> Result<HostDecoderState> {
        Ok(HostDecoderState {
            st: self.core.state()?,
        })
    }
    pub fn push(&self, state: &mut HostDecoderState, codes: &Codes) -> Result<Vec<f32>> {
        self.core.push(&mut state.st, codes)
    }
    /// As [`CudaDecoder::push_many`].
    pub fn push_many(
        &self,
        states: &mut [&mut HostDecoderState],
        codes: &[&Codes],
    ) -> Result<Vec<Vec<f32>>> {
        let mut sts: Vec<&mut StateBufs> = states.iter_mut().map(|s| &mut s.st).collect();
        self.core.push_many(&mut sts, codes)
    }
    /// As [`CudaDecoder::set_step_frames`].
    pub fn set_step_frames(&self, frames: usize) {
        self.core.set_step_frames(frames);
    }
    /// As [`CudaDecoder::scratch_bytes`].
    pub fn scratch_bytes(&self, frames: usize, streams: usize) -> usize {
        4 * self.core.scratch_elems(frames, streams)
    }
}

/// The codec encoder on the GPU. Cheap to clone; states made from it share its weights.
#[derive(Clone)]
pub struct CudaEncoder {
    core: Arc<Mutex<EncCore<CudaExec>>>,
    frame_length: usize,
}

impl CudaEncoder {
    /// Loads the encoder of `codec` from the path it was loaded from (directory or
    /// `codec.pth`), on device 0.
    pub fn load(path: &Path, codec: &Codec) -> Result<Self> {
        let gpu = Arc::new(Gpu::new(0)?);
        Self::load_on(gpu, path, codec)
    }

    /// As [`CudaEncoder::load`], on an opened device (its stream carries every launch).
    pub fn load_on(gpu: Arc<Gpu>, path: &Path, codec: &Codec) -> Result<Self> {
        let sd = checkpoint::pth::read_pth(&pth_path(path))?;
        Self::from_state_dict(gpu, &sd, codec.config())
    }

    /// From a read `codec.pth` state dict and the codec's config.
    pub fn from_state_dict(gpu: Arc<Gpu>, sd: &PthStateDict, cfg: &CodecConfig) -> Result<Self> {
        let exec = CudaExec::new(gpu)?;
        let core = EncCore::new(exec, sd, cfg)?;
        core.exec.sync()?;
        Ok(Self {
            frame_length: cfg.frame_length(),
            core: Arc::new(Mutex::new(core)),
        })
    }

    /// Samples per code frame (pushes are whole frames).
    pub fn frame_length(&self) -> usize {
        self.frame_length
    }

    /// A fresh streaming state (position 0, zero histories), with its own device buffers.
    pub fn state(&self) -> Result<CudaEncoderState> {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        let st = core.state()?;
        drop(core);
        Ok(CudaEncoderState {
            core: self.core.clone(),
            st: Some(st),
        })
    }

    /// Encodes 44.1 kHz mono PCM to codes as [`Codec::encode`] does (right-padded with zeros to
    /// whole frames; empty or non-finite input is an error), `STEP_FRAMES` frames per step.
    pub fn encode(&self, pcm: &[f32]) -> Result<Codes> {
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .encode(pcm)
    }

    /// The device this encoder runs on.
    pub fn gpu(&self) -> Arc<Gpu> {
        self.core
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .exec
            .gpu
            .clone()
    }
}

/// Streaming GPU encoder of one clip; any split into whole frames gives the same codes.
pub struct CudaEncoderState {
    core: Arc<Mutex<EncCore<CudaExec>>>,
    st: Option<EncStateBufs>,
}

impl CudaEncoderState {
    /// Frames encoded so far.
    pub fn frames(&self) -> u64 {
        self.st.as_ref().map_or(0, |s| s.frames)
    }

    /// Encodes the next frames: `pcm` is a whole number of `frame_length`-sample frames (an
    /// error otherwise, as is a non-finite sample); returns their codes.
    pub fn push(&mut self, pcm: &[f32]) -> Result<Codes> {
        let core = self.core.lock().unwrap_or_else(|p| p.into_inner());
        let st = self
            .st
            .as_mut()
            .ok_or_else(|| CudaCodecError::Shape("state already released".into()))?;
        core.push(st, pcm)
    }
}

impl Drop for CudaEncoderState {
    fn drop(&mut self) {
        if let Some(st) = self.st.take() {
            self.core
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .release(st);
        }
    }
}

/// The same encoder on the CPU executor (plain loops with the kernels' semantics): a slow
/// reference for the encoder's bookkeeping, usable without a GPU.
pub struct HostEncoder {
    core: EncCore<HostExec>,
}

/// A [`HostEncoder`] stream.
pub struct HostEncoderState {
    st: EncStateBufs,
}

impl HostEncoder {
    pub fn from_state_dict(sd: &PthStateDict, cfg: &CodecConfig) -> Result<Self> {
        Ok(Self {
            core: EncCore::new(HostExec::new(), sd, cfg)?,
        })
    }
    pub fn frame_length(&self) -> usize {
        self.core.frame_length()
    }
    pub fn state(&self) -> Result<HostEncoderState> {
        Ok(HostEncoderState {
            st: self.core.state()?,
        })
    }
    /// As [`CudaEncoderState::push`].
    pub fn push(&self, state: &mut HostEncoderState, pcm: &[f32]) -> Result<Codes> {
        self.core.push(&mut state.st, pcm)
    }
    /// As [`CudaEncoder::encode`].
    pub fn encode(&self, pcm: &[f32]) -> Result<Codes> {
        self.core.encode(pcm)
    }
}

impl HostEncoderState {
    /// Frames encoded so far.
    pub fn frames(&self) -> u64 {
        self.st.frames
    }
}

/// The fixture's codec goldens: `(name, codes, f64 PCM)` for `codec_decode` and, when the long
/// golden file is there, `codec_long_decode`.
pub fn fixture_goldens(
    fixture: &Path,
) -> std::result::Result<Vec<(String, Codes, Vec<f64>)>, String> {
    let gdir = fixture.join("golden");
    let mut out = Vec::new();
    for (file, case) in [
        ("golden.safetensors", "codec_decode"),
        ("golden_long.safetensors", "codec_long_decode"),
    ] {
        let path = gdir.join(file);
        if !path.is_file() {
            continue;
        }
        let store = checkpoint::Store::open_file(&path).map_err(|e| e.to_string())?;
        let codes = read_codes(&store, case)?;
        let pcm = store
            .get(&format!("{case}_pcm_f64"))
            .map_err(|e| e.to_string())?
            .to_f64();
        drop(store);
        out.push((case.to_string(), codes, pcm));
    }
    Ok(out)
}

/// The fixture's encoder goldens: `(name, PCM, codes)` for `codec_encode` (the chirp) and, when
/// the long golden file is there, `codec_long_encode`.
pub fn fixture_encode_goldens(
    fixture: &Path,
) -> std::result::Result<Vec<(String, Vec<f32>, Codes)>, String> {
    let gdir = fixture.join("golden");
    let mut out = Vec::new();
    for (file, case, input) in [
        (
            "golden.safetensors",
            "codec_encode",
            "codec_encode_input_chirp",
        ),
        (
            "golden_long.safetensors",
            "codec_long_encode",
            "codec_long_encode_input",
        ),
    ] {
        let path = gdir.join(file);
        if !path.is_file() {
            continue;
        }
        let store = checkpoint::Store::open_file(&path).map_err(|e| e.to_string())?;
        let pcm = store.get(input).map_err(|e| e.to_string())?.to_f32();
        let codes = read_codes(&store, case)?;
        drop(store);
        out.push((case.to_string(), pcm, codes));
    }
    Ok(out)
}

/// The golden `{case}_codes` tensor, `[codebooks, frames]`.
fn read_codes(store: &checkpoint::Store, case: &str) -> std::result::Result<Codes, String> {
    let codes = store
        .get(&format!("{case}_codes"))
        .map_err(|e| e.to_string())?;
    let shape = codes.shape().to_vec();
    if shape.len() != 2 {
        return Err(format!("{case}_codes has shape {shape:?}"));
    }
    Codes::from_i64(shape[0], shape[1], &codes.to_i64()).map_err(|e| e.to_string())
}

/// Max |a − b| over two equally long f32 signals; `None` if the lengths differ.
pub fn max_abs_diff32(a: &[f32], b: &[f32]) -> Option<f64> {
    (a.len() == b.len()).then(|| {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| (f64::from(x) - f64::from(y)).abs())
            .fold(0.0, f64::max)
    })
}

/// Whether two f32 signals are identical bit for bit.
pub fn bit_identical(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

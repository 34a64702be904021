//! Codec hyper-parameters: `codec_config.json` when present (the tiny fixture), otherwise the
//! real Drama 3 values of DRAMA3.md §8 (the real checkpoint ships no codec config).

use serde::Deserialize;

use crate::CodecError;

/// A WindowLimitedTransformer (fish style, RoPE, causal window).
#[derive(Debug, Clone, PartialEq)]
pub struct TransformerConfig {
    pub n_layer: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub dim: usize,
    pub intermediate_size: usize,
    pub rope_base: f64,
    pub norm_eps: f32,
    /// Rows attended, the row itself included.
    pub window: usize,
}

/// ModifiedDAC hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct CodecConfig {
    pub sample_rate: u32,
    pub encoder_dim: usize,
    pub encoder_rates: Vec<usize>,
    pub decoder_dim: usize,
    pub decoder_rates: Vec<usize>,
    /// Transformer layers after each encoder block (heads = block dim / 64, FFN 3·dim).
    pub encoder_transformer_layers: Vec<usize>,
    pub encoder_head_dim: usize,
    pub encoder_rope_base: f64,
    pub encoder_norm_eps: f32,
    pub encoder_window: usize,
    /// `pre_module` / `post_module` (also gives the quantizer input dim).
    pub quantizer: TransformerConfig,
    pub semantic_codebook_size: usize,
    pub codebook_size: usize,
    pub codebook_dim: usize,
    /// Residual codebooks (the semantic one comes on top).
    pub n_codebooks: usize,
    pub downsample_factor: Vec<usize>,
}

impl Default for CodecConfig {
    /// The real Drama 3 codec (`modded_dac_vq.yaml`, DRAMA3.md §8).
    fn default() -> Self {
        Self {
            sample_rate: 44100,
            encoder_dim: 64,
            encoder_rates: vec![2, 4, 8, 8],
            decoder_dim: 1536,
            decoder_rates: vec![8, 8, 4, 2],
            encoder_transformer_layers: vec![0, 0, 0, 4],
            encoder_head_dim: 64,
            encoder_rope_base: 10000.0,
            encoder_norm_eps: 1e-5,
            encoder_window: 512,
            quantizer: TransformerConfig {
                n_layer: 8,
                n_head: 16,
                head_dim: 64,
                dim: 1024,
                intermediate_size: 3072,
                rope_base: 10000.0,
                norm_eps: 1e-5,
                window: 128,
            },
            semantic_codebook_size: 4096,
            codebook_size: 1024,
            codebook_dim: 8,
            n_codebooks: 9,
            downsample_factor: vec![2, 2],
        }
    }
}

#[derive(Deserialize)]
struct JsonQuantizer {
    n_layer: usize,
    n_head: usize,
    dim: usize,
    intermediate_size: usize,
    head_dim: usize,
    rope_base: f64,
    norm_eps: f32,
    window_size: Option<usize>,
}

#[derive(Deserialize)]
struct JsonEncoderTransformer {
    head_dim: Option<usize>,
    rope_base: Option<f64>,
    norm_eps: Option<f32>,
    window_size: Option<usize>,
}

#[derive(Deserialize)]
struct JsonConfig {
    quantizer: JsonQuantizer,
    sample_rate: u32,
    encoder_dim: usize,
    encoder_rates: Vec<usize>,
    decoder_dim: usize,
    decoder_rates: Vec<usize>,
    encoder_transformer_layers: Vec<usize>,
    semantic_codebook_size: usize,
    codebook_size: usize,
    codebook_dim: usize,
    n_codebooks: usize,
    downsample_factor: Vec<usize>,
    encoder_transformer: Option<JsonEncoderTransformer>,
}

impl CodecConfig {
    /// Heads and FFN width of the transformer after a `full`-wide encoder block: the reference
    /// hard-codes `n_head = dim / 64` and `FFN = 3·dim` there (not `encoder_head_dim`); a block
    /// too narrow for one head is an error naming the width.
    pub fn encoder_transformer_shape(&self, full: usize) -> Result<(usize, usize), String> {
        match full / 64 {
            0 => Err(format!(
                "encoder transformer on a {full}-wide block has no 64-wide head"
            )),
            heads => Ok((heads, 3 * full)),
        }
    }

    /// Parses `codec_config.json` (the fixture's layout).
    pub fn from_json(text: &str) -> Result<Self, CodecError> {
        let j: JsonConfig =
            serde_json::from_str(text).map_err(|e| CodecError::Config(e.to_string()))?;
        let d = Self::default();
        let et = j.encoder_transformer;
        let cfg = Self {
            sample_rate: j.sample_rate,
            encoder_dim: j.encoder_dim,
            encoder_rates: j.encoder_rates,
            decoder_dim: j.decoder_dim,
            decoder_rates: j.decoder_rates,
            encoder_transformer_layers: j.encoder_transformer_layers,
            encoder_head_dim: et
                .as_ref()
                .and_then(|e| e.head_dim)
                .unwrap_or(d.encoder_head_dim),
            encoder_rope_base: et
                .as_ref()
                .and_then(|e| e.rope_base)
                .unwrap_or(d.encoder_rope_base),
            encoder_norm_eps: et
                .as_ref()
                .and_then(|e| e.norm_eps)
                .unwrap_or(d.encoder_norm_eps),
            encoder_window: et
                .as_ref()
                .and_then(|e| e.window_size)
                .unwrap_or(d.encoder_window),
            quantizer: TransformerConfig {
                n_layer: j.quantizer.n_layer,
                n_head: j.quantizer.n_head,
                head_dim: j.quantizer.head_dim,
                dim: j.quantizer.dim,
                intermediate_size: j.quantizer.intermediate_size,
                rope_base: j.quantizer.rope_base,
                norm_eps: j.quantizer.norm_eps,
                window: j.quantizer.window_size.unwrap_or(d.quantizer.window),
            },
            semantic_codebook_size: j.semantic_codebook_size,
            codebook_size: j.codebook_size,
            codebook_dim: j.codebook_dim,
            n_codebooks: j.n_codebooks,
            downsample_factor: j.downsample_factor,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Channels after the encoder (`encoder_dim · 2^blocks`).
    pub fn latent_dim(&self) -> usize {
        self.encoder_dim << self.encoder_rates.len()
    }

    /// Samples per encoder step (product of the encoder rates).
    pub fn hop_length(&self) -> usize {
        self.encoder_rates.iter().product()
    }

    /// Samples per code frame (hop × quantizer downsampling).
    pub fn frame_length(&self) -> usize {
        self.hop_length() * self.downsample_factor.iter().product::<usize>()
    }

    /// Semantic plus residual codebooks.
    pub fn num_codebooks(&self) -> usize {
        1 + self.n_codebooks
    }

    pub(crate) fn validate(&self) -> Result<(), CodecError> {
        let bad = |m: String| Err(CodecError::Config(m));
        let pos = |v: &[usize]| v.iter().all(|&x| x > 0);
        if self.encoder_rates.is_empty() || !pos(&self.encoder_rates) {
            return bad(format!(
                "encoder_rates {:?} must be non-empty and positive",
                self.encoder_rates
            ));
        }
        if self.decoder_rates.is_empty() || !pos(&self.decoder_rates) {
            return bad(format!(
                "decoder_rates {:?} must be non-empty and positive",
                self.decoder_rates
            ));
        }
        if !pos(&self.downsample_factor) {
            return bad(format!(
                "downsample_factor {:?} must be positive",
                self.downsample_factor
            ));
        }
        if self.encoder_transformer_layers.len() != self.encoder_rates.len() {
            return bad(format!(
                "encoder_transformer_layers has {} entries, encoder_rates {}",
                self.encoder_transformer_layers.len(),
                self.encoder_rates.len()
            ));
        }
        let dec_prod: usize = self.decoder_rates.iter().product();
        let up: usize = self.downsample_factor.iter().product();
        if dec_prod.checked_mul(up) != Some(self.frame_length()) {
            return bad(format!(
                "decoder rates {:?} × upsampling {up} = {} samples/frame, encoder gives {}",
                self.decoder_rates,
                dec_prod.saturating_mul(up),
                self.frame_length()
            ));
        }
        if self.decoder_dim >> self.decoder_rates.len() == 0 {
            return bad(format!(
                "decoder_dim {} halves to 0 over {} blocks",
                self.decoder_dim,
                self.decoder_rates.len()
            ));
        }
        let q = &self.quantizer;
        if q.dim != self.latent_dim() {
            return bad(format!(
                "quantizer dim {} differs from the latent dim {} (input_proj is identity only then)",
                q.dim,
                self.latent_dim()
            ));
        }
        if q.n_head == 0 || q.head_dim == 0 || q.head_dim & 1 == 1 || q.window == 0 {
            return bad(format!(
                "quantizer transformer heads {} × {} (window {}) invalid",
                q.n_head, q.head_dim, q.window
            ));
        }
        if self.encoder_head_dim == 0 || self.encoder_head_dim & 1 == 1 || self.encoder_window == 0
        {
            return bad(format!(
                "encoder transformer head_dim {} / window {} invalid",
                self.encoder_head_dim, self.encoder_window
            ));
        }
        if self.codebook_dim == 0 || self.codebook_size == 0 || self.semantic_codebook_size == 0 {
            return bad("codebook sizes must be positive".into());
        }
        Ok(())
    }
}

//! `config.json` of `model_type: fish_omni`, typed and validated as the official loader does.
//!
//! Every geometry figure the engine uses comes from here; nothing downstream hard-codes one.

use serde::{Deserialize, Serialize};
use std::path::Path;

use crate::CheckpointError;

/// Where the residual codebooks of an input frame enter the model (fixture README).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VqFeaturePlacement {
    /// Codebooks 1..=k enter the backbone embedding; k+1..=9 enter tower layer 0.
    BackbonePartial,
    /// No codebook enters the backbone (k = 0); all residual codes enter tower layer 0.
    MtpSharedPre,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    LinearAttention,
    FullAttention,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_type: Option<String>,
    pub rope_theta: f64,
    #[serde(default = "one")]
    pub partial_rotary_factor: f64,
}

fn one() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}

/// The backbone (`text_config`, a Qwen3.5-MoE text model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub layer_types: Vec<LayerType>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    #[serde(default = "yes")]
    pub attn_output_gate: bool,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    #[serde(default = "yes")]
    pub norm_topk_prob: bool,
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub rope_parameters: RopeParameters,
}

/// The codebook-MTP tower (`audio_decoder_config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AudioDecoderConfig {
    pub dim: usize,
    #[serde(default)]
    pub text_dim: Option<usize>,
    pub n_head: usize,
    pub n_local_heads: usize,
    pub head_dim: usize,
    pub n_layer: usize,
    pub shared_enrichment_layers: usize,
    pub intermediate_size: usize,
    pub norm_eps: f64,
    pub num_codebooks: usize,
    /// Codebook size of the semantic band = head width.
    pub vocab_size: usize,
    pub rope_base: f64,
    pub rotary_percent: f64,
    #[serde(default = "yes")]
    pub layernorm_zero_centered_gamma: bool,
    pub vq_feature_placement: VqFeaturePlacement,
    #[serde(default)]
    pub vq_backbone_codebooks: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationConfig {
    pub quant_method: String,
    #[serde(default)]
    pub activation_scheme: Option<String>,
    #[serde(default)]
    pub weight_block_size: Option<Vec<usize>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Config {
    pub model_type: String,
    #[serde(default)]
    pub speech_template_version: Option<String>,
    pub eos_token_id: u32,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    pub semantic_start_token_id: u32,
    pub semantic_end_token_id: u32,
    #[serde(default)]
    pub quantization_config: Option<QuantizationConfig>,
    pub text_config: TextConfig,
    pub audio_decoder_config: AudioDecoderConfig,
}

fn bad(field: &str, why: impl Into<String>) -> CheckpointError {
    CheckpointError::Config {
        field: field.to_string(),
        why: why.into(),
    }
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self, CheckpointError> {
        let text = std::fs::read_to_string(path).map_err(|e| CheckpointError::io(path, e))?;
        Self::from_json(&text)
    }

    /// Parses and validates; a missing or wrong field names its JSON path.
    pub fn from_json(text: &str) -> Result<Self, CheckpointError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            bad(&path, e.into_inner().to_string())
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), CheckpointError> {
        if self.model_type != "fish_omni" {
            return Err(bad(
                "model_type",
                format!("expected \"fish_omni\", found {:?}", self.model_type),
            ));
        }
        let t = &self.text_config;
        let a = &self.audio_decoder_config;
        let positive = [
            ("text_config.vocab_size", t.vocab_size),
            ("text_config.hidden_size", t.hidden_size),
            ("text_config.num_hidden_layers", t.num_hidden_layers),
            ("text_config.num_attention_heads", t.num_attention_heads),
            ("text_config.num_key_value_heads", t.num_key_value_heads),
            ("text_config.head_dim", t.head_dim),
            (
                "text_config.linear_conv_kernel_dim",
                t.linear_conv_kernel_dim,
            ),
            ("text_config.linear_key_head_dim", t.linear_key_head_dim),
            ("text_config.linear_value_head_dim", t.linear_value_head_dim),
            ("text_config.linear_num_key_heads", t.linear_num_key_heads),
            (
                "text_config.linear_num_value_heads",
                t.linear_num_value_heads,
            ),
            ("text_config.num_experts", t.num_experts),
            ("text_config.num_experts_per_tok", t.num_experts_per_tok),
            ("text_config.moe_intermediate_size", t.moe_intermediate_size),
            (
                "text_config.shared_expert_intermediate_size",
                t.shared_expert_intermediate_size,
            ),
            (
                "text_config.max_position_embeddings",
                t.max_position_embeddings,
            ),
            ("audio_decoder_config.dim", a.dim),
            ("audio_decoder_config.n_head", a.n_head),
            ("audio_decoder_config.n_local_heads", a.n_local_heads),
            ("audio_decoder_config.head_dim", a.head_dim),
            (
                "audio_decoder_config.intermediate_size",
                a.intermediate_size,
            ),
            ("audio_decoder_config.vocab_size", a.vocab_size),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(bad(field, "must be at least 1, found 0"));
            }
        }
        if t.layer_types.len() != t.num_hidden_layers {
            return Err(bad(
                "text_config.layer_types",
                format!(
                    "has {} entries but num_hidden_layers is {}",
                    t.layer_types.len(),
                    t.num_hidden_layers
                ),
            ));
        }
        if !t.num_attention_heads.is_multiple_of(t.num_key_value_heads) {
            return Err(bad(
                "text_config.num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    t.num_key_value_heads, t.num_attention_heads
                ),
            ));
        }
        if !t
            .linear_num_value_heads
            .is_multiple_of(t.linear_num_key_heads)
        {
            return Err(bad(
                "text_config.linear_num_key_heads",
                format!(
                    "{} does not divide linear_num_value_heads {}",
                    t.linear_num_key_heads, t.linear_num_value_heads
                ),
            ));
        }
        if t.num_experts_per_tok > t.num_experts {
            return Err(bad(
                "text_config.num_experts_per_tok",
                format!(
                    "{} exceeds num_experts {}",
                    t.num_experts_per_tok, t.num_experts
                ),
            ));
        }
        if !t.attn_output_gate {
            return Err(bad(
                "text_config.attn_output_gate",
                "only true is supported",
            ));
        }
        let rot = t.rope_parameters.partial_rotary_factor;
        if !(rot > 0.0 && rot <= 1.0 && t.rope_parameters.rope_theta.is_finite()) {
            return Err(bad(
                "text_config.rope_parameters",
                format!(
                    "partial_rotary_factor must be in (0, 1] and rope_theta finite, found {} and {}",
                    rot, t.rope_parameters.rope_theta
                ),
            ));
        }
        if !(t.rms_norm_eps > 0.0 && t.rms_norm_eps.is_finite()) {
            return Err(bad(
                "text_config.rms_norm_eps",
                "must be positive and finite",
            ));
        }
        if a.dim != t.hidden_size {
            return Err(bad(
                "audio_decoder_config.dim",
                format!(
                    "{} must equal text_config.hidden_size {}",
                    a.dim, t.hidden_size
                ),
            ));
        }
        if let Some(td) = a.text_dim {
            if td != t.hidden_size {
                return Err(bad(
                    "audio_decoder_config.text_dim",
                    format!(
                        "{} must equal text_config.hidden_size {}",
                        td, t.hidden_size
                    ),
                ));
            }
        }
        // The official validator requires the tower attention geometry to equal the backbone's.
        for (field, tower, backbone) in [
            (
                "audio_decoder_config.n_head",
                a.n_head,
                t.num_attention_heads,
            ),
            (
                "audio_decoder_config.n_local_heads",
                a.n_local_heads,
                t.num_key_value_heads,
            ),
            ("audio_decoder_config.head_dim", a.head_dim, t.head_dim),
        ] {
            if tower != backbone {
                return Err(bad(
                    field,
                    format!("{tower} must equal the backbone's {backbone}"),
                ));
            }
        }
        if a.num_codebooks < 2 {
            return Err(bad(
                "audio_decoder_config.num_codebooks",
                format!("must be at least 2, found {}", a.num_codebooks),
            ));
        }
        if a.n_layer != a.shared_enrichment_layers {
            return Err(bad(
                "audio_decoder_config.n_layer",
                format!(
                    "{} must equal shared_enrichment_layers {}",
                    a.n_layer, a.shared_enrichment_layers
                ),
            ));
        }
        if !a.layernorm_zero_centered_gamma {
            return Err(bad(
                "audio_decoder_config.layernorm_zero_centered_gamma",
                "only true is supported (zero-centred tower norms)",
            ));
        }
        let residual = a.num_codebooks - 1;
        match a.vq_feature_placement {
            VqFeaturePlacement::BackbonePartial => {
                if a.vq_backbone_codebooks < 1 || a.vq_backbone_codebooks > residual {
                    return Err(bad(
                        "audio_decoder_config.vq_backbone_codebooks",
                        format!(
                            "must be in 1..={residual} for backbone_partial, found {}",
                            a.vq_backbone_codebooks
                        ),
                    ));
                }
            }
            VqFeaturePlacement::MtpSharedPre => {
                if a.vq_backbone_codebooks != 0 {
                    return Err(bad(
                        "audio_decoder_config.vq_backbone_codebooks",
                        format!(
                            "must be 0 for mtp_shared_pre, found {}",
                            a.vq_backbone_codebooks
                        ),
                    ));
                }
            }
        }
        let rp = a.rotary_percent;
        if !(rp > 0.0 && rp <= 1.0) {
            return Err(bad(
                "audio_decoder_config.rotary_percent",
                format!("must be in (0, 1], found {rp}"),
            ));
        }
        if self.semantic_end_token_id < self.semantic_start_token_id {
            return Err(bad(
                "semantic_end_token_id",
                format!(
                    "{} is below semantic_start_token_id {}",
                    self.semantic_end_token_id, self.semantic_start_token_id
                ),
            ));
        }
        let band = (self.semantic_end_token_id - self.semantic_start_token_id) as usize + 1;
        if band != a.vocab_size {
            return Err(bad(
                "audio_decoder_config.vocab_size",
                format!(
                    "{} must equal the semantic band size {band} (semantic_start_token_id..=semantic_end_token_id)",
                    a.vocab_size
                ),
            ));
        }
        if self.semantic_end_token_id as usize >= t.vocab_size
            || self.eos_token_id as usize >= t.vocab_size
        {
            return Err(bad(
                "text_config.vocab_size",
                format!(
                    "{} does not cover eos_token_id {} and semantic_end_token_id {}",
                    t.vocab_size, self.eos_token_id, self.semantic_end_token_id
                ),
            ));
        }
        if (self.semantic_start_token_id..=self.semantic_end_token_id).contains(&self.eos_token_id)
        {
            return Err(bad("eos_token_id", "lies inside the semantic band"));
        }
        if let Some(q) = &self.quantization_config {
            if let Some(b) = &q.weight_block_size {
                if b.as_slice() != [128, 128] {
                    return Err(bad(
                        "quantization_config.weight_block_size",
                        format!("only [128, 128] is supported, found {b:?}"),
                    ));
                }
            }
        }
        let rot_dims = self.backbone_rotary_dims();
        if !rot_dims.is_multiple_of(2) || rot_dims == 0 {
            return Err(bad(
                "text_config.rope_parameters.partial_rotary_factor",
                format!("gives {rot_dims} rotary dims; must be even and positive"),
            ));
        }
        let trot = self.tower_rotary_dims();
        if !trot.is_multiple_of(2) || trot == 0 {
            return Err(bad(
                "audio_decoder_config.rotary_percent",
                format!("gives {trot} rotary dims; must be even and positive"),
            ));
        }
        Ok(())
    }

    pub fn backbone_rotary_dims(&self) -> usize {
        let t = &self.text_config;
        (t.head_dim as f64 * t.rope_parameters.partial_rotary_factor).round() as usize
    }

    pub fn tower_rotary_dims(&self) -> usize {
        let a = &self.audio_decoder_config;
        (a.head_dim as f64 * a.rotary_percent).round() as usize
    }

    /// Residual codebooks summed into the backbone input (k of the fixture README).
    pub fn backbone_codebooks(&self) -> usize {
        match self.audio_decoder_config.vq_feature_placement {
            VqFeaturePlacement::BackbonePartial => self.audio_decoder_config.vq_backbone_codebooks,
            VqFeaturePlacement::MtpSharedPre => 0,
        }
    }

    pub fn num_codebooks(&self) -> usize {
        self.audio_decoder_config.num_codebooks
    }

    /// Semantic band size = codebook size used by every tower table and head.
    pub fn codebook_size(&self) -> usize {
        self.audio_decoder_config.vocab_size
    }

    pub fn tower_layers(&self) -> usize {
        self.audio_decoder_config.shared_enrichment_layers + self.num_codebooks() - 1
    }

    pub fn is_semantic(&self, token: u32) -> bool {
        (self.semantic_start_token_id..=self.semantic_end_token_id).contains(&token)
    }

    /// Ascending `{eos} ∪ semantic band`: the rows of `lm_head` the main head reads.
    pub fn candidate_token_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> =
            (self.semantic_start_token_id..=self.semantic_end_token_id).collect();
        ids.push(self.eos_token_id);
        ids.sort_unstable();
        ids
    }

    pub fn gdn_conv_channels(&self) -> usize {
        let t = &self.text_config;
        2 * t.linear_num_key_heads * t.linear_key_head_dim
            + t.linear_num_value_heads * t.linear_value_head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> serde_json::Value {
        let p =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny/config.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    #[test]
    fn tiny_config_parses() {
        let c = Config::from_json(&tiny().to_string()).unwrap();
        assert_eq!(c.text_config.hidden_size, 128);
        assert_eq!(c.backbone_codebooks(), 2);
        assert_eq!(c.tower_layers(), 13);
        assert_eq!(c.backbone_rotary_dims(), 8);
        let cand = c.candidate_token_ids();
        assert_eq!(cand.len(), 65);
        assert_eq!(cand[0], 354);
        assert_eq!(cand[1], 374);
    }

    #[test]
    fn missing_field_is_named() {
        let mut v = tiny();
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("hidden_size");
        let e = Config::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("hidden_size"), "{e}");
    }

    #[test]
    fn wrong_type_is_named() {
        let mut v = tiny();
        v["audio_decoder_config"]["n_head"] = serde_json::json!("four");
        let e = Config::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("audio_decoder_config.n_head"), "{e}");
    }

    #[test]
    fn vq_backbone_codebooks_range() {
        for bad_k in [0, 10, 42] {
            let mut v = tiny();
            v["audio_decoder_config"]["vq_backbone_codebooks"] = serde_json::json!(bad_k);
            let e = Config::from_json(&v.to_string()).unwrap_err().to_string();
            assert!(e.contains("vq_backbone_codebooks"), "{e}");
            assert!(e.contains("1..=9"), "{e}");
        }
        for k in 1..=9 {
            let mut v = tiny();
            v["audio_decoder_config"]["vq_backbone_codebooks"] = serde_json::json!(k);
            Config::from_json(&v.to_string()).unwrap();
        }
        let mut v = tiny();
        v["audio_decoder_config"]["vq_feature_placement"] = serde_json::json!("mtp_shared_pre");
        let e = Config::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("must be 0"), "{e}");
        v["audio_decoder_config"]["vq_backbone_codebooks"] = serde_json::json!(0);
        assert_eq!(
            Config::from_json(&v.to_string())
                .unwrap()
                .backbone_codebooks(),
            0
        );
    }

    #[test]
    fn wrong_model_type() {
        let mut v = tiny();
        v["model_type"] = serde_json::json!("qwen3");
        let e = Config::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("model_type"), "{e}");
    }

    #[test]
    fn tower_heads_must_match() {
        let mut v = tiny();
        v["audio_decoder_config"]["n_local_heads"] = serde_json::json!(4);
        let e = Config::from_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.contains("n_local_heads"), "{e}");
    }
}

//! Named geometries for synthetic checkpoints: the vendored tiny fixture's and the published
//! Drama 3 one (DRAMA3.md section 2.4). Consumers still read the written `config.json`.

use crate::config::Config;

/// The vendored tiny fixture's config, byte for byte.
pub const TINY_CONFIG_JSON: &str = include_str!("../../../testdata/drama3-tiny/config.json");

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Geometry {
    Tiny,
    Drama3,
}

impl Geometry {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "tiny" => Some(Self::Tiny),
            "drama3" => Some(Self::Drama3),
            _ => None,
        }
    }

    pub fn config(self) -> Config {
        let text = match self {
            Self::Tiny => TINY_CONFIG_JSON.to_string(),
            Self::Drama3 => drama3_config_json(),
        };
        Config::from_json(&text).expect("built-in geometry is valid")
    }
}

/// Semantic band of the synthetic Drama 3 vocabulary: the tiny byte-level BPE (352 tokens) and its
/// 22 specials, then 4096 `<|semantic:i|>`, padded to 4480 rows.
pub const DRAMA3_SEMANTIC_START: u32 = 374;
pub const DRAMA3_VOCAB: usize = 4480;

pub fn drama3_config_json() -> String {
    let layer_types: Vec<&str> = (0..40)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let v = serde_json::json!({
        "architectures": ["FishOmniModel"],
        "model_type": "fish_omni",
        "fish_schema_version": 1,
        "speech_template_version": "reference-bracket-v1",
        "eos_token_id": 354,
        "pad_token_id": 352,
        "semantic_start_token_id": DRAMA3_SEMANTIC_START,
        "semantic_end_token_id": DRAMA3_SEMANTIC_START + 4095,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "quantization_config": {"quant_method": "bsgemm-moe", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "text_config": {
            "model_type": "fish_omni_text",
            "vocab_size": DRAMA3_VOCAB,
            "hidden_size": 2048,
            "num_hidden_layers": 40,
            "layer_types": layer_types,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "attn_output_gate": true,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "norm_topk_prob": true,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1.0e7, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": false
        },
        "audio_decoder_config": {
            "model_type": "fish_qwen3_audio_decoder",
            "decoder_type": "codebook_mtp_shared",
            "dim": 2048,
            "text_dim": 2048,
            "n_head": 16,
            "n_local_heads": 2,
            "head_dim": 256,
            "n_layer": 4,
            "shared_enrichment_layers": 4,
            "intermediate_size": 6144,
            "norm_eps": 1e-6,
            "num_codebooks": 10,
            "vocab_size": 4096,
            "max_seq_len": 11,
            "rope_base": 1.0e7,
            "rotary_percent": 0.25,
            "rotary_interleaved": true,
            "attention_output_gate": true,
            "attention_qk_norm": false,
            "layernorm_zero_centered_gamma": true,
            "vq_feature_scope": "all_vq",
            "vq_feature_placement": "backbone_partial",
            "vq_backbone_codebooks": 2
        }
    });
    serde_json::to_string_pretty(&v).expect("json")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{expected_tensors, tally, ExpertFormat};

    #[test]
    fn drama3_manifest_counts_match_published_header() {
        let cfg = Geometry::Drama3.config();
        let m = expected_tensors(&cfg, &ExpertFormat::Fp8Block128).unwrap();
        let t = tally(&m);
        assert_eq!(t.tensors, 62245);
        assert_eq!(t.by_dtype["BF16"], 805);
        assert_eq!(t.by_dtype["F8_E4M3"], 30720);
        assert_eq!(t.by_dtype["F32"], 30720);
        // Experts: 40 x 256 x 3 x 2048 x 512 bytes.
        assert_eq!(t.bytes_by_class["experts"], 40 * 256 * 3 * 2048 * 512);
    }

    #[test]
    fn tiny_geometry_is_the_fixture() {
        let cfg = Geometry::Tiny.config();
        assert_eq!(cfg.text_config.hidden_size, 128);
    }
}

//! The built-in tiny synthetic checkpoint (random weights: the audio is noise, but every stage
//! runs), generated deterministically on first use, and the admission geometry of a checkpoint.

use std::path::PathBuf;

use admission::{CodecGeometry, ExpertFormat as AdmExperts, LayerKind, ModelGeometry};
use checkpoint::fixture::{CodecSource, FixtureExperts, FixtureOptions};
use checkpoint::geometry::Geometry;
use checkpoint::{Checkpoint, ExpertFormat, LayerType};

/// The vendored tiny codec (the fixture's, seed 1236) and its config.
const TINY_CODEC: &[u8] = include_bytes!("../../../testdata/drama3-tiny/codec.pth");
const TINY_CODEC_CONFIG: &str = include_str!("../../../testdata/drama3-tiny/codec_config.json");
/// Bump when the generator's output changes, so an old cache is not reused.
const BUILTIN_VERSION: &str = "builtin-tiny-v1";
pub const BUILTIN_SEED: u64 = 20261129;

fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("dramatis").join(BUILTIN_VERSION)
}

/// Writes the tiny checkpoint once (atomically: a temporary folder renamed into place).
pub fn ensure_builtin() -> Result<PathBuf, String> {
    let dir = cache_dir();
    if dir.join("model.safetensors.index.json").exists() && dir.join("codec.pth").exists() {
        return Ok(dir);
    }
    let parent = dir.parent().ok_or("no cache parent")?.to_path_buf();
    std::fs::create_dir_all(&parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = parent.join(format!(".{BUILTIN_VERSION}.{}.{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    write_tiny(&tmp, BUILTIN_SEED)?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another process won the race: use its copy.
        Err(_) if dir.join("model.safetensors.index.json").exists() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(format!("{}: {e}", dir.display())),
    }
}

/// A tiny synthetic checkpoint with the vendored codec, in `out`.
pub fn write_tiny(out: &std::path::Path, seed: u64) -> Result<(), String> {
    let opts = FixtureOptions {
        geometry: Geometry::Tiny,
        seed,
        out: out.to_path_buf(),
        experts: FixtureExperts::Fp8,
        codec: Some(CodecSource::Bytes(TINY_CODEC.to_vec())),
    };
    checkpoint::fixture::write(&opts, &|_, _| {}).map_err(|e| e.to_string())?;
    std::fs::write(out.join("codec_config.json"), TINY_CODEC_CONFIG).map_err(|e| e.to_string())?;
    Ok(())
}

pub fn tiny_codec_pth() -> &'static [u8] {
    TINY_CODEC
}

pub fn tiny_codec_config() -> &'static str {
    TINY_CODEC_CONFIG
}

/// The memory-plan geometry of an opened checkpoint (every figure from its config).
pub fn admission_geometry(ck: &Checkpoint) -> Result<ModelGeometry, String> {
    geometry_from_config(&ck.config, &ck.expert_format, &ck.dir.display().to_string())
}

pub fn geometry_from_config(
    c: &checkpoint::Config,
    experts: &ExpertFormat,
    name: &str,
) -> Result<ModelGeometry, String> {
    let t = &c.text_config;
    let a = &c.audio_decoder_config;
    let u = |x: usize| x as u64;
    let g = ModelGeometry {
        name: name.to_string(),
        hidden_size: u(t.hidden_size),
        layer_types: t
            .layer_types
            .iter()
            .map(|l| match l {
                LayerType::LinearAttention => LayerKind::LinearAttention,
                LayerType::FullAttention => LayerKind::FullAttention,
            })
            .collect(),
        num_attention_heads: u(t.num_attention_heads),
        num_key_value_heads: u(t.num_key_value_heads),
        head_dim: u(t.head_dim),
        attn_output_gate: t.attn_output_gate,
        linear_conv_kernel_dim: u(t.linear_conv_kernel_dim),
        linear_num_key_heads: u(t.linear_num_key_heads),
        linear_key_head_dim: u(t.linear_key_head_dim),
        linear_num_value_heads: u(t.linear_num_value_heads),
        linear_value_head_dim: u(t.linear_value_head_dim),
        num_experts: u(t.num_experts),
        num_experts_per_tok: u(t.num_experts_per_tok),
        moe_intermediate_size: u(t.moe_intermediate_size),
        shared_expert_intermediate_size: u(t.shared_expert_intermediate_size),
        expert_format: match experts {
            ExpertFormat::Fp8Block128 => AdmExperts::fp8_128(),
            ExpertFormat::Nvfp4Pruned { kept } => AdmExperts::Nvfp4 {
                kept_experts_per_layer: kept.iter().map(|k| k.len() as u64).collect(),
            },
        },
        vocab_size: u(t.vocab_size),
        tie_word_embeddings: false,
        max_position_embeddings: u(t.max_position_embeddings),
        tower_dim: u(a.dim),
        tower_layers: u(c.tower_layers()),
        tower_heads: u(a.n_head),
        tower_kv_heads: u(a.n_local_heads),
        tower_head_dim: u(a.head_dim),
        tower_intermediate_size: u(a.intermediate_size),
        num_codebooks: u(a.num_codebooks),
        codebook_size: u(a.vocab_size),
        codec: CodecGeometry {
            frame_length: 2048,
            sample_rate: 44_100,
            weight_bytes: 0,
            state_bytes_per_lane: 0,
            workspace_bytes_per_lane: 0,
        },
    };
    g.validate().map_err(|e| e.to_string())?;
    Ok(g)
}

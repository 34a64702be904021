//! The numbers the memory plan needs, as plain public fields.
//!
//! The engine fills a `ModelGeometry` from `config.json` (and the index, for pruned NVFP4 experts);
//! `drama3()` and `tiny()` are the synthetic geometries of DRAMA3.md §2.4 and the tiny fixture, for
//! `plan` and tests without a checkpoint. Every derived size is computed with checked `u64`
//! arithmetic; an overflow is `LimitError::Overflow`, never a wrap.

use crate::contract::WindowContract;
use crate::error::LimitError;
use crate::limits::Limits;
use crate::units::Window;
use serde::{Deserialize, Serialize};

/// A backbone layer's sequence mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// Gated DeltaNet: fixed recurrent and conv state per lane.
    LinearAttention,
    /// Gated full attention: KV state per row.
    FullAttention,
}

/// How routed experts are stored (and kept in memory: never expanded).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "format")]
pub enum ExpertFormat {
    /// BF16 experts (synthetic geometries only).
    Bf16,
    /// F8_E4M3 weights, one F32 `weight_scale_inv` per `block_rows` x `block_cols` block.
    Fp8Block { block_rows: u64, block_cols: u64 },
    /// NVFP4: U8 `[out, in/2]` + E4M3 `[out, in/16]` + one F32 global scale per matrix. Only kept
    /// experts are stored; one count per backbone layer.
    Nvfp4 { kept_experts_per_layer: Vec<u64> },
}

impl ExpertFormat {
    /// The FP8 format of the released checkpoint.
    pub const fn fp8_128() -> Self {
        Self::Fp8Block {
            block_rows: 128,
            block_cols: 128,
        }
    }

    pub const fn name(&self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp8Block { .. } => "fp8",
            Self::Nvfp4 { .. } => "nvfp4",
        }
    }
}

/// Codec facts. The byte figures come from the codec crate (they are not in `config.json`); 0 means
/// the caller did not supply them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodecGeometry {
    /// PCM samples per generated frame.
    pub frame_length: u64,
    pub sample_rate: u64,
    pub weight_bytes: u64,
    pub state_bytes_per_lane: u64,
    pub workspace_bytes_per_lane: u64,
}

/// Everything the plan reads about the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelGeometry {
    pub name: String,

    // Backbone (`text_config`).
    pub hidden_size: u64,
    pub layer_types: Vec<LayerKind>,
    pub num_attention_heads: u64,
    pub num_key_value_heads: u64,
    pub head_dim: u64,
    /// `q_proj` emits a gate as wide as the queries.
    pub attn_output_gate: bool,
    pub linear_conv_kernel_dim: u64,
    pub linear_num_key_heads: u64,
    pub linear_key_head_dim: u64,
    pub linear_num_value_heads: u64,
    pub linear_value_head_dim: u64,
    pub num_experts: u64,
    pub num_experts_per_tok: u64,
    pub moe_intermediate_size: u64,
    pub shared_expert_intermediate_size: u64,
    pub expert_format: ExpertFormat,
    pub vocab_size: u64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: u64,

    // Tower (`audio_decoder_config`): shared_enrichment_layers + num_codebooks - 1 layers.
    pub tower_dim: u64,
    pub tower_layers: u64,
    pub tower_heads: u64,
    pub tower_kv_heads: u64,
    pub tower_head_dim: u64,
    pub tower_intermediate_size: u64,
    pub num_codebooks: u64,
    /// Tower `vocab_size`: entries per codebook table and head width.
    pub codebook_size: u64,

    pub codec: CodecGeometry,
}

/// Resident weight bytes by format.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WeightBytes {
    /// Backbone mixers, norms, router and shared experts (BF16).
    pub backbone_dense_bf16: u64,
    /// `embed_tokens` and `lm_head` (BF16).
    pub embeddings_bf16: u64,
    /// Tower layers, heads and codebook embeddings (BF16).
    pub tower_bf16: u64,
    /// Routed expert payload in the stored format.
    pub experts: u64,
    /// Expert scales: F32 block scales (FP8) or E4M3 block + F32 global scales (NVFP4).
    pub expert_scales: u64,
}

/// What one frame round reads, from [`ModelGeometry::frame_read_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct FrameReadBytes {
    /// Backbone dense, tower layers and heads, main-head candidate rows (BF16).
    pub dense_bf16: u64,
    /// Routed experts (payload and scales) expected to be hit by the round's lanes.
    pub experts_expected: f64,
    /// Expected distinct experts hit per layer.
    pub experts_per_layer_expected: f64,
    /// Gated DeltaNet state of every lane, read and written back.
    pub gdn_state: u64,
}

impl FrameReadBytes {
    pub fn total(&self) -> f64 {
        self.dense_bf16 as f64 + self.experts_expected + self.gdn_state as f64
    }
}

pub(crate) fn mul(a: u64, b: u64, what: &'static str) -> Result<u64, LimitError> {
    a.checked_mul(b).ok_or(LimitError::Overflow { what })
}

pub(crate) fn add(a: u64, b: u64, what: &'static str) -> Result<u64, LimitError> {
    a.checked_add(b).ok_or(LimitError::Overflow { what })
}

/// Product of several factors, checked.
pub(crate) fn product(factors: &[u64], what: &'static str) -> Result<u64, LimitError> {
    factors.iter().try_fold(1u64, |acc, &f| mul(acc, f, what))
}

/// Sum of several terms, checked.
pub(crate) fn sum(terms: &[u64], what: &'static str) -> Result<u64, LimitError> {
    terms.iter().try_fold(0u64, |acc, &t| add(acc, t, what))
}

fn ceil_div(a: u64, b: u64) -> u64 {
    // b is validated non-zero; `div_ceil` cannot overflow.
    a.div_ceil(b.max(1))
}

const BF16: u64 = 2;
const F32: u64 = 4;

/// A geometry the plan cannot use.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("geometry field {field} {reason}")]
pub struct GeometryError {
    pub field: &'static str,
    pub reason: &'static str,
}

/// The H200's device-to-device copy rate that GPU.md measured (bytes read + written per
/// second): what the weight-read floor divides by.
pub const H200_COPY_BYTES_PER_S: f64 = 4.3e12;

impl ModelGeometry {
    /// The synthetic full-size Drama 3 geometry (DRAMA3.md §2.4).
    pub fn drama3() -> Self {
        let mut layer_types = Vec::with_capacity(40);
        for i in 0..40 {
            layer_types.push(if (i + 1) % 4 == 0 {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            });
        }
        Self {
            name: "drama3".into(),
            hidden_size: 2048,
            layer_types,
            num_attention_heads: 16,
            num_key_value_heads: 2,
            head_dim: 256,
            attn_output_gate: true,
            linear_conv_kernel_dim: 4,
            linear_num_key_heads: 16,
            linear_key_head_dim: 128,
            linear_num_value_heads: 32,
            linear_value_head_dim: 128,
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: 512,
            expert_format: ExpertFormat::fp8_128(),
            vocab_size: 4480,
            tie_word_embeddings: false,
            max_position_embeddings: 262_144,
            tower_dim: 2048,
            tower_layers: 13,
            tower_heads: 16,
            tower_kv_heads: 2,
            tower_head_dim: 256,
            tower_intermediate_size: 6144,
            num_codebooks: 10,
            codebook_size: 4096,
            codec: CodecGeometry {
                frame_length: 2048,
                sample_rate: 44_100,
                weight_bytes: 0,
                state_bytes_per_lane: 0,
                workspace_bytes_per_lane: 0,
            },
        }
    }

    /// The tiny fixture (`testdata/drama3-tiny/config.json`).
    pub fn tiny() -> Self {
        Self {
            name: "tiny".into(),
            hidden_size: 128,
            layer_types: vec![
                LayerKind::LinearAttention,
                LayerKind::LinearAttention,
                LayerKind::LinearAttention,
                LayerKind::FullAttention,
            ],
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            attn_output_gate: true,
            linear_conv_kernel_dim: 4,
            linear_num_key_heads: 2,
            linear_key_head_dim: 16,
            linear_num_value_heads: 4,
            linear_value_head_dim: 16,
            num_experts: 16,
            num_experts_per_tok: 8,
            moe_intermediate_size: 256,
            shared_expert_intermediate_size: 256,
            expert_format: ExpertFormat::fp8_128(),
            vocab_size: 512,
            tie_word_embeddings: false,
            max_position_embeddings: 262_144,
            tower_dim: 128,
            tower_layers: 13,
            tower_heads: 4,
            tower_kv_heads: 2,
            tower_head_dim: 32,
            tower_intermediate_size: 256,
            num_codebooks: 10,
            codebook_size: 64,
            codec: CodecGeometry {
                frame_length: 2048,
                sample_rate: 44_100,
                weight_bytes: 0,
                state_bytes_per_lane: 0,
                workspace_bytes_per_lane: 0,
            },
        }
    }

    /// A geometry by name: `tiny` or `drama3`.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny()),
            "drama3" => Some(Self::drama3()),
            _ => None,
        }
    }

    /// The window contract for this model: `context` defaults to `max_position_embeddings`.
    pub fn window_contract(
        &self,
        context: Option<Window>,
        limits: &Limits,
    ) -> Result<WindowContract, LimitError> {
        let max = Window(self.max_position_embeddings);
        WindowContract::new(context.unwrap_or(max), max, limits.default_frame_cap)
    }

    /// Structural checks the arithmetic relies on (divisors non-zero, counts consistent).
    pub fn validate(&self) -> Result<(), GeometryError> {
        let nonzero: [(&'static str, u64); 9] = [
            ("hidden_size", self.hidden_size),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("num_experts", self.num_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("max_position_embeddings", self.max_position_embeddings),
            ("num_codebooks", self.num_codebooks),
            ("codebook_size", self.codebook_size),
            ("tower_dim", self.tower_dim),
            ("codec.frame_length", self.codec.frame_length),
        ];
        for (field, value) in nonzero {
            if value == 0 {
                return Err(GeometryError {
                    field,
                    reason: "must be at least 1",
                });
            }
        }
        if self.layer_types.is_empty() {
            return Err(GeometryError {
                field: "layer_types",
                reason: "must list at least one layer",
            });
        }
        if self.num_experts_per_tok > self.num_experts {
            return Err(GeometryError {
                field: "num_experts_per_tok",
                reason: "exceeds num_experts",
            });
        }
        match &self.expert_format {
            ExpertFormat::Bf16 => {}
            ExpertFormat::Fp8Block {
                block_rows,
                block_cols,
            } => {
                if *block_rows == 0 || *block_cols == 0 {
                    return Err(GeometryError {
                        field: "expert_format.block",
                        reason: "must be at least 1",
                    });
                }
            }
            ExpertFormat::Nvfp4 {
                kept_experts_per_layer,
            } => {
                if kept_experts_per_layer.len() != self.layer_types.len() {
                    return Err(GeometryError {
                        field: "expert_format.kept_experts_per_layer",
                        reason: "must have one count per backbone layer",
                    });
                }
                if kept_experts_per_layer
                    .iter()
                    .any(|&k| k > self.num_experts || k < self.num_experts_per_tok)
                {
                    return Err(GeometryError {
                        field: "expert_format.kept_experts_per_layer",
                        reason: "must lie between num_experts_per_tok and num_experts",
                    });
                }
            }
        }
        Ok(())
    }

    fn count_layers(&self, kind: LayerKind) -> u64 {
        let n = self.layer_types.iter().filter(|&&k| k == kind).count();
        // A Vec's length always fits in u64 on our 64-bit targets.
        u64::try_from(n).unwrap_or(u64::MAX)
    }

    pub fn full_attention_layers(&self) -> u64 {
        self.count_layers(LayerKind::FullAttention)
    }

    pub fn linear_attention_layers(&self) -> u64 {
        self.count_layers(LayerKind::LinearAttention)
    }

    /// Width of the DeltaNet qkv projection and conv: `2·nk·dk + nv·dv`.
    pub fn linear_conv_dim(&self) -> Result<u64, LimitError> {
        let qk = product(
            &[2, self.linear_num_key_heads, self.linear_key_head_dim],
            "linear conv width",
        )?;
        let v = self.linear_value_dim()?;
        add(qk, v, "linear conv width")
    }

    /// `nv·dv`.
    pub fn linear_value_dim(&self) -> Result<u64, LimitError> {
        mul(
            self.linear_num_value_heads,
            self.linear_value_head_dim,
            "linear value width",
        )
    }

    /// Backbone KV bytes per row: full layers x (K, V) x kv heads x head_dim x element bytes.
    pub fn backbone_kv_bytes_per_row(&self, kv_element_bytes: u64) -> Result<u64, LimitError> {
        product(
            &[
                self.full_attention_layers(),
                2,
                self.num_key_value_heads,
                self.head_dim,
                kv_element_bytes,
            ],
            "backbone KV bytes per row",
        )
    }

    /// Tower KV bytes per row: tower layers x (K, V) x kv heads x head_dim x element bytes.
    pub fn tower_kv_bytes_per_row(&self, kv_element_bytes: u64) -> Result<u64, LimitError> {
        product(
            &[
                self.tower_layers,
                2,
                self.tower_kv_heads,
                self.tower_head_dim,
                kv_element_bytes,
            ],
            "tower KV bytes per row",
        )
    }

    /// Gated DeltaNet state S per lane, f32: linear layers x nv x dk x dv x 4.
    pub fn gdn_recurrent_bytes(&self) -> Result<u64, LimitError> {
        product(
            &[
                self.linear_attention_layers(),
                self.linear_num_value_heads,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
                F32,
            ],
            "Gated DeltaNet recurrent state",
        )
    }

    /// Conv state per lane, f32: linear layers x (K - 1) x conv width x 4.
    pub fn gdn_conv_bytes(&self) -> Result<u64, LimitError> {
        product(
            &[
                self.linear_attention_layers(),
                self.linear_conv_kernel_dim.saturating_sub(1),
                self.linear_conv_dim()?,
                F32,
            ],
            "Gated DeltaNet conv state",
        )
    }

    /// Gated DeltaNet state per lane (recurrent and conv), f32.
    pub fn gdn_state_bytes(&self) -> Result<u64, LimitError> {
        add(
            self.gdn_recurrent_bytes()?,
            self.gdn_conv_bytes()?,
            "Gated DeltaNet state",
        )
    }

    /// Parameters of one routed expert's three matrices, per matrix as (out, in).
    fn expert_matrices(&self) -> [(u64, u64); 3] {
        let (h, i) = (self.hidden_size, self.moe_intermediate_size);
        [(i, h), (i, h), (h, i)]
    }

    /// Stored experts in all layers.
    fn stored_experts(&self) -> Result<u64, LimitError> {
        match &self.expert_format {
            ExpertFormat::Nvfp4 {
                kept_experts_per_layer,
            } => sum(kept_experts_per_layer, "stored expert count"),
            _ => mul(
                u64::try_from(self.layer_types.len()).unwrap_or(u64::MAX),
                self.num_experts,
                "stored expert count",
            ),
        }
    }

    /// One tower layer's parameters: (its token-embedding table, which a frame only gathers
    /// rows from; everything else, which a frame reads whole).
    fn tower_layer_params(&self) -> Result<(u64, u64), LimitError> {
        const W: &str = "weight bytes";
        let d = self.tower_dim;
        let t_q = mul(self.tower_heads, self.tower_head_dim, W)?;
        let t_kv = mul(self.tower_kv_heads, self.tower_head_dim, W)?;
        let read = sum(
            &[
                mul(2, d, W)?,                                          // enorm, hnorm
                product(&[d, 2, d], W)?,                                // eh_proj
                mul(add(mul(2, t_q, W)?, mul(2, t_kv, W)?, W)?, d, W)?, // wqkv with gate
                mul(d, t_q, W)?,                                        // wo
                mul(2, self.tower_head_dim, W)?,                        // q_norm, k_norm
                mul(3, d, W)?, // attention, ffn, final norms
                product(&[3, self.tower_intermediate_size, d], W)?, // w1, w3, w2
            ],
            W,
        )?;
        Ok((mul(self.codebook_size, d, W)?, read))
    }

    /// Weight bytes one frame round of `lanes` lanes reads (DRAMA3.md section 5): every dense
    /// BF16 matrix once whatever the lane count (backbone; tower layers without their token
    /// tables; the heads), the main head's candidate rows (a codebook of semantic tokens plus
    /// end of speech), and the routed experts the lanes hit. One lane hits k experts per layer;
    /// for several the figure is the expected number of distinct experts under independent
    /// uniform routing, `E (1 - (1 - k/E)^lanes)` per layer (an assumption: real routing is
    /// skewed, which lowers it); and each lane's Gated DeltaNet state (recurrent and conv),
    /// read and written back once. Embedding gathers and K/V reads (which grow with the context)
    /// are left out.
    pub fn frame_read_bytes(&self, lanes: u64) -> Result<FrameReadBytes, LimitError> {
        const W: &str = "frame read bytes";
        let w = self.weight_bytes()?;
        let (_, tower_read) = self.tower_layer_params()?;
        let heads = product(
            &[
                self.num_codebooks.saturating_sub(1),
                self.codebook_size,
                self.tower_dim,
            ],
            W,
        )?;
        let tower = mul(
            add(mul(self.tower_layers, tower_read, W)?, heads, W)?,
            BF16,
            W,
        )?;
        let candidates = product(&[self.codebook_size + 1, self.hidden_size, BF16], W)?;
        let dense = sum(&[w.backbone_dense_bf16, tower, candidates], W)?;
        let layers = u64::try_from(self.layer_types.len()).unwrap_or(u64::MAX);
        let stored = self.stored_experts()?;
        let per_expert = if stored == 0 {
            0.0
        } else {
            (w.experts + w.expert_scales) as f64 / stored as f64
        };
        let e_layer = if layers == 0 {
            0.0
        } else {
            stored as f64 / layers as f64
        };
        let k = (self.num_experts_per_tok as f64).min(e_layer);
        let hit = if e_layer > 0.0 {
            e_layer * (1.0 - (1.0 - k / e_layer).powf(lanes.max(1) as f64))
        } else {
            0.0
        };
        let experts = layers as f64 * hit * per_expert;
        let state = product(&[2, lanes.max(1), self.gdn_state_bytes()?], W)?;
        Ok(FrameReadBytes {
            dense_bf16: dense,
            experts_expected: experts,
            experts_per_layer_expected: hit,
            gdn_state: state,
        })
    }

    /// Resident weight bytes, by format (codec weights are separate: `codec.weight_bytes`).
    pub fn weight_bytes(&self) -> Result<WeightBytes, LimitError> {
        const W: &str = "weight bytes";
        let h = self.hidden_size;
        let heads_q = mul(self.num_attention_heads, self.head_dim, W)?;
        let kv = mul(self.num_key_value_heads, self.head_dim, W)?;
        let q_out = mul(heads_q, if self.attn_output_gate { 2 } else { 1 }, W)?;
        let conv_dim = self.linear_conv_dim()?;
        let v_dim = self.linear_value_dim()?;
        let nv = self.linear_num_value_heads;

        // DRAMA3.md §5 per-layer counts.
        let linear_mixer = sum(
            &[
                mul(conv_dim, h, W)?,
                mul(v_dim, h, W)?,
                product(&[2, nv, h], W)?,
                mul(conv_dim, self.linear_conv_kernel_dim, W)?,
                mul(2, nv, W)?,
                self.linear_value_head_dim,
                mul(h, v_dim, W)?,
            ],
            W,
        )?;
        let full_mixer = sum(
            &[
                mul(q_out, h, W)?,
                product(&[2, kv, h], W)?,
                mul(h, heads_q, W)?,
                mul(2, self.head_dim, W)?,
            ],
            W,
        )?;
        let common = sum(
            &[
                mul(self.num_experts, h, W)?,
                product(&[3, h, self.shared_expert_intermediate_size], W)?,
                h,
                mul(2, h, W)?,
            ],
            W,
        )?;
        let backbone_params = sum(
            &[
                mul(
                    self.linear_attention_layers(),
                    add(linear_mixer, common, W)?,
                    W,
                )?,
                mul(self.full_attention_layers(), add(full_mixer, common, W)?, W)?,
                h, // final norm
            ],
            W,
        )?;
        let embed = mul(self.vocab_size, h, W)?;
        let embeddings_params = if self.tie_word_embeddings {
            embed
        } else {
            mul(embed, 2, W)?
        };

        let d = self.tower_dim;
        let (table, read) = self.tower_layer_params()?;
        let tower_layer = add(table, read, W)?;
        let tower_params = sum(
            &[
                mul(self.tower_layers, tower_layer, W)?,
                product(
                    &[self.num_codebooks.saturating_sub(1), self.codebook_size, d],
                    W,
                )?, // heads
                product(&[self.num_codebooks, self.codebook_size, d], W)?, // codebook_embeddings
            ],
            W,
        )?;

        let experts = self.stored_experts()?;
        let (payload, scales) = match &self.expert_format {
            ExpertFormat::Bf16 => {
                let per = self
                    .expert_matrices()
                    .iter()
                    .try_fold(0u64, |acc, &(o, i)| add(acc, product(&[o, i, BF16], W)?, W))?;
                (per, 0)
            }
            ExpertFormat::Fp8Block {
                block_rows,
                block_cols,
            } => {
                let mut payload = 0u64;
                let mut scales = 0u64;
                for (o, i) in self.expert_matrices() {
                    payload = add(payload, mul(o, i, W)?, W)?;
                    let blocks = mul(ceil_div(o, *block_rows), ceil_div(i, *block_cols), W)?;
                    scales = add(scales, mul(blocks, F32, W)?, W)?;
                }
                (payload, scales)
            }
            ExpertFormat::Nvfp4 { .. } => {
                let mut payload = 0u64;
                let mut scales = 0u64;
                for (o, i) in self.expert_matrices() {
                    payload = add(payload, mul(o, ceil_div(i, 2), W)?, W)?;
                    scales = add(scales, add(mul(o, ceil_div(i, 16), W)?, F32, W)?, W)?;
                }
                (payload, scales)
            }
        };

        Ok(WeightBytes {
            backbone_dense_bf16: mul(backbone_params, BF16, W)?,
            embeddings_bf16: mul(embeddings_params, BF16, W)?,
            tower_bf16: mul(tower_params, BF16, W)?,
            experts: mul(experts, payload, W)?,
            expert_scales: mul(experts, scales, W)?,
        })
    }

    /// f32 activation elements per prefill row (an upper bound on what one chunk row needs live).
    pub fn scratch_elements_per_row(&self) -> Result<u64, LimitError> {
        const S: &str = "scratch width";
        let h = self.hidden_size;
        let heads_q = mul(self.num_attention_heads, self.head_dim, S)?;
        let kv = mul(self.num_key_value_heads, self.head_dim, S)?;
        let q_out = mul(heads_q, if self.attn_output_gate { 2 } else { 1 }, S)?;
        let full_proj = add(q_out, mul(2, kv, S)?, S)?;
        let linear_proj = sum(
            &[
                self.linear_conv_dim()?,
                self.linear_value_dim()?,
                mul(2, self.linear_num_value_heads, S)?,
            ],
            S,
        )?;
        let moe_width = self
            .moe_intermediate_size
            .max(self.shared_expert_intermediate_size);
        let t_q = mul(self.tower_heads, self.tower_head_dim, S)?;
        let t_kv = mul(self.tower_kv_heads, self.tower_head_dim, S)?;
        sum(
            &[
                mul(4, h, S)?,              // residual, normed, mixer out, MoE out
                full_proj.max(linear_proj), // mixer projections
                heads_q,                    // attention output
                self.num_experts,           // router logits
                product(&[add(self.num_experts_per_tok, 1, S)?, 2, moe_width], S)?, // expert gate/up
                // experts grouped by expert (CUDA prefill): per routed slot its gate/up output,
                // its down output and its place in the expert's list
                product(
                    &[
                        self.num_experts_per_tok,
                        sum(&[self.moe_intermediate_size, h, 1], S)?,
                    ],
                    S,
                )?,
                mul(3, self.tower_dim, S)?, // tower residual, normed, eh input half
                mul(self.tower_dim, 2, S)?, // eh_proj input
                add(mul(2, t_q, S)?, mul(2, t_kv, S)?, S)?, // tower wqkv
                mul(2, self.tower_intermediate_size, S)?, // tower w1, w3
                add(self.codebook_size, 1, S)?, // candidate logits
            ],
            S,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drama3_state_matches_drama3_md_section_5() {
        let g = ModelGeometry::drama3();
        assert_eq!(g.full_attention_layers(), 10);
        assert_eq!(g.linear_attention_layers(), 30);
        // 10 x 2 x 2 x 256 x 2 B
        assert_eq!(g.backbone_kv_bytes_per_row(2), Ok(20_480));
        // 13 x 2 x 2 x 256 x 2 B
        assert_eq!(g.tower_kv_bytes_per_row(2), Ok(26_624));
        // 30 x 32 x 128 x 128 x 4 B
        assert_eq!(g.gdn_recurrent_bytes(), Ok(62_914_560));
        // 30 x 3 x 8192 x 4 B
        assert_eq!(g.gdn_conv_bytes(), Ok(2_949_120));
        // f32 on CPU: twice.
        assert_eq!(g.backbone_kv_bytes_per_row(4), Ok(40_960));
        assert_eq!(g.tower_kv_bytes_per_row(4), Ok(53_248));
    }

    #[test]
    fn drama3_weights_match_hand_arithmetic() {
        let g = ModelGeometry::drama3();
        let w = g.weight_bytes().unwrap();
        // §5: 30·(33,718,464 + 3,676,160) + 10·(27,263,488 + 3,676,160) params, + final norm 2048.
        assert_eq!(w.backbone_dense_bf16, (1_431_235_200 + 2048) * 2);
        assert_eq!(w.embeddings_bf16, 2 * 4480 * 2048 * 2);
        // §5 tower layer 73,411,072 params + its 4096x2048 token embedding; 9 heads; 10 tables.
        let tower = 13 * (73_411_072 + 4096 * 2048) + 9 * 4096 * 2048 + 10 * 4096 * 2048;
        assert_eq!(w.tower_bf16, tower * 2);
        // §3.4: 40 x 256 x 3 x 2048 x 512 FP8 bytes.
        assert_eq!(w.experts, 32_212_254_720);
        // 30720 scales: gate/up [4,16], down [16,4], F32.
        assert_eq!(w.expert_scales, 40 * 256 * 3 * 64 * 4);
    }

    #[test]
    fn a_frame_reads_the_section_5_bytes() {
        let g = ModelGeometry::drama3();
        let one = g.frame_read_bytes(1).unwrap();
        // §5: backbone dense (+ final norm), 13 tower layers, 9 heads, 4097 lm_head rows (BF16),
        // and 40 layers x 8 experts x 3 matrices of FP8 with their 64 F32 block scales
        let dense = (1_431_235_200u64 + 2048) * 2
            + 13 * 73_411_072 * 2
            + 9 * 4096 * 2048 * 2
            + 4097 * 2048 * 2;
        assert_eq!(one.dense_bf16, dense);
        let experts = 40.0 * 8.0 * (3.0 * 2048.0 * 512.0 + 3.0 * 64.0 * 4.0);
        assert!((one.experts_expected - experts).abs() < 1.0);
        assert!((one.experts_per_layer_expected - 8.0).abs() < 1e-9);
        // §5's 5.95 GB of weights, plus 30 layers of f32 state (32 x 128 x 128 recurrent, 3 x
        // 8192 conv) read and written back
        let state = 2 * (30 * 32 * 128 * 128 * 4 + 30 * 3 * 8192 * 4);
        assert_eq!(one.gdn_state, state);
        assert!(((one.total() - state as f64) / 1e9 - 5.95).abs() < 0.01);
        // 32 lanes: 256 (1 - (1 - 8/256)^32) = 163.3 distinct experts per layer
        let many = g.frame_read_bytes(32).unwrap();
        assert!((many.experts_per_layer_expected - 163.3).abs() < 0.1);
        assert_eq!(many.dense_bf16, dense);
        assert_eq!(many.gdn_state, 32 * state);
        assert!(many.total() > one.total() && many.total() < one.total() * 32.0);
    }

    #[test]
    fn tiny_matches_the_fixture_config() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../testdata/drama3-tiny/config.json"
        ))
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let t = &v["text_config"];
        let a = &v["audio_decoder_config"];
        let g = ModelGeometry::tiny();
        let n = |x: &serde_json::Value| x.as_u64().unwrap();
        assert_eq!(g.hidden_size, n(&t["hidden_size"]));
        assert_eq!(
            u64::try_from(g.layer_types.len()).unwrap(),
            n(&t["num_hidden_layers"])
        );
        for (k, s) in g
            .layer_types
            .iter()
            .zip(t["layer_types"].as_array().unwrap())
        {
            let want = match s.as_str().unwrap() {
                "full_attention" => LayerKind::FullAttention,
                _ => LayerKind::LinearAttention,
            };
            assert_eq!(*k, want);
        }
        assert_eq!(g.num_attention_heads, n(&t["num_attention_heads"]));
        assert_eq!(g.num_key_value_heads, n(&t["num_key_value_heads"]));
        assert_eq!(g.head_dim, n(&t["head_dim"]));
        assert_eq!(g.attn_output_gate, t["attn_output_gate"].as_bool().unwrap());
        assert_eq!(g.linear_conv_kernel_dim, n(&t["linear_conv_kernel_dim"]));
        assert_eq!(g.linear_num_key_heads, n(&t["linear_num_key_heads"]));
        assert_eq!(g.linear_key_head_dim, n(&t["linear_key_head_dim"]));
        assert_eq!(g.linear_num_value_heads, n(&t["linear_num_value_heads"]));
        assert_eq!(g.linear_value_head_dim, n(&t["linear_value_head_dim"]));
        assert_eq!(g.num_experts, n(&t["num_experts"]));
        assert_eq!(g.num_experts_per_tok, n(&t["num_experts_per_tok"]));
        assert_eq!(g.moe_intermediate_size, n(&t["moe_intermediate_size"]));
        assert_eq!(
            g.shared_expert_intermediate_size,
            n(&t["shared_expert_intermediate_size"])
        );
        assert_eq!(g.vocab_size, n(&t["vocab_size"]));
        assert_eq!(g.max_position_embeddings, n(&t["max_position_embeddings"]));
        assert_eq!(g.tower_dim, n(&a["dim"]));
        assert_eq!(
            g.tower_layers,
            n(&a["shared_enrichment_layers"]) + n(&a["num_codebooks"]) - 1
        );
        assert_eq!(g.tower_heads, n(&a["n_head"]));
        assert_eq!(g.tower_kv_heads, n(&a["n_local_heads"]));
        assert_eq!(g.tower_head_dim, n(&a["head_dim"]));
        assert_eq!(g.tower_intermediate_size, n(&a["intermediate_size"]));
        assert_eq!(g.num_codebooks, n(&a["num_codebooks"]));
        assert_eq!(g.codebook_size, n(&a["vocab_size"]));
        let block = &v["quantization_config"]["weight_block_size"];
        assert_eq!(
            g.expert_format,
            ExpertFormat::Fp8Block {
                block_rows: n(&block[0]),
                block_cols: n(&block[1])
            }
        );
        assert!(g.validate().is_ok());
    }

    #[test]
    fn nvfp4_counts_kept_experts_only() {
        let mut g = ModelGeometry::drama3();
        let kept = vec![128u64; 40];
        g.expert_format = ExpertFormat::Nvfp4 {
            kept_experts_per_layer: kept,
        };
        assert!(g.validate().is_ok());
        let w = g.weight_bytes().unwrap();
        // Per expert: 3 matrices of 2048x512 params, 4 bits each.
        assert_eq!(w.experts, 40 * 128 * 3 * 2048 * 512 / 2);
        // E4M3 scale per 16 values + one F32 per matrix: gate/up [512, 128], down [2048, 32].
        assert_eq!(
            w.expert_scales,
            40 * 128 * (2 * (512 * 128 + 4) + (2048 * 32 + 4))
        );
        g.expert_format = ExpertFormat::Nvfp4 {
            kept_experts_per_layer: vec![128; 39],
        };
        assert_eq!(
            g.validate().unwrap_err().field,
            "expert_format.kept_experts_per_layer"
        );
        g.expert_format = ExpertFormat::Nvfp4 {
            kept_experts_per_layer: vec![257; 40],
        };
        assert!(g.validate().is_err());
    }

    #[test]
    fn huge_geometry_overflows_into_errors() {
        let mut g = ModelGeometry::drama3();
        g.head_dim = u64::MAX;
        assert_eq!(
            g.backbone_kv_bytes_per_row(2).unwrap_err().code(),
            "size_overflow"
        );
        assert!(g.weight_bytes().is_err());
        let mut g = ModelGeometry::drama3();
        g.linear_value_head_dim = u64::MAX / 2;
        assert!(g.gdn_recurrent_bytes().is_err());
        assert!(g.gdn_conv_bytes().is_err());
        assert!(g.scratch_elements_per_row().is_err());
    }

    #[test]
    fn window_contract_defaults_to_the_model_maximum() {
        let g = ModelGeometry::drama3();
        let l = Limits::default();
        assert_eq!(g.window_contract(None, &l).unwrap().window, Window(262_144));
        assert_eq!(
            g.window_contract(Some(Window(262_145)), &l)
                .unwrap_err()
                .code(),
            "context_over_model_max"
        );
        assert_eq!(
            g.window_contract(Some(Window(8192)), &l).unwrap().window,
            Window(8192)
        );
    }

    #[test]
    fn by_name() {
        assert_eq!(ModelGeometry::by_name("tiny"), Some(ModelGeometry::tiny()));
        assert_eq!(
            ModelGeometry::by_name("drama3"),
            Some(ModelGeometry::drama3())
        );
        assert_eq!(ModelGeometry::by_name("other"), None);
    }
}

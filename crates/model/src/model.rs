//! Drama 3 over a [`Backend`]: input rows, the Qwen3.5-MoE backbone (DRAMA3.md §4.1–4.6) and the
//! codebook-MTP tower (§4.8, fixture README). Shapes are in the comments; every size comes from
//! `config.json`.

use checkpoint::{Checkpoint, Config, ExpertFormat, LayerType};

use crate::backend::{
    gather_row, AttnDims, Backend, CodeTerm, Counter, Expert, Frame, GdnDims, Rope, RopeAt,
    RoundSpec, Rows, Slot,
};
use crate::lane::LaneState;
use crate::ModelError;

type Result<T> = std::result::Result<T, ModelError>;

/// One backbone input row: `[token, c0, …, c9]`.
pub type Row = [i64; 11];
/// Width of a row (1 + codebooks); the model refuses configs with another codebook count.
pub const ROW_WIDTH: usize = 11;

/// Which of a call's rows belong to which lane.
#[derive(Clone, Copy)]
enum Span<'a> {
    /// One row per lane (frame rounds, the tower's step).
    Step,
    /// Prompts: lane i's rows are the next `lens[i]` rows, after the lanes before it. One lane
    /// runs as `Rows::Bulk`, several as `Rows::Joined`.
    Prompts(&'a [usize]),
}

impl Span<'_> {
    /// How the backend may treat the call's rows.
    fn rows(self) -> Rows {
        match self {
            Span::Step => Rows::Exact,
            Span::Prompts([_]) => Rows::Bulk,
            Span::Prompts(_) => Rows::Joined,
        }
    }
}

/// Sizes the forward pass needs, read once from the config.
#[derive(Debug, Clone)]
pub struct Geometry {
    pub hidden: usize,
    pub vocab: usize,
    pub eps: f32,
    pub attn: AttnDims,
    pub gdn: GdnDims,
    pub top_k: usize,
    pub layer_types: Vec<LayerType>,
    /// Codebook size (semantic band, head width, rows per codebook table).
    pub codebook: usize,
    pub codebooks: usize,
    /// Residual codebooks summed into the backbone input (k).
    pub backbone_codebooks: usize,
    pub tower_shared: usize,
    pub tower_layers: usize,
    pub tower_attn: AttnDims,
    pub tower_eps: f32,
    pub semantic_start: u32,
    pub semantic_end: u32,
    pub eos: u32,
}

impl Geometry {
    pub fn from_config(c: &Config) -> Result<Self> {
        let t = &c.text_config;
        let a = &c.audio_decoder_config;
        if a.num_codebooks + 1 != ROW_WIDTH {
            return Err(ModelError::Unsupported(format!(
                "rows are {ROW_WIDTH} wide (1 + 10 codebooks) but num_codebooks is {}",
                a.num_codebooks
            )));
        }
        Ok(Self {
            hidden: t.hidden_size,
            vocab: t.vocab_size,
            eps: t.rms_norm_eps as f32,
            attn: AttnDims {
                q_heads: t.num_attention_heads,
                kv_heads: t.num_key_value_heads,
                head_dim: t.head_dim,
                rot_dims: c.backbone_rotary_dims(),
                theta: t.rope_parameters.rope_theta,
                rope: Rope::Neox,
            },
            gdn: GdnDims {
                k_heads: t.linear_num_key_heads,
                v_heads: t.linear_num_value_heads,
                k_dim: t.linear_key_head_dim,
                v_dim: t.linear_value_head_dim,
                conv_kernel: t.linear_conv_kernel_dim,
            },
            top_k: t.num_experts_per_tok,
            layer_types: t.layer_types.clone(),
            codebook: c.codebook_size(),
            codebooks: a.num_codebooks,
            backbone_codebooks: c.backbone_codebooks(),
            tower_shared: a.shared_enrichment_layers,
            tower_layers: c.tower_layers(),
            tower_attn: AttnDims {
                q_heads: a.n_head,
                kv_heads: a.n_local_heads,
                head_dim: a.head_dim,
                rot_dims: c.tower_rotary_dims(),
                theta: a.rope_base,
                rope: Rope::Interleaved,
            },
            tower_eps: a.norm_eps as f32,
            semantic_start: c.semantic_start_token_id,
            semantic_end: c.semantic_end_token_id,
            eos: c.eos_token_id,
        })
    }

    pub fn is_semantic(&self, tok: i64) -> bool {
        tok >= i64::from(self.semantic_start) && tok <= i64::from(self.semantic_end)
    }

    pub fn full_layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|t| **t == LayerType::FullAttention)
            .count()
    }

    pub fn linear_layers(&self) -> usize {
        self.layer_types.len() - self.full_layers()
    }
}

struct GdnWeights<B: Backend> {
    qkv: B::Weight,
    z: B::Weight,
    b: B::Weight,
    a: B::Weight,
    conv: B::Vector,
    a_log: B::Vector,
    dt_bias: B::Vector,
    norm: B::Vector,
    out: B::Weight,
}

struct AttnWeights<B: Backend> {
    q: B::Weight,
    k: B::Weight,
    v: B::Weight,
    o: B::Weight,
    q_norm: B::Vector,
    k_norm: B::Vector,
}

enum Mixer<B: Backend> {
    /// Index into the lane's GDN states.
    Gdn(usize, GdnWeights<B>),
    /// Index into the lane's backbone KV caches.
    Attn(usize, AttnWeights<B>),
}

struct Moe<B: Backend> {
    router: B::Weight,
    /// By original expert id; `None` where a pruned checkpoint dropped it.
    experts: Vec<Option<Expert<B::Weight>>>,
    keep: Option<Vec<bool>>,
    shared: Expert<B::Weight>,
    shared_gate: B::Weight,
}

/// A MoE block's output in parts: `routed + shared · sigmoid(gate)`.
struct MoeOut<B: Backend> {
    routed: B::Buf,
    shared: B::Buf,
    gate: B::Buf,
}

struct Layer<B: Backend> {
    input_norm: B::Vector,
    post_norm: B::Vector,
    mixer: Mixer<B>,
    moe: Moe<B>,
}

struct TowerLayer<B: Backend> {
    emb: B::Weight,
    enorm: B::Vector,
    hnorm: B::Vector,
    eh_proj: B::Weight,
    attn_norm: B::Vector,
    wqkv: B::Weight,
    wo: B::Weight,
    q_norm: B::Vector,
    k_norm: B::Vector,
    ffn_norm: B::Vector,
    w1: B::Weight,
    w3: B::Weight,
    w2: B::Weight,
    out_norm: B::Vector,
}

/// A loaded Drama 3 model on backend `B`. Weights stay in stored precision.
pub struct Model<B: Backend> {
    pub backend: B,
    pub config: Config,
    pub geometry: Geometry,
    embed: B::Weight,
    /// `audio_decoder.codebook_embeddings`, `[10·CB, H]`, row `c·CB + code`.
    codebooks: B::Weight,
    layers: Vec<Layer<B>>,
    norm: B::Vector,
    lm_head_candidates: B::Weight,
    lm_head: B::Weight,
    candidates: Vec<u32>,
    tower: Vec<TowerLayer<B>>,
    heads: Vec<B::Weight>,
    /// The frame round kept on the backend for the newest lane set (generate.rs).
    pub(crate) kept: std::sync::Mutex<Option<crate::generate::KeptRound<B>>>,
    /// Lane sets whose recording failed (from `generate::CAPTURE_TRIES` on, rounds run as
    /// issued).
    pub(crate) capture_failures: std::sync::atomic::AtomicU64,
    /// How frame rounds ran (shared with whoever asked for [`Model::round_stats`]).
    pub(crate) round_stats: std::sync::Arc<crate::generate::RoundStats>,
    /// `DRAMATIS_TRACE_ROUTES`: each routed call's top experts and near-tie gaps (trace.rs).
    pub(crate) route_trace: Option<crate::trace::RouteTrace>,
}

/// Backbone outputs over a sequence, teacher-forced (for goldens).
#[derive(Debug, Clone)]
pub struct BackboneTrace {
    /// `[t, H]`.
    pub input_embeds: Vec<f32>,
    /// Per layer, the residual stream after it, `[t, H]`.
    pub layer_outputs: Vec<Vec<f32>>,
    /// After the final norm, `[t, H]`.
    pub final_hidden: Vec<f32>,
    /// `[t, candidates]`, candidates ascending (`Model::candidates`).
    pub candidate_logits: Vec<f32>,
    /// `[t, vocab]`.
    pub full_logits: Vec<f32>,
}

/// Tower outputs over a sequence, teacher-forced: position p uses row p+1 as its label.
#[derive(Debug, Clone)]
pub struct TowerTrace {
    /// Per tower layer, `[t-1, D]` (each ends in its output norm).
    pub layer_outputs: Vec<Vec<f32>>,
    /// `[t-1, codebooks-1, CB]`: head r gives codebook r+1.
    pub codebook_logits: Vec<f32>,
}

/// One layer's stored experts as (slot, original ID) pairs, and its router keep-mask.
type ExpertSlots = (Vec<(usize, usize)>, Option<Vec<bool>>);

/// Where a batch's positions (and, one row per lane, its cache lengths) come from: the
/// backend's [`RopeAt`] (host positions, or lane i's counter in a frame round kept on the
/// backend).
pub(crate) type At<'a, B> = RopeAt<'a, <B as Backend>::Round>;

fn w_name(prefix: &str, s: &str) -> String {
    format!("{prefix}.{s}")
}

impl<B: Backend> Model<B> {
    /// Prepares every weight the forward pass reads (zero-copy where the backend allows).
    pub fn load(ck: &Checkpoint, backend: B) -> Result<Self> {
        let g = Geometry::from_config(&ck.config)?;
        let n_exp = ck.config.text_config.num_experts;
        // Per layer: (slot, original expert ID) of every stored expert, and the router keep-mask.
        let slots_for = |layer: usize| -> Result<ExpertSlots> {
            match &ck.expert_format {
                ExpertFormat::Fp8Block128 => Ok(((0..n_exp).map(|e| (e, e)).collect(), None)),
                ExpertFormat::Nvfp4Pruned { kept } => {
                    let ids = kept.get(layer).ok_or_else(|| {
                        ModelError::Unsupported(format!(
                            "metadata.drama_experts has no entry for layer {layer}"
                        ))
                    })?;
                    let mut keep = vec![false; n_exp];
                    let mut slots = Vec::with_capacity(ids.len());
                    for (slot, &id) in ids.iter().enumerate() {
                        let id = id as usize;
                        if id >= n_exp || keep[id] {
                            return Err(ModelError::Unsupported(format!(
                                "layer {layer}: slot {slot} maps to expert {id}, which is out of \
                                 0..{n_exp} or listed twice"
                            )));
                        }
                        keep[id] = true;
                        slots.push((slot, id));
                    }
                    if ids.len() < g.top_k {
                        return Err(ModelError::Unsupported(format!(
                            "layer {layer} keeps {} experts, fewer than top-k {}",
                            ids.len(),
                            g.top_k
                        )));
                    }
                    Ok((slots, Some(keep)))
                }
            }
        };
        let be = &backend;
        let p = "model.language_model";
        let mut layers = Vec::with_capacity(g.layer_types.len());
        let (mut n_gdn, mut n_attn) = (0usize, 0usize);
        for (i, lt) in g.layer_types.iter().enumerate() {
            let l = format!("{p}.layers.{i}");
            let mixer = match lt {
                LayerType::LinearAttention => {
                    let m = format!("{l}.linear_attn");
                    let w = GdnWeights {
                        qkv: be.weight(ck, &w_name(&m, "in_proj_qkv.weight"))?,
                        z: be.weight(ck, &w_name(&m, "in_proj_z.weight"))?,
                        b: be.weight(ck, &w_name(&m, "in_proj_b.weight"))?,
                        a: be.weight(ck, &w_name(&m, "in_proj_a.weight"))?,
                        conv: be.vector(ck, &w_name(&m, "conv1d.weight"))?,
                        a_log: be.vector(ck, &w_name(&m, "A_log"))?,
                        dt_bias: be.vector(ck, &w_name(&m, "dt_bias"))?,
                        norm: be.vector(ck, &w_name(&m, "norm.weight"))?,
                        out: be.weight(ck, &w_name(&m, "out_proj.weight"))?,
                    };
                    n_gdn += 1;
                    Mixer::Gdn(n_gdn - 1, w)
                }
                LayerType::FullAttention => {
                    let m = format!("{l}.self_attn");
                    let w = AttnWeights {
                        q: be.weight(ck, &w_name(&m, "q_proj.weight"))?,
                        k: be.weight(ck, &w_name(&m, "k_proj.weight"))?,
                        v: be.weight(ck, &w_name(&m, "v_proj.weight"))?,
                        o: be.weight(ck, &w_name(&m, "o_proj.weight"))?,
                        q_norm: be.vector(ck, &w_name(&m, "q_norm.weight"))?,
                        k_norm: be.vector(ck, &w_name(&m, "k_norm.weight"))?,
                    };
                    n_attn += 1;
                    Mixer::Attn(n_attn - 1, w)
                }
            };
            let m = format!("{l}.mlp");
            // Tensors are named by storage slot; the model indexes experts by original ID.
            let (slots, keep) = slots_for(i)?;
            let mut experts: Vec<Option<Expert<B::Weight>>> = (0..n_exp).map(|_| None).collect();
            for (slot, id) in slots {
                let x = format!("{m}.experts.{slot}");
                experts[id] = Some(Expert {
                    gate: be.weight(ck, &format!("{x}.gate_proj.weight"))?,
                    up: be.weight(ck, &format!("{x}.up_proj.weight"))?,
                    down: be.weight(ck, &format!("{x}.down_proj.weight"))?,
                });
            }
            let moe = Moe {
                router: be.weight(ck, &w_name(&m, "gate.weight"))?,
                experts,
                keep,
                shared: Expert {
                    gate: be.weight(ck, &w_name(&m, "shared_expert.gate_proj.weight"))?,
                    up: be.weight(ck, &w_name(&m, "shared_expert.up_proj.weight"))?,
                    down: be.weight(ck, &w_name(&m, "shared_expert.down_proj.weight"))?,
                },
                shared_gate: be.weight(ck, &w_name(&m, "shared_expert_gate.weight"))?,
            };
            layers.push(Layer {
                input_norm: be.vector(ck, &w_name(&l, "input_layernorm.weight"))?,
                post_norm: be.vector(ck, &w_name(&l, "post_attention_layernorm.weight"))?,
                mixer,
                moe,
            });
        }
        let candidates = ck.config.candidate_token_ids();
        let mut tower = Vec::with_capacity(g.tower_layers);
        for t in 0..g.tower_layers {
            let (l, emb) = if t < g.tower_shared {
                (
                    format!("audio_decoder_mtp_shared.layers.{t}"),
                    "semantic_embedding.weight",
                )
            } else {
                (
                    format!("audio_decoder_mtp.layers.{}", t - g.tower_shared),
                    "codebook_embedding.weight",
                )
            };
            let tl = format!("{l}.transformer_layer");
            tower.push(TowerLayer {
                emb: be.weight(ck, &w_name(&l, emb))?,
                enorm: be.vector(ck, &w_name(&l, "enorm.weight"))?,
                hnorm: be.vector(ck, &w_name(&l, "hnorm.weight"))?,
                eh_proj: be.weight(ck, &w_name(&l, "eh_proj.weight"))?,
                attn_norm: be.vector(ck, &w_name(&tl, "attention_norm.weight"))?,
                wqkv: be.weight(ck, &w_name(&tl, "attention.wqkv.weight"))?,
                wo: be.weight(ck, &w_name(&tl, "attention.wo.weight"))?,
                q_norm: be.vector(ck, &w_name(&tl, "attention.q_norm.weight"))?,
                k_norm: be.vector(ck, &w_name(&tl, "attention.k_norm.weight"))?,
                ffn_norm: be.vector(ck, &w_name(&tl, "ffn_norm.weight"))?,
                w1: be.weight(ck, &w_name(&tl, "feed_forward.w1.weight"))?,
                w3: be.weight(ck, &w_name(&tl, "feed_forward.w3.weight"))?,
                w2: be.weight(ck, &w_name(&tl, "feed_forward.w2.weight"))?,
                out_norm: be.vector(ck, &w_name(&l, "final_layernorm.weight"))?,
            });
        }
        let heads = (0..g.codebooks - 1)
            .map(|r| be.weight(ck, &format!("audio_decoder_mtp.heads.{r}.weight")))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self {
            embed: be.weight(ck, &format!("{p}.embed_tokens.weight"))?,
            codebooks: be.weight(ck, "audio_decoder.codebook_embeddings.weight")?,
            layers,
            norm: be.vector(ck, &format!("{p}.norm.weight"))?,
            lm_head_candidates: be.weight_rows(ck, "lm_head.weight", &candidates)?,
            lm_head: be.weight(ck, "lm_head.weight")?,
            candidates,
            tower,
            heads,
            kept: std::sync::Mutex::new(None),
            capture_failures: std::sync::atomic::AtomicU64::new(0),
            route_trace: crate::trace::RouteTrace::from_env(backend.name()),
            round_stats: Default::default(),
            config: ck.config.clone(),
            geometry: g,
            backend,
        })
    }

    /// Original IDs of the routed experts layer `layer` holds, ascending (all of them unless the
    /// checkpoint is pruned); `None` past the last layer.
    pub fn expert_ids(&self, layer: usize) -> Option<Vec<u32>> {
        let m = &self.layers.get(layer)?.moe;
        Some(
            m.experts
                .iter()
                .enumerate()
                .filter(|(_, e)| e.is_some())
                .map(|(i, _)| i as u32)
                .collect(),
        )
    }

    /// The router keep-mask of layer `layer` by original ID (`None`: every expert is stored).
    pub fn keep_mask(&self, layer: usize) -> Option<&[bool]> {
        self.layers.get(layer)?.moe.keep.as_deref()
    }

    /// Each loaded routed expert of `layer` by original ID, for size reports and tests.
    pub fn experts(&self, layer: usize) -> Option<&[Option<Expert<B::Weight>>]> {
        Some(&self.layers.get(layer)?.moe.experts)
    }

    /// Ascending `{eos} ∪ semantic band`: the token id of each main-head logit.
    pub fn candidates(&self) -> &[u32] {
        &self.candidates
    }

    /// How this model's frame rounds ran so far (a shared handle: it keeps counting).
    pub fn round_stats(&self) -> std::sync::Arc<crate::generate::RoundStats> {
        self.round_stats.clone()
    }

    /// A fresh lane able to hold `capacity_rows` backbone rows (admission reserves P + F + 1).
    pub fn new_lane(&self, capacity_rows: usize) -> Result<LaneState<B>> {
        LaneState::new(self, capacity_rows, true)
    }

    /// A lane with backbone state only (the unconditional branch of guidance): prefill and
    /// advance skip the tower, and it never samples a frame itself.
    pub fn new_backbone_lane(&self, capacity_rows: usize) -> Result<LaneState<B>> {
        LaneState::new(self, capacity_rows, false)
    }

    /// Checks a row's token and codes against the vocabulary and codebook.
    pub fn check_row(&self, index: usize, row: &Row) -> Result<()> {
        let g = &self.geometry;
        let bad = |why: String| ModelError::BadRow { index, why };
        if row[0] < 0 || row[0] as u64 >= g.vocab as u64 {
            return Err(bad(format!(
                "token {} is outside the vocabulary of {} ids",
                row[0], g.vocab
            )));
        }
        if g.is_semantic(row[0]) {
            for (c, &code) in row[1..].iter().enumerate() {
                if code < 0 || code as u64 >= g.codebook as u64 {
                    return Err(bad(format!(
                        "code c{c} = {code} is outside the codebook of {} entries",
                        g.codebook
                    )));
                }
            }
            if row[0] - i64::from(g.semantic_start) != row[1] {
                return Err(bad(format!(
                    "semantic token {} does not match c0 = {} (semantic_start {})",
                    row[0], row[1], g.semantic_start
                )));
            }
        }
        Ok(())
    }

    // ---------------------------------------------------------------- §4.1 input rows

    /// Backbone input: `E[tok]`, or for semantic rows `(E[tok] + Σ_{c=1..k} CB[c][code_c]) / √(1+k)`.
    pub fn embed_rows(&self, rows: &[Row]) -> Result<B::Buf> {
        for (i, r) in rows.iter().enumerate() {
            self.check_row(i, r)?;
        }
        self.embed_checked(rows)
    }

    /// [`Model::embed_rows`] of rows already checked (`check_row`).
    fn embed_checked(&self, rows: &[Row]) -> Result<B::Buf> {
        let g = &self.geometry;
        let (terms, mix) = self.embed_terms();
        let out: Vec<_> = rows
            .iter()
            .map(|r| gather_row(&terms, mix, r, r, |t| g.is_semantic(t)))
            .collect();
        Ok(self
            .backend
            .gather_sum(&[&self.embed, &self.codebooks], &out)?)
    }

    /// The backbone input's terms over `[embed, codebooks]` (a row is its own `cur`): `E[main]`,
    /// and for a semantic main `CB[c][code_c]`, c = 1..=k, scaled by `1/√(1+k)`.
    fn embed_terms(&self) -> (Vec<CodeTerm>, f32) {
        let g = &self.geometry;
        let k = g.backbone_codebooks;
        let mut terms = vec![CodeTerm {
            table: 0,
            frame: Frame::Current,
            col: 0,
            offset: 0,
            guarded: false,
        }];
        terms.extend((1..=k).map(|c| CodeTerm {
            table: 1,
            frame: Frame::Current,
            col: 1 + c,
            offset: (c * g.codebook) as u32,
            guarded: true,
        }));
        (terms, 1.0 / ((1 + k) as f32).sqrt())
    }

    /// Tower layer `t`'s embedding terms over `[Emb_t, codebooks]`: `Emb_t[c_col]` of the
    /// frame (shared layers embed c0, residual layer r embeds c_r), and at layer 0 the
    /// residual codes of the lane's previous row that the backbone did not see.
    fn tower_terms(&self, t: usize) -> Vec<CodeTerm> {
        let g = &self.geometry;
        let mut terms = vec![CodeTerm {
            table: 0,
            frame: Frame::Current,
            col: 1 + t.saturating_sub(g.tower_shared),
            offset: 0,
            guarded: true,
        }];
        if t == 0 {
            terms.extend((g.backbone_codebooks + 1..g.codebooks).map(|c| CodeTerm {
                table: 1,
                frame: Frame::Last,
                col: 1 + c,
                offset: (c * g.codebook) as u32,
                guarded: true,
            }));
        }
        terms
    }

    // ---------------------------------------------------------------- §4.2 backbone

    /// Runs the backbone layers over `x` (`[rows, H]`): each lane's next prompt rows
    /// (`Span::Prompts`) or one row per lane (`Span::Step`). Returns the final-normed hidden;
    /// advances the lanes. With `round`, positions and cache lengths come from the round's
    /// counters and the lanes' host counters are left to the round's bookkeeping.
    fn backbone(
        &self,
        lanes: &mut [&mut LaneState<B>],
        mut x: B::Buf,
        span: Span<'_>,
        mut trace: Option<&mut Vec<Vec<f32>>>,
        round: Option<&B::Round>,
    ) -> Result<B::Buf> {
        let be = &self.backend;
        let g = &self.geometry;
        let mode = span.rows();
        let host: Vec<usize> = match (round, span) {
            (Some(_), _) => Vec::new(),
            (None, Span::Prompts(lens)) => lanes
                .iter()
                .zip(lens)
                .flat_map(|(l, &n)| (0..n).map(move |i| l.rows + i))
                .collect(),
            (None, Span::Step) => lanes.iter().map(|l| l.rows).collect(),
        };
        let positions = match round {
            Some(r) => RopeAt::Round(r, Counter::Backbone),
            None => RopeAt::Host(&host),
        };
        // Each residual add is fused with the norm that follows it: the post-mixer norm, then
        // the next layer's input norm (the final norm after the last layer).
        let first = self.layers.first().map_or(&self.norm, |l| &l.input_norm);
        let mut h = be.rms_norm(&x, first, g.hidden, g.eps, true)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let m = match &layer.mixer {
                Mixer::Gdn(s, w) => self.gdn(lanes, *s, w, &h, span)?,
                Mixer::Attn(s, w) => self.attention(lanes, *s, w, &h, positions, span)?,
            };
            let (x1, h1) = be.add_rms_norm(&x, &m, &layer.post_norm, g.hidden, g.eps, true)?;
            let y = self.moe(&layer.moe, &h1, mode)?;
            let next = self
                .layers
                .get(li + 1)
                .map_or(&self.norm, |l| &l.input_norm);
            let (x2, h2) = be.add_gated_rms_norm(
                &x1, &y.routed, &y.shared, &y.gate, next, g.hidden, g.eps, true,
            )?;
            x = x2;
            h = h2;
            if let Some(t) = trace.as_deref_mut() {
                t.push(be.download(&x)?);
            }
        }
        match (span, round) {
            (_, Some(_)) => {}
            (Span::Prompts(lens), None) => {
                lanes.iter_mut().zip(lens).for_each(|(l, n)| l.rows += n)
            }
            (Span::Step, None) => lanes.iter_mut().for_each(|l| l.rows += 1),
        }
        Ok(h)
    }

    /// `f(i, parts)` on lane i's rows of each of `bufs` (`lens[i]` rows after the lanes before
    /// it), the outputs joined in lane order; a single lane takes the buffers whole.
    fn per_lane<F>(&self, lens: &[usize], bufs: &[&B::Buf], mut f: F) -> Result<B::Buf>
    where
        F: FnMut(usize, &[&B::Buf]) -> Result<B::Buf>,
    {
        if let [_] = lens {
            return f(0, bufs);
        }
        let be = &self.backend;
        let mut outs = Vec::with_capacity(lens.len());
        let mut off = 0;
        for (i, &n) in lens.iter().enumerate() {
            let parts = bufs
                .iter()
                .map(|b| be.rows(b, off, n))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let refs: Vec<&B::Buf> = parts.iter().collect();
            outs.push(f(i, &refs)?);
            off += n;
        }
        let refs: Vec<&B::Buf> = outs.iter().collect();
        Ok(be.concat_rows(&refs)?)
    }

    /// §4.3 Gated DeltaNet mixer: `[n, H] -> [n, H]`.
    fn gdn(
        &self,
        lanes: &mut [&mut LaneState<B>],
        slot: usize,
        w: &GdnWeights<B>,
        x: &B::Buf,
        span: Span<'_>,
    ) -> Result<B::Buf> {
        let be = &self.backend;
        let d = &self.geometry.gdn;
        let mode = span.rows();
        let mut states: Vec<&mut B::Gdn> = lanes.iter_mut().map(|l| &mut l.gdn[slot]).collect();
        let lens = match span {
            Span::Step => return self.gdn_step(&mut states, w, x),
            Span::Prompts(lens) => lens,
        };
        // qkv [n, C], z [n, nv·dv], b and a [n, nv]
        let [qkv, z, b, a]: [B::Buf; 4] = linears(be, x, [&w.qkv, &w.z, &w.b, &w.a], mode)?;
        let o = if let [_] = lens {
            let u = be.gdn_conv(&qkv, &w.conv, d, states[0])?;
            be.gdn_prefill(&u, &b, &a, &w.a_log, &w.dt_bias, d, states[0], true)?
        } else {
            be.gdn_prefill_lanes(
                &qkv,
                &b,
                &a,
                &w.conv,
                &w.a_log,
                &w.dt_bias,
                d,
                lens,
                &mut states,
            )?
        };
        // RMSNormGated: plain w over each value head, times silu(z).
        let o = be.rms_norm_silu(&o, &z, &w.norm, d.v_dim, self.geometry.eps, false)?;
        Ok(be.linear(&o, &w.out, mode)?)
    }

    /// The GDN mixer's frame step (one row per lane): the delta rule and RMSNormGated as one op
    /// (`Backend::gdn_step_gated`), and z's projection on a side branch when one opens, beside
    /// qkv, b, a and the conv step (only the gated norm reads z; a multi launch equals its
    /// separate linears, so the same bits either way).
    fn gdn_step(
        &self,
        states: &mut [&mut B::Gdn],
        w: &GdnWeights<B>,
        x: &B::Buf,
    ) -> Result<B::Buf> {
        let be = &self.backend;
        let d = &self.geometry.gdn;
        let mode = Span::Step.rows();
        let mut aside = Aside::begin(be, be.shape(x).0)?;
        let (qkv, z, b, a) = if aside.on {
            let z = be.linear(x, &w.z, mode)?;
            aside.end()?;
            let [qkv, b, a]: [B::Buf; 3] = linears(be, x, [&w.qkv, &w.b, &w.a], mode)?;
            (qkv, z, b, a)
        } else {
            let [qkv, z, b, a]: [B::Buf; 4] = linears(be, x, [&w.qkv, &w.z, &w.b, &w.a], mode)?;
            (qkv, z, b, a)
        };
        let u = be.gdn_conv_step(&qkv, &w.conv, d, states)?;
        aside.join()?;
        let eps = self.geometry.eps;
        let o = be.gdn_step_gated(
            &u, &b, &a, &w.a_log, &w.dt_bias, d, states, &z, &w.norm, eps,
        )?;
        Ok(be.linear(&o, &w.out, mode)?)
    }

    /// §4.4 gated full attention, shared by the backbone and the tower (`dims` differ). `q` and
    /// `k` are each a buffer and the `(group, offset, len)` column selection of its heads
    /// (`Backend::cols_grouped`), normalised and rotated in place by `Backend::norm_rope`.
    /// Returns the attention output; the caller's output projection takes `o ⊙ sigmoid(gate)`
    /// (`Backend::linear_sigmoid_mul`).
    #[allow(clippy::too_many_arguments)]
    fn gated_attention(
        &self,
        kvs: &mut [&mut B::Kv],
        dims: &AttnDims,
        eps: f32,
        q: (&B::Buf, (usize, usize, usize)),
        k: (&B::Buf, (usize, usize, usize)),
        v: B::Buf,
        q_norm: &B::Vector,
        k_norm: &B::Vector,
        positions: At<'_, B>,
        span: Span<'_>,
    ) -> Result<B::Buf> {
        let be = &self.backend;
        let hd = dims.head_dim;
        let (rot, th, st) = (dims.rot_dims, dims.theta, dims.rope);
        // the query heads on a side branch beside the key heads (both only read the projection)
        let mut aside = Aside::begin(be, be.shape(q.0).0)?;
        let q = be.norm_rope(q.0, q.1, q_norm, eps, hd, rot, th, st, positions)?;
        aside.end()?;
        let k = be.norm_rope(k.0, k.1, k_norm, eps, hd, rot, th, st, positions)?;
        aside.join()?;
        let o = match positions {
            RopeAt::Host(_) => match span {
                Span::Prompts(lens) => {
                    let joined = match lens {
                        [_] => None,
                        _ => be.attn_prefill_lanes(&q, &k, &v, dims, kvs, lens)?,
                    };
                    match joined {
                        Some(o) => o,
                        None => self.per_lane(lens, &[&q, &k, &v], |i, p| {
                            Ok(be.attn_prefill(p[0], p[1], p[2], dims, kvs[i])?)
                        })?,
                    }
                }
                Span::Step => be.attn_step(&q, &k, &v, dims, kvs)?,
            },
            RopeAt::Round(r, c) => be.attn_step_round(&q, &k, &v, dims, kvs, r, c)?,
        };
        Ok(o)
    }

    fn attention(
        &self,
        lanes: &mut [&mut LaneState<B>],
        slot: usize,
        w: &AttnWeights<B>,
        x: &B::Buf,
        positions: At<'_, B>,
        span: Span<'_>,
    ) -> Result<B::Buf> {
        let be = &self.backend;
        let d = &self.geometry.attn;
        let mode = span.rows();
        let (hq, hd) = (d.q_heads, d.head_dim);
        // q_proj rows are per head [q_h ; gate_h]: split each 2·hd block.
        let [qg, k, v]: [B::Buf; 3] = linears(be, x, [&w.q, &w.k, &w.v], mode)?;
        debug_assert_eq!(be.shape(&qg).1, 2 * hq * hd);
        let gate = be.cols_grouped(&qg, 2 * hd, hd, hd)?;
        let kc = be.shape(&k).1;
        let mut kvs: Vec<&mut B::Kv> = lanes.iter_mut().map(|l| &mut l.kv[slot]).collect();
        let o = self.gated_attention(
            &mut kvs,
            d,
            self.geometry.eps,
            (&qg, (2 * hd, 0, hd)),
            (&k, (kc, 0, kc)),
            v,
            &w.q_norm,
            &w.k_norm,
            positions,
            span,
        )?;
        Ok(be.linear_sigmoid_mul(&o, &gate, &w.o, mode)?)
    }

    /// §4.5 MoE: routed experts (softmax, top-k, renormalise) and the shared one with its gate;
    /// the output is `routed + shared · sigmoid(gate)`, which the caller adds to the residual
    /// with the next norm (`Backend::add_gated_rms_norm`).
    fn moe(&self, m: &Moe<B>, x: &B::Buf, mode: Rows) -> Result<MoeOut<B>> {
        let be = &self.backend;
        let mut aside = Aside::begin(be, be.shape(x).0)?;
        if aside.on {
            // The shared expert on a side branch (its gate, up and sigmoid gate, then its down
            // projection) beside the router and the routed experts: neither reads the other's
            // buffers until the join. The same linears as below (a multi launch equals its
            // separate linears bit for bit), so the same bits.
            let [g, u, sg]: [B::Buf; 3] =
                linears(be, x, [&m.shared.gate, &m.shared.up, &m.shared_gate], mode)?;
            let s = be.linear_silu_mul(&g, &u, &m.shared.down, mode)?;
            aside.end()?;
            let logits = be.linear(x, &m.router, mode)?;
            let routed = self.routed(m, x, &logits, mode)?;
            aside.join()?;
            return Ok(MoeOut {
                routed,
                shared: s,
                gate: sg,
            });
        }
        // router logits, the shared expert's gate and up, and its sigmoid gate [n, 1]
        let [logits, g, u, sg]: [B::Buf; 4] = linears(
            be,
            x,
            [&m.router, &m.shared.gate, &m.shared.up, &m.shared_gate],
            mode,
        )?;
        let routed = self.routed(m, x, &logits, mode)?;
        let s = be.linear_silu_mul(&g, &u, &m.shared.down, mode)?;
        Ok(MoeOut {
            routed,
            shared: s,
            gate: sg,
        })
    }

    /// The routed experts' sum for router logits `logits` (softmax, top-k, renormalise).
    fn routed(&self, m: &Moe<B>, x: &B::Buf, logits: &B::Buf, mode: Rows) -> Result<B::Buf> {
        let be = &self.backend;
        if let Some(t) = &self.route_trace {
            let (_, e) = be.shape(logits);
            t.record(
                &be.download(logits)?,
                e,
                self.geometry.top_k,
                m.keep.as_deref(),
            );
        }
        let route = be.route(logits, self.geometry.top_k, m.keep.as_deref())?;
        Ok(be.moe_experts(x, &route, &m.experts, mode)?)
    }

    /// §4.6 main head over the candidate rows only: `[n, H] -> [n, candidates]`.
    pub fn candidate_logits(&self, hidden: &B::Buf, mode: Rows) -> Result<B::Buf> {
        Ok(self
            .backend
            .linear(hidden, &self.lm_head_candidates, mode)?)
    }

    // ---------------------------------------------------------------- §4.8 tower

    /// Embedding input of tower layer `t` for each row: `Emb_t[code]` where the label is
    /// semantic, plus (layer 0, semantic input row) the residual codes the backbone did not see.
    fn tower_embed(&self, t: usize, inputs: &[Row], labels: &[Row]) -> Result<B::Buf> {
        let g = &self.geometry;
        let terms = self.tower_terms(t);
        let rows = inputs
            .iter()
            .zip(labels)
            .map(|(inp, lab)| gather_row(&terms, 1.0, lab, inp, |t| g.is_semantic(t)))
            .collect::<Vec<_>>();
        Ok(self
            .backend
            .gather_sum(&[&self.tower[t].emb, &self.codebooks], &rows)?)
    }

    /// One tower layer: `h = out_norm(r + SwiGLU(ffn_norm(r)))`, `r = m + Attn(attn_norm(m))`,
    /// `m = eh_proj([enorm(e) ; hnorm(h)])`.
    fn tower_layer(
        &self,
        t: usize,
        kvs: &mut [&mut B::Kv],
        h: &B::Buf,
        e: &B::Buf,
        positions: At<'_, B>,
        span: Span<'_>,
    ) -> Result<B::Buf> {
        let be = &self.backend;
        let g = &self.geometry;
        let mode = span.rows();
        let w = &self.tower[t];
        let d = &g.tower_attn;
        let (dim, eps) = (g.hidden, g.tower_eps);
        debug_assert_eq!((be.shape(e).1, be.shape(h).1), (dim, dim));
        let m = be.linear(
            &be.rms_norm_concat(e, &w.enorm, h, &w.hnorm, eps, true)?,
            &w.eh_proj,
            mode,
        )?;
        // wqkv rows are [query | gate | key | value], heads contiguous inside each.
        let x = be.rms_norm(&m, &w.attn_norm, dim, eps, true)?;
        let qkv = be.linear(&x, &w.wqkv, mode)?;
        let (qw, kw) = (d.q_heads * d.head_dim, d.kv_heads * d.head_dim);
        let all = be.shape(&qkv).1;
        // the gate's copy on a side branch beside the value's
        let mut aside = Aside::begin(be, be.shape(&qkv).0)?;
        let gate = be.cols(&qkv, qw, qw)?;
        aside.end()?;
        let v = be.cols(&qkv, 2 * qw + kw, kw)?;
        aside.join()?;
        let o = self.gated_attention(
            kvs,
            d,
            eps,
            (&qkv, (all, 0, qw)),
            (&qkv, (all, 2 * qw, kw)),
            v,
            &w.q_norm,
            &w.k_norm,
            positions,
            span,
        )?;
        let (r, x) = be.add_rms_norm(
            &m,
            &be.linear_sigmoid_mul(&o, &gate, &w.wo, mode)?,
            &w.ffn_norm,
            dim,
            eps,
            true,
        )?;
        let f = swiglu(
            be,
            &x,
            &Expert {
                gate: &w.w1,
                up: &w.w3,
                down: &w.w2,
            },
            mode,
        )?;
        Ok(be.add_rms_norm(&r, &f, &w.out_norm, dim, eps, true)?.1)
    }

    /// Teacher-forced tower over each lane's next `lens[i]` positions `lane.tower_rows ..`
    /// (every `lens[i]` at least 1), the lanes' rows one after another: `hidden[j]` and
    /// `inputs[j]` at that position, `labels[j]` the frame it predicts. Optionally records each
    /// layer's output and the head logits.
    fn tower_prompts(
        &self,
        lanes: &mut [&mut LaneState<B>],
        hidden: &B::Buf,
        inputs: &[Row],
        labels: &[Row],
        lens: &[usize],
        mut trace: Option<&mut TowerTrace>,
    ) -> Result<()> {
        let be = &self.backend;
        let n = inputs.len();
        if n == 0 {
            return Ok(());
        }
        let positions: Vec<usize> = lanes
            .iter()
            .zip(lens)
            .flat_map(|(l, &m)| (0..m).map(move |i| l.tower_rows + i))
            .collect();
        let span = Span::Prompts(lens);
        let mut h = be.rows(hidden, 0, n)?;
        for t in 0..self.geometry.tower_layers {
            let e = self.tower_embed(t, inputs, labels)?;
            let mut kvs: Vec<&mut B::Kv> = lanes.iter_mut().map(|l| &mut l.tower_kv[t]).collect();
            h = self.tower_layer(t, &mut kvs, &h, &e, RopeAt::Host(&positions), span)?;
            if let Some(tr) = trace.as_deref_mut() {
                tr.layer_outputs.push(be.download(&h)?);
                if t >= self.geometry.tower_shared {
                    let r = t - self.geometry.tower_shared;
                    let l = be.download(&be.linear(&h, &self.heads[r], span.rows())?)?;
                    tr.codebook_logits.extend(l);
                }
            }
        }
        for (l, m) in lanes.iter_mut().zip(lens) {
            l.tower_rows += m;
        }
        Ok(())
    }

    // ---------------------------------------------------------------- public driving API

    /// Feeds one lane's next rows (the prompt, or a continuation of it): backbone over `rows`,
    /// then the tower teacher-forced over every position whose label is now known.
    pub fn prefill(&self, lane: &mut LaneState<B>, rows: &[Row]) -> Result<()> {
        self.prefill_one(lane, rows)?;
        // an error the prompt's kernels raised fails this prefill, not the next shared round
        self.backend.settle()?;
        Ok(())
    }

    /// [`Model::prefill`] in pieces of at most `chunk` rows (the activation scratch a memory
    /// plan reserves is sized for its chunk); the lane ends in the same state.
    pub fn prefill_chunked(
        &self,
        lane: &mut LaneState<B>,
        rows: &[Row],
        chunk: usize,
    ) -> Result<()> {
        for piece in rows.chunks(chunk.max(1)) {
            self.prefill_one(lane, piece)?;
        }
        // one wait for the whole prompt, not one per piece
        self.backend.settle()?;
        Ok(())
    }

    /// [`Model::prefill`] of several lanes at once, `prompts[i]` into `lanes[i]`: one pass of
    /// the row-wise ops over every prompt's rows (each weight read once for all of them), the
    /// recurrences and attention per lane. Each prompt's rows get the bits of its own prefill
    /// ([`Rows::Joined`]), so a lane ends as [`Model::prefill`] would leave it. Prompts over the
    /// backend's [`Backend::joined_rows`], a single lane, or a backend that cannot join take
    /// [`Model::prefill`] one after another. The caller bounds the total rows (the plan's
    /// prefill chunk).
    pub fn prefill_joined(
        &self,
        lanes: &mut [&mut LaneState<B>],
        prompts: &[&[Row]],
    ) -> Result<()> {
        let be = &self.backend;
        if lanes.len() != prompts.len() {
            return Err(ModelError::Unsupported(format!(
                "prefill_joined: {} lanes for {} prompts",
                lanes.len(),
                prompts.len()
            )));
        }
        // every prompt checked before any work, so a bad one leaves every lane untouched
        for (lane, rows) in lanes.iter().zip(prompts) {
            self.check_prompt(lane, rows)?;
        }
        let most = be.joined_rows();
        if lanes.len() < 2 || prompts.iter().any(|p| p.len() > most) {
            for (lane, rows) in lanes.iter_mut().zip(prompts) {
                self.prefill_lanes(&mut [&mut **lane], &[rows])?;
            }
        } else {
            self.prefill_lanes(lanes, prompts)?;
        }
        // an error the prompts' kernels raised fails these prefills, not the next shared round
        be.settle()?;
        Ok(())
    }

    /// Checks a prompt, then prefills it (`prefill_lanes` of one lane).
    fn prefill_one(&self, lane: &mut LaneState<B>, rows: &[Row]) -> Result<()> {
        self.check_prompt(lane, rows)?;
        self.prefill_lanes(&mut [lane], &[rows])
    }

    /// `prompts[i]` (checked by the caller: `check_prompt`) into `lanes[i]`: the backbone over every prompt's
    /// rows (`Span::Prompts`: one lane `Rows::Bulk`, several `Rows::Joined`), then the tower
    /// teacher-forced over each lane's positions whose label is now known (its previous last
    /// row, if any, and all new rows but the last), then each lane's newest hidden and rows.
    fn prefill_lanes(&self, lanes: &mut [&mut LaneState<B>], prompts: &[&[Row]]) -> Result<()> {
        let be = &self.backend;
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let x = match prompts {
            [one] => self.embed_checked(one)?,
            _ => self.embed_checked(&prompts.concat())?,
        };
        let hn = self.backbone(lanes, x, Span::Prompts(&lens), None, None)?;
        let (mut inputs, mut labels, mut hidden, mut tlens) = (vec![], vec![], vec![], vec![]);
        let mut off = 0;
        for (lane, rows) in lanes.iter_mut().zip(prompts) {
            let t = rows.len();
            let last = lane.last_hidden.take();
            let mut n = 0;
            if lane.has_tower() {
                if let (Some(r), Some(h)) = (lane.last_row, last) {
                    inputs.push(r);
                    hidden.push(h);
                    n += 1;
                }
                inputs.extend_from_slice(&rows[..t - 1]);
                labels.extend_from_slice(if lane.last_row.is_some() {
                    rows
                } else {
                    &rows[1..]
                });
                if t > 1 {
                    hidden.push(be.rows(&hn, off, t - 1)?);
                }
                n += t - 1;
            }
            tlens.push(n);
            off += t;
        }
        if !inputs.is_empty() {
            let refs: Vec<&B::Buf> = hidden.iter().collect();
            let h = be.concat_rows(&refs)?;
            let mut with: Vec<&mut LaneState<B>> = lanes
                .iter_mut()
                .zip(&tlens)
                .filter(|(_, &n)| n > 0)
                .map(|(l, _)| &mut **l)
                .collect();
            let lens: Vec<usize> = tlens.iter().copied().filter(|&n| n > 0).collect();
            self.tower_prompts(&mut with, &h, &inputs, &labels, &lens, None)?;
        }
        let mut off = 0;
        for (lane, rows) in lanes.iter_mut().zip(prompts) {
            let t = rows.len();
            lane.set_hidden(be.rows(&hn, off + t - 1, 1)?);
            lane.last_row = Some(rows[t - 1]);
            for r in rows.iter() {
                lane.push_main(r[0]);
            }
            off += t;
        }
        Ok(())
    }

    /// What [`Model::prefill`] refuses before any work: no rows, more rows than the lane has
    /// room for, a row out of range.
    pub fn check_prompt(&self, lane: &LaneState<B>, rows: &[Row]) -> Result<()> {
        if rows.is_empty() {
            return Err(ModelError::BadRow {
                index: 0,
                why: "prefill needs at least one row".into(),
            });
        }
        lane.check_room(rows.len())?;
        for (i, r) in rows.iter().enumerate() {
            self.check_row(i, r)?;
        }
        Ok(())
    }

    /// Teacher-forced backbone over `rows` on a fresh lane (prefill path): every layer's output,
    /// final hidden, candidate and full logits.
    pub fn backbone_teacher_forced(&self, rows: &[Row]) -> Result<BackboneTrace> {
        let be = &self.backend;
        let mut lane = self.new_lane(rows.len())?;
        let x = self.embed_rows(rows)?;
        let input_embeds = be.download(&x)?;
        let mut layers = Vec::new();
        let t = rows.len();
        let hn = self.backbone(
            &mut [&mut lane],
            x,
            Span::Prompts(&[t]),
            Some(&mut layers),
            None,
        )?;
        Ok(BackboneTrace {
            input_embeds,
            layer_outputs: layers,
            final_hidden: be.download(&hn)?,
            candidate_logits: be.download(&self.candidate_logits(&hn, Rows::Bulk)?)?,
            full_logits: be.download(&be.linear(&hn, &self.lm_head, Rows::Bulk)?)?,
        })
    }

    /// Teacher-forced tower over `rows` given the backbone's final hidden (`[t, H]`, e.g.
    /// [`BackboneTrace::final_hidden`]): positions 0..t-1, position p labelled by row p+1.
    pub fn tower_teacher_forced(&self, rows: &[Row], final_hidden: &[f32]) -> Result<TowerTrace> {
        let be = &self.backend;
        let t = rows.len();
        for (i, r) in rows.iter().enumerate() {
            self.check_row(i, r)?;
        }
        let mut lane = self.new_lane(t)?;
        let h = be.upload(final_hidden, t, self.geometry.hidden)?;
        let mut trace = TowerTrace {
            layer_outputs: Vec::new(),
            codebook_logits: Vec::new(),
        };
        if t > 1 {
            self.tower_prompts(
                &mut [&mut lane],
                &h,
                &rows[..t - 1],
                &rows[1..],
                &[t - 1],
                Some(&mut trace),
            )?;
            // Reorder logits from [head][pos][cb] to [pos][head][cb].
            let (cb, heads) = (self.geometry.codebook, self.geometry.codebooks - 1);
            let src = std::mem::take(&mut trace.codebook_logits);
            let mut dst = vec![0f32; src.len()];
            for r in 0..heads {
                for p in 0..t - 1 {
                    let s = (r * (t - 1) + p) * cb;
                    let d = (p * heads + r) * cb;
                    dst[d..d + cb].copy_from_slice(&src[s..s + cb]);
                }
            }
            trace.codebook_logits = dst;
        }
        Ok(trace)
    }

    /// Candidate logits of each lane's newest position (`[lanes][candidates]`).
    pub fn main_logits(&self, lanes: &[&mut LaneState<B>]) -> Result<Vec<Vec<f32>>> {
        let be = &self.backend;
        let hs = lanes
            .iter()
            .map(|l| l.last_hidden.as_ref().ok_or(ModelError::NotPrefilled))
            .collect::<Result<Vec<_>>>()?;
        let h = be.concat_rows(&hs)?;
        let l = be.download(&self.candidate_logits(&h, Rows::Exact)?)?;
        let c = self.candidates.len();
        Ok(l.chunks_exact(c).map(<[f32]>::to_vec).collect())
    }

    /// Runs the tower for one new frame per lane at each lane's newest position: `main[i]` is the
    /// lane's sampled semantic token; `pick(r, lane, logits)` chooses code r+1 from head r.
    /// Returns the frames `[main, c0..c9]` and, if asked, each head's logits.
    pub fn tower_step(
        &self,
        lanes: &mut [&mut LaneState<B>],
        main: &[u32],
        pick: &(dyn Fn(usize, usize, &[f32]) -> u32 + Sync),
        mut head_logits: Option<&mut Vec<Vec<f32>>>,
    ) -> Result<Vec<Row>> {
        if lanes.iter().any(|l| !l.has_tower()) {
            return Err(ModelError::Unsupported(
                "a backbone-only lane (guidance branch) cannot run the tower".into(),
            ));
        }
        let be = &self.backend;
        let g = &self.geometry;
        let n = lanes.len();
        let mut frames: Vec<Row> = main
            .iter()
            .map(|&m| {
                let mut f = [0i64; ROW_WIDTH];
                f[0] = i64::from(m);
                f[1] = i64::from(m) - i64::from(g.semantic_start);
                f
            })
            .collect();
        let inputs = lanes
            .iter()
            .map(|l| l.last_row.ok_or(ModelError::NotPrefilled))
            .collect::<Result<Vec<_>>>()?;
        let hs = lanes
            .iter()
            .map(|l| l.last_hidden.as_ref().ok_or(ModelError::NotPrefilled))
            .collect::<Result<Vec<_>>>()?;
        let mut h = be.concat_rows(&hs)?;
        let positions: Vec<usize> = lanes.iter().map(|l| l.tower_rows).collect();
        for t in 0..g.tower_layers {
            let e = self.tower_embed(t, &inputs, &frames)?;
            let mut kvs: Vec<&mut B::Kv> = lanes.iter_mut().map(|l| &mut l.tower_kv[t]).collect();
            h = self.tower_layer(t, &mut kvs, &h, &e, RopeAt::Host(&positions), Span::Step)?;
            if t >= g.tower_shared {
                let r = t - g.tower_shared;
                let l = be.download(&be.linear(&h, &self.heads[r], Rows::Exact)?)?;
                let cb = g.codebook;
                let codes: Vec<u32> = crate::lanes_map(n, |i| pick(r, i, &l[i * cb..(i + 1) * cb]));
                for (i, (row, code)) in l.chunks_exact(g.codebook).zip(codes).enumerate() {
                    frames[i][2 + r] = i64::from(code);
                    if let Some(hl) = head_logits.as_deref_mut() {
                        hl.push(row.to_vec());
                    }
                }
            }
        }
        for l in lanes.iter_mut() {
            l.tower_rows += 1;
        }
        debug_assert_eq!(frames.len(), n);
        Ok(frames)
    }

    /// What a frame round kept on the backend needs to know of the model.
    pub(crate) fn round_spec(&self) -> RoundSpec {
        RoundSpec {
            candidates: self.candidates.clone(),
            semantic_start: self.geometry.semantic_start,
            semantic_end: self.geometry.semantic_end,
        }
    }

    /// A whole frame round on the backend, with no host round trip: the main draw, the tower
    /// with each head's draw, and the frame fed back through the backbone, each lane's newest
    /// hidden written in place. The same ops and arithmetic as `step_frames` without a hook
    /// (`main_logits`, `tower_step`, `advance`), except that the embeddings and draws read the
    /// round's frames on the backend. Every lane runs the tower and the backbone, also one
    /// that drew EOS (its state is then spent). Host counters are left to the caller.
    pub(crate) fn round_body(
        &self,
        lanes: &mut [&mut LaneState<B>],
        round: &mut B::Round,
        leaders: usize,
    ) -> Result<()> {
        let be = &self.backend;
        let g = &self.geometry;
        let h0 = {
            let hs = lanes
                .iter()
                .map(|l| l.last_hidden.as_ref().ok_or(ModelError::NotPrefilled))
                .collect::<Result<Vec<_>>>()?;
            be.concat_rows(&hs)?
        };
        // every lane's main logits (the unconditional branches' are mixed into their lanes')
        be.round_sample(&self.candidate_logits(&h0, Rows::Exact)?, round, Slot::Main)?;
        // the tower runs on the drawing lanes only
        let mut h = if leaders == lanes.len() {
            h0
        } else {
            be.rows(&h0, 0, leaders)?
        };
        for t in 0..g.tower_layers {
            let terms = self.tower_terms(t);
            let e = be.round_embed(
                &[&self.tower[t].emb, &self.codebooks],
                round,
                &terms,
                1.0,
                Counter::Tower,
            )?;
            let mut kvs: Vec<&mut B::Kv> = lanes[..leaders]
                .iter_mut()
                .map(|l| &mut l.tower_kv[t])
                .collect();
            h = self.tower_layer(
                t,
                &mut kvs,
                &h,
                &e,
                RopeAt::Round(round, Counter::Tower),
                Span::Step,
            )?;
            if t >= g.tower_shared {
                let r = t - g.tower_shared;
                be.round_sample(
                    &be.linear(&h, &self.heads[r], Rows::Exact)?,
                    round,
                    Slot::Head(r),
                )?;
            }
        }
        let (terms, mix) = self.embed_terms();
        let x = be.round_embed(
            &[&self.embed, &self.codebooks],
            round,
            &terms,
            mix,
            Counter::Backbone,
        )?;
        let hn = self.backbone(lanes, x, Span::Step, None, Some(round))?;
        let mut outs = lanes
            .iter_mut()
            .map(|l| l.last_hidden.as_mut().ok_or(ModelError::NotPrefilled))
            .collect::<Result<Vec<_>>>()?;
        be.write_rows(&hn, &mut outs)?;
        Ok(())
    }

    /// Feeds one row per lane (a generated frame) through the backbone.
    pub fn advance(&self, lanes: &mut [&mut LaneState<B>], frames: &[Row]) -> Result<()> {
        let be = &self.backend;
        for l in lanes.iter() {
            l.check_room(1)?;
        }
        let x = self.embed_rows(frames)?;
        let hn = self.backbone(lanes, x, Span::Step, None, None)?;
        for (i, l) in lanes.iter_mut().enumerate() {
            l.set_hidden(be.rows(&hn, i, 1)?);
            l.last_row = Some(frames[i]);
            l.push_main(frames[i][0]);
        }
        Ok(())
    }
}

impl<B: Backend> Drop for Model<B> {
    fn drop(&mut self) {
        if crate::prof::enabled() {
            eprintln!("{}", crate::prof::report());
        }
    }
}

/// [`Backend::linear_many`] as a fixed-size array.
fn linears<B: Backend, const N: usize>(
    be: &B,
    x: &B::Buf,
    ws: [&B::Weight; N],
    mode: Rows,
) -> Result<[B::Buf; N]> {
    be.linear_many(x, &ws, mode)?
        .try_into()
        .map_err(|v: Vec<B::Buf>| {
            ModelError::Unsupported(format!(
                "linear_many gave {} outputs for {N} weights",
                v.len()
            ))
        })
}

/// A side branch (`Backend::aside_begin`) that is ended and joined however the caller leaves:
/// on an early return the branch is still joined before the buffers it used can be reused.
struct Aside<'a, B: Backend> {
    be: &'a B,
    on: bool,
    ended: bool,
    joined: bool,
}

impl<'a, B: Backend> Aside<'a, B> {
    fn begin(be: &'a B, rows: usize) -> Result<Self> {
        Ok(Aside {
            be,
            on: be.aside_begin(rows)?,
            ended: false,
            joined: false,
        })
    }

    fn end(&mut self) -> Result<()> {
        if self.on && !self.ended {
            self.ended = true;
            self.be.aside_end()?;
        }
        Ok(())
    }

    fn join(&mut self) -> Result<()> {
        self.end()?;
        if self.on && !self.joined {
            self.joined = true;
            self.be.aside_join()?;
        }
        Ok(())
    }
}

impl<B: Backend> Drop for Aside<'_, B> {
    fn drop(&mut self) {
        // an error is already on its way out; the join only keeps later work in order
        let _ = self.join();
    }
}

/// `down(silu(gate x) ⊙ up x)`.
fn swiglu<B: Backend, W: std::borrow::Borrow<B::Weight>>(
    be: &B,
    x: &B::Buf,
    e: &Expert<W>,
    mode: Rows,
) -> Result<B::Buf> {
    let [g, u]: [B::Buf; 2] = linears(be, x, [e.gate.borrow(), e.up.borrow()], mode)?;
    Ok(be.linear_silu_mul(&g, &u, e.down.borrow(), mode)?)
}

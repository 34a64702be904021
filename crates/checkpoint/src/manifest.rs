//! The manifest: every tensor the config implies (name, dtype, shape), compared with the shard
//! headers before anything is allocated.

use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

use crate::config::{Config, LayerType};
use crate::dtype::DType;
use crate::store::Store;
use crate::CheckpointError;

/// How routed experts are stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum ExpertFormat {
    /// F8_E4M3 weights with one F32 `weight_scale_inv` per 128x128 block.
    Fp8Block128,
    /// NVFP4 (E2M1 pairs + E4M3 per-16 scales + F32 global), pruned: `kept[layer]` lists the
    /// original expert IDs in slot order.
    Nvfp4Pruned { kept: Vec<Vec<u32>> },
}

impl ExpertFormat {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Fp8Block128 => "fp8-block128",
            Self::Nvfp4Pruned { .. } => "nvfp4-pruned",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum DTypeRule {
    Exact(DType),
    /// Small tensors (norms, gates' biases) may be stored BF16 or F32.
    Small,
}

impl DTypeRule {
    pub fn accepts(self, d: DType) -> bool {
        match self {
            Self::Exact(x) => x == d,
            Self::Small => matches!(d, DType::BF16 | DType::F32),
        }
    }
    fn describe(self) -> String {
        match self {
            Self::Exact(d) => d.to_string(),
            Self::Small => "BF16 or F32".into(),
        }
    }
    /// The dtype a writer uses.
    pub fn canonical(self) -> DType {
        match self {
            Self::Exact(d) => d,
            Self::Small => DType::BF16,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Expected {
    /// Canonical name; `alt` lists accepted other spellings of the same tensor.
    pub name: String,
    pub alt: Vec<String>,
    pub rule: DTypeRule,
    pub shape: Vec<usize>,
    /// Byte class for reports (`dense`, `experts`, `expert_scales`, `tower`, `embedding`).
    pub class: &'static str,
    /// May be absent (e.g. NVFP4 `input_scale`).
    pub optional: bool,
}

fn e(name: String, rule: DTypeRule, shape: &[usize], class: &'static str) -> Expected {
    Expected {
        name,
        alt: vec![],
        rule,
        shape: shape.to_vec(),
        class,
        optional: false,
    }
}

const BF16: DTypeRule = DTypeRule::Exact(DType::BF16);
const SMALL: DTypeRule = DTypeRule::Small;

fn ceil_div(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

/// Refuses dimensions so large that the shape arithmetic below could overflow (a config that
/// passes validation must never make the manifest panic). Limits are far above Drama 3's.
fn check_dims(cfg: &Config) -> Result<(), CheckpointError> {
    let t = &cfg.text_config;
    let a = &cfg.audio_decoder_config;
    let limits = [
        ("text_config.vocab_size", t.vocab_size, 1 << 24),
        ("text_config.hidden_size", t.hidden_size, 1 << 16),
        ("text_config.num_hidden_layers", t.num_hidden_layers, 1024),
        (
            "text_config.num_attention_heads",
            t.num_attention_heads,
            1024,
        ),
        (
            "text_config.num_key_value_heads",
            t.num_key_value_heads,
            1024,
        ),
        ("text_config.head_dim", t.head_dim, 4096),
        (
            "text_config.linear_conv_kernel_dim",
            t.linear_conv_kernel_dim,
            64,
        ),
        (
            "text_config.linear_key_head_dim",
            t.linear_key_head_dim,
            4096,
        ),
        (
            "text_config.linear_value_head_dim",
            t.linear_value_head_dim,
            4096,
        ),
        (
            "text_config.linear_num_key_heads",
            t.linear_num_key_heads,
            1024,
        ),
        (
            "text_config.linear_num_value_heads",
            t.linear_num_value_heads,
            1024,
        ),
        ("text_config.num_experts", t.num_experts, 4096),
        (
            "text_config.moe_intermediate_size",
            t.moe_intermediate_size,
            1 << 18,
        ),
        (
            "text_config.shared_expert_intermediate_size",
            t.shared_expert_intermediate_size,
            1 << 18,
        ),
        (
            "audio_decoder_config.intermediate_size",
            a.intermediate_size,
            1 << 18,
        ),
        ("audio_decoder_config.num_codebooks", a.num_codebooks, 64),
        ("audio_decoder_config.vocab_size", a.vocab_size, 1 << 20),
        (
            "audio_decoder_config.shared_enrichment_layers",
            a.shared_enrichment_layers,
            64,
        ),
    ];
    for (field, v, max) in limits {
        if v > max {
            return Err(CheckpointError::Config {
                field: field.into(),
                why: format!("{v} exceeds the supported maximum {max}"),
            });
        }
    }
    Ok(())
}

/// Every tensor `cfg` implies, for the given expert format.
pub fn expected_tensors(
    cfg: &Config,
    fmt: &ExpertFormat,
) -> Result<Vec<Expected>, CheckpointError> {
    check_dims(cfg)?;
    let t = &cfg.text_config;
    let a = &cfg.audio_decoder_config;
    let h = t.hidden_size;
    let mut v = Vec::new();
    let p = "model.language_model";
    v.push(e(
        format!("{p}.embed_tokens.weight"),
        BF16,
        &[t.vocab_size, h],
        "embedding",
    ));
    v.push(e(format!("{p}.norm.weight"), SMALL, &[h], "dense"));
    v.push(e(
        "lm_head.weight".into(),
        BF16,
        &[t.vocab_size, h],
        "embedding",
    ));
    let conv_ch = cfg.gdn_conv_channels();
    let vdim = t.linear_num_value_heads * t.linear_value_head_dim;
    if let ExpertFormat::Nvfp4Pruned { kept } = fmt {
        if kept.len() != t.num_hidden_layers {
            return Err(CheckpointError::ExpertMetadata(format!(
                "metadata.drama_experts lists {} layers but the config has {}",
                kept.len(),
                t.num_hidden_layers
            )));
        }
    }
    for (i, lt) in t.layer_types.iter().enumerate() {
        let l = format!("{p}.layers.{i}");
        v.push(e(
            format!("{l}.input_layernorm.weight"),
            SMALL,
            &[h],
            "dense",
        ));
        v.push(e(
            format!("{l}.post_attention_layernorm.weight"),
            SMALL,
            &[h],
            "dense",
        ));
        match lt {
            LayerType::LinearAttention => {
                let m = format!("{l}.linear_attn");
                v.push(e(
                    format!("{m}.in_proj_qkv.weight"),
                    BF16,
                    &[conv_ch, h],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.in_proj_z.weight"),
                    BF16,
                    &[vdim, h],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.in_proj_b.weight"),
                    BF16,
                    &[t.linear_num_value_heads, h],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.in_proj_a.weight"),
                    BF16,
                    &[t.linear_num_value_heads, h],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.conv1d.weight"),
                    SMALL,
                    &[conv_ch, 1, t.linear_conv_kernel_dim],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.dt_bias"),
                    SMALL,
                    &[t.linear_num_value_heads],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.A_log"),
                    SMALL,
                    &[t.linear_num_value_heads],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.norm.weight"),
                    SMALL,
                    &[t.linear_value_head_dim],
                    "dense",
                ));
                v.push(e(format!("{m}.out_proj.weight"), BF16, &[h, vdim], "dense"));
            }
            LayerType::FullAttention => {
                let m = format!("{l}.self_attn");
                let (hq, hkv, hd) = (t.num_attention_heads, t.num_key_value_heads, t.head_dim);
                v.push(e(
                    format!("{m}.q_proj.weight"),
                    BF16,
                    &[2 * hq * hd, h],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.k_proj.weight"),
                    BF16,
                    &[hkv * hd, h],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.v_proj.weight"),
                    BF16,
                    &[hkv * hd, h],
                    "dense",
                ));
                v.push(e(
                    format!("{m}.o_proj.weight"),
                    BF16,
                    &[h, hq * hd],
                    "dense",
                ));
                v.push(e(format!("{m}.q_norm.weight"), SMALL, &[hd], "dense"));
                v.push(e(format!("{m}.k_norm.weight"), SMALL, &[hd], "dense"));
            }
        }
        let m = format!("{l}.mlp");
        let (ie, is) = (t.moe_intermediate_size, t.shared_expert_intermediate_size);
        v.push(e(
            format!("{m}.gate.weight"),
            BF16,
            &[t.num_experts, h],
            "dense",
        ));
        v.push(e(
            format!("{m}.shared_expert_gate.weight"),
            BF16,
            &[1, h],
            "dense",
        ));
        v.push(e(
            format!("{m}.shared_expert.gate_proj.weight"),
            BF16,
            &[is, h],
            "dense",
        ));
        v.push(e(
            format!("{m}.shared_expert.up_proj.weight"),
            BF16,
            &[is, h],
            "dense",
        ));
        v.push(e(
            format!("{m}.shared_expert.down_proj.weight"),
            BF16,
            &[h, is],
            "dense",
        ));
        let slots = match fmt {
            ExpertFormat::Fp8Block128 => t.num_experts,
            ExpertFormat::Nvfp4Pruned { kept } => kept[i].len(),
        };
        for x in 0..slots {
            for (proj, out, inp) in [
                ("gate_proj", ie, h),
                ("up_proj", ie, h),
                ("down_proj", h, ie),
            ] {
                let n = format!("{m}.experts.{x}.{proj}");
                match fmt {
                    ExpertFormat::Fp8Block128 => {
                        v.push(e(
                            format!("{n}.weight"),
                            DTypeRule::Exact(DType::F8E4M3),
                            &[out, inp],
                            "experts",
                        ));
                        v.push(e(
                            format!("{n}.weight_scale_inv"),
                            DTypeRule::Exact(DType::F32),
                            &[ceil_div(out, 128), ceil_div(inp, 128)],
                            "expert_scales",
                        ));
                    }
                    ExpertFormat::Nvfp4Pruned { .. } => {
                        if inp % 16 != 0 {
                            return Err(CheckpointError::ExpertMetadata(format!(
                                "NVFP4 needs input width divisible by 16, {proj} has {inp}"
                            )));
                        }
                        v.push(e(
                            format!("{n}.weight"),
                            DTypeRule::Exact(DType::U8),
                            &[out, inp / 2],
                            "experts",
                        ));
                        v.push(e(
                            format!("{n}.weight_scale"),
                            DTypeRule::Exact(DType::F8E4M3),
                            &[out, inp / 16],
                            "expert_scales",
                        ));
                        v.push(e(
                            format!("{n}.weight_scale_2"),
                            DTypeRule::Exact(DType::F32),
                            &[],
                            "expert_scales",
                        ));
                        let mut is = e(
                            format!("{n}.input_scale"),
                            DTypeRule::Exact(DType::F32),
                            &[],
                            "expert_scales",
                        );
                        is.optional = true;
                        v.push(is);
                    }
                }
            }
        }
    }
    // Tower.
    let cb = cfg.codebook_size();
    let (hq, hkv, hd, ti) = (a.n_head, a.n_local_heads, a.head_dim, a.intermediate_size);
    let d = a.dim;
    v.push(e(
        "audio_decoder.codebook_embeddings.weight".into(),
        BF16,
        &[a.num_codebooks * cb, d],
        "tower",
    ));
    let shared = a.shared_enrichment_layers;
    for li in 0..cfg.tower_layers() {
        let (l, canon, other) = if li < shared {
            (
                format!("audio_decoder_mtp_shared.layers.{li}"),
                "semantic_embedding",
                "codebook_embedding",
            )
        } else {
            (
                format!("audio_decoder_mtp.layers.{}", li - shared),
                "codebook_embedding",
                "semantic_embedding",
            )
        };
        let mut emb = e(format!("{l}.{canon}.weight"), BF16, &[cb, d], "tower");
        emb.alt.push(format!("{l}.{other}.weight"));
        v.push(emb);
        v.push(e(format!("{l}.enorm.weight"), SMALL, &[d], "tower"));
        v.push(e(format!("{l}.hnorm.weight"), SMALL, &[d], "tower"));
        v.push(e(format!("{l}.eh_proj.weight"), BF16, &[d, 2 * d], "tower"));
        let tl = format!("{l}.transformer_layer");
        v.push(e(
            format!("{tl}.attention.wqkv.weight"),
            BF16,
            &[2 * hq * hd + 2 * hkv * hd, d],
            "tower",
        ));
        v.push(e(
            format!("{tl}.attention.wo.weight"),
            BF16,
            &[d, hq * hd],
            "tower",
        ));
        v.push(e(
            format!("{tl}.attention.q_norm.weight"),
            SMALL,
            &[hd],
            "tower",
        ));
        v.push(e(
            format!("{tl}.attention.k_norm.weight"),
            SMALL,
            &[hd],
            "tower",
        ));
        v.push(e(
            format!("{tl}.attention_norm.weight"),
            SMALL,
            &[d],
            "tower",
        ));
        v.push(e(format!("{tl}.ffn_norm.weight"), SMALL, &[d], "tower"));
        v.push(e(
            format!("{tl}.feed_forward.w1.weight"),
            BF16,
            &[ti, d],
            "tower",
        ));
        v.push(e(
            format!("{tl}.feed_forward.w3.weight"),
            BF16,
            &[ti, d],
            "tower",
        ));
        v.push(e(
            format!("{tl}.feed_forward.w2.weight"),
            BF16,
            &[d, ti],
            "tower",
        ));
        v.push(e(
            format!("{l}.final_layernorm.weight"),
            SMALL,
            &[d],
            "tower",
        ));
    }
    for r in 0..a.num_codebooks - 1 {
        v.push(e(
            format!("audio_decoder_mtp.heads.{r}.weight"),
            BF16,
            &[cb, d],
            "tower",
        ));
    }
    Ok(v)
}

#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    pub name: String,
    pub expected: String,
    pub found: String,
}

/// The verdict of comparing a store with the manifest.
#[derive(Debug, Clone, Serialize, Default)]
pub struct ManifestReport {
    pub expected: usize,
    pub missing: Vec<String>,
    pub mismatched: Vec<Mismatch>,
    pub unused: Vec<String>,
    /// Stored name for each canonical name (differs only for alternative spellings).
    #[serde(skip)]
    pub resolved: BTreeMap<String, String>,
}

impl ManifestReport {
    pub fn ok(&self) -> bool {
        self.missing.is_empty() && self.mismatched.is_empty() && self.unused.is_empty()
    }

    /// A readable refusal listing every problem.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "checkpoint does not match its config: {} missing, {} mismatched, {} unused tensor(s)",
            self.missing.len(),
            self.mismatched.len(),
            self.unused.len()
        );
        for m in &self.missing {
            s.push_str(&format!("\n  missing:    {m}"));
        }
        for m in &self.mismatched {
            s.push_str(&format!(
                "\n  mismatched: {} (expected {}, found {})",
                m.name, m.expected, m.found
            ));
        }
        for m in &self.unused {
            s.push_str(&format!("\n  unused:     {m}"));
        }
        s
    }
}

/// Which expert format the stored tensors use (decided from layer 0 and the index metadata).
pub fn detect_expert_format(cfg: &Config, store: &Store) -> Result<ExpertFormat, CheckpointError> {
    let probe = "model.language_model.layers.0.mlp.experts.0.gate_proj";
    if store.contains(&format!("{probe}.weight_scale_inv")) {
        return Ok(ExpertFormat::Fp8Block128);
    }
    if store.contains(&format!("{probe}.weight_scale"))
        || store.metadata.contains_key("drama_experts")
    {
        let kept = parse_drama_experts(cfg, &store.metadata)?;
        return Ok(ExpertFormat::Nvfp4Pruned { kept });
    }
    // Neither: report against the FP8 manifest so the missing tensors are listed.
    Ok(ExpertFormat::Fp8Block128)
}

const DRAMA_EXPERTS_FORM: &str = "metadata.drama_experts must be a JSON string holding an object \
from layer index (decimal string) to the list of original expert IDs in slot order, e.g. \
\"{\\\"0\\\": [0, 3, 7], \\\"1\\\": [1, 2]}\"";

/// Parses `metadata.drama_experts` of the index into per-layer kept original IDs.
pub fn parse_drama_experts(
    cfg: &Config,
    meta: &BTreeMap<String, serde_json::Value>,
) -> Result<Vec<Vec<u32>>, CheckpointError> {
    let err = |why: String| CheckpointError::ExpertMetadata(format!("{why}; {DRAMA_EXPERTS_FORM}"));
    let raw = meta
        .get("drama_experts")
        .ok_or_else(|| err("metadata.drama_experts is absent".into()))?;
    let s = raw.as_str().ok_or_else(|| {
        err(format!(
            "metadata.drama_experts is a JSON {} rather than a string",
            json_kind(raw)
        ))
    })?;
    let obj: serde_json::Map<String, serde_json::Value> = serde_json::from_str(s).map_err(|e| {
        err(format!(
            "metadata.drama_experts does not parse as an object: {e}"
        ))
    })?;
    let layers = cfg.text_config.num_hidden_layers;
    let ne = cfg.text_config.num_experts;
    let topk = cfg.text_config.num_experts_per_tok;
    let mut kept: Vec<Option<Vec<u32>>> = vec![None; layers];
    for (k, v) in obj {
        let li: usize = k
            .parse()
            .ok()
            .filter(|x: &usize| k == x.to_string())
            .ok_or_else(|| err(format!("layer key {k:?} is not a decimal layer index")))?;
        if li >= layers {
            return Err(err(format!(
                "layer {li} is out of range (the config has {layers} layers)"
            )));
        }
        let arr = v
            .as_array()
            .ok_or_else(|| err(format!("layer {li}: value is not a list")))?;
        let mut ids = Vec::with_capacity(arr.len());
        let mut seen = BTreeSet::new();
        for x in arr {
            let id = x
                .as_u64()
                .filter(|&id| (id as usize) < ne)
                .ok_or_else(|| err(format!("layer {li}: {x} is not an expert ID in 0..{ne}")))?;
            if !seen.insert(id) {
                return Err(err(format!("layer {li}: expert {id} listed twice")));
            }
            ids.push(id as u32);
        }
        if ids.len() < topk {
            return Err(err(format!(
                "layer {li}: {} kept experts, fewer than num_experts_per_tok {topk}",
                ids.len()
            )));
        }
        kept[li] = Some(ids);
    }
    kept.into_iter()
        .enumerate()
        .map(|(i, k)| k.ok_or_else(|| err(format!("layer {i} is missing"))))
        .collect()
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    }
}

fn shape_str(s: &[usize]) -> String {
    format!("{s:?}")
}

/// Compares `store` with `expected`; every problem is listed, nothing stops at the first.
pub fn check(expected: &[Expected], store: &Store) -> ManifestReport {
    let mut r = ManifestReport {
        expected: expected.len(),
        ..Default::default()
    };
    let mut used = BTreeSet::new();
    for x in expected {
        let found = std::iter::once(&x.name)
            .chain(x.alt.iter())
            .find(|n| store.tensors.contains_key(*n));
        let Some(n) = found else {
            if !x.optional {
                r.missing.push(x.name.clone());
            }
            continue;
        };
        used.insert(n.clone());
        r.resolved.insert(x.name.clone(), n.clone());
        let info = &store.tensors[n];
        if !x.rule.accepts(info.dtype) || info.shape != x.shape {
            r.mismatched.push(Mismatch {
                name: n.clone(),
                expected: format!("{} {}", x.rule.describe(), shape_str(&x.shape)),
                found: format!("{} {}", info.dtype, shape_str(&info.shape)),
            });
        }
    }
    for n in store.tensors.keys() {
        if !used.contains(n) {
            r.unused.push(n.clone());
        }
    }
    r
}

/// Refuses non-finite or negative expert scales (they would poison every activation). Zero is
/// allowed: an all-zero 128x128 block quantises to scale 0.
pub fn check_scales(expected: &[Expected], store: &Store) -> Result<(), CheckpointError> {
    for x in expected.iter().filter(|x| x.class == "expert_scales") {
        let Ok(view) = store.get(&x.name) else {
            continue;
        };
        let vals = view.to_f32();
        if let Some((i, v)) = vals
            .iter()
            .enumerate()
            .find(|(_, v)| !v.is_finite() || **v < 0.0)
        {
            return Err(CheckpointError::BadScale {
                name: x.name.clone(),
                index: i,
                value: *v,
            });
        }
    }
    Ok(())
}

/// Counts and bytes by dtype and class, for `inspect` and `fixture --manifest-only`.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Tally {
    pub tensors: usize,
    pub by_dtype: BTreeMap<String, usize>,
    pub bytes_by_class: BTreeMap<String, u64>,
    pub total_bytes: u64,
}

pub fn tally(expected: &[Expected]) -> Tally {
    let mut t = Tally::default();
    for x in expected.iter().filter(|x| !x.optional) {
        let d = x.rule.canonical();
        t.tensors += 1;
        *t.by_dtype.entry(d.to_string()).or_default() += 1;
        let b = x.shape.iter().product::<usize>() as u64 * d.size() as u64;
        *t.bytes_by_class.entry(x.class.to_string()).or_default() += b;
        t.total_bytes += b;
    }
    t
}

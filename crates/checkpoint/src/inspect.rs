//! The `dramatis inspect` report: geometry, counts per dtype, bytes per class, the verdict.

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::Path;

use crate::manifest::{self, ManifestReport};
use crate::{Checkpoint, CheckpointError};

#[derive(Debug, Serialize)]
pub struct Geometry {
    pub hidden_size: usize,
    pub layers: usize,
    pub linear_attention_layers: usize,
    pub full_attention_layers: usize,
    pub attention_heads: String,
    pub experts: String,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub tower_layers: usize,
    pub tower_intermediate_size: usize,
    pub codebooks: usize,
    pub codebook_size: usize,
    pub vq_feature_placement: String,
    pub vq_backbone_codebooks: usize,
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub dir: String,
    pub model_type: String,
    pub geometry: Geometry,
    pub expert_format: String,
    pub tensors: usize,
    pub tensors_by_dtype: BTreeMap<String, usize>,
    pub bytes_by_class: BTreeMap<String, u64>,
    pub total_bytes: u64,
    pub manifest: ManifestReport,
    pub scales_ok: Result<(), String>,
    pub codec_pth: bool,
    pub tokenizer_json: bool,
    pub verdict: String,
}

impl Report {
    pub fn admitted(&self) -> bool {
        self.manifest.ok() && self.scales_ok.is_ok()
    }
}

pub fn inspect(dir: &Path) -> Result<Report, CheckpointError> {
    let ck = Checkpoint::open_unverified(dir)?;
    let c = &ck.config;
    let t = &c.text_config;
    let a = &c.audio_decoder_config;
    let full = t
        .layer_types
        .iter()
        .filter(|l| **l == crate::LayerType::FullAttention)
        .count();
    let mut by_dtype = BTreeMap::new();
    let mut by_class: BTreeMap<String, u64> = BTreeMap::new();
    let expected = manifest::expected_tensors(c, &ck.expert_format)?;
    let class_of: BTreeMap<&str, &str> = expected
        .iter()
        .flat_map(|x| {
            std::iter::once(x.name.as_str())
                .chain(x.alt.iter().map(String::as_str))
                .map(move |n| (n, x.class))
        })
        .collect();
    for info in ck.store.tensors.values() {
        *by_dtype.entry(info.dtype.to_string()).or_insert(0usize) += 1;
        let class = class_of
            .get(info.name.as_str())
            .copied()
            .unwrap_or("unused");
        *by_class.entry(class.to_string()).or_default() += info.nbytes() as u64;
    }
    let scales_ok = manifest::check_scales(&expected, &ck.store).map_err(|e| e.to_string());
    let ok = ck.report.ok() && scales_ok.is_ok();
    let verdict = if ok {
        "admitted: every tensor the config implies is present with its dtype and shape".to_string()
    } else if !ck.report.ok() {
        format!("refused: {}", ck.report.describe())
    } else {
        format!("refused: {}", scales_ok.as_ref().unwrap_err())
    };
    Ok(Report {
        dir: dir.display().to_string(),
        model_type: c.model_type.clone(),
        geometry: Geometry {
            hidden_size: t.hidden_size,
            layers: t.num_hidden_layers,
            linear_attention_layers: t.num_hidden_layers - full,
            full_attention_layers: full,
            attention_heads: format!(
                "{} q / {} kv x {}",
                t.num_attention_heads, t.num_key_value_heads, t.head_dim
            ),
            experts: format!(
                "{} routed (top {}) x {} + shared {}",
                t.num_experts,
                t.num_experts_per_tok,
                t.moe_intermediate_size,
                t.shared_expert_intermediate_size
            ),
            vocab_size: t.vocab_size,
            max_position_embeddings: t.max_position_embeddings,
            tower_layers: c.tower_layers(),
            tower_intermediate_size: a.intermediate_size,
            codebooks: a.num_codebooks,
            codebook_size: a.vocab_size,
            vq_feature_placement: format!("{:?}", a.vq_feature_placement),
            vq_backbone_codebooks: c.backbone_codebooks(),
        },
        expert_format: ck.expert_format.name().to_string(),
        tensors: ck.store.tensors.len(),
        tensors_by_dtype: by_dtype,
        bytes_by_class: by_class,
        total_bytes: ck.store.total_bytes(),
        manifest: ck.report.clone(),
        scales_ok,
        codec_pth: ck.codec_path().exists(),
        tokenizer_json: ck.tokenizer_path().exists(),
        verdict,
    })
}

fn gib(b: u64) -> String {
    format!("{:.3} GiB", b as f64 / (1u64 << 30) as f64)
}

pub fn render(r: &Report) -> String {
    let g = &r.geometry;
    let mut s = String::new();
    s.push_str(&format!(
        "checkpoint   {}\nmodel_type   {}\n",
        r.dir, r.model_type
    ));
    s.push_str(&format!(
        "backbone     hidden {}, {} layers ({} linear, {} full), heads {}, experts {}\n",
        g.hidden_size,
        g.layers,
        g.linear_attention_layers,
        g.full_attention_layers,
        g.attention_heads,
        g.experts
    ));
    s.push_str(&format!(
        "vocab        {} rows, window {} rows\n",
        g.vocab_size, g.max_position_embeddings
    ));
    s.push_str(&format!(
        "tower        {} layers, intermediate {}, {} codebooks x {}, {} (k = {})\n",
        g.tower_layers,
        g.tower_intermediate_size,
        g.codebooks,
        g.codebook_size,
        g.vq_feature_placement,
        g.vq_backbone_codebooks
    ));
    s.push_str(&format!("experts      {}\n", r.expert_format));
    let dt: Vec<String> = r
        .tensors_by_dtype
        .iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect();
    s.push_str(&format!("tensors      {} ({})\n", r.tensors, dt.join(", ")));
    for (k, v) in &r.bytes_by_class {
        s.push_str(&format!("  {k:<14} {v:>16} bytes  {}\n", gib(*v)));
    }
    s.push_str(&format!(
        "  {:<14} {:>16} bytes  {}\n",
        "total",
        r.total_bytes,
        gib(r.total_bytes)
    ));
    s.push_str(&format!(
        "files        codec.pth {}, tokenizer.json {}\n",
        if r.codec_pth { "present" } else { "ABSENT" },
        if r.tokenizer_json {
            "present"
        } else {
            "ABSENT"
        }
    ));
    s.push_str(&format!("verdict      {}\n", r.verdict));
    s
}

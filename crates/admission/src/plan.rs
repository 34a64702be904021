//! The memory plan: every byte class, computed from the geometry before anything is allocated, and
//! the verdict against the device and host budgets.

use crate::contract::{Admission, FrameCap, WindowContract, MIN_WINDOW};
use crate::error::LimitError;
use crate::geometry::{mul, product, sum, GeometryError, ModelGeometry};
use crate::limits::Limits;
use crate::units::{Bytes, Frames, Lanes, PromptRows, Rows, Window};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Where the model runs. It decides the KV element size and which budget a class draws on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// KV in f32; everything in host memory.
    Cpu,
    /// KV in BF16; model state on the device, replies and pinned staging on the host.
    Cuda,
}

impl Backend {
    pub const fn kv_element_bytes(self) -> u64 {
        match self {
            Self::Cpu => 4,
            Self::Cuda => 2,
        }
    }

    pub const fn kv_dtype(self) -> &'static str {
        match self {
            Self::Cpu => "f32",
            Self::Cuda => "bf16",
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }

    /// Where model state (weights, KV, recurrent state, scratch) lives.
    const fn model_memory(self) -> Memory {
        match self {
            Self::Cpu => Memory::Host,
            Self::Cuda => Memory::Device,
        }
    }
}

/// KV cache element precision, when it differs from the backend's default.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvDtype {
    F32,
    Bf16,
}

impl KvDtype {
    pub const fn bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 => 2,
        }
    }
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
        }
    }
}

/// Caller-owned PCM sample format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PcmFormat {
    F32,
    I16,
}

impl PcmFormat {
    pub const fn bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::I16 => 2,
        }
    }
}

/// How a reply's PCM is held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum ReplyMode {
    /// Chunks leave as they are made; no whole-reply buffer.
    Streamed,
    /// The whole reply is held; a redraw keeps a second buffer of the same size.
    Whole { redraw_buffer: bool },
}

/// A memory budget side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Memory {
    Device,
    Host,
}

impl Memory {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Device => "device",
            Self::Host => "host",
        }
    }
}

/// Where a budget figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetSource {
    /// `--device-gib` / `--host-gib`.
    Flag,
    /// Total device memory / host `MemAvailable` at start-up.
    Detected,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryBudget {
    pub bytes: Bytes,
    pub source: BudgetSource,
}

impl MemoryBudget {
    /// A flag (`--device-gib`, `--host-gib`) overrides what was detected; `None` when neither.
    pub fn choose(flag: Option<Bytes>, detected: Option<Bytes>) -> Option<Self> {
        match (flag, detected) {
            (Some(bytes), _) => Some(Self {
                bytes,
                source: BudgetSource::Flag,
            }),
            (None, Some(bytes)) => Some(Self {
                bytes,
                source: BudgetSource::Detected,
            }),
            (None, None) => None,
        }
    }
}

/// What to plan for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanRequest {
    pub backend: Backend,
    /// C; `None` is the model maximum.
    pub context: Option<Window>,
    /// `--parallel`.
    pub lanes: Lanes,
    /// P of the request to check; `None` plans for the smallest prompt (2 rows).
    pub prompt_rows: Option<PromptRows>,
    pub frames: FrameCap,
    /// Guidance on: the unconditional branch keeps its own backbone state.
    pub cfg: bool,
    pub reply: ReplyMode,
    pub pcm: PcmFormat,
    /// KV pool size; `None` is lanes x C (every lane can fill its window at once).
    pub pool_rows: Option<Rows>,
    /// Rows per prefill chunk (sizes the activation scratch and staging).
    pub prefill_chunk_rows: Rows,
    /// `--prompt-cache-gib`: reference prefill cache.
    pub prompt_cache: Bytes,
    /// `None`: unknown (fit on that side is not checked, and the verdict says so).
    pub device_budget: Option<MemoryBudget>,
    pub host_budget: Option<MemoryBudget>,
    pub limits: Limits,
    /// KV element precision; `None` is the backend's default ([`Backend::kv_element_bytes`]).
    pub kv: Option<KvDtype>,
}

/// Default prefill chunk.
pub const DEFAULT_PREFILL_CHUNK_ROWS: Rows = Rows(512);

impl PlanRequest {
    pub fn new(backend: Backend) -> Self {
        Self {
            backend,
            context: None,
            lanes: Lanes(1),
            prompt_rows: None,
            frames: FrameCap::Default,
            cfg: false,
            reply: ReplyMode::Whole {
                redraw_buffer: false,
            },
            pcm: PcmFormat::F32,
            pool_rows: None,
            prefill_chunk_rows: DEFAULT_PREFILL_CHUNK_ROWS,
            prompt_cache: Bytes(0),
            device_budget: None,
            host_budget: None,
            limits: Limits::default(),
            kv: None,
        }
    }
}

impl Default for PlanRequest {
    fn default() -> Self {
        Self::new(Backend::Cuda)
    }
}

/// One accounted class of memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ByteClass {
    /// Stable snake_case key.
    pub class: &'static str,
    pub memory: Memory,
    pub bytes: Bytes,
    pub gib: String,
    /// How the figure was computed, in units.
    pub arithmetic: String,
}

/// Attention state per row of window (the KV pool's unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StatePerRow {
    pub kv_dtype: &'static str,
    pub backbone_kv: Bytes,
    /// The unconditional CFG branch's backbone KV (0 without guidance).
    pub backbone_kv_cfg: Bytes,
    pub tower_kv: Bytes,
    pub total: Bytes,
    /// `total` x C: one request that fills the window.
    pub full_window: Bytes,
}

/// Fixed state per lane.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct StatePerLane {
    pub gdn_recurrent: Bytes,
    pub gdn_conv: Bytes,
    /// Recurrent + conv of the unconditional branch (0 without guidance).
    pub gdn_cfg: Bytes,
    pub scratch: Bytes,
    pub codec_state: Bytes,
    pub codec_workspace: Bytes,
    /// Each of pinned host and device staging (0 on CPU).
    pub staging: Bytes,
}

/// Every budget, each in its unit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Budgets {
    pub max_position_embeddings: Window,
    pub window: Window,
    pub lanes: Lanes,
    pub pool_rows: Option<Rows>,
    pub prompt_rows_max: Option<PromptRows>,
    pub frames_default: Frames,
    pub frames_max: Option<Frames>,
    pub requested_prompt_rows: PromptRows,
    pub requested_frames: FrameCap,
    /// The admitted request, when the window contract admits it.
    pub admission: Option<Admission>,
    pub rows_reserved: Option<Rows>,
    pub cfg: bool,
    pub reply: ReplyMode,
    pub pcm: PcmFormat,
    pub prefill_chunk_rows: Rows,
    pub limits: Limits,
}

/// Needed vs budget on one side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemoryTotal {
    pub memory: Memory,
    pub needed: Bytes,
    pub budget: Option<MemoryBudget>,
    /// `None` when the budget is unknown.
    pub fits: Option<bool>,
}

/// A plan that does not fit: which side, which class tipped it over, and what would fit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DoesNotFit {
    pub memory: Memory,
    /// The first class (in plan order) at which the running total passes the budget.
    pub class: &'static str,
    pub needed: Bytes,
    pub budget: Bytes,
    /// The largest C that fits with the requested lanes (`None`: none does).
    pub largest_context: Option<Window>,
    /// The largest lane count that fits at the requested C (`None`: none does).
    pub largest_lanes: Option<Lanes>,
}

impl fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} memory needs {} ({} GiB) but the budget is {} ({} GiB); it overflows at class {}; ",
            self.memory.as_str(),
            self.needed,
            self.needed.gib_string(),
            self.budget,
            self.budget.gib_string(),
            self.class
        )?;
        match self.largest_context {
            Some(c) => write!(f, "largest fitting context: {c}; ")?,
            None => write!(f, "no context fits at this lane count; ")?,
        }
        match self.largest_lanes {
            Some(l) => write!(f, "largest fitting lane count at this context: {l}"),
            None => write!(f, "no lane count fits at this context"),
        }
    }
}

/// Why a plan was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Limit(#[from] LimitError),
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    #[error("--parallel is 0 lanes; at least 1 lane is required")]
    NoLanes,
    #[error("a prefill chunk of 0 KV rows was requested; at least 1 row is required")]
    NoPrefillChunk,
    #[error("the KV pool of {pool} cannot hold one request that fills the window of {window}")]
    PoolSmallerThanWindow { pool: Rows, window: Window },
    #[error("{0}")]
    DoesNotFit(DoesNotFit),
}

impl PlanError {
    pub const fn code(&self) -> &'static str {
        match self {
            Self::Limit(e) => e.code(),
            Self::Geometry(_) => "invalid_geometry",
            Self::NoLanes => "lanes_zero",
            Self::NoPrefillChunk => "prefill_chunk_zero",
            Self::PoolSmallerThanWindow { .. } => "pool_smaller_than_window",
            Self::DoesNotFit(d) => match d.memory {
                Memory::Device => "device_memory_exceeded",
                Memory::Host => "host_memory_exceeded",
            },
        }
    }
}

/// The plan's conclusion.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "verdict")]
pub enum Verdict {
    /// Fits every known budget. `unchecked_budgets` lists sides whose budget was unknown.
    Admitted { unchecked_budgets: Vec<Memory> },
    Refused {
        code: &'static str,
        message: String,
        does_not_fit: Option<DoesNotFit>,
    },
}

impl Verdict {
    fn refused(e: &PlanError) -> Self {
        Self::Refused {
            code: e.code(),
            message: e.to_string(),
            does_not_fit: match e {
                PlanError::DoesNotFit(d) => Some(*d),
                _ => None,
            },
        }
    }
}

/// Everything `dramatis plan` shows, and what start-up and admission consult.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Plan {
    pub geometry: String,
    pub backend: Backend,
    pub expert_format: &'static str,
    pub budgets: Budgets,
    pub state_per_row: Option<StatePerRow>,
    pub state_per_lane: Option<StatePerLane>,
    pub classes: Vec<ByteClass>,
    pub totals: Vec<MemoryTotal>,
    pub verdict: Verdict,
}

/// The name the CLI and server use for the plan's result.
pub type PlanReport = Plan;

impl Plan {
    pub fn is_admitted(&self) -> bool {
        matches!(self.verdict, Verdict::Admitted { .. })
    }

    /// The refusal code, if refused.
    pub fn refusal_code(&self) -> Option<&'static str> {
        match &self.verdict {
            Verdict::Refused { code, .. } => Some(code),
            Verdict::Admitted { .. } => None,
        }
    }

    pub fn class(&self, key: &str) -> Option<&ByteClass> {
        self.classes.iter().find(|c| c.class == key)
    }

    pub fn total(&self, memory: Memory) -> Option<&MemoryTotal> {
        self.totals.iter().find(|t| t.memory == memory)
    }

    /// The device classes beyond the weights (`weights_*`): the KV pool, per-lane state,
    /// scratch, codec state, staging and caches, which a backend reserves at start-up once the
    /// weights are resident.
    pub fn device_state_bytes(&self) -> Bytes {
        Bytes(
            self.classes
                .iter()
                .filter(|c| c.memory == Memory::Device && !c.class.starts_with("weights_"))
                .map(|c| c.bytes.0)
                .fold(0u64, u64::saturating_add),
        )
    }
}

/// Everything derived from (geometry, request) at one C and lane count.
struct Sized {
    pool_rows: Rows,
    per_row: StatePerRow,
    per_lane: StatePerLane,
    classes: Vec<ByteClass>,
}

struct ClassList {
    backend: Backend,
    classes: Vec<ByteClass>,
}

impl ClassList {
    fn push(&mut self, class: &'static str, memory: Memory, bytes: u64, arithmetic: String) {
        // CPU keeps everything in host memory.
        let memory = match self.backend {
            Backend::Cpu => Memory::Host,
            Backend::Cuda => memory,
        };
        self.classes.push(ByteClass {
            class,
            memory,
            bytes: Bytes(bytes),
            gib: Bytes(bytes).gib_string(),
            arithmetic,
        });
    }
}

fn size(
    geom: &ModelGeometry,
    req: &PlanRequest,
    window: Window,
    lanes: Lanes,
    admission: &Admission,
) -> Result<Sized, PlanError> {
    const P: &str = "memory plan";
    let backend = req.backend;
    let model = backend.model_memory();
    let n = lanes.0;

    let pool_rows = match req.pool_rows {
        Some(rows) => rows,
        None => Rows(mul(n, window.0, "KV pool rows (lanes x C)")?),
    };
    if pool_rows.0 < window.0 {
        return Err(PlanError::PoolSmallerThanWindow {
            pool: pool_rows,
            window,
        });
    }

    let kv_el = req
        .kv
        .map(KvDtype::bytes)
        .unwrap_or(backend.kv_element_bytes());
    let kv_name = req.kv.map(KvDtype::as_str).unwrap_or(backend.kv_dtype());
    let backbone_row = geom.backbone_kv_bytes_per_row(kv_el)?;
    let backbone_cfg_row = if req.cfg { backbone_row } else { 0 };
    let tower_row = geom.tower_kv_bytes_per_row(kv_el)?;
    let row_total = sum(&[backbone_row, backbone_cfg_row, tower_row], P)?;
    let per_row = StatePerRow {
        kv_dtype: kv_name,
        backbone_kv: Bytes(backbone_row),
        backbone_kv_cfg: Bytes(backbone_cfg_row),
        tower_kv: Bytes(tower_row),
        total: Bytes(row_total),
        full_window: Bytes(mul(row_total, window.0, "KV bytes for a full window")?),
    };

    let recurrent = geom.gdn_recurrent_bytes()?;
    let conv = geom.gdn_conv_bytes()?;
    let gdn_cfg = if req.cfg { geom.gdn_state_bytes()? } else { 0 };
    let chunk = req.prefill_chunk_rows.0;
    let score_heads = geom.num_attention_heads.max(geom.tower_heads);
    let scratch = sum(
        &[
            product(
                &[chunk, geom.scratch_elements_per_row()?, 4],
                "prefill scratch",
            )?,
            product(&[score_heads, window.0, 4], "attention score scratch")?,
        ],
        P,
    )?;
    let frame_len = geom.codec.frame_length;
    let nc = geom.num_codebooks;
    let staging = match backend {
        Backend::Cpu => 0,
        Backend::Cuda => sum(
            &[
                product(&[chunk, nc.saturating_add(1), 4], "staging")?,
                product(&[2, frame_len, 4], "staging")?,
            ],
            P,
        )?,
    };
    let per_lane = StatePerLane {
        gdn_recurrent: Bytes(recurrent),
        gdn_conv: Bytes(conv),
        gdn_cfg: Bytes(gdn_cfg),
        scratch: Bytes(scratch),
        codec_state: Bytes(geom.codec.state_bytes_per_lane),
        codec_workspace: Bytes(geom.codec.workspace_bytes_per_lane),
        staging: Bytes(staging),
    };

    let w = geom.weight_bytes()?;
    let mut list = ClassList {
        backend,
        classes: Vec::new(),
    };
    let fmt_name = geom.expert_format.name();

    // Weights first: they overflow before anything else is worth naming.
    list.push(
        "weights_backbone_bf16",
        model,
        w.backbone_dense_bf16,
        format!("{} layers, dense BF16", geom.layer_types.len()),
    );
    list.push(
        "weights_embeddings_bf16",
        model,
        w.embeddings_bf16,
        format!(
            "vocab {} x hidden {} x {} table(s), BF16",
            geom.vocab_size,
            geom.hidden_size,
            if geom.tie_word_embeddings { 1 } else { 2 }
        ),
    );
    list.push(
        "weights_tower_bf16",
        model,
        w.tower_bf16,
        format!(
            "{} tower layers + {} heads + codebook tables, BF16",
            geom.tower_layers,
            nc.saturating_sub(1)
        ),
    );
    list.push(
        match fmt_name {
            "fp8" => "weights_experts_fp8",
            "nvfp4" => "weights_experts_nvfp4",
            _ => "weights_experts_bf16",
        },
        model,
        w.experts,
        format!("routed experts, stored {fmt_name}"),
    );
    if w.expert_scales > 0 {
        list.push(
            "weights_expert_scales",
            model,
            w.expert_scales,
            match fmt_name {
                "nvfp4" => "E4M3 per 16 values + F32 per matrix".to_string(),
                _ => "F32 per block".to_string(),
            },
        );
    }
    list.push(
        "weights_codec",
        model,
        geom.codec.weight_bytes,
        "from the codec (0: not supplied)".into(),
    );

    // The KV pool: P + F + 1 rows per request.
    let rows = pool_rows.0;
    list.push(
        "backbone_kv",
        model,
        mul(rows, backbone_row, "backbone KV pool")?,
        format!(
            "{rows} KV rows x {backbone_row} B ({} full-attention layers, {})",
            geom.full_attention_layers(),
            kv_name
        ),
    );
    if req.cfg {
        list.push(
            "backbone_kv_cfg",
            model,
            mul(rows, backbone_cfg_row, "CFG backbone KV pool")?,
            format!("{rows} KV rows x {backbone_cfg_row} B (unconditional branch)"),
        );
    }
    list.push(
        "tower_kv",
        model,
        mul(rows, tower_row, "tower KV pool")?,
        format!(
            "{rows} KV rows x {tower_row} B ({} tower layers, {})",
            geom.tower_layers, kv_name
        ),
    );

    // Fixed state per lane.
    let per =
        |what: &'static str, bytes: u64| -> Result<u64, PlanError> { Ok(mul(n, bytes, what)?) };
    list.push(
        "gdn_recurrent",
        model,
        per("Gated DeltaNet recurrent state", recurrent)?,
        format!(
            "{n} lanes x {recurrent} B ({} linear layers, f32)",
            geom.linear_attention_layers()
        ),
    );
    list.push(
        "gdn_conv",
        model,
        per("Gated DeltaNet conv state", conv)?,
        format!("{n} lanes x {conv} B (f32)"),
    );
    if req.cfg {
        list.push(
            "gdn_cfg",
            model,
            per("CFG recurrent state", gdn_cfg)?,
            format!("{n} lanes x {gdn_cfg} B (unconditional branch)"),
        );
    }
    list.push(
        "scratch",
        model,
        per("scratch", scratch)?,
        format!("{n} lanes x {scratch} B ({chunk}-row prefill chunk + one score row over C)"),
    );
    list.push(
        "codec_state",
        model,
        per("codec state", geom.codec.state_bytes_per_lane)?,
        format!("{n} lanes x {} B", geom.codec.state_bytes_per_lane),
    );
    list.push(
        "codec_workspace",
        model,
        per("codec workspace", geom.codec.workspace_bytes_per_lane)?,
        format!("{n} lanes x {} B", geom.codec.workspace_bytes_per_lane),
    );
    if backend == Backend::Cuda {
        list.push(
            "staging_device",
            Memory::Device,
            per("device staging", staging)?,
            format!("{n} lanes x {staging} B"),
        );
    }
    list.push(
        "reference_cache",
        model,
        req.prompt_cache.0,
        "--prompt-cache-gib".into(),
    );

    // Host: what a reply holds.
    let f = admission.frames.0;
    let frames_bytes = product(&[n, f, nc, 4], "generated frames")?;
    list.push(
        "generated_frames",
        Memory::Host,
        frames_bytes,
        format!("{n} lanes x {f} frames x {nc} codes x 4 B"),
    );
    let sample = req.pcm.bytes();
    let pcm_name = match req.pcm {
        PcmFormat::F32 => "f32",
        PcmFormat::I16 => "i16",
    };
    match req.reply {
        ReplyMode::Streamed => {
            let b = product(&[n, 2, frame_len, sample], "stream buffer")?;
            list.push(
                "pcm_stream_buffer",
                Memory::Host,
                b,
                format!("{n} lanes x 2 frames x {frame_len} samples x {sample} B ({pcm_name})"),
            );
        }
        ReplyMode::Whole { redraw_buffer } => {
            let samples = admission
                .frames
                .samples(frame_len)
                .ok_or(LimitError::Overflow {
                    what: "whole-reply PCM samples",
                })?;
            let b = product(&[n, samples.0, sample], "whole-reply PCM")?;
            let arithmetic =
                format!("{n} lanes x {f} frames x {frame_len} samples x {sample} B ({pcm_name})");
            list.push("pcm_whole_reply", Memory::Host, b, arithmetic.clone());
            if redraw_buffer {
                list.push("pcm_redraw_buffer", Memory::Host, b, arithmetic);
            }
        }
    }
    if backend == Backend::Cuda {
        list.push(
            "staging_pinned_host",
            Memory::Host,
            per("pinned staging", staging)?,
            format!("{n} lanes x {staging} B"),
        );
    }

    Ok(Sized {
        pool_rows,
        per_row,
        per_lane,
        classes: list.classes,
    })
}

/// The first class (in plan order) at which a side's running total passes its budget.
struct Overflowed {
    memory: Memory,
    class: &'static str,
    needed: Bytes,
    budget: Bytes,
}

/// Totals per side, and the first overflow in plan order.
fn totals(
    req: &PlanRequest,
    classes: &[ByteClass],
) -> Result<(Vec<MemoryTotal>, Option<Overflowed>), PlanError> {
    let sides: &[Memory] = match req.backend {
        Backend::Cpu => &[Memory::Host],
        Backend::Cuda => &[Memory::Device, Memory::Host],
    };
    let mut out = Vec::new();
    let mut overflow = None;
    for &side in sides {
        let budget = match side {
            Memory::Device => req.device_budget,
            Memory::Host => req.host_budget,
        };
        let mut running = 0u64;
        let mut first_over = None;
        for c in classes.iter().filter(|c| c.memory == side) {
            running = running
                .checked_add(c.bytes.0)
                .ok_or(LimitError::Overflow { what: "plan total" })?;
            if let Some(b) = budget {
                if first_over.is_none() && running > b.bytes.0 {
                    first_over = Some(c.class);
                }
            }
        }
        let fits = budget.map(|b| running <= b.bytes.0);
        if let (Some(class), Some(b), None) = (first_over, budget, &overflow) {
            overflow = Some(Overflowed {
                memory: side,
                class,
                needed: Bytes(running),
                budget: b.bytes,
            });
        }
        out.push(MemoryTotal {
            memory: side,
            needed: Bytes(running),
            budget,
            fits,
        });
    }
    Ok((out, overflow))
}

/// Whether the request's P and cap fit at (C, lanes) on every known budget.
fn fits_at(geom: &ModelGeometry, req: &PlanRequest, window: Window, lanes: Lanes) -> bool {
    let Ok(contract) = WindowContract::new(
        window,
        Window(geom.max_position_embeddings),
        req.limits.default_frame_cap,
    ) else {
        return false;
    };
    let p = req.prompt_rows.unwrap_or(PromptRows::MIN);
    let Ok(admission) = contract.admit(p, req.frames) else {
        return false;
    };
    let Ok(sized) = size(geom, req, window, lanes, &admission) else {
        return false;
    };
    matches!(totals(req, &sized.classes), Ok((_, None)))
}

/// The largest x in [lo, hi] with `ok(x)`, given `ok` is true then false over the range.
fn last_true(lo: u64, hi: u64, ok: impl Fn(u64) -> bool) -> Option<u64> {
    if lo > hi || !ok(lo) {
        return None;
    }
    if ok(hi) {
        return Some(hi);
    }
    let (mut good, mut bad) = (lo, hi);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if ok(mid) {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Some(good)
}

fn largest_fitting(
    geom: &ModelGeometry,
    req: &PlanRequest,
    window: Window,
    lanes: Lanes,
) -> (Option<Window>, Option<Lanes>) {
    // Below P + F + 1 the contract refuses; above it, memory only grows with C.
    let p = req.prompt_rows.unwrap_or(PromptRows::MIN).0;
    let f_min = match req.frames {
        FrameCap::Explicit(f) => f.0,
        FrameCap::Default => 1,
    };
    let lo = p
        .checked_add(f_min)
        .and_then(|x| x.checked_add(1))
        .map_or(u64::MAX, |x| x.max(MIN_WINDOW.0));
    let context = last_true(lo, window.0.saturating_sub(1), |c| {
        fits_at(geom, req, Window(c), lanes)
    })
    .map(Window);
    let lanes = last_true(1, lanes.0.saturating_sub(1), |n| {
        fits_at(geom, req, window, Lanes(n))
    })
    .map(Lanes);
    (context, lanes)
}

/// The single entry point: budgets, byte classes, totals and the verdict.
pub fn plan(geom: &ModelGeometry, req: &PlanRequest) -> Plan {
    let max = Window(geom.max_position_embeddings);
    let window = req.context.unwrap_or(max);
    let requested_p = req.prompt_rows.unwrap_or(PromptRows::MIN);
    let mut out = Plan {
        geometry: geom.name.clone(),
        backend: req.backend,
        expert_format: geom.expert_format.name(),
        budgets: Budgets {
            max_position_embeddings: max,
            window,
            lanes: req.lanes,
            pool_rows: None,
            prompt_rows_max: None,
            frames_default: req.limits.default_frame_cap,
            frames_max: None,
            requested_prompt_rows: requested_p,
            requested_frames: req.frames,
            admission: None,
            rows_reserved: None,
            cfg: req.cfg,
            reply: req.reply,
            pcm: req.pcm,
            prefill_chunk_rows: req.prefill_chunk_rows,
            limits: req.limits,
        },
        state_per_row: None,
        state_per_lane: None,
        classes: Vec::new(),
        totals: Vec::new(),
        verdict: Verdict::Admitted {
            unchecked_budgets: Vec::new(),
        },
    };
    if let Err(e) = fill(geom, req, &mut out) {
        out.verdict = Verdict::refused(&e);
    }
    out
}

fn fill(geom: &ModelGeometry, req: &PlanRequest, out: &mut Plan) -> Result<(), PlanError> {
    geom.validate()?;
    if req.lanes.0 == 0 {
        return Err(PlanError::NoLanes);
    }
    if req.prefill_chunk_rows.0 == 0 {
        return Err(PlanError::NoPrefillChunk);
    }
    let window = out.budgets.window;
    let contract = WindowContract::new(
        window,
        out.budgets.max_position_embeddings,
        req.limits.default_frame_cap,
    )?;
    out.budgets.prompt_rows_max = Some(contract.prompt_rows_max());
    out.budgets.frames_max = Some(contract.frames_max());
    let admission = contract.admit(out.budgets.requested_prompt_rows, req.frames)?;
    out.budgets.admission = Some(admission);
    out.budgets.rows_reserved = Some(admission.rows());

    let sized = size(geom, req, window, req.lanes, &admission)?;
    out.budgets.pool_rows = Some(sized.pool_rows);
    out.state_per_row = Some(sized.per_row);
    out.state_per_lane = Some(sized.per_lane);
    out.classes = sized.classes;
    let (totals, overflow) = totals(req, &out.classes)?;
    out.totals = totals;
    if let Some(o) = overflow {
        let (largest_context, largest_lanes) = largest_fitting(geom, req, window, req.lanes);
        return Err(PlanError::DoesNotFit(DoesNotFit {
            memory: o.memory,
            class: o.class,
            needed: o.needed,
            budget: o.budget,
            largest_context,
            largest_lanes,
        }));
    }
    out.verdict = Verdict::Admitted {
        unchecked_budgets: out
            .totals
            .iter()
            .filter(|t| t.budget.is_none())
            .map(|t| t.memory)
            .collect(),
    };
    Ok(())
}

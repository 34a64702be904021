//! checkpoint: reads Drama 3 checkpoints exactly as they are stored (config, sharded
//! safetensors, codec.pth, tokenizer) and checks them against the manifest the config implies.
//! It does no model math beyond dtype conversion; the model crates own the forward pass.

pub mod config;
pub mod dtype;
pub mod fixture;
pub mod geometry;
pub mod inspect;
pub mod manifest;
pub mod pth;
pub mod pth_write;
pub mod rng;
pub mod store;

use std::path::{Path, PathBuf};

pub use config::{Config, LayerType, VqFeaturePlacement};
pub use dtype::DType;
pub use manifest::{ExpertFormat, ManifestReport};
pub use store::{Store, TensorInfo, TensorView};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config.json field `{field}`: {why}")]
    Config { field: String, why: String },
    #[error("{path}: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("tensor {0:?} is not in the checkpoint")]
    MissingTensor(String),
    #[error("{0}")]
    Manifest(String),
    #[error("expert metadata: {0}")]
    ExpertMetadata(String),
    #[error("tensor {name:?}: scale at element {index} is {value}, expected a finite non-negative number")]
    BadScale {
        name: String,
        index: usize,
        value: f32,
    },
}

impl CheckpointError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// An opened, verified checkpoint folder.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Config,
    pub store: Store,
    pub expert_format: ExpertFormat,
    pub report: ManifestReport,
}

impl Checkpoint {
    /// Opens and verifies: config, headers, manifest, scales. Nothing is allocated for weights.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let ck = Self::open_unverified(dir)?;
        if !ck.report.ok() {
            return Err(CheckpointError::Manifest(ck.report.describe()));
        }
        let expected = manifest::expected_tensors(&ck.config, &ck.expert_format)?;
        manifest::check_scales(&expected, &ck.store)?;
        Ok(ck)
    }

    /// Opens and computes the manifest verdict without refusing (for `inspect`).
    pub fn open_unverified(dir: &Path) -> Result<Self, CheckpointError> {
        let config = Config::from_file(&dir.join("config.json"))?;
        let store = Store::open(dir)?;
        let expert_format = manifest::detect_expert_format(&config, &store)?;
        let expected = manifest::expected_tensors(&config, &expert_format)?;
        let report = manifest::check(&expected, &store);
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            store,
            expert_format,
            report,
        })
    }

    /// A tensor by canonical manifest name (alternative spellings resolved).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let stored = self
            .report
            .resolved
            .get(name)
            .map(String::as_str)
            .unwrap_or(name);
        self.store.get(stored)
    }

    pub fn codec_path(&self) -> PathBuf {
        self.dir.join("codec.pth")
    }

    pub fn tokenizer_path(&self) -> PathBuf {
        self.dir.join("tokenizer.json")
    }
}

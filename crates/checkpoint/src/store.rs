//! Sharded safetensors, memory-mapped, with zero-copy tensor views.
//!
//! Headers are parsed here rather than by the `safetensors` crate because it silently keeps the
//! last of duplicate names; every offset is checked against the file before a view exists.

use memmap2::Mmap;
use serde::de::{MapAccess, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::{decode_to_f32, DType};
use crate::CheckpointError;

/// Largest header we accept (the format's own reference limit is 100 MB).
const MAX_HEADER: u64 = 100 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Shard index into `Store::shards`.
    pub shard: usize,
    /// Absolute byte range within the shard file.
    pub start: usize,
    pub end: usize,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> usize {
        self.end - self.start
    }
}

pub struct Shard {
    pub path: PathBuf,
    pub map: Mmap,
}

/// All tensors of a checkpoint folder, by name.
pub struct Store {
    pub shards: Vec<Arc<Shard>>,
    pub tensors: BTreeMap<String, TensorInfo>,
    /// The index's `metadata` map (kept for the NVFP4 expert keep-mask and provenance).
    pub metadata: BTreeMap<String, serde_json::Value>,
}

/// A zero-copy view of one stored tensor.
#[derive(Clone, Copy)]
pub struct TensorView<'a> {
    pub info: &'a TensorInfo,
    pub bytes: &'a [u8],
}

impl<'a> TensorView<'a> {
    pub fn dtype(&self) -> DType {
        self.info.dtype
    }
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }
    pub fn name(&self) -> &'a str {
        &self.info.name
    }
    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = Vec::with_capacity(self.info.numel());
        decode_to_f32(self.info.dtype, self.bytes, &mut v);
        v
    }
    pub fn to_f64(&self) -> Vec<f64> {
        match self.info.dtype {
            DType::F64 => self
                .bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
            _ => self.to_f32().into_iter().map(f64::from).collect(),
        }
    }
    pub fn to_i64(&self) -> Vec<i64> {
        match self.info.dtype {
            DType::I64 => self
                .bytes
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
            _ => self.to_f32().into_iter().map(|x| x as i64).collect(),
        }
    }
}

#[derive(Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<u64>,
    data_offsets: [u64; 2],
}

/// A JSON object that refuses duplicate keys.
struct NoDupMap<V>(Vec<(String, V)>);

impl<'de, V: Deserialize<'de>> Deserialize<'de> for NoDupMap<V> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V2<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for V2<V> {
            type Value = NoDupMap<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
                let mut seen = std::collections::HashSet::new();
                let mut out = Vec::new();
                while let Some(k) = m.next_key::<String>()? {
                    if !seen.insert(k.clone()) {
                        return Err(serde::de::Error::custom(format!(
                            "duplicate tensor name {k:?}"
                        )));
                    }
                    let v = m.next_value::<V>()?;
                    out.push((k, v));
                }
                Ok(NoDupMap(out))
            }
        }
        d.deserialize_map(V2(std::marker::PhantomData))
    }
}

/// Parses one shard's header; returns its tensors with absolute offsets, checked against the file.
fn parse_header(
    path: &Path,
    map: &[u8],
    shard: usize,
) -> Result<(Vec<TensorInfo>, BTreeMap<String, String>), CheckpointError> {
    let file_len = map.len() as u64;
    let corrupt = |why: String| CheckpointError::Corrupt {
        path: path.to_path_buf(),
        why,
    };
    if file_len < 8 {
        return Err(corrupt(format!(
            "file is {file_len} bytes, shorter than the 8-byte header length"
        )));
    }
    let hlen = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
    if hlen > MAX_HEADER {
        return Err(corrupt(format!(
            "header length {hlen} bytes exceeds the limit of {MAX_HEADER} bytes"
        )));
    }
    let data_start = 8u64
        .checked_add(hlen)
        .ok_or_else(|| corrupt("header length overflows".into()))?;
    if data_start > file_len {
        return Err(corrupt(format!(
            "header length {hlen} bytes runs past the end of the {file_len}-byte file"
        )));
    }
    let hbytes = &map[8..data_start as usize];
    let raw: NoDupMap<serde_json::Value> = serde_json::from_slice(hbytes).map_err(|e| {
        corrupt(format!(
            "header is not a valid safetensors JSON object: {e}"
        ))
    })?;
    let data_len = file_len - data_start;
    let mut out = Vec::new();
    let mut meta = BTreeMap::new();
    for (name, v) in raw.0 {
        if name == "__metadata__" {
            if let Some(o) = v.as_object() {
                for (k, v) in o {
                    meta.insert(k.clone(), v.as_str().unwrap_or_default().to_string());
                }
            }
            continue;
        }
        let e: RawEntry = serde_json::from_value(v)
            .map_err(|e| corrupt(format!("tensor {name:?}: bad header entry: {e}")))?;
        let dtype = DType::parse(&e.dtype)
            .ok_or_else(|| corrupt(format!("tensor {name:?}: unsupported dtype {:?}", e.dtype)))?;
        let [b, en] = e.data_offsets;
        if b > en || en > data_len {
            return Err(corrupt(format!(
                "tensor {name:?}: data offsets [{b}, {en}) fall outside the {data_len}-byte data section (file truncated or offsets wrong)"
            )));
        }
        let mut numel: u64 = 1;
        for &d in &e.shape {
            numel = numel.checked_mul(d).ok_or_else(|| {
                corrupt(format!("tensor {name:?}: shape {:?} overflows", e.shape))
            })?;
        }
        let want = numel
            .checked_mul(dtype.size() as u64)
            .ok_or_else(|| corrupt(format!("tensor {name:?}: byte size overflows")))?;
        if en - b != want {
            return Err(corrupt(format!(
                "tensor {name:?}: {} bytes stored but dtype {dtype} and shape {:?} need {want}",
                en - b,
                e.shape
            )));
        }
        let shape = e
            .shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| corrupt(format!("tensor {name:?}: dimension exceeds usize")))?;
        let start =
            usize::try_from(data_start + b).map_err(|_| corrupt("offset exceeds usize".into()))?;
        let end =
            usize::try_from(data_start + en).map_err(|_| corrupt("offset exceeds usize".into()))?;
        out.push(TensorInfo {
            name,
            dtype,
            shape,
            shard,
            start,
            end,
        });
    }
    Ok((out, meta))
}

#[derive(Deserialize)]
struct IndexFile {
    #[serde(default)]
    metadata: BTreeMap<String, serde_json::Value>,
    weight_map: NoDupMap<String>,
}

impl Store {
    /// Opens `model.safetensors.index.json` (or a single `model.safetensors`) under `dir`.
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let index_path = dir.join("model.safetensors.index.json");
        let (files, weight_map, metadata) = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)
                .map_err(|e| CheckpointError::io(&index_path, e))?;
            let idx: IndexFile =
                serde_json::from_str(&text).map_err(|e| CheckpointError::Corrupt {
                    path: index_path.clone(),
                    why: format!("not a valid index: {e}"),
                })?;
            let mut files: Vec<String> = idx.weight_map.0.iter().map(|(_, f)| f.clone()).collect();
            files.sort();
            files.dedup();
            let wm: BTreeMap<String, String> = idx.weight_map.0.into_iter().collect();
            (files, Some(wm), idx.metadata)
        } else {
            (vec!["model.safetensors".to_string()], None, BTreeMap::new())
        };
        let mut shards = Vec::new();
        let mut tensors = BTreeMap::new();
        for (si, f) in files.iter().enumerate() {
            if f.contains("..") || f.contains('/') || f.contains('\\') {
                return Err(CheckpointError::Corrupt {
                    path: index_path.clone(),
                    why: format!("shard file name {f:?} must be a plain file name"),
                });
            }
            let path = dir.join(f);
            let file = File::open(&path).map_err(|e| CheckpointError::io(&path, e))?;
            // SAFETY: the shard is opened read-only; checkpoints are not modified while served.
            let map = unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(&path, e))?;
            let (infos, _meta) = parse_header(&path, &map, si)?;
            for info in infos {
                if let Some(wm) = &weight_map {
                    match wm.get(&info.name) {
                        Some(owner) if owner == f => {}
                        Some(owner) => {
                            return Err(CheckpointError::Corrupt {
                                path: path.clone(),
                                why: format!(
                                    "tensor {:?} is stored here but the index places it in {owner}",
                                    info.name
                                ),
                            })
                        }
                        None => {
                            return Err(CheckpointError::Corrupt {
                                path: path.clone(),
                                why: format!("tensor {:?} is not listed in the index", info.name),
                            })
                        }
                    }
                }
                if tensors.contains_key(&info.name) {
                    return Err(CheckpointError::Corrupt {
                        path: path.clone(),
                        why: format!("duplicate tensor name {:?} across shards", info.name),
                    });
                }
                tensors.insert(info.name.clone(), info);
            }
            shards.push(Arc::new(Shard { path, map }));
        }
        if let Some(wm) = &weight_map {
            for (name, f) in wm {
                if !tensors.contains_key(name) {
                    return Err(CheckpointError::Corrupt {
                        path: dir.join(f),
                        why: format!(
                            "the index lists tensor {name:?} but the shard does not hold it"
                        ),
                    });
                }
            }
        }
        Ok(Store {
            shards,
            tensors,
            metadata,
        })
    }

    /// Opens one safetensors file on its own (golden files, single-file checkpoints).
    pub fn open_file(path: &Path) -> Result<Self, CheckpointError> {
        let file = File::open(path).map_err(|e| CheckpointError::io(path, e))?;
        // SAFETY: the file is opened read-only and not modified while mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(path, e))?;
        let (infos, _meta) = parse_header(path, &map, 0)?;
        let tensors = infos.into_iter().map(|i| (i.name.clone(), i)).collect();
        Ok(Store {
            shards: vec![Arc::new(Shard {
                path: path.to_path_buf(),
                map,
            })],
            tensors,
            metadata: BTreeMap::new(),
        })
    }

    pub fn get(&self, name: &str) -> Result<TensorView<'_>, CheckpointError> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| CheckpointError::MissingTensor(name.to_string()))?;
        let bytes = &self.shards[info.shard].map[info.start..info.end];
        Ok(TensorView { info, bytes })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn total_bytes(&self) -> u64 {
        self.tensors.values().map(|t| t.nbytes() as u64).sum()
    }
}

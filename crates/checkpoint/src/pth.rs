//! Reader for PyTorch `torch.save` zip archives (the codec's `codec.pth`).
//!
//! No crates.io crate reads torch pickles well without pulling a whole framework, so this is a
//! small pickle (protocol 2..4) VM that knows just what state dicts use: dicts and
//! `collections.OrderedDict`, tuples and lists, `torch._utils._rebuild_tensor_v2`,
//! `_rebuild_parameter`, and persistent ids `('storage', torch.XStorage, key, location, numel)`.
//! Storages are read from `<archive>/data/<key>` (little-endian); offset, size and strides are
//! honoured. Every size read from the file is bounds-checked: corrupt input gives a [`PthError`].
//!
//! As the fish-speech loader does, a top-level `state_dict` entry is used when present and a
//! `generator.` prefix is stripped from every name.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};

/// Most values the pickle stack may hold at once; a real state dict needs a few dozen.
const MAX_STACK: usize = 1 << 20;
/// Most dimensions a tensor may have.
const MAX_DIMS: usize = 16;

/// Errors while reading a `.pth` archive.
#[derive(Debug, thiserror::Error)]
pub enum PthError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a readable torch zip archive: {source}")]
    Zip {
        path: PathBuf,
        #[source]
        source: zip::result::ZipError,
    },
    #[error("{path}: no `*/data.pkl` entry in the archive (a legacy non-zip torch.save file?)")]
    NoDataPkl { path: PathBuf },
    #[error("{path}: archive byte order is {order:?}; only little-endian is supported")]
    ByteOrder { path: PathBuf, order: String },
    #[error("pickle: {what} at byte {pos} of {len}")]
    Pickle {
        what: String,
        pos: usize,
        len: usize,
    },
    #[error("pickle: unsupported opcode 0x{op:02x} at byte {pos}")]
    Opcode { op: u8, pos: usize },
    #[error("pickle: top level is {found}, expected a dict of tensors")]
    NotADict { found: String },
    #[error("storage {key}: unsupported storage type {ty}")]
    StorageType { key: String, ty: String },
    #[error(
        "storage {key}: entry {entry} is {have} bytes, {dtype} x {numel} elements need {need}"
    )]
    StorageShort {
        key: String,
        entry: String,
        have: usize,
        need: usize,
        dtype: &'static str,
        numel: usize,
    },
    #[error("storage {key}: entry {entry} missing from the archive")]
    StorageMissing { key: String, entry: String },
    #[error("tensor {name}: {what}")]
    BadTensor { name: String, what: String },
    #[error("tensor {name}: appears twice (after stripping `generator.`)")]
    Duplicate { name: String },
}

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PthDtype {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U8,
    Bool,
}

impl PthDtype {
    fn from_storage(name: &str) -> Option<Self> {
        Some(match name {
            "DoubleStorage" => Self::F64,
            "FloatStorage" => Self::F32,
            "HalfStorage" => Self::F16,
            "BFloat16Storage" => Self::BF16,
            "LongStorage" => Self::I64,
            "IntStorage" => Self::I32,
            "ShortStorage" => Self::I16,
            "CharStorage" => Self::I8,
            "ByteStorage" => Self::U8,
            "BoolStorage" => Self::Bool,
            _ => return None,
        })
    }

    /// Bytes per element in the storage.
    pub fn size(self) -> usize {
        match self {
            Self::F64 | Self::I64 => 8,
            Self::F32 | Self::I32 => 4,
            Self::F16 | Self::BF16 | Self::I16 => 2,
            Self::I8 | Self::U8 | Self::Bool => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::F64 => "F64",
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::I64 => "I64",
            Self::I32 => "I32",
            Self::I16 => "I16",
            Self::I8 => "I8",
            Self::U8 => "U8",
            Self::Bool => "BOOL",
        }
    }
}

/// Values of a tensor, in row-major order of its shape. Half types are widened to f32 and
/// integer types to i64.
#[derive(Debug, Clone, PartialEq)]
pub enum PthData {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
}

/// One named tensor of a state dict.
#[derive(Debug, Clone)]
pub struct PthTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// Dtype as stored in the archive.
    pub dtype: PthDtype,
    pub data: PthData,
}

impl PthTensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        match &self.data {
            PthData::F32(v) => v.len(),
            PthData::F64(v) => v.len(),
            PthData::I64(v) => v.len(),
        }
    }

    /// Values as f64 (exact for every float dtype).
    pub fn to_f64(&self) -> Vec<f64> {
        match &self.data {
            PthData::F32(v) => v.iter().map(|&x| f64::from(x)).collect(),
            PthData::F64(v) => v.clone(),
            PthData::I64(v) => v.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Values as f32 (f64 storages are rounded).
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            PthData::F32(v) => v.clone(),
            PthData::F64(v) => v.iter().map(|&x| x as f32).collect(),
            PthData::I64(v) => v.iter().map(|&x| x as f32).collect(),
        }
    }
}

/// The tensors of a `torch.save`d state dict, in file order.
#[derive(Debug, Clone, Default)]
pub struct PthStateDict {
    tensors: Vec<PthTensor>,
    index: HashMap<String, usize>,
}

impl PthStateDict {
    pub fn get(&self, name: &str) -> Option<&PthTensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|t| t.name.as_str())
    }
    pub fn iter(&self) -> impl Iterator<Item = &PthTensor> {
        self.tensors.iter()
    }
    pub fn len(&self) -> usize {
        self.tensors.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

/// Reads every tensor of a `torch.save` zip archive.
pub fn read_pth(path: &Path) -> Result<PthStateDict, PthError> {
    let file = File::open(path).map_err(|source| PthError::Io {
        path: path.to_owned(),
        source,
    })?;
    read_pth_from(file, path)
}

/// As [`read_pth`], from any seekable reader; `path` only names the source in errors.
pub fn read_pth_from<R: Read + Seek>(reader: R, path: &Path) -> Result<PthStateDict, PthError> {
    let zip_err = |source| PthError::Zip {
        path: path.to_owned(),
        source,
    };
    let mut archive = zip::ZipArchive::new(reader).map_err(zip_err)?;
    let pkl_name = archive
        .file_names()
        .filter(|n| n.ends_with("/data.pkl") && n.matches('/').count() == 1)
        .min()
        .map(str::to_owned)
        .ok_or_else(|| PthError::NoDataPkl {
            path: path.to_owned(),
        })?;
    let prefix = pkl_name.trim_end_matches("data.pkl").to_owned();
    let byteorder_name = format!("{prefix}byteorder");
    if archive.file_names().any(|n| n == byteorder_name) {
        let order = read_entry(&mut archive, &byteorder_name).map_err(zip_err)?;
        let order = String::from_utf8_lossy(&order).trim().to_owned();
        if order != "little" {
            return Err(PthError::ByteOrder {
                path: path.to_owned(),
                order,
            });
        }
    }
    let pkl = read_entry(&mut archive, &pkl_name).map_err(zip_err)?;
    let root = Unpickler::new(&pkl).run()?;

    let entries = match root {
        Value::Dict(items) => items,
        other => {
            return Err(PthError::NotADict {
                found: other.kind(),
            })
        }
    };
    // fish-speech: `state_dict["state_dict"]` when present.
    let entries = match entries.iter().position(|(k, v)| {
        matches!(k, Value::Str(s) if s == "state_dict") && matches!(v, Value::Dict(_))
    }) {
        Some(i) => match entries.into_iter().nth(i) {
            Some((_, Value::Dict(inner))) => inner,
            _ => Vec::new(),
        },
        None => entries,
    };

    let mut storages: HashMap<String, Vec<u8>> = HashMap::new();
    let mut out = PthStateDict::default();
    for (key, value) in entries {
        let (Value::Str(name), Value::Tensor(t)) = (key, value) else {
            continue; // non-tensor entries are ignored, as a non-strict load does
        };
        let name = name.strip_prefix("generator.").unwrap_or(&name).to_owned();
        if out.index.contains_key(&name) {
            return Err(PthError::Duplicate { name });
        }
        if !storages.contains_key(&t.storage.key) {
            let entry = format!("{prefix}data/{}", t.storage.key);
            if !archive.file_names().any(|n| n == entry) {
                return Err(PthError::StorageMissing {
                    key: t.storage.key.clone(),
                    entry,
                });
            }
            let bytes = read_entry(&mut archive, &entry).map_err(zip_err)?;
            let need = t.storage.numel.saturating_mul(t.storage.dtype.size());
            if bytes.len() < need {
                return Err(PthError::StorageShort {
                    key: t.storage.key.clone(),
                    entry,
                    have: bytes.len(),
                    need,
                    dtype: t.storage.dtype.name(),
                    numel: t.storage.numel,
                });
            }
            storages.insert(t.storage.key.clone(), bytes);
        }
        let bytes = &storages[&t.storage.key];
        let tensor = materialise(&name, &t, bytes)?;
        out.index.insert(name, out.tensors.len());
        out.tensors.push(tensor);
    }
    Ok(out)
}

fn read_entry<R: Read + Seek>(
    archive: &mut zip::ZipArchive<R>,
    name: &str,
) -> Result<Vec<u8>, zip::result::ZipError> {
    let mut f = archive.by_name(name)?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    Ok(buf)
}

/// Gathers a strided view of a storage into a dense row-major tensor.
fn materialise(name: &str, t: &TensorRef, bytes: &[u8]) -> Result<PthTensor, PthError> {
    let bad = |what: String| PthError::BadTensor {
        name: name.to_owned(),
        what,
    };
    if t.shape.len() != t.stride.len() {
        return Err(bad(format!(
            "{} sizes but {} strides",
            t.shape.len(),
            t.stride.len()
        )));
    }
    let numel = t
        .shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {:?} overflows", t.shape)))?;
    if numel > 0 {
        let last = t
            .shape
            .iter()
            .zip(&t.stride)
            .try_fold(t.offset, |a, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| a.checked_add(x))
            })
            .ok_or_else(|| bad("offset/stride arithmetic overflows".into()))?;
        if last >= t.storage.numel {
            return Err(bad(format!(
                "view (offset {}, shape {:?}, stride {:?}) reaches element {last}, storage {} has {}",
                t.offset, t.shape, t.stride, t.storage.key, t.storage.numel
            )));
        }
    }
    // Element indices of the view in row-major order.
    let mut idx = Vec::with_capacity(numel);
    if numel > 0 {
        let nd = t.shape.len();
        let mut counter = vec![0usize; nd];
        let mut cur = t.offset;
        for _ in 0..numel {
            idx.push(cur);
            for d in (0..nd).rev() {
                // Wrapping: intermediate values may pass the end; every index pushed was checked.
                counter[d] += 1;
                cur = cur.wrapping_add(t.stride[d]);
                if counter[d] < t.shape[d] {
                    break;
                }
                cur = cur.wrapping_sub(t.stride[d].wrapping_mul(t.shape[d]));
                counter[d] = 0;
            }
        }
    }
    let dtype = t.storage.dtype;
    let el = |i: usize| -> &[u8] { &bytes[i * dtype.size()..(i + 1) * dtype.size()] };
    let data = match dtype {
        PthDtype::F32 => PthData::F32(
            idx.iter()
                .map(|&i| f32::from_le_bytes(el(i).try_into().unwrap_or([0; 4])))
                .collect(),
        ),
        PthDtype::F64 => PthData::F64(
            idx.iter()
                .map(|&i| f64::from_le_bytes(el(i).try_into().unwrap_or([0; 8])))
                .collect(),
        ),
        PthDtype::F16 => PthData::F32(
            idx.iter()
                .map(|&i| half::f16::from_le_bytes([el(i)[0], el(i)[1]]).to_f32())
                .collect(),
        ),
        PthDtype::BF16 => PthData::F32(
            idx.iter()
                .map(|&i| half::bf16::from_le_bytes([el(i)[0], el(i)[1]]).to_f32())
                .collect(),
        ),
        PthDtype::I64 => PthData::I64(
            idx.iter()
                .map(|&i| i64::from_le_bytes(el(i).try_into().unwrap_or([0; 8])))
                .collect(),
        ),
        PthDtype::I32 => PthData::I64(
            idx.iter()
                .map(|&i| i64::from(i32::from_le_bytes(el(i).try_into().unwrap_or([0; 4]))))
                .collect(),
        ),
        PthDtype::I16 => PthData::I64(
            idx.iter()
                .map(|&i| i64::from(i16::from_le_bytes([el(i)[0], el(i)[1]])))
                .collect(),
        ),
        PthDtype::I8 => PthData::I64(idx.iter().map(|&i| i64::from(el(i)[0] as i8)).collect()),
        PthDtype::U8 | PthDtype::Bool => {
            PthData::I64(idx.iter().map(|&i| i64::from(el(i)[0])).collect())
        }
    };
    Ok(PthTensor {
        name: name.to_owned(),
        shape: t.shape.clone(),
        dtype,
        data,
    })
}

#[derive(Debug, Clone)]
struct StorageRef {
    key: String,
    dtype: PthDtype,
    numel: usize,
}

#[derive(Debug, Clone)]
struct TensorRef {
    storage: StorageRef,
    offset: usize,
    shape: Vec<usize>,
    stride: Vec<usize>,
}

/// A pickle value, restricted to what state dicts contain.
#[derive(Debug, Clone)]
enum Value {
    None,
    /// Booleans, floats and byte strings are parsed but their values are never needed.
    Bool,
    Int(i64),
    Float,
    Str(String),
    Bytes,
    Tuple(Vec<Value>),
    List(Vec<Value>),
    Dict(Vec<(Value, Value)>),
    Global(String, String),
    Storage(StorageRef),
    Tensor(TensorRef),
    /// The result of calling something this reader does not model; fine unless used as data.
    Opaque(String),
}

impl Value {
    fn kind(&self) -> String {
        match self {
            Value::None => "None".into(),
            Value::Bool => "bool".into(),
            Value::Int(_) => "int".into(),
            Value::Float => "float".into(),
            Value::Str(_) => "str".into(),
            Value::Bytes => "bytes".into(),
            Value::Tuple(_) => "tuple".into(),
            Value::List(_) => "list".into(),
            Value::Dict(_) => "dict".into(),
            Value::Global(m, n) => format!("global {m}.{n}"),
            Value::Storage(_) => "storage".into(),
            Value::Tensor(_) => "tensor".into(),
            Value::Opaque(s) => format!("object {s}"),
        }
    }
}

struct Unpickler<'a> {
    data: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
}

impl<'a> Unpickler<'a> {
    fn new(data: &'a [u8]) -> Self {
        Self {
            data,
            pos: 0,
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
        }
    }

    fn err(&self, what: impl Into<String>) -> PthError {
        PthError::Pickle {
            what: what.into(),
            pos: self.pos,
            len: self.data.len(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PthError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or_else(|| self.err(format!("truncated: need {n} more bytes")))?;
        let s = &self.data[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, PthError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, PthError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, PthError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn len_u32(&mut self) -> Result<usize, PthError> {
        let n = self.u32()?;
        usize::try_from(n).map_err(|_| self.err("length does not fit usize"))
    }
    fn line(&mut self) -> Result<String, PthError> {
        let rest = &self.data[self.pos..];
        let nl = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.err("unterminated text line"))?;
        let s = std::str::from_utf8(&rest[..nl])
            .map_err(|_| self.err("text line is not UTF-8"))?
            .to_owned();
        self.pos += nl + 1;
        Ok(s)
    }
    fn utf8(&mut self, n: usize) -> Result<String, PthError> {
        let b = self.take(n)?;
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| self.err("string is not UTF-8"))
    }

    fn push(&mut self, v: Value) -> Result<(), PthError> {
        if self.stack.len() >= MAX_STACK {
            return Err(self.err(format!("stack deeper than {MAX_STACK}")));
        }
        self.stack.push(v);
        Ok(())
    }
    fn pop(&mut self) -> Result<Value, PthError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err("stack underflow"));
        }
        self.stack.pop().ok_or_else(|| self.err("stack underflow"))
    }
    fn top(&mut self) -> Result<&mut Value, PthError> {
        let pos = self.pos;
        let len = self.data.len();
        self.stack.last_mut().ok_or(PthError::Pickle {
            what: "empty stack".into(),
            pos,
            len,
        })
    }
    fn pop_mark(&mut self) -> Result<Vec<Value>, PthError> {
        let m = self
            .marks
            .pop()
            .ok_or_else(|| self.err("no MARK on the stack"))?;
        if m > self.stack.len() {
            return Err(self.err("MARK above the stack"));
        }
        Ok(self.stack.split_off(m))
    }
    fn memo_get(&self, i: u32) -> Result<Value, PthError> {
        self.memo
            .get(&i)
            .cloned()
            .ok_or_else(|| self.err(format!("memo entry {i} not set")))
    }
    fn memo_put(&mut self, i: u32) -> Result<(), PthError> {
        let v = self
            .stack
            .last()
            .cloned()
            .ok_or_else(|| self.err("PUT on an empty stack"))?;
        self.memo.insert(i, v);
        Ok(())
    }

    fn run(mut self) -> Result<Value, PthError> {
        loop {
            let op_pos = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(self.err(format!("pickle protocol {proto} > 5")));
                    }
                }
                0x95 => {
                    self.take(8)?; // FRAME: a length hint only
                }
                b'.' => return self.pop(), // STOP
                b'(' => self.marks.push(self.stack.len()),
                b'N' => self.push(Value::None)?,
                0x88 | 0x89 => self.push(Value::Bool)?,
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(i64::from(v)))?
                }
                b'M' => {
                    let v = self.u16()?;
                    self.push(Value::Int(i64::from(v)))?
                }
                b'J' => {
                    let b = self.take(4)?;
                    self.push(Value::Int(i64::from(i32::from_le_bytes([
                        b[0], b[1], b[2], b[3],
                    ]))))?
                }
                0x8a => {
                    // LONG1: little-endian two's complement, up to 8 bytes here.
                    let n = usize::from(self.u8()?);
                    if n > 8 {
                        return Err(self.err(format!("LONG1 of {n} bytes exceeds i64")));
                    }
                    let b = self.take(n)?;
                    let mut v: i64 = 0;
                    for (i, &byte) in b.iter().enumerate() {
                        v |= i64::from(byte) << (8 * i);
                    }
                    if n > 0 && n < 8 && b[n - 1] & 0x80 != 0 {
                        v -= 1i64 << (8 * n);
                    }
                    self.push(Value::Int(v))?
                }
                b'G' => {
                    self.take(8)?;
                    self.push(Value::Float)?
                }
                b'X' => {
                    let n = self.len_u32()?;
                    let s = self.utf8(n)?;
                    self.push(Value::Str(s))?
                }
                0x8c => {
                    let n = usize::from(self.u8()?);
                    let s = self.utf8(n)?;
                    self.push(Value::Str(s))?
                }
                b'T' | b'B' => {
                    let n = self.len_u32()?;
                    let b = self.take(n)?;
                    self.push(if op == b'T' {
                        Value::Str(String::from_utf8_lossy(b).into_owned())
                    } else {
                        Value::Bytes
                    })?
                }
                b'U' | b'C' => {
                    let n = usize::from(self.u8()?);
                    let b = self.take(n)?;
                    self.push(if op == b'U' {
                        Value::Str(String::from_utf8_lossy(b).into_owned())
                    } else {
                        Value::Bytes
                    })?
                }
                b')' => self.push(Value::Tuple(Vec::new()))?,
                b't' => {
                    let items = self.pop_mark()?;
                    self.push(Value::Tuple(items))?
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(Value::Tuple(items))?
                }
                b']' => self.push(Value::List(Vec::new()))?,
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(Value::List(items))?
                }
                b'}' => self.push(Value::Dict(Vec::new()))?,
                b'd' => {
                    let items = self.pop_mark()?;
                    let d = self.pairs(items)?;
                    self.push(Value::Dict(d))?
                }
                b'a' => {
                    let v = self.pop()?;
                    match self.top()? {
                        Value::List(l) => l.push(v),
                        _ => return Err(self.err("APPEND to a non-list")),
                    }
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    match self.top()? {
                        Value::List(l) => l.extend(items),
                        _ => return Err(self.err("APPENDS to a non-list")),
                    }
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    match self.top()? {
                        Value::Dict(d) => d.push((k, v)),
                        _ => return Err(self.err("SETITEM on a non-dict")),
                    }
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    let pairs = self.pairs(items)?;
                    match self.top()? {
                        Value::Dict(d) => d.extend(pairs),
                        _ => return Err(self.err("SETITEMS on a non-dict")),
                    }
                }
                b'q' => {
                    let i = self.u8()?;
                    self.memo_put(u32::from(i))?
                }
                b'r' => {
                    let i = self.u32()?;
                    self.memo_put(i)?
                }
                0x94 => {
                    let i = u32::try_from(self.memo.len())
                        .map_err(|_| self.err("memo larger than u32"))?;
                    self.memo_put(i)?
                }
                b'h' => {
                    let i = self.u8()?;
                    let v = self.memo_get(u32::from(i))?;
                    self.push(v)?
                }
                b'j' => {
                    let i = self.u32()?;
                    let v = self.memo_get(i)?;
                    self.push(v)?
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v)?
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    self.push(Value::Global(module, name))?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    match (module, name) {
                        (Value::Str(m), Value::Str(n)) => self.push(Value::Global(m, n))?,
                        _ => return Err(self.err("STACK_GLOBAL needs two strings")),
                    }
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent(pid)?;
                    self.push(v)?
                }
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let v = self.call(callable, args)?;
                    self.push(v)?
                }
                b'b' => {
                    // BUILD: state on dicts/tensors (e.g. `_metadata`) is not needed.
                    self.pop()?;
                    self.top()?;
                }
                0x8f => self.push(Value::List(Vec::new()))?, // EMPTY_SET, kept as a list
                0x90 => {
                    let items = self.pop_mark()?;
                    match self.top()? {
                        Value::List(l) => l.extend(items),
                        _ => return Err(self.err("ADDITEMS to a non-set")),
                    }
                }
                _ => return Err(PthError::Opcode { op, pos: op_pos }),
            }
        }
    }

    fn pairs(&self, items: Vec<Value>) -> Result<Vec<(Value, Value)>, PthError> {
        if items.len() & 1 == 1 {
            return Err(self.err(format!("odd number ({}) of dict items", items.len())));
        }
        let mut out = Vec::with_capacity(items.len() / 2);
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            out.push((k, v));
        }
        Ok(out)
    }

    fn persistent(&self, pid: Value) -> Result<Value, PthError> {
        let Value::Tuple(items) = pid else {
            return Err(self.err(format!("persistent id is a {}", pid.kind())));
        };
        match items.as_slice() {
            [Value::Str(tag), Value::Global(_, ty), key, _location, Value::Int(numel), ..]
                if tag == "storage" =>
            {
                let key = match key {
                    Value::Str(s) => s.clone(),
                    Value::Int(i) => i.to_string(),
                    other => return Err(self.err(format!("storage key is a {}", other.kind()))),
                };
                let dtype = PthDtype::from_storage(ty).ok_or_else(|| PthError::StorageType {
                    key: key.clone(),
                    ty: ty.clone(),
                })?;
                let numel = usize::try_from(*numel)
                    .map_err(|_| self.err(format!("storage {key} has numel {numel}")))?;
                Ok(Value::Storage(StorageRef { key, dtype, numel }))
            }
            _ => Err(self.err("persistent id is not ('storage', type, key, location, numel)")),
        }
    }

    fn call(&self, callable: Value, args: Value) -> Result<Value, PthError> {
        let Value::Global(module, name) = &callable else {
            return Ok(Value::Opaque(format!("call of {}", callable.kind())));
        };
        let Value::Tuple(args) = args else {
            return Err(self.err(format!("{module}.{name} called with a {}", args.kind())));
        };
        match (module.as_str(), name.as_str()) {
            ("collections", "OrderedDict") => {
                let mut d = Vec::new();
                if let Some(Value::List(items)) = args.into_iter().next() {
                    for it in items {
                        if let Value::Tuple(kv) = it {
                            let [k, v] = <[Value; 2]>::try_from(kv).map_err(|_| {
                                self.err("OrderedDict item is not a (key, value) pair")
                            })?;
                            d.push((k, v));
                        }
                    }
                }
                Ok(Value::Dict(d))
            }
            ("torch._utils", "_rebuild_tensor_v2") | ("torch._utils", "_rebuild_tensor") => {
                let mut it = args.into_iter();
                let storage = match it.next() {
                    Some(Value::Storage(s)) => s,
                    other => {
                        return Err(self.err(format!(
                            "{name}: first argument is {}, not a storage",
                            other.map_or("nothing".into(), |v| v.kind())
                        )))
                    }
                };
                let offset = match it.next() {
                    Some(Value::Int(o)) if o >= 0 => usize::try_from(o)
                        .map_err(|_| self.err(format!("storage offset {o} too large")))?,
                    _ => return Err(self.err(format!("{name}: bad storage offset"))),
                };
                let shape = self.usize_tuple(it.next(), "size")?;
                let stride = self.usize_tuple(it.next(), "stride")?;
                Ok(Value::Tensor(TensorRef {
                    storage,
                    offset,
                    shape,
                    stride,
                }))
            }
            ("torch._utils", "_rebuild_parameter")
            | ("torch._utils", "_rebuild_parameter_with_state") => match args.into_iter().next() {
                Some(t @ Value::Tensor(_)) => Ok(t),
                _ => Err(self.err(format!("{name}: first argument is not a tensor"))),
            },
            _ => Ok(Value::Opaque(format!("{module}.{name}"))),
        }
    }

    fn usize_tuple(&self, v: Option<Value>, what: &str) -> Result<Vec<usize>, PthError> {
        let items = match v {
            Some(Value::Tuple(items)) | Some(Value::List(items)) => items,
            _ => return Err(self.err(format!("tensor {what} is not a tuple"))),
        };
        if items.len() > MAX_DIMS {
            return Err(self.err(format!(
                "tensor {what} has {} dims, at most {MAX_DIMS}",
                items.len()
            )));
        }
        items
            .into_iter()
            .map(|x| match x {
                Value::Int(i) => {
                    usize::try_from(i).map_err(|_| self.err(format!("tensor {what} entry {i}")))
                }
                other => Err(self.err(format!("tensor {what} entry is a {}", other.kind()))),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Cursor, Write};

    fn fixture() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny/codec.pth")
    }

    #[test]
    fn reads_fixture_codec() {
        let sd = read_pth(&fixture()).unwrap();
        assert_eq!(sd.len(), 400);
        assert_eq!(sd.names().next(), Some("encoder.block.0.conv.bias"));
        let v = sd
            .get("decoder.model.1.block.1.conv.parametrizations.weight.original1")
            .unwrap();
        assert_eq!(v.shape, vec![64, 32, 16]);
        assert_eq!(v.dtype, PthDtype::F32);
        assert_eq!(v.numel(), 64 * 32 * 16);
        let cb = sd
            .get("quantizer.semantic_quantizer.quantizers.0.codebook.weight")
            .unwrap();
        assert_eq!(cb.shape, vec![64, 8]);
        let g = sd
            .get("quantizer.quantizer.quantizers.3.in_proj.weight_g")
            .unwrap();
        assert_eq!(g.shape, vec![8, 1, 1]);
        let alpha = sd.get("decoder.model.5.alpha").unwrap();
        assert_eq!(alpha.shape, vec![1, 4, 1]);
        // Random weights: not all zero, all finite.
        let w = v.to_f32();
        assert!(w.iter().all(|x| x.is_finite()) && w.iter().any(|&x| x != 0.0));
    }

    /// A zip holding `archive/data.pkl` and the given storages.
    fn make_zip(pkl: &[u8], storages: &[(&str, &[u8])]) -> Vec<u8> {
        let mut buf = Cursor::new(Vec::new());
        {
            let mut z = zip::ZipWriter::new(&mut buf);
            let opts = zip::write::SimpleFileOptions::default()
                .compression_method(zip::CompressionMethod::Stored);
            z.start_file("archive/data.pkl", opts).unwrap();
            z.write_all(pkl).unwrap();
            for (k, b) in storages {
                z.start_file(format!("archive/data/{k}"), opts).unwrap();
                z.write_all(b).unwrap();
            }
            z.finish().unwrap();
        }
        buf.into_inner()
    }

    /// Pickle of `{"state_dict": {"generator.w": tensor}}` where the tensor views a
    /// 6-element f32 storage with the given offset, size and stride.
    fn pickle_one(offset: u8, size: [u8; 2], stride: [u8; 2], numel: u8) -> Vec<u8> {
        let mut p = vec![0x80, 2, b'}', b'X'];
        let s = |p: &mut Vec<u8>, t: &str| {
            p.push(b'X');
            p.extend((t.len() as u32).to_le_bytes());
            p.extend(t.as_bytes());
        };
        p.pop();
        s(&mut p, "state_dict");
        p.push(b'}');
        s(&mut p, "generator.w");
        p.extend(b"ctorch._utils\n_rebuild_tensor_v2\n(");
        p.push(b'(');
        s(&mut p, "storage");
        p.extend(b"ctorch\nFloatStorage\n");
        s(&mut p, "0");
        s(&mut p, "cpu");
        p.extend([b'K', numel, b't', b'Q']);
        p.extend([b'K', offset]);
        p.extend([b'K', size[0], b'K', size[1], 0x86]);
        p.extend([b'K', stride[0], b'K', stride[1], 0x86]);
        p.extend([0x89, b')', b't', b'R', b's', b's', b'.']);
        p
    }

    fn storage6() -> Vec<u8> {
        (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect()
    }

    #[test]
    fn strided_view_state_dict_and_prefix() {
        // Transposed 2x3 view of a 3x2 storage, offset 0: [[0,2,4],[1,3,5]].
        let z = make_zip(&pickle_one(0, [2, 3], [1, 2], 6), &[("0", &storage6())]);
        let sd = read_pth_from(Cursor::new(z), Path::new("mem")).unwrap();
        let t = sd.get("w").unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(t.data, PthData::F32(vec![0., 2., 4., 1., 3., 5.]));
        // Offset 1, shape 2x2, stride (2,1): [[1,2],[3,4]].
        let z = make_zip(&pickle_one(1, [2, 2], [2, 1], 6), &[("0", &storage6())]);
        let sd = read_pth_from(Cursor::new(z), Path::new("mem")).unwrap();
        assert_eq!(
            sd.get("w").unwrap().data,
            PthData::F32(vec![1., 2., 3., 4.])
        );
    }

    #[test]
    fn view_past_storage_is_an_error() {
        let z = make_zip(&pickle_one(3, [2, 2], [2, 1], 6), &[("0", &storage6())]);
        let e = read_pth_from(Cursor::new(z), Path::new("mem")).unwrap_err();
        assert!(matches!(e, PthError::BadTensor { .. }), "{e}");
        // Storage shorter than its declared numel.
        let z = make_zip(
            &pickle_one(0, [2, 2], [2, 1], 6),
            &[("0", &storage6()[..20])],
        );
        let e = read_pth_from(Cursor::new(z), Path::new("mem")).unwrap_err();
        assert!(matches!(e, PthError::StorageShort { .. }), "{e}");
        // Storage entry missing.
        let z = make_zip(&pickle_one(0, [2, 2], [2, 1], 6), &[]);
        let e = read_pth_from(Cursor::new(z), Path::new("mem")).unwrap_err();
        assert!(matches!(e, PthError::StorageMissing { .. }), "{e}");
    }

    #[test]
    fn truncated_zip_is_an_error() {
        let bytes = std::fs::read(fixture()).unwrap();
        for cut in [0, 10, 1000, bytes.len() / 2, bytes.len() - 10] {
            let r = read_pth_from(Cursor::new(bytes[..cut].to_vec()), Path::new("cut"));
            assert!(r.is_err(), "cut at {cut} read fine");
        }
    }

    #[test]
    fn garbage_and_truncated_pickles_are_errors() {
        let good = pickle_one(0, [2, 3], [1, 2], 6);
        for cut in 0..good.len() {
            let z = make_zip(&good[..cut], &[("0", &storage6())]);
            let r = read_pth_from(Cursor::new(z), Path::new("mem"));
            assert!(r.is_err(), "pickle cut at {cut} read fine");
        }
        // Pseudo-random garbage must never panic.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..200 {
            let mut g = vec![0x80, 2];
            for _ in 0..64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                g.push((x >> 24) as u8);
            }
            let z = make_zip(&g, &[("0", &storage6())]);
            let _ = read_pth_from(Cursor::new(z), Path::new("mem"));
        }
        let z = make_zip(b"\x80\x02\xff", &[]);
        let e = read_pth_from(Cursor::new(z), Path::new("mem")).unwrap_err();
        assert!(matches!(e, PthError::Opcode { op: 0xff, .. }), "{e}");
    }
}

//! Writer of PyTorch `torch.save` zip archives holding an `OrderedDict` of f32 tensors — what
//! `torch.save(OrderedDict(...), buf)` produces, closely enough that [`crate::pth::read_pth`]
//! and `torch.load` (including `weights_only=True`) read it.
//!
//! Layout, as torch's `PyTorchFileWriter` writes it: stored (uncompressed) entries under
//! `archive/`: `data.pkl` (pickle protocol 2, memoised as Python's pickler does),
//! `.format_version`, `.storage_alignment`, `byteorder`, one `data/<key>` per tensor (raw
//! little-endian f32, keys `0, 1, …` in order) and `version` (`3\n`). Every entry's data starts
//! on a 64-byte boundary, padded with torch's `FB` extra field. Each tensor has its own
//! contiguous storage. The output is a pure function of the input: no timestamps, no ids.
//!
//! Archives past the plain zip limits (4 GiB, 65535 entries) would need zip64 and are refused.

use std::collections::HashSet;
use std::path::PathBuf;

use rayon::prelude::*;

use crate::CheckpointError;

/// Folder inside the zip (torch names it after the file; `archive` when saving to a buffer).
const ARCHIVE: &str = "archive";
/// Alignment of every entry's data (torch's `kFieldAlignment`).
const ALIGN: usize = 64;
const LOCAL_HEADER: usize = 30;
const CENTRAL_HEADER: usize = 46;
const END_RECORD: usize = 22;
/// The `FB` extra field's own header (id + length).
const FB_HEADER: usize = 4;
/// Items per MARK … SETITEMS batch (Python's pickler).
const BATCH: usize = 1000;
/// DOS date 1980-01-01, time 00:00.
const DOS_DATE: u16 = (1 << 5) | 1;
const DOS_TIME: u16 = 0;
/// Zip spec 2.0; general flag bit 11: names are UTF-8.
const ZIP_VERSION: u16 = 20;
const ZIP_FLAGS: u16 = 1 << 11;

fn err(why: impl Into<String>) -> CheckpointError {
    CheckpointError::Corrupt {
        path: PathBuf::from(ARCHIVE),
        why: why.into(),
    }
}

/// Serialises `tensors` (name, shape, row-major values) as `torch.save` would an
/// `OrderedDict` of contiguous float32 CPU tensors, in the given order.
///
/// Errors: a shape whose element count differs from (or overflows) the value count, duplicate
/// or over-long names, and archives beyond the plain (non-zip64) zip limits.
pub fn write_pth(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<Vec<u8>, CheckpointError> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for (name, shape, values) in tensors {
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| err(format!("tensor {name:?}: shape {shape:?} overflows")))?;
        if numel != values.len() {
            return Err(err(format!(
                "tensor {name:?}: shape {shape:?} has {numel} elements, {} values given",
                values.len()
            )));
        }
        if numel.checked_mul(4).is_none_or(|b| b > u32::MAX as usize) {
            return Err(err(format!(
                "tensor {name:?}: {numel} f32 values exceed 4 GiB (zip64 is not written)"
            )));
        }
        if !seen.insert(name.as_str()) {
            return Err(err(format!("tensor {name:?} appears twice")));
        }
    }

    let pkl = pickle(tensors)?;
    let mut entries: Vec<(String, Content<'_>)> = vec![
        (format!("{ARCHIVE}/data.pkl"), Content::Bytes(&pkl)),
        (format!("{ARCHIVE}/.format_version"), Content::Bytes(b"1")),
        (
            format!("{ARCHIVE}/.storage_alignment"),
            Content::Bytes(b"64"),
        ),
        (format!("{ARCHIVE}/byteorder"), Content::Bytes(b"little")),
    ];
    for (key, (_, _, values)) in tensors.iter().enumerate() {
        entries.push((format!("{ARCHIVE}/data/{key}"), Content::F32(values)));
    }
    entries.push((format!("{ARCHIVE}/version"), Content::Bytes(b"3\n")));
    write_zip(&entries)
}

/// What one zip entry holds.
enum Content<'a> {
    Bytes(&'a [u8]),
    /// Written little-endian.
    F32(&'a [f32]),
}

impl Content<'_> {
    fn len(&self) -> usize {
        match self {
            Content::Bytes(b) => b.len(),
            Content::F32(v) => v.len() * 4,
        }
    }

    fn write(&self, out: &mut [u8]) {
        match self {
            Content::Bytes(b) => out.copy_from_slice(b),
            Content::F32(v) => {
                for (o, x) in out.chunks_exact_mut(4).zip(v.iter()) {
                    o.copy_from_slice(&x.to_le_bytes());
                }
            }
        }
    }
}

struct Placed {
    offset: usize,
    /// Local header + name + extra field + data.
    span: usize,
    extra: usize,
    len: usize,
}

fn u32_of(x: usize, what: &str) -> Result<u32, CheckpointError> {
    u32::try_from(x).map_err(|_| {
        err(format!(
            "{what} {x} exceeds the plain zip limit (zip64 is not written)"
        ))
    })
}

fn write_zip(entries: &[(String, Content<'_>)]) -> Result<Vec<u8>, CheckpointError> {
    let count = u16::try_from(entries.len())
        .ok()
        .filter(|&n| n < u16::MAX)
        .ok_or_else(|| err(format!("{} zip entries need zip64", entries.len())))?;
    // Where each entry goes: torch pads the local header's extra field so data is aligned.
    let mut placed = Vec::with_capacity(entries.len());
    let mut cursor = 0usize;
    let mut central = 0usize;
    for (name, content) in entries {
        let name_len = u16::try_from(name.len())
            .map_err(|_| err(format!("entry name of {} bytes is too long", name.len())))?;
        let start = cursor + LOCAL_HEADER + usize::from(name_len) + FB_HEADER;
        let pad = (ALIGN - start % ALIGN) % ALIGN;
        let extra = FB_HEADER + pad;
        let len = content.len();
        let span = LOCAL_HEADER + usize::from(name_len) + extra + len;
        u32_of(cursor, "entry offset")?;
        u32_of(len, "entry size")?;
        placed.push(Placed {
            offset: cursor,
            span,
            extra,
            len,
        });
        cursor = cursor
            .checked_add(span)
            .ok_or_else(|| err("archive size overflows"))?;
        central += CENTRAL_HEADER + name.len();
    }
    let cd_offset = u32_of(cursor, "central directory offset")?;
    let cd_size = u32_of(central, "central directory size")?;
    let total = cursor + central + END_RECORD;
    u32_of(total, "archive size")?;

    let mut out = vec![0u8; total];
    // Each entry's span is disjoint: fill them (data + CRC) in parallel.
    let (body, tail) = out.split_at_mut(cursor);
    let mut spans = Vec::with_capacity(entries.len());
    let mut rest = body;
    for p in &placed {
        let (head, next) = rest.split_at_mut(p.span);
        spans.push(head);
        rest = next;
    }
    let crcs: Vec<u32> = spans
        .into_par_iter()
        .zip(entries.par_iter())
        .zip(placed.par_iter())
        .map(|((span, (name, content)), p)| {
            let data_at = LOCAL_HEADER + name.len() + p.extra;
            content.write(&mut span[data_at..]);
            let crc = crc32(&span[data_at..]);
            let mut h = Vec::with_capacity(data_at);
            h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
            h.extend_from_slice(&ZIP_VERSION.to_le_bytes());
            h.extend_from_slice(&ZIP_FLAGS.to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // stored
            h.extend_from_slice(&DOS_TIME.to_le_bytes());
            h.extend_from_slice(&DOS_DATE.to_le_bytes());
            h.extend_from_slice(&crc.to_le_bytes());
            h.extend_from_slice(&(p.len as u32).to_le_bytes()); // sizes checked above
            h.extend_from_slice(&(p.len as u32).to_le_bytes());
            h.extend_from_slice(&(name.len() as u16).to_le_bytes());
            h.extend_from_slice(&(p.extra as u16).to_le_bytes());
            h.extend_from_slice(name.as_bytes());
            let pad = p.extra - FB_HEADER;
            h.extend_from_slice(b"FB");
            h.extend_from_slice(&(pad as u16).to_le_bytes());
            h.resize(data_at, b'Z');
            span[..data_at].copy_from_slice(&h);
            crc
        })
        .collect();

    let mut cd = Vec::with_capacity(central + END_RECORD);
    for (((name, _), p), crc) in entries.iter().zip(&placed).zip(&crcs) {
        cd.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        cd.extend_from_slice(&ZIP_VERSION.to_le_bytes()); // made by
        cd.extend_from_slice(&ZIP_VERSION.to_le_bytes()); // needed
        cd.extend_from_slice(&ZIP_FLAGS.to_le_bytes());
        cd.extend_from_slice(&0u16.to_le_bytes());
        cd.extend_from_slice(&DOS_TIME.to_le_bytes());
        cd.extend_from_slice(&DOS_DATE.to_le_bytes());
        cd.extend_from_slice(&crc.to_le_bytes());
        cd.extend_from_slice(&(p.len as u32).to_le_bytes());
        cd.extend_from_slice(&(p.len as u32).to_le_bytes());
        cd.extend_from_slice(&(name.len() as u16).to_le_bytes());
        cd.extend_from_slice(&[0; 8]); // extra, comment, disk, internal attributes
        cd.extend_from_slice(&0u32.to_le_bytes()); // external attributes
        cd.extend_from_slice(&(p.offset as u32).to_le_bytes());
        cd.extend_from_slice(name.as_bytes());
    }
    cd.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    cd.extend_from_slice(&[0; 4]); // this disk, central directory disk
    cd.extend_from_slice(&count.to_le_bytes());
    cd.extend_from_slice(&count.to_le_bytes());
    cd.extend_from_slice(&cd_size.to_le_bytes());
    cd.extend_from_slice(&cd_offset.to_le_bytes());
    cd.extend_from_slice(&0u16.to_le_bytes()); // comment
    tail.copy_from_slice(&cd);
    Ok(out)
}

// ---------------------------------------------------------------- pickle

/// Pickle protocol 2 emitter with Python's memo behaviour for the few objects used here.
struct Pickler {
    out: Vec<u8>,
    next_memo: u32,
}

/// Memo slots of objects pickled once and referenced after.
#[derive(Default)]
struct Shared {
    rebuild: Option<u32>,
    storage_tag: Option<u32>,
    float_storage: Option<u32>,
    cpu: Option<u32>,
}

impl Pickler {
    fn op(&mut self, op: u8) {
        self.out.push(op);
    }

    fn memoize(&mut self) -> Result<u32, CheckpointError> {
        let i = self.next_memo;
        if i < 256 {
            self.out.extend_from_slice(&[b'q', i as u8]);
        } else {
            self.out.push(b'r');
            self.out.extend_from_slice(&i.to_le_bytes());
        }
        self.next_memo = i
            .checked_add(1)
            .ok_or_else(|| err("pickle memo overflows"))?;
        Ok(i)
    }

    fn get(&mut self, i: u32) {
        if i < 256 {
            self.out.extend_from_slice(&[b'h', i as u8]);
        } else {
            self.out.push(b'j');
            self.out.extend_from_slice(&i.to_le_bytes());
        }
    }

    /// A global, memoised at first use (`GLOBAL` then `BINGET`).
    fn global(
        &mut self,
        slot: &mut Option<u32>,
        module: &str,
        name: &str,
    ) -> Result<(), CheckpointError> {
        match *slot {
            Some(i) => self.get(i),
            None => {
                self.op(b'c');
                self.out.extend_from_slice(module.as_bytes());
                self.op(b'\n');
                self.out.extend_from_slice(name.as_bytes());
                self.op(b'\n');
                *slot = Some(self.memoize()?);
            }
        }
        Ok(())
    }

    /// A new string object (`BINUNICODE`, memoised).
    fn str(&mut self, s: &str) -> Result<u32, CheckpointError> {
        let n = u32::try_from(s.len()).map_err(|_| err("string longer than 4 GiB"))?;
        self.op(b'X');
        self.out.extend_from_slice(&n.to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
        self.memoize()
    }

    /// A string shared across the pickle (Python's interned literals).
    fn shared_str(&mut self, slot: &mut Option<u32>, s: &str) -> Result<(), CheckpointError> {
        match *slot {
            Some(i) => self.get(i),
            None => *slot = Some(self.str(s)?),
        }
        Ok(())
    }

    /// A non-negative int as Python's `save_long` writes it (protocol 2).
    fn int(&mut self, x: usize) {
        if x <= 0xff {
            self.out.extend_from_slice(&[b'K', x as u8]);
        } else if x <= 0xffff {
            self.op(b'M');
            self.out.extend_from_slice(&(x as u16).to_le_bytes());
        } else if x <= i32::MAX as usize {
            self.op(b'J');
            self.out.extend_from_slice(&(x as i32).to_le_bytes());
        } else {
            // LONG1: minimal little-endian two's complement (a sign byte when the top bit is set).
            let bytes = (x as u64).to_le_bytes();
            let bits = 64 - (x as u64).leading_zeros() as usize;
            let n = bits / 8 + 1;
            self.op(0x8a);
            self.op(n as u8);
            self.out.extend_from_slice(&bytes[..n.min(8)]);
            if n > 8 {
                self.op(0);
            }
        }
    }

    /// A tuple of ints (`TUPLE1..3`, or `MARK … TUPLE`; `EMPTY_TUPLE` is not memoised).
    fn int_tuple(&mut self, xs: &[usize]) -> Result<(), CheckpointError> {
        if xs.is_empty() {
            self.op(b')');
            return Ok(());
        }
        if xs.len() > 3 {
            self.op(b'(');
        }
        for &x in xs {
            self.int(x);
        }
        self.op(match xs.len() {
            1 => 0x85,
            2 => 0x86,
            3 => 0x87,
            _ => b't',
        });
        self.memoize()?;
        Ok(())
    }

    /// `collections.OrderedDict()`; `slot` holds the class's memo entry.
    fn empty_ordered_dict(&mut self, slot: &mut Option<u32>) -> Result<(), CheckpointError> {
        self.global(slot, "collections", "OrderedDict")?;
        self.op(b')');
        self.op(b'R');
        self.memoize()?;
        Ok(())
    }

    /// `torch._utils._rebuild_tensor_v2(storage, 0, shape, stride, False, OrderedDict())`.
    fn tensor(
        &mut self,
        sh: &mut Shared,
        odict: &mut Option<u32>,
        key: usize,
        shape: &[usize],
        numel: usize,
    ) -> Result<(), CheckpointError> {
        self.global(&mut sh.rebuild, "torch._utils", "_rebuild_tensor_v2")?;
        self.op(b'(');
        // Persistent id ('storage', torch.FloatStorage, key, 'cpu', numel).
        self.op(b'(');
        self.shared_str(&mut sh.storage_tag, "storage")?;
        self.global(&mut sh.float_storage, "torch", "FloatStorage")?;
        self.str(&key.to_string())?;
        self.shared_str(&mut sh.cpu, "cpu")?;
        self.int(numel);
        self.op(b't');
        self.memoize()?;
        self.op(b'Q');
        self.int(0);
        self.int_tuple(shape)?;
        self.int_tuple(&contiguous_stride(shape))?;
        self.op(0x89); // NEWFALSE: requires_grad
        self.empty_ordered_dict(odict)?;
        self.op(b't');
        self.memoize()?;
        self.op(b'R');
        self.memoize()?;
        Ok(())
    }
}

/// Strides of a contiguous tensor as torch computes them (sizes of 0 count as 1).
fn contiguous_stride(shape: &[usize]) -> Vec<usize> {
    let mut stride = vec![1usize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        stride[i] = stride[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    stride
}

fn pickle(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Result<Vec<u8>, CheckpointError> {
    let mut p = Pickler {
        out: Vec::with_capacity(256 + 160 * tensors.len()),
        next_memo: 0,
    };
    p.out.extend_from_slice(&[0x80, 2]);
    let mut odict = None;
    p.empty_ordered_dict(&mut odict)?;
    let mut sh = Shared::default();
    for (b, batch) in tensors.chunks(BATCH).enumerate() {
        if batch.len() > 1 {
            p.op(b'(');
        }
        for (i, (name, shape, values)) in batch.iter().enumerate() {
            p.str(name)?;
            p.tensor(&mut sh, &mut odict, b * BATCH + i, shape, values.len())?;
        }
        p.op(if batch.len() > 1 { b'u' } else { b's' });
    }
    p.op(b'.');
    Ok(p.out)
}

// ---------------------------------------------------------------- crc32

/// CRC-32 (IEEE, reflected 0xEDB88320) tables for slicing-by-8.
const CRC_TABLES: [[u32; 256]; 8] = {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut i = 0;
    while i < 256 {
        let mut s = 1;
        while s < 8 {
            let prev = t[s - 1][i];
            t[s][i] = (prev >> 8) ^ t[0][(prev & 0xff) as usize];
            s += 1;
        }
        i += 1;
    }
    t
};

fn crc32(data: &[u8]) -> u32 {
    let t = &CRC_TABLES;
    let mut c = !0u32;
    let mut chunks = data.chunks_exact(8);
    for b in &mut chunks {
        let lo = c ^ u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        c = t[7][(lo & 0xff) as usize]
            ^ t[6][((lo >> 8) & 0xff) as usize]
            ^ t[5][((lo >> 16) & 0xff) as usize]
            ^ t[4][(lo >> 24) as usize]
            ^ t[3][b[4] as usize]
            ^ t[2][b[5] as usize]
            ^ t[1][b[6] as usize]
            ^ t[0][b[7] as usize];
    }
    for &b in chunks.remainder() {
        c = (c >> 8) ^ t[0][((c ^ u32::from(b)) & 0xff) as usize];
    }
    !c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pth::{read_pth_from, PthData, PthDtype};
    use std::io::{Cursor, Read};
    use std::path::Path;

    fn sample() -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let mut v = Vec::new();
        let mut x = 0.5f32;
        let mut next = |n: usize| {
            (0..n)
                .map(|_| {
                    x = (x * 3.7 + 0.11).fract() - 0.25;
                    x
                })
                .collect::<Vec<f32>>()
        };
        v.push(("a.bias".to_owned(), vec![4], next(4)));
        v.push(("a.weight".to_owned(), vec![4, 3, 7], next(84)));
        v.push(("scalar".to_owned(), vec![], vec![-1.5]));
        v.push(("empty".to_owned(), vec![0, 5], vec![]));
        v.push(("four.dims".to_owned(), vec![2, 1, 3, 2], next(12)));
        v.push(("big".to_owned(), vec![300, 257], next(300 * 257)));
        v.push((
            "specials".to_owned(),
            vec![5],
            vec![f32::INFINITY, -0.0, f32::MIN_POSITIVE, f32::MAX, 1e-42],
        ));
        v
    }

    fn round_trip(tensors: &[(String, Vec<usize>, Vec<f32>)]) {
        let bytes = write_pth(tensors).unwrap();
        let sd = read_pth_from(Cursor::new(bytes), Path::new("mem.pth")).unwrap();
        let names: Vec<&str> = sd.names().collect();
        let want: Vec<&str> = tensors.iter().map(|t| t.0.as_str()).collect();
        assert_eq!(names, want);
        for (name, shape, values) in tensors {
            let t = sd.get(name).unwrap();
            assert_eq!(&t.shape, shape, "{name}");
            assert_eq!(t.dtype, PthDtype::F32);
            let PthData::F32(got) = &t.data else {
                panic!("{name}: not f32")
            };
            let same = got.len() == values.len()
                && got
                    .iter()
                    .zip(values)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: values differ");
        }
    }

    #[test]
    fn round_trips_names_shapes_values() {
        round_trip(&sample());
        round_trip(&[]);
    }

    #[test]
    fn round_trips_many_tensors_and_large_memo() {
        // > 1000 items (several SETITEMS batches, one of a single item) and > 256 memo slots.
        let t: Vec<_> = (0..2001)
            .map(|i| {
                (
                    format!("layer.{i}.w"),
                    vec![1, (i % 3) + 1],
                    vec![i as f32; (i % 3) + 1],
                )
            })
            .collect();
        round_trip(&t);
    }

    #[test]
    fn deterministic_bytes() {
        let a = write_pth(&sample()).unwrap();
        let b = write_pth(&sample()).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn layout_is_torch_like() {
        let bytes = write_pth(&sample()).unwrap();
        let mut z = zip::ZipArchive::new(Cursor::new(&bytes)).unwrap();
        let names: Vec<String> = z.file_names().map(str::to_owned).collect();
        for want in [
            "archive/data.pkl",
            "archive/version",
            "archive/byteorder",
            "archive/.format_version",
            "archive/data/0",
            "archive/data/6",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} missing: {names:?}");
        }
        let mut read = |n: &str| {
            let mut f = z.by_name(n).unwrap();
            assert_eq!(f.compression(), zip::CompressionMethod::Stored);
            assert_eq!(f.data_start() % ALIGN as u64, 0, "{n} not aligned");
            let mut s = Vec::new();
            f.read_to_end(&mut s).unwrap();
            s
        };
        assert_eq!(read("archive/version"), b"3\n");
        assert_eq!(read("archive/byteorder"), b"little");
        let pkl = read("archive/data.pkl");
        assert_eq!(&pkl[..2], &[0x80, 2]);
        assert!(pkl.starts_with(b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01("));
        assert_eq!(pkl.last(), Some(&b'.'));
        let d1 = read("archive/data/1");
        assert_eq!(d1.len(), 84 * 4);
        assert_eq!(&d1[..4], &sample()[1].2[0].to_le_bytes());
    }

    #[test]
    fn crc32_known_values() {
        assert_eq!(crc32(b""), 0);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
        let long: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
        // Bytewise reference.
        let mut c = !0u32;
        for &b in &long {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
        }
        assert_eq!(crc32(&long), !c);
    }

    #[test]
    fn strides_and_ints() {
        assert_eq!(contiguous_stride(&[4, 3, 7]), vec![21, 7, 1]);
        assert_eq!(contiguous_stride(&[0, 5]), vec![5, 1]);
        assert_eq!(contiguous_stride(&[]), Vec::<usize>::new());
        let mut p = Pickler {
            out: Vec::new(),
            next_memo: 0,
        };
        p.int(255);
        p.int(256);
        p.int(70000);
        p.int(1 << 31);
        p.int(usize::MAX);
        assert_eq!(
            p.out,
            [
                &[b'K', 255][..],
                &[b'M', 0, 1],
                &[b'J', 0x70, 0x11, 1, 0],
                &[0x8a, 5, 0, 0, 0, 0x80, 0],
                &[0x8a, 9, 255, 255, 255, 255, 255, 255, 255, 255, 0],
            ]
            .concat()
        );
    }

    #[test]
    fn bad_input_is_an_error() {
        let bad = |t: Vec<(String, Vec<usize>, Vec<f32>)>| assert!(write_pth(&t).is_err());
        bad(vec![("x".into(), vec![2, 3], vec![0.0; 5])]);
        bad(vec![("x".into(), vec![usize::MAX, 3], vec![])]);
        bad(vec![
            ("x".into(), vec![1], vec![0.0]),
            ("x".into(), vec![1], vec![0.0]),
        ]);
    }
}

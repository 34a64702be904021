//! Weights in stored precision and the matmuls that read them.
//!
//! Stored formats: BF16, F32, FP8 (E4M3 with one f32 per 128x128 block) and NVFP4 (two E2M1 codes
//! per byte, low nibble = even column, one E4M3 scale per 16 columns, one f32 global scale). The
//! quantised forms are never expanded in memory: codes and E4M3 scales stay on the mmap.
//!
//! Decode (`Rows::Exact`): each weight row is dequantised once into f32 and dotted with every
//! input row by one fixed-order kernel, so a row's result never depends on the batch.
//! Prefill (`Rows::Bulk`): weight tiles are dequantised to f32 and multiplied with
//! `matrixmultiply::sgemm`.

use std::sync::Arc;

use checkpoint::dtype::{bf16_to_f32, e2m1_to_f32, f8_table};
use checkpoint::store::Shard;
use rayon::prelude::*;

/// FP8 block edge (DRAMA3.md §3.3).
pub const FP8_BLOCK: usize = 128;
/// NVFP4 scale group: one E4M3 `weight_scale` per this many consecutive columns of a row.
pub use model::stored::NVFP4_GROUP;

/// The 16 E2M1 values by nibble (bit 3 = sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
fn e2m1_table() -> &'static [f32; 16] {
    static T: std::sync::OnceLock<[f32; 16]> = std::sync::OnceLock::new();
    T.get_or_init(|| std::array::from_fn(|n| e2m1_to_f32(n as u8)))
}

/// Bytes of a tensor: a range of a memory-mapped shard, or a copy (gathered rows).
pub enum Bytes {
    Mapped {
        shard: Arc<Shard>,
        start: usize,
        end: usize,
    },
    Owned(Vec<u8>),
}

impl Bytes {
    pub fn get(&self) -> &[u8] {
        match self {
            Bytes::Mapped { shard, start, end } => &shard.map[*start..*end],
            Bytes::Owned(v) => v,
        }
    }
}

/// How a matrix is stored.
pub enum Format {
    Bf16,
    /// E4M3 with one f32 multiplier per 128x128 block, `[ceil(rows/128), ceil(cols/128)]`.
    Fp8 {
        scale: Vec<f32>,
        scale_cols: usize,
    },
    F32,
    /// NVFP4 (ModelOpt): `bytes` holds `[rows, cols/2]` packed E2M1 codes (low nibble = even
    /// column); `scale` holds the `[rows, cols/16]` E4M3 `weight_scale` codes, also in stored
    /// form; `global` is `weight_scale_2`. Value = `(e2m1 · e4m3) · global`: the first product is
    /// exact in f32, so each dequantised value is the correctly rounded exact product.
    Nvfp4 {
        scale: Bytes,
        global: f32,
    },
}

/// A `[rows, cols]` matrix in stored precision.
pub struct CpuWeight {
    pub bytes: Bytes,
    pub format: Format,
    pub rows: usize,
    pub cols: usize,
}

impl CpuWeight {
    /// Bytes this matrix occupies in its stored form (codes plus scales), mapped or owned.
    pub fn stored_bytes(&self) -> usize {
        self.bytes.get().len()
            + match &self.format {
                Format::Bf16 | Format::F32 => 0,
                Format::Fp8 { scale, .. } => scale.len() * 4,
                Format::Nvfp4 { scale, .. } => scale.get().len() + 4,
            }
    }

    /// Bytes held in process memory rather than on the mmap (copies, decoded scales).
    pub fn owned_bytes(&self) -> usize {
        let own = |b: &Bytes| match b {
            Bytes::Mapped { .. } => 0,
            Bytes::Owned(v) => v.len(),
        };
        own(&self.bytes)
            + match &self.format {
                Format::Bf16 | Format::F32 => 0,
                Format::Fp8 { scale, .. } => scale.len() * 4,
                Format::Nvfp4 { scale, .. } => own(scale),
            }
    }

    /// Dequantises row `r` into `out` (`cols` values), exactly as the stored value times scale.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let c = self.cols;
        let b = self.bytes.get();
        match &self.format {
            Format::Bf16 => {
                let src = &b[r * c * 2..(r + 1) * c * 2];
                for (o, p) in out.iter_mut().zip(src.chunks_exact(2)) {
                    *o = bf16_to_f32(u16::from_le_bytes([p[0], p[1]]));
                }
            }
            Format::F32 => {
                let src = &b[r * c * 4..(r + 1) * c * 4];
                for (o, p) in out.iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([p[0], p[1], p[2], p[3]]);
                }
            }
            Format::Fp8 { scale, scale_cols } => {
                let t = f8_table();
                let src = &b[r * c..(r + 1) * c];
                let srow = &scale[(r / FP8_BLOCK) * scale_cols..];
                for (blk, (o, s)) in out
                    .chunks_mut(FP8_BLOCK)
                    .zip(src.chunks(FP8_BLOCK))
                    .enumerate()
                {
                    let m = srow[blk];
                    for (o, &q) in o.iter_mut().zip(s) {
                        *o = t[q as usize] * m;
                    }
                }
            }
            Format::Nvfp4 { scale, global } => {
                let (t, e) = (f8_table(), e2m1_table());
                let src = &b[r * c / 2..(r + 1) * c / 2];
                let groups = c / NVFP4_GROUP;
                let srow = &scale.get()[r * groups..(r + 1) * groups];
                for ((o, p), &sc) in out
                    .chunks_exact_mut(NVFP4_GROUP)
                    .zip(src.chunks_exact(NVFP4_GROUP / 2))
                    .zip(srow)
                {
                    let s = t[sc as usize];
                    for (o, &q) in o.chunks_exact_mut(2).zip(p) {
                        o[0] = (e[(q & 15) as usize] * s) * global;
                        o[1] = (e[(q >> 4) as usize] * s) * global;
                    }
                }
            }
        }
    }
}

/// Fixed-order dot product: 8 interleaved partial sums, then a fixed tree.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Output columns per parallel task in the row-exact kernel (any value gives the same bits).
const EXACT_TILE: usize = 16;
/// Below this many multiply-adds a linear runs on the calling thread.
pub const PARALLEL_MIN_MACS: usize = 1 << 18;
/// Output columns per sgemm tile.
const BULK_TILE: usize = 128;
/// Below this many rows the sgemm path is not worth its dequantisation pass.
/// From this many rows on, a `Rows::Bulk` linear runs the tiled GEMM (`matrixmultiply`, whose
/// rounding may depend on the row count); below it every row takes the exact path, so prompts
/// of fewer rows join with their own bits (`CpuBackend::joined_rows`). 8, or
/// `DRAMATIS_CPU_BULK_MIN_ROWS` (read once per process; the engine tests raise it so their
/// prompts join).
pub(crate) fn bulk_min_rows() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        std::env::var("DRAMATIS_CPU_BULK_MIN_ROWS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .filter(|&n| n >= 1)
            .unwrap_or(8)
    })
}

/// `y = x Wᵀ`, `x` `[n, cols]`, each row by the same arithmetic whatever `n`.
pub fn linear_exact(x: &[f32], n: usize, w: &CpuWeight) -> Vec<f32> {
    let (out, k) = (w.rows, w.cols);
    let mut yt = vec![0f32; out * n]; // [out, n]
    let tile = |buf: &mut Vec<f32>, (ti, chunk): (usize, &mut [f32])| {
        for (jj, col) in chunk.chunks_mut(n).enumerate() {
            w.row_f32(ti * EXACT_TILE + jj, buf);
            for (i, y) in col.iter_mut().enumerate() {
                *y = dot(&x[i * k..(i + 1) * k], buf);
            }
        }
    };
    // Threads cost more than they save on small products; the bits are the same either way.
    if out * k * n < PARALLEL_MIN_MACS {
        let mut buf = vec![0f32; k];
        yt.chunks_mut(EXACT_TILE * n)
            .enumerate()
            .for_each(|c| tile(&mut buf, c));
    } else {
        yt.par_chunks_mut(EXACT_TILE * n)
            .enumerate()
            .for_each_init(|| vec![0f32; k], tile);
    }
    let mut y = vec![0f32; n * out];
    for (j, col) in yt.chunks_exact(n).enumerate() {
        for (i, &v) in col.iter().enumerate() {
            y[i * out + j] = v;
        }
    }
    y
}

/// A pointer the sgemm tiles write through; each tile owns a disjoint column range.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tiles write disjoint columns of one buffer that outlives the parallel loop.
unsafe impl Send for OutPtr {}
// SAFETY: as above; no two tiles touch the same element.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not a field access) so closures capture the whole Send wrapper.
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// `y = x Wᵀ` through f32 tiles and sgemm (one lane's prompt).
pub fn linear_bulk(x: &[f32], n: usize, w: &CpuWeight) -> Vec<f32> {
    if n < bulk_min_rows() {
        return linear_exact(x, n, w);
    }
    let (out, k) = (w.rows, w.cols);
    let mut y = vec![0f32; n * out];
    let yp = OutPtr(y.as_mut_ptr());
    let tiles = out.div_ceil(BULK_TILE);
    (0..tiles).into_par_iter().for_each(|t| {
        let j0 = t * BULK_TILE;
        let jt = BULK_TILE.min(out - j0);
        let mut wt = vec![0f32; jt * k];
        for (jj, row) in wt.chunks_mut(k).enumerate() {
            w.row_f32(j0 + jj, row);
        }
        // SAFETY: x is [n, k] and wt is [jt, k] (read as its transpose [k, jt]); the output
        // view starts at column j0 of the [n, out] buffer with row stride `out`, and tile t
        // writes only columns j0..j0+jt, disjoint from every other tile.
        unsafe {
            matrixmultiply::sgemm(
                n,
                k,
                jt,
                1.0,
                x.as_ptr(),
                k as isize,
                1,
                wt.as_ptr(),
                1,
                k as isize,
                0.0,
                yp.at(j0),
                out as isize,
                1,
            );
        }
    });
    y
}

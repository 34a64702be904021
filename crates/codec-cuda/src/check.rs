//! The decoder's tensor-core GEMM (`gemm_tc16` / `gemm_tc64`, 3xTF32) against an FP64
//! reference on fresh random inputs, with its lower-precision twin (one TF32 MMA a step, the
//! `LowPrecision` build) that the same tolerance must catch, and the bit-for-bit checks that
//! streaming needs: a row's result is the same whatever the row count, the row tile and whether
//! K's segments are summed across blocks or inside one, and the cp.async tiles (`gemm_tcw`,
//! `gemm_tcw2` for many rows, `gemm_tcs` for up to 16) give `gemm_tc64` / `gemm_tc16`'s bits.
//! Run on a GPU by `examples/codec_gpu` and by the crate's GPU test.

use std::sync::Arc;

use backend_cuda::rng::Rng;
use backend_cuda::{Gpu, Variant};

use crate::cuda::CudaExec;
use crate::exec::{Exec, Gemm, P};
use crate::Result;

/// Error bound, as a fraction of Σ|a·b| over an output's terms. A 3xTF32 step carries about 22
/// bits of each operand (error ~2⁻²² of Σ|a·b|, f32 rounding of the sums about as much); one
/// TF32 MMA a step carries 11 (~2⁻¹¹ a product). 1e-5 (~2⁻¹⁷) sits between them.
pub const TOLERANCE: f64 = 1e-5;

/// One shape: an im2col conv operand (`stride`, `dil`, `cin`, taps) or a plain linear.
#[derive(Debug, Clone, Copy)]
struct Shape {
    m: usize,
    n: usize,
    cin: usize,
    taps: usize,
    stride: usize,
    dil: usize,
}

impl Shape {
    fn k(&self) -> usize {
        self.cin * self.taps
    }
    /// Whether the cp.async tiles may take this shape (the dispatch's conditions on operands
    /// allocated at offset 0).
    fn staged(&self) -> bool {
        let ks = crate::exec::split_len(self.k(), self.n);
        let (rsa, jstride) = (self.stride * self.cin, self.dil * self.cin);
        crate::cuda::staged(self.cin, self.k(), ks, self.n, rsa, jstride, 0, 0)
    }
    /// K's segments (see [`crate::exec::split_len`]).
    fn segments(&self) -> usize {
        self.k().div_ceil(crate::exec::split_len(self.k(), self.n))
    }
    /// A elements the GEMM may read: rows `m` at `stride·cin`, taps at `dil·cin`.
    fn a_len(&self) -> usize {
        (self.m - 1) * self.stride * self.cin + (self.taps - 1) * self.dil * self.cin + self.cin
    }
    fn gemm(&self, a: P, b: P, c: P, bias: P, res: P) -> Gemm {
        Gemm {
            m: self.m,
            n: self.n,
            k: self.k(),
            a,
            rsa: self.stride * self.cin,
            cin: self.cin,
            jstride: self.dil * self.cin,
            b,
            c,
            bias: Some(bias),
            bias_n: self.n,
            gamma: None,
            res: Some(res),
            tanh: false,
        }
    }
}

/// What one run found.
#[derive(Debug, Clone)]
pub struct TcCheck {
    /// Shapes checked (m, n, k).
    pub shapes: Vec<(usize, usize, usize)>,
    /// Largest |got − ref| / Σ|a·b| (+|bias| + |res|) of the exact build over every output.
    pub exact_worst: f64,
    /// The same for the lower-precision twin without `gemm_tcs` (the default kernels unless
    /// `DRAMATIS_CODEC_TCS=1`; must exceed [`TOLERANCE`]).
    pub twin_worst: f64,
    /// The twin on `gemm_tcs` (off by default), over the shapes that reach it (must exceed
    /// [`TOLERANCE`] too: kept apart, so the default kernels' error cannot stand in for it).
    pub twin_small_worst: f64,
    /// Rows 0, middle and last of each shape equal bit for bit to their own one-row launches,
    /// in both segment modes.
    pub rows_bitwise: bool,
    /// Segments summed across blocks equal segments summed in one block, bit for bit.
    pub modes_bitwise: bool,
    /// Whole launches on the cp.async tiles (`gemm_tcw`, `gemm_tcw2`, `gemm_tcw2s`, `gemm_tcw3s`,
    /// `gemm_tcw4s`, `gemm_tcw96s`, `gemm_tcs`) and on `gemm_fr` / `gemm_fr4` equal `gemm_tc64` / `gemm_tc16`'s bit for bit, in both segment modes and
    /// the default dispatch.
    pub wide_bitwise: bool,
    /// Launches that took the wide tiles (the shapes meant for them must reach them).
    pub wide_launches: u64,
    /// Launches that took a wide one-segment kernel (`gemm_tcw2s`, `gemm_tcw3s`, `gemm_tcw4s`,
    /// `gemm_tcw96s`).
    pub seg1_launches: u64,
    /// Launches that took `gemm_tcw96s`.
    pub wide96_launches: u64,
    /// Launches that took `gemm_fr` or `gemm_fr4`.
    pub frame_launches: u64,
    /// Launches that took `gemm_tcs`.
    pub small_launches: u64,
    /// Every shape reached the cp.async tiles exactly when its operands allow them (so a shape
    /// meant for them cannot silently fall back, nor another take them).
    pub dispatch_as_expected: bool,
}

impl TcCheck {
    /// The exact build within tolerance, the twin caught, the bits independent of the batch and
    /// equal across the kernels, every shape dispatched as its operands allow, and both kinds of
    /// cp.async tiles launched.
    pub fn pass(&self) -> bool {
        self.exact_worst <= TOLERANCE
            && self.twin_worst > TOLERANCE
            && self.twin_small_worst > TOLERANCE
            && self.rows_bitwise
            && self.modes_bitwise
            && self.wide_bitwise
            && self.wide_launches > 0
            && self.seg1_launches > 0
            && self.wide96_launches > 0
            && self.frame_launches > 0
            && self.small_launches > 0
            && self.dispatch_as_expected
    }
}

struct Case {
    s: Shape,
    a: Vec<f32>,
    b: Vec<f32>,
    bias: Vec<f32>,
    res: Vec<f32>,
}

impl Case {
    fn new(s: Shape, rng: &mut Rng) -> Case {
        Case {
            s,
            a: rng.normals_f32(s.a_len(), 1.0),
            b: rng.normals_f32(s.k() * s.n, 0.05),
            bias: rng.normals_f32(s.n, 0.1),
            res: rng.normals_f32(s.m * s.n, 0.5),
        }
    }

    /// FP64 value and Σ|terms| of output (r, c).
    fn reference(&self, r: usize, c: usize) -> (f64, f64) {
        let s = &self.s;
        let (mut v, mut mag) = (0.0f64, 0.0f64);
        for j in 0..s.taps {
            for ci in 0..s.cin {
                let av = f64::from(self.a[r * s.stride * s.cin + j * s.dil * s.cin + ci]);
                let bv = f64::from(self.b[(j * s.cin + ci) * s.n + c]);
                v += av * bv;
                mag += (av * bv).abs();
            }
        }
        let bias = f64::from(self.bias[c]);
        let res = f64::from(self.res[r * s.n + c]);
        (res + (v + bias), mag + bias.abs() + res.abs())
    }

    /// The GEMM on `e` over rows `rows` (a sub-range of the case, as its own launch).
    fn run(&self, e: &CudaExec, rows: std::ops::Range<usize>) -> Result<Vec<f32>> {
        let s = Shape {
            m: rows.len(),
            ..self.s
        };
        let a0 = rows.start * self.s.stride * self.s.cin;
        let pa = e.alloc(s.a_len())?;
        let pb = e.alloc(self.b.len())?;
        let pc = e.alloc(s.m * s.n)?;
        let pbias = e.alloc(s.n)?;
        let pres = e.alloc(s.m * s.n)?;
        let at = |b: usize| P { buf: b, off: 0 };
        e.write(at(pa), &self.a[a0..a0 + s.a_len()])?;
        e.write(at(pb), &self.b)?;
        e.write(at(pbias), &self.bias)?;
        e.write(at(pres), &self.res[rows.start * s.n..rows.end * s.n])?;
        e.gemm(&s.gemm(at(pa), at(pb), at(pc), at(pbias), at(pres)))?;
        let out = e.read(at(pc), s.m * s.n);
        for b in [pa, pb, pc, pbias, pres] {
            e.free(b);
        }
        out
    }

    fn worst(&self, got: &[f32]) -> f64 {
        let s = &self.s;
        let mut w = 0.0f64;
        for r in 0..s.m {
            for c in 0..s.n {
                let (v, mag) = self.reference(r, c);
                let g = f64::from(got[r * s.n + c]);
                let e = if g.is_finite() {
                    (g - v).abs() / mag.max(f64::MIN_POSITIVE)
                } else {
                    f64::INFINITY
                };
                w = w.max(e);
            }
        }
        w
    }
}

/// Runs the check on `gpu` with fresh random inputs.
pub fn tc_gemm(gpu: Arc<Gpu>) -> Result<TcCheck> {
    let mut rng = Rng::new(Rng::fresh_seed());
    // K across segments (split_len: 256 keys past 512) and not a multiple of 32; N not a
    // multiple of 64; M of one row, of the 16-row tile and of the 64-row tile.
    let shapes = [
        Shape {
            m: 1,
            n: 72,
            cin: 96,
            taps: 7,
            stride: 1,
            dil: 3,
        },
        Shape {
            m: 13,
            n: 40,
            cin: 100,
            taps: 7,
            stride: 2,
            dil: 1,
        },
        Shape {
            m: 70,
            n: 136,
            cin: 520,
            taps: 1,
            stride: 1,
            dil: 1,
        },
        Shape {
            m: 37,
            n: 64,
            cin: 44,
            taps: 3,
            stride: 1,
            dil: 9,
        },
        // the wide tiles (cin, K and the segment length multiples of 16, N of 4, more than 64
        // rows): rows not a multiple of 128, N not of 64, K over three segments (the last
        // short), and a strided conv
        Shape {
            m: 300,
            n: 96,
            cin: 96,
            taps: 7,
            stride: 1,
            dil: 3,
        },
        Shape {
            m: 200,
            n: 136,
            cin: 64,
            taps: 3,
            stride: 2,
            dil: 9,
        },
        // 96-wide one-segment tiles with columns past N (88 of 96: zero-filled weights, the
        // last warp's tiles partly outside)
        Shape {
            m: 150,
            n: 88,
            cin: 32,
            taps: 3,
            stride: 1,
            dil: 1,
        },
        // gemm_tcs (up to 16 rows): a linear over four segments, N a multiple of 4 but not of 8
        // (a half-empty n8 tile; the 72-column conv above takes gemm_tcs too)
        Shape {
            m: 16,
            n: 100,
            cin: 1024,
            taps: 1,
            stride: 1,
            dil: 1,
        },
    ];
    let exact = CudaExec::with(gpu.clone(), Variant::Exact, true)?;
    let twin = CudaExec::with(gpu, Variant::LowPrecision, true)?;
    let mut out = TcCheck {
        shapes: Vec::new(),
        exact_worst: 0.0,
        twin_worst: 0.0,
        twin_small_worst: 0.0,
        rows_bitwise: true,
        modes_bitwise: true,
        wide_bitwise: true,
        wide_launches: 0,
        seg1_launches: 0,
        wide96_launches: 0,
        frame_launches: 0,
        small_launches: 0,
        dispatch_as_expected: true,
    };
    let (wide0, small0) = (exact.wide_launches(), exact.small_launches());
    let (seg10, frame0) = (exact.seg1_launches(), exact.frame_launches());
    let w960 = exact.wide96_launches();
    for s in shapes {
        let case = Case::new(s, &mut rng);
        out.shapes.push((s.m, s.n, s.k()));
        // segments across blocks (the default for so few tiles), then inside one block
        exact.set_split_below(Some(usize::MAX));
        let split = case.run(&exact, 0..s.m)?;
        exact.set_split_below(Some(0));
        let inblock = case.run(&exact, 0..s.m)?;
        out.modes_bitwise &= crate::bit_identical(&split, &inblock);
        out.exact_worst = out.exact_worst.max(case.worst(&split));
        for (mode, whole) in [(usize::MAX, &split), (0, &inblock)] {
            exact.set_split_below(Some(mode));
            for r in [0, s.m / 2, s.m - 1] {
                let one = case.run(&exact, r..r + 1)?;
                out.rows_bitwise &= crate::bit_identical(&one, &whole[r * s.n..(r + 1) * s.n]);
            }
        }
        // the cp.async tiles against gemm_tc16 / gemm_tc64, whole launches in both modes and
        // in the default one (the wide GEMMs' segments across blocks where a one-segment
        // kernel is set)
        for (mode, whole) in [
            (Some(usize::MAX), &split),
            (Some(0), &inblock),
            (None, &split),
        ] {
            exact.set_split_below(mode);
            let mut runs = Vec::new();
            for (w, seg1, small, frame, w96) in [
                (None, None, false, 0, false),
                (None, None, false, 16, false),
                (None, None, false, 64, false),
                (None, None, true, 0, false),
                (Some("gemm_tcw"), None, false, 0, false),
                (Some("gemm_tcw2"), None, false, 0, false),
                (Some("gemm_tcw2"), Some("gemm_tcw2s"), false, 0, false),
                (Some("gemm_tcw2"), Some("gemm_tcw3s"), false, 0, false),
                (Some("gemm_tcw2"), Some("gemm_tcw4s"), false, 0, false),
                (Some("gemm_tcw2"), Some("gemm_tcw3s"), false, 0, true),
            ] {
                exact.set_wide(w);
                exact.set_wide96(w96);
                exact.set_seg1(seg1);
                exact.set_small(small);
                exact.set_frame(frame);
                let before = (
                    exact.wide_launches(),
                    exact.small_launches(),
                    exact.seg1_launches(),
                    exact.frame_launches(),
                    exact.wide96_launches(),
                );
                runs.push(case.run(&exact, 0..s.m)?);
                let took = (
                    exact.wide_launches() > before.0,
                    exact.small_launches() > before.1,
                    exact.frame_launches() > before.3,
                );
                let wide = w.is_some() && s.staged() && s.m > crate::cuda::WIDE_MIN_ROWS;
                let tcs = small && s.staged() && s.m <= 16;
                let expect = (wide, tcs, !wide && !tcs && s.m <= frame);
                out.dispatch_as_expected &= took == expect;
                // a one-segment kernel takes every wide GEMM but those whose segments a forced
                // in-block mode keeps together
                let one_seg = wide && seg1.is_some() && (mode != Some(0) || s.segments() == 1);
                out.dispatch_as_expected &= (exact.seg1_launches() > before.2) == one_seg;
                let at96 = one_seg && w96 && crate::cuda::pads_less_at_96(s.n);
                out.dispatch_as_expected &= (exact.wide96_launches() > before.4) == at96;
            }
            exact.set_wide(crate::cuda::wide_kernel());
            exact.set_seg1(crate::cuda::seg1_kernel());
            exact.set_small(crate::cuda::small_tiles());
            exact.set_frame(crate::cuda::frame_rows());
            exact.set_wide96(crate::cuda::wide96());
            out.wide_bitwise &= runs.iter().all(|r| crate::bit_identical(r, whole));
        }
        exact.set_split_below(None);
        // the twin without gemm_tcs (the default build's kernels unless DRAMATIS_CODEC_TCS=1),
        // and on gemm_tcs where it runs
        twin.set_small(false);
        out.twin_worst = out.twin_worst.max(case.worst(&twin.run_case(&case)?));
        if s.staged() && s.m <= 16 {
            twin.set_small(true);
            out.twin_small_worst = out.twin_small_worst.max(case.worst(&twin.run_case(&case)?));
        }
        twin.set_small(crate::cuda::small_tiles());
    }
    out.wide_launches = exact.wide_launches() - wide0;
    out.seg1_launches = exact.seg1_launches() - seg10;
    out.wide96_launches = exact.wide96_launches() - w960;
    out.frame_launches = exact.frame_launches() - frame0;
    out.small_launches = exact.small_launches() - small0;
    Ok(out)
}

impl CudaExec {
    fn run_case(&self, case: &Case) -> Result<Vec<f32>> {
        case.run(self, 0..case.s.m)
    }
}

/// The TF32 split on the device (`tf32_split`: hi made on the bits, lo by cvt.rna) against
/// cvt.rna's own hi: every finite value gives the same bits, every non-finite one a
/// split whose sum as the MMA reads it (the top 19 bits of each) is NaN. Fresh random bit
/// patterns over every exponent, plus the edges: ties and one below them, the largest finite
/// value (which rounds to inf), denormals, zeros, infinities and NaNs (CUDA's 0x7fffffff too).
#[derive(Debug, Clone)]
pub struct SplitCheck {
    /// Values tried.
    pub values: usize,
    /// Finite values whose hi differs from cvt.rna's (should be none; lo is cvt.rna of x - hi).
    pub finite_differ: Vec<u32>,
    /// Non-finite values whose split does not sum to NaN (should be none).
    pub nonfinite_lost: Vec<u32>,
}

impl SplitCheck {
    /// Whether no value failed.
    pub fn pass(&self) -> bool {
        self.finite_differ.is_empty() && self.nonfinite_lost.is_empty()
    }
}

/// Runs the split check on `gpu`.
pub fn tf32_split(gpu: Arc<Gpu>) -> Result<SplitCheck> {
    let exec = CudaExec::new(gpu)?;
    let mut rng = Rng::new(Rng::fresh_seed());
    let mut bits: Vec<u32> = (0..1 << 20).map(|_| rng.next_u64() as u32).collect();
    for sign in [0u32, 0x8000_0000] {
        for e in 0..=255u32 {
            for m in [
                0u32, 0x0fff, 0x1000, 0x1001, 0x1fff, 0x2000, 0x3000, 0x7f_efff, 0x7f_f000,
                0x7f_ffff,
            ] {
                bits.push(sign | (e << 23) | m);
            }
        }
    }
    let x: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
    let out = exec.tf32_split_bits(&x)?;
    let as_mma = |b: u32| f32::from_bits(b & 0xffff_e000);
    let mut c = SplitCheck {
        values: x.len(),
        finite_differ: Vec::new(),
        nonfinite_lost: Vec::new(),
    };
    for (v, [h, l, rh]) in x.iter().zip(out) {
        if v.is_finite() {
            // hi exactly (lo is cvt.rna of x - hi either way, so it agrees when hi does)
            if h != rh {
                c.finite_differ.push(v.to_bits());
            }
        } else if !(as_mma(h) + as_mma(l)).is_nan() {
            c.nonfinite_lost.push(v.to_bits());
        }
    }
    c.finite_differ.truncate(8);
    c.nonfinite_lost.truncate(8);
    Ok(c)
}

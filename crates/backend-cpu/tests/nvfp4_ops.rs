//! NVFP4 weights and the masked router against independent FP64 references on random inputs,
//! each with a planted control showing the check can fail.

use backend_cpu::{route_row, Bytes, CpuBackend, CpuWeight, Format};
use checkpoint::dtype::{bf16_to_f32, f32_to_bf16};
use model::{Backend, BackendError, Rows};

mod common;
use common::{buf, Rng};

/// E2M1 decoded from its definition (sign bit 3, exponent bits 2..1 with bias 1, mantissa bit 0;
/// exponent 0 is subnormal: 0 or 0.5), independently of `checkpoint::dtype`.
fn e2m1_f64(n: u8) -> f64 {
    let (s, e, m) = ((n >> 3) & 1, (n >> 1) & 3, n & 1);
    let mag = if e == 0 {
        0.5 * f64::from(m)
    } else {
        2f64.powi(i32::from(e) - 1) * (1.0 + 0.5 * f64::from(m))
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

/// E4M3FN from its definition (bias 7, exponent 0 subnormal, S.1111.111 NaN).
fn e4m3_f64(b: u8) -> f64 {
    let (s, e, m) = ((b >> 7) & 1, (b >> 3) & 15, b & 7);
    assert!(e != 15 || m != 7, "NaN code in test data");
    let mag = if e == 0 {
        2f64.powi(-6) * f64::from(m) / 8.0
    } else {
        2f64.powi(i32::from(e) - 7) * (1.0 + f64::from(m) / 8.0)
    };
    if s == 1 {
        -mag
    } else {
        mag
    }
}

/// Random packed NVFP4 `[rows, cols]`: every nibble (including −0), scale codes over the whole
/// non-negative finite E4M3 range (subnormals and 0 included), and a global scale with a full
/// 24-bit mantissa. Returns the weight and its FP64 dequantisation.
fn nvfp4_weight(rng: &mut Rng, rows: usize, cols: usize, global: f32) -> (CpuWeight, Vec<f64>) {
    let groups = cols / 16;
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.next() as u8).collect();
    let scale: Vec<u8> = (0..rows * groups)
        .map(|_| {
            // Mostly normal codes around 1..64 so outputs are O(1); some subnormals and zeros.
            match rng.below(16) {
                0 => 0,
                1 => rng.below(8) as u8,
                _ => (48 + rng.below(48)) as u8,
            }
        })
        .collect();
    let mut deq = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let byte = packed[r * cols / 2 + c / 2];
            let nib = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
            deq.push(e2m1_f64(nib) * e4m3_f64(scale[r * groups + c / 16]) * f64::from(global));
        }
    }
    let w = CpuWeight {
        bytes: Bytes::Owned(packed),
        format: Format::Nvfp4 {
            scale: Bytes::Owned(scale),
            global,
        },
        rows,
        cols,
    };
    (w, deq)
}

fn naive_linear(x: &[f32], n: usize, w: &[f64], out: usize, k: usize) -> Vec<f64> {
    let mut y = vec![0f64; n * out];
    for i in 0..n {
        for j in 0..out {
            y[i * out + j] = (0..k).map(|c| f64::from(x[i * k + c]) * w[j * k + c]).sum();
        }
    }
    y
}

/// max |got − want| / max |want|.
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(1e-30f64, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0f64, f64::max);
    worst / scale
}

fn rel_err64(got: &[f64], want: &[f64]) -> f64 {
    let g: Vec<f32> = got.iter().map(|v| *v as f32).collect();
    rel_err(&g, want)
}

/// Global scale with all 24 mantissa bits busy (not a power of two, not BF16-representable).
const GLOBAL: f32 = f32::from_bits(0x3aa1_d2a7); // ≈ 0.00123; mantissa bit 0 set

#[test]
fn nvfp4_dequant_is_the_correctly_rounded_exact_value() {
    let mut rng = Rng(11);
    let (rows, cols) = (37, 272); // 17 groups of 16: a wrong group index or stride shows.
    assert_ne!(f32_to_bf16(GLOBAL) as u32, 0);
    assert_ne!(bf16_to_f32(f32_to_bf16(GLOBAL)), GLOBAL);
    let (w, deq) = nvfp4_weight(&mut rng, rows, cols, GLOBAL);
    let mut row = vec![0f32; cols];
    let mut reordered_mismatch = 0;
    for r in 0..rows {
        w.row_f32(r, &mut row);
        for (c, got) in row.iter().enumerate() {
            let want = deq[r * cols + c] as f32; // one rounding of the exact product
            assert_eq!(got.to_bits(), want.to_bits(), "row {r} col {c}");
        }
        // Control: scale · global first, then the code, rounds twice; the bit check sees it.
        let Format::Nvfp4 { scale, .. } = &w.format else {
            unreachable!()
        };
        for (c, got) in row.iter().enumerate() {
            let byte = w.bytes.get()[r * cols / 2 + c / 2];
            let nib = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
            let s = e4m3_f64(scale.get()[r * cols / 16 + c / 16]) as f32;
            let alt = e2m1_f64(nib) as f32 * (s * GLOBAL);
            reordered_mismatch += usize::from(alt.to_bits() != got.to_bits());
        }
    }
    assert!(
        reordered_mismatch > 0,
        "the control ordering should differ somewhere"
    );
}

#[test]
fn nvfp4_linear_against_f64_both_paths_with_planted_controls() {
    let mut rng = Rng(12);
    let (n, out, k) = (19, 200, 320);
    let x: Vec<f32> = (0..n * k).map(|_| rng.f()).collect();
    let (w, deq) = nvfp4_weight(&mut rng, out, k, GLOBAL);
    let want = naive_linear(&x, n, &deq, out, k);
    // f32 accumulation over k = 320 of O(1) terms: a few ulps of the row norm.
    let tol = 1e-5;
    for rows in [Rows::Exact, Rows::Bulk] {
        let y = CpuBackend.linear(&buf(n, k, x.clone()), &w, rows).unwrap();
        let e = rel_err(&y.data, &want);
        assert!(e <= tol, "{rows:?}: relative error {e:e} exceeds {tol:e}");
    }
    // Precision-discriminating control: the same weights expanded to BF16 miss the tolerance by
    // far (BF16 keeps 8 mantissa bits, the dequantised values need up to 24).
    let deq_bf16: Vec<f64> = deq
        .iter()
        .map(|v| f64::from(bf16_to_f32(f32_to_bf16(*v as f32))))
        .collect();
    let e = rel_err64(&naive_linear(&x, n, &deq_bf16, out, k), &want);
    assert!(
        e > 10.0 * tol,
        "BF16 control error {e:e} is not above the tolerance"
    );
    // Layout controls: swapped nibbles, or one scale per 32 columns, are far outside it.
    let swapped: Vec<f64> = (0..out * k).map(|i| deq[i ^ 1]).collect();
    let e = rel_err64(&naive_linear(&x, n, &swapped, out, k), &want);
    assert!(e > 1e3 * tol, "nibble-order control {e:e}");
    let Format::Nvfp4 { scale, .. } = &w.format else {
        unreachable!()
    };
    let wide: Vec<f64> = (0..out * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            let byte = w.bytes.get()[i / 2];
            let nib = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
            let s = scale.get()[r * k / 16 + (c / 32) * 2];
            e2m1_f64(nib) * e4m3_f64(s) * f64::from(GLOBAL)
        })
        .collect();
    let e = rel_err64(&naive_linear(&x, n, &wide, out, k), &want);
    assert!(e > 1e3 * tol, "scale-group control {e:e}");
}

#[test]
fn nvfp4_exact_rows_are_batch_invariant_and_bulk_small_batches_match() {
    let mut rng = Rng(13);
    let (n, out, k) = (11, 130, 256);
    let x: Vec<f32> = (0..n * k).map(|_| rng.f()).collect();
    let (w, _) = nvfp4_weight(&mut rng, out, k, GLOBAL);
    let all = CpuBackend
        .linear(&buf(n, k, x.clone()), &w, Rows::Exact)
        .unwrap();
    for i in 0..n {
        let one = CpuBackend
            .linear(&buf(1, k, x[i * k..(i + 1) * k].to_vec()), &w, Rows::Exact)
            .unwrap();
        assert_eq!(one.data, all.data[i * out..(i + 1) * out], "row {i}");
    }
}

// ------------------------------------------------------------------------------ router

/// Independent FP64 routing: kept experts only, NaN as −∞, rank by logit then ID, weights
/// `exp(l − M) / Σ_chosen exp(l − M)` (the +∞ limit: equal shares among the chosen +∞).
/// `None` where every kept logit is NaN or −∞.
fn route_f64(l: &[f32], k: usize, keep: &[bool]) -> Option<(Vec<u32>, Vec<f64>)> {
    let v = |i: usize| -> f64 {
        if l[i].is_nan() {
            f64::NEG_INFINITY
        } else {
            f64::from(l[i])
        }
    };
    let mut ids: Vec<usize> = (0..l.len()).filter(|&i| keep[i]).collect();
    let m = ids.iter().map(|&i| v(i)).fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return None;
    }
    // Selection sort with an explicit tie rule, not the library sort.
    let mut chosen = Vec::new();
    for _ in 0..k {
        let mut best = 0;
        for j in 1..ids.len() {
            let (a, b) = (v(ids[j]), v(ids[best]));
            if a > b || (a == b && ids[j] < ids[best]) {
                best = j;
            }
        }
        chosen.push(ids.remove(best));
    }
    let e: Vec<f64> = chosen
        .iter()
        .map(|&i| {
            if m == f64::INFINITY {
                f64::from(u8::from(v(i) == f64::INFINITY))
            } else {
                (v(i) - m).exp()
            }
        })
        .collect();
    let z: f64 = e.iter().sum();
    Some((
        chosen.iter().map(|&i| i as u32).collect(),
        e.iter().map(|x| x / z).collect(),
    ))
}

#[test]
fn masked_router_against_f64_with_ties_and_non_finite_logits() {
    let mut rng = Rng(21);
    let (ne, k) = (24usize, 8usize);
    let mut seen = [0usize; 5]; // ties, NaN, -inf, +inf, errors
    for case in 0..3000 {
        let n = 1 + rng.below(4) as usize;
        // Keep masks from all-kept down to exactly k kept.
        let keep: Vec<bool> = if case % 5 == 0 {
            vec![true; ne]
        } else {
            let mut m = vec![false; ne];
            let kept = k + rng.below((ne - k + 1) as u64) as usize;
            let mut ids: Vec<usize> = (0..ne).collect();
            for i in 0..kept {
                let j = i + rng.below((ne - i) as u64) as usize;
                ids.swap(i, j);
                m[ids[i]] = true;
            }
            m
        };
        let mut logits = Vec::with_capacity(n * ne);
        for _ in 0..n * ne {
            // A coarse grid makes ties common; specials are sprinkled in.
            let v = match rng.below(40) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                2 if case % 7 == 0 => f32::INFINITY,
                3 => -0.0,
                _ if case % 3 == 0 => (rng.below(6) as f32) * 0.5 - 1.0,
                _ => rng.f() * 4.0,
            };
            logits.push(v);
        }
        // Some rows have every kept logit NaN or −∞, and pruned experts at the top.
        if case % 50 == 1 {
            for (i, v) in logits[..ne].iter_mut().enumerate() {
                *v = if keep[i] {
                    [f32::NAN, f32::NEG_INFINITY][i % 2]
                } else {
                    100.0
                };
            }
        }
        if case % 11 == 2 {
            for (i, v) in logits.iter_mut().enumerate() {
                if !keep[i % ne] {
                    *v = f32::INFINITY;
                }
            }
        }
        let want: Vec<_> = logits
            .chunks_exact(ne)
            .map(|r| route_f64(r, k, &keep))
            .collect();
        let keep_arg = (case % 5 != 0).then_some(&keep[..]);
        let got = CpuBackend.route(&buf(n, ne, logits.clone()), k, keep_arg);
        if want.iter().any(Option::is_none) {
            seen[4] += 1;
            let e = got.unwrap_err();
            assert!(
                matches!(e, BackendError::NonFinite { op: "route", .. }),
                "{e}"
            );
            let bad = want.iter().position(Option::is_none).unwrap();
            assert!(e.to_string().contains(&format!("row {bad}")), "{e}");
            continue;
        }
        let got = got.unwrap();
        for (r, (w, row)) in want.iter().zip(logits.chunks_exact(ne)).enumerate() {
            let (ids, ws) = w.as_ref().unwrap();
            assert_eq!(
                &got.experts[r], ids,
                "case {case} row {r}: {row:?} keep {keep:?}"
            );
            for (&e, (&g, &x)) in ids.iter().zip(got.weights[r].iter().zip(ws)) {
                assert!(keep[e as usize], "pruned expert {e} chosen");
                assert!(
                    (f64::from(g) - x).abs() <= 1e-6 * x.max(1e-30) + 1e-7,
                    "case {case} row {r}: weight of {e} is {g}, want {x}"
                );
                if x == 0.0 {
                    assert_eq!(g, 0.0);
                }
            }
            // And the op is row-independent: the row alone gives the same bits.
            let alone = route_row(row, k, keep_arg).unwrap();
            assert_eq!(alone.0, got.experts[r]);
            assert_eq!(alone.1, got.weights[r]);
            let kept_vals: Vec<f32> = (0..ne).filter(|&i| keep[i]).map(|i| row[i]).collect();
            let chosen: Vec<f32> = ids.iter().map(|&i| row[i as usize]).collect();
            let mut sorted = chosen.clone();
            sorted.dedup();
            seen[0] += usize::from(sorted.len() < chosen.len());
            seen[1] += usize::from(kept_vals.iter().any(|v| v.is_nan()));
            seen[2] += usize::from(kept_vals.contains(&f32::NEG_INFINITY));
            seen[3] += usize::from(kept_vals.contains(&f32::INFINITY));
        }
    }
    // The random cases really exercised each situation.
    assert!(seen.iter().all(|&c| c >= 20), "coverage {seen:?}");
}

#[test]
fn router_non_finite_rules_by_example() {
    let b = CpuBackend;
    // NaN ranks as −∞: expert 0 (NaN) loses to every finite logit, even a very negative one.
    let r = b
        .route(&buf(1, 4, vec![f32::NAN, -1e30, 0.0, 1.0]), 3, None)
        .unwrap();
    assert_eq!(r.experts[0], vec![3, 2, 1]);
    // Fewer than k finite kept logits: a −∞/NaN expert fills the slot with weight exactly 0,
    // lowest ID first among them (NaN and −∞ tie).
    let r = b
        .route(
            &buf(1, 4, vec![f32::NEG_INFINITY, 2.0, f32::NAN, 2.0]),
            3,
            None,
        )
        .unwrap();
    assert_eq!(r.experts[0], vec![1, 3, 0]);
    assert_eq!(r.weights[0], vec![0.5, 0.5, 0.0]);
    // +∞ experts share the mass; a pruned +∞ is ignored.
    let keep = [true, true, false, true];
    let r = b
        .route(
            &buf(1, 4, vec![f32::INFINITY, 5.0, f32::INFINITY, f32::INFINITY]),
            2,
            Some(&keep),
        )
        .unwrap();
    assert_eq!(r.experts[0], vec![0, 3]);
    assert_eq!(r.weights[0], vec![0.5, 0.5]);
    // −0 and +0 tie: the lower ID wins.
    let r = b.route(&buf(1, 3, vec![-1.0, 0.0, -0.0]), 1, None).unwrap();
    assert_eq!(r.experts[0], vec![1]);
    let r = b.route(&buf(1, 3, vec![-1.0, -0.0, 0.0]), 1, None).unwrap();
    assert_eq!(r.experts[0], vec![1]);
    // No finite kept logit: a clear error naming the row, even if a pruned expert is finite.
    let keep = [false, true, true];
    let e = b
        .route(
            &buf(2, 3, vec![0.0, 1.0, 2.0, 9.0, f32::NAN, f32::NEG_INFINITY]),
            1,
            Some(&keep),
        )
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("row 1") && msg.contains("NaN or -inf"),
        "{msg}"
    );
    // k above the kept count is refused as a shape error.
    let e = b
        .route(&buf(1, 3, vec![0.0; 3]), 2, Some(&[true, false, false]))
        .unwrap_err();
    assert!(matches!(e, BackendError::Shape { op: "route", .. }), "{e}");
}

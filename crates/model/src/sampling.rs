//! Token sampling (DRAMA3.md §7 and §11 item 4): temperature, top-k, top-p, the repetition-aware
//! resampling of the main token, and a counter-based RNG so a draw depends only on
//! (seed, stream, step), never on batching or timing.

/// RNG stream of the main-token draw.
pub const STREAM_MAIN: u32 = 0;
/// RNG stream of the RAS second draw.
pub const STREAM_RAS: u32 = 1;
/// RNG stream of residual head r is `STREAM_HEAD0 + r`.
pub const STREAM_HEAD0: u32 = 2;

/// The fixed RAS draw: T 1.0, top-k 30, top-p 0.95 (official code).
pub const RAS_TEMPERATURE: f32 = 1.0;
pub const RAS_TOP_K: usize = 30;
pub const RAS_TOP_P: f32 = 0.95;

/// Per-request sampling settings, applied to the main token and every head.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy (argmax, ties to the lower index).
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    pub top_p: f32,
    /// Repetition-aware resampling of the main token (on in normal use; the goldens turn it off).
    pub ras: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 30,
            top_p: 0.9,
            ras: true,
        }
    }
}

impl SamplingParams {
    /// Argmax everywhere, no RAS: what the fixture's greedy goldens used.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            ras: false,
        }
    }
}

/// Philox4x32-10 (Salmon et al., Random123): `ctr` under `key`.
pub fn philox4x32_10(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
        }
        let p0 = M0 * u64::from(c[0]);
        let p1 = M1 * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// A uniform draw in [0, 1) with 53 random bits, keyed by (seed, stream, step).
pub fn uniform(seed: u64, stream: u32, step: u64) -> f64 {
    let key = [seed as u32, (seed >> 32) as u32];
    let out = philox4x32_10([step as u32, (step >> 32) as u32, stream, 0], key);
    let bits = ((u64::from(out[0]) << 32) | u64::from(out[1])) >> 11;
    bits as f64 * (1.0 / (1u64 << 53) as f64)
}

/// What top-p does with the token whose cumulative probability first exceeds `top_p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crossing {
    /// Semantic (main-token) draws keep it.
    Keep,
    /// Acoustic heads drop it.
    Drop,
}

/// Index of the largest logit, ties to the lower index.
pub fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// Indices of `v` by value descending (`f32::total_cmp`), equal values in index order: the
/// order of a stable sort by value, found by sorting one u64 key per value (the value's
/// total-order bits, inverted, above the index), which is several times faster than sorting
/// indices through a comparator.
pub fn rank_desc(v: &[f32]) -> Vec<usize> {
    let mut keys: Vec<u64> = v
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let b = x.to_bits();
            // unsigned keys in total_cmp order: negatives reversed below the positives
            let ord = if b & 0x8000_0000 != 0 {
                !b
            } else {
                b | 0x8000_0000
            };
            (u64::from(!ord) << 32) | i as u64
        })
        .collect();
    keys.sort_unstable();
    keys.into_iter()
        .map(|k| (k & 0xffff_ffff) as usize)
        .collect()
}

/// One draw from `logits` with uniform `u`: `logits / max(T, 1e-5)`, sorted descending (ties to
/// the lower index), softmax over all (the total by `sum_det` in index order), inclusive
/// cumulative sum in rank order; rank 0 always kept, ranks ≥ top_k dropped (top_k > 0), top-p
/// per `crossing`; renormalise and draw. T = 0 is argmax.
pub fn sample(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    crossing: Crossing,
    u: f64,
) -> usize {
    if temperature <= 0.0 || logits.len() <= 1 {
        return argmax(logits);
    }
    let t = temperature.max(1e-5);
    let scaled: Vec<f32> = logits.iter().map(|&l| l / t).collect();
    let order = rank_desc(&scaled);
    let max = f64::from(scaled[order[0]]);
    // the total in index order (so a device draw needs the order of the kept ranks only),
    // the cut and the draw in rank order
    let by_index: Vec<f64> = scaled
        .iter()
        .map(|&x| exp_det(f64::from(x) - max))
        .collect();
    let total = sum_det(&by_index);
    let exps: Vec<f64> = order.iter().map(|&i| by_index[i]).collect();
    let top_p = f64::from(top_p);
    let mut kept = 0usize;
    let mut cum = 0.0f64;
    for (rank, e) in exps.iter().enumerate() {
        let p = e / total;
        let before = cum;
        cum += p;
        if rank > 0 {
            if top_k > 0 && rank >= top_k {
                break;
            }
            let over = match crossing {
                Crossing::Keep => before > top_p,
                Crossing::Drop => cum > top_p,
            };
            if over {
                break;
            }
        }
        kept = rank + 1;
    }
    let mass: f64 = exps[..kept].iter().sum();
    let target = u * mass;
    let mut acc = 0.0;
    for (rank, e) in exps[..kept].iter().enumerate() {
        acc += e;
        if target < acc {
            return order[rank];
        }
    }
    order[kept - 1]
}

/// `e^x` from adds and multiplies only, each rounded once (no fused multiply-add), so the
/// device sampler (`round.cu`) computes the same bits: a platform `exp` may differ in the
/// last place, which would move a draw that lands on a cumulative boundary. Cody-Waite
/// reduction `x = k ln2 + r`, |r| <= ln2/2, and Taylor terms to r^13 (error below 2 ulp).
pub fn exp_det(x: f64) -> f64 {
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    // ln 2 split so that k * LN2_HI is exact for |k| < 2^11
    // (the bit patterns round.cu uses: 6.9314718036912381649e-1 and 1.90821492927058770002e-10)
    const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
    if x.is_nan() {
        return x;
    }
    if x > 709.0 {
        return f64::INFINITY;
    }
    if x < -745.0 {
        return 0.0;
    }
    let k = (x * LOG2E + 0.5).floor();
    let r = (x - k * LN2_HI) - k * LN2_LO;
    // Horner from the r^13 term: 1/13!, 1/12!, ..., 1/1!, 1
    let mut p = EXP_TAYLOR[0];
    for &c in &EXP_TAYLOR[1..] {
        p = p * r + c;
    }
    // p · 2^k in two exact power-of-two steps (k may be below the normal range)
    let k = k as i64;
    let (k1, k2) = (k / 2, k - k / 2);
    p * pow2(k1) * pow2(k2)
}

/// 1/n! for n = 13 down to 0.
const EXP_TAYLOR: [f64; 14] = [
    1.0 / 6_227_020_800.0,
    1.0 / 479_001_600.0,
    1.0 / 39_916_800.0,
    1.0 / 3_628_800.0,
    1.0 / 362_880.0,
    1.0 / 40_320.0,
    1.0 / 5_040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    1.0 / 2.0,
    1.0,
    1.0,
];

/// 2^k for |k| <= 1022 (a normal power of two, built from its bits).
fn pow2(k: i64) -> f64 {
    f64::from_bits(((k + 1023) as u64) << 52)
}

/// The sum of `v` in a fixed order that 32 device threads reproduce: lane j adds the entries
/// `j, j + 32, ...` in turn, then the 32 partials combine by the butterfly `a_j + a_(j^s)` for
/// s = 16, 8, 4, 2, 1 (a warp's xor shuffles); the result is lane 0's.
pub fn sum_det(v: &[f64]) -> f64 {
    let mut a = [0.0f64; 32];
    for (i, &x) in v.iter().enumerate() {
        a[i % 32] += x;
    }
    for s in [16, 8, 4, 2, 1] {
        let b = a;
        for j in 0..32 {
            a[j] = b[j] + b[j ^ s];
        }
    }
    a[0]
}

/// Classifier-free guidance on the main logits, before temperature and truncation:
/// `l_c + γ (l_c − l_u)`. γ = 0 leaves `cond` untouched bit for bit.
pub fn cfg_mix(cond: &mut [f32], uncond: &[f32], gamma: f32) {
    if gamma == 0.0 {
        return;
    }
    for (c, &u) in cond.iter_mut().zip(uncond) {
        *c += gamma * (*c - u);
    }
}

/// The main-token choice: a draw with the request's settings, and (RAS on) a second draw with
/// T 1.0, top-k 30, top-p 0.95 that replaces it when the first is a semantic token among the
/// lane's recent main tokens. Returns the index into `logits`.
pub fn sample_main(
    logits: &[f32],
    candidates: &[u32],
    is_semantic: impl Fn(u32) -> bool,
    recent: impl Iterator<Item = i64>,
    params: &SamplingParams,
    seed: u64,
    step: u64,
) -> usize {
    let first = sample(
        logits,
        params.temperature,
        params.top_k,
        params.top_p,
        Crossing::Keep,
        uniform(seed, STREAM_MAIN, step),
    );
    if !params.ras {
        return first;
    }
    let tok = candidates[first];
    let mut recent = recent;
    if is_semantic(tok) && recent.any(|r| r == i64::from(tok)) {
        // the second draw has its own stream: skipping it when unused changes no other draw
        sample(
            logits,
            RAS_TEMPERATURE,
            RAS_TOP_K,
            RAS_TOP_P,
            Crossing::Keep,
            uniform(seed, STREAM_RAS, step),
        )
    } else {
        first
    }
}

/// Code of residual head r.
pub fn sample_head(
    logits: &[f32],
    params: &SamplingParams,
    seed: u64,
    step: u64,
    r: usize,
) -> usize {
    let stream = STREAM_HEAD0.saturating_add(u32::try_from(r).unwrap_or(u32::MAX));
    sample(
        logits,
        params.temperature,
        params.top_k,
        params.top_p,
        Crossing::Drop,
        uniform(seed, stream, step),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_desc_is_the_stable_descending_sort() {
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for n in [1usize, 2, 7, 300, 4097] {
            // ties, signed zeros, infinities and NaNs of both signs, and ordinary values
            let special = [
                0.0f32,
                -0.0,
                1.5,
                -1.5,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -f32::NAN,
            ];
            let v: Vec<f32> = (0..n)
                .map(|_| {
                    let r = next();
                    if r % 3 == 0 {
                        special[(r >> 8) as usize % special.len()]
                    } else {
                        ((r >> 11) as f64 / (1u64 << 53) as f64 * 20.0 - 10.0) as f32
                    }
                })
                .collect();
            let mut want: Vec<usize> = (0..n).collect();
            want.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
            assert_eq!(rank_desc(&v), want, "n = {n}");
        }
    }

    #[test]
    fn philox_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0, 0]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn uniform_depends_on_each_key_part() {
        let a = uniform(1, 0, 0);
        assert!((0.0..1.0).contains(&a));
        assert_ne!(a, uniform(2, 0, 0));
        assert_ne!(a, uniform(1, 1, 0));
        assert_ne!(a, uniform(1, 0, 1));
        assert_eq!(a, uniform(1, 0, 0));
    }

    #[test]
    fn exp_det_is_within_two_ulp_of_exp() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut worst = 0u64;
        for i in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // most draws in the sampler's range (a logit minus the max), some far out
            let span = if i % 10 == 0 { 745.0 } else { 40.0 };
            let x = -((state >> 11) as f64 / (1u64 << 53) as f64) * span;
            let (a, b) = (exp_det(x), x.exp());
            if b > f64::MIN_POSITIVE {
                worst = worst.max(a.to_bits().abs_diff(b.to_bits()));
            } else {
                assert!(
                    (a - b).abs() <= 2.0 * f64::from_bits(1),
                    "x = {x}: {a} vs {b}"
                );
            }
        }
        assert!(worst <= 2, "worst {worst} ulp");
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(f64::NEG_INFINITY), 0.0);
        assert!(exp_det(f64::NAN).is_nan());
        assert_eq!(exp_det(1000.0), f64::INFINITY);
    }

    #[test]
    fn sum_det_is_the_butterfly_of_32_strided_partials() {
        // 1e16 has a spacing of 2: a left fold adds each 1.0 to 1e16 and loses both (ties to
        // even), while the strided partials add the two ones first (lane 1: entries 1 and 33)
        let mut v = vec![0.0f64; 34];
        v[0] = 1e16;
        v[1] = 1.0;
        v[33] = 1.0;
        let left: f64 = v.iter().sum();
        assert_eq!(left, 1e16);
        assert_eq!(sum_det(&v), 1e16 + 2.0);
        // the butterfly, not a left fold of the partials: lanes 0, 8 and 16 hold 1e16, 1.0 and
        // -1e16; the butterfly cancels lanes 0 and 16 first (1.0), a left fold loses the 1.0
        let mut w = vec![0.0f64; 32];
        w[0] = 1e16;
        w[8] = 1.0;
        w[16] = -1e16;
        assert_eq!(w.iter().sum::<f64>(), 0.0);
        assert_eq!(sum_det(&w), 1.0);
        assert_eq!(sum_det(&[]), 0.0);
        assert_eq!(sum_det(&[0.25, 0.5]), 0.75);
    }

    #[test]
    fn greedy_ties_go_low() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(
            sample(&[1.0, 3.0, 3.0], 0.0, 0, 1.0, Crossing::Keep, 0.99),
            1
        );
    }

    #[test]
    fn top_k_one_is_argmax_for_any_u() {
        let l = [0.5, 2.0, 1.9, -1.0];
        for i in 0..50 {
            let u = i as f64 / 50.0;
            assert_eq!(sample(&l, 1.0, 1, 1.0, Crossing::Keep, u), 1);
        }
    }

    /// Probabilities 0.5, 0.3, 0.2 (logits ln p): top_p 0.8 ends exactly at rank 1.
    #[test]
    fn crossing_token_kept_for_semantic_dropped_for_heads() {
        let l = [0.2f32.ln(), 0.5f32.ln(), 0.3f32.ln()];
        // top_p 0.6: rank 0 (0.5) below, rank 1 crosses (0.8 > 0.6).
        let mut seen_keep = std::collections::BTreeSet::new();
        let mut seen_drop = std::collections::BTreeSet::new();
        for i in 0..200 {
            let u = (i as f64 + 0.5) / 200.0;
            seen_keep.insert(sample(&l, 1.0, 0, 0.6, Crossing::Keep, u));
            seen_drop.insert(sample(&l, 1.0, 0, 0.6, Crossing::Drop, u));
        }
        assert_eq!(seen_keep.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(seen_drop.into_iter().collect::<Vec<_>>(), vec![1]);
    }

    #[test]
    fn draw_follows_renormalised_mass() {
        // Two kept tokens of equal probability: u below 0.5 picks rank 0, above picks rank 1.
        let l = [1.0f32, 1.0, -30.0];
        assert_eq!(sample(&l, 1.0, 2, 1.0, Crossing::Drop, 0.49), 0);
        assert_eq!(sample(&l, 1.0, 2, 1.0, Crossing::Drop, 0.51), 1);
    }

    #[test]
    fn ras_replaces_a_repeated_semantic_token() {
        let cands = [10u32, 20, 21, 22];
        let sem = |t: u32| t >= 20;
        let logits = [0.0f32, 5.0, 4.9, 4.8];
        let p = SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        };
        // 20 not recent: greedy pick stays.
        assert_eq!(
            sample_main(&logits, &cands, sem, [21i64].into_iter(), &p, 0, 0),
            1
        );
        // 20 recent: the RAS draw (temperature 1) decides; over many steps it is not always 1.
        let picks: std::collections::BTreeSet<usize> = (0..64)
            .map(|s| sample_main(&logits, &cands, sem, [20i64].into_iter(), &p, 0, s))
            .collect();
        assert!(picks.len() > 1, "{picks:?}");
        // RAS off: never replaced.
        let off = SamplingParams { ras: false, ..p };
        assert_eq!(
            sample_main(&logits, &cands, sem, [20i64].into_iter(), &off, 0, 0),
            1
        );
    }

    #[test]
    fn cfg_zero_gamma_is_identity() {
        let mut c = vec![1.0f32, -2.0, 0.3];
        let before = c.clone();
        cfg_mix(&mut c, &[5.0, 5.0, 5.0], 0.0);
        assert_eq!(c, before);
        cfg_mix(&mut c, &[0.0, 0.0, 0.0], 1.0);
        assert_eq!(c, vec![2.0, -4.0, 0.6]);
    }
}

//! A small counter-based generator (splitmix64) for contract inputs: fresh per run, reproducible
//! from the printed seed, never all zeros.

/// splitmix64 stream.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// A seed from the clock, so each contract run draws fresh inputs.
    pub fn fresh_seed() -> u64 {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        (t as u64) ^ ((t >> 64) as u64) ^ u64::from(std::process::id()).rotate_left(32)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.uniform() * n as f64) as usize % n.max(1)
    }

    /// `n` normal values times `scale`, as f32.
    pub fn normals_f32(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n).map(|_| (self.normal() * scale) as f32).collect()
    }

    /// `n` normal values times `scale`, rounded to bf16 bits.
    pub fn normals_bf16(&mut self, n: usize, scale: f64) -> Vec<u16> {
        (0..n)
            .map(|_| half::bf16::from_f64(self.normal() * scale).to_bits())
            .collect()
    }

    /// `n` random bytes (NVFP4 code pairs: every byte is valid).
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next_u64() >> 56) as u8).collect()
    }

    /// `n` positive e4m3fn scale bytes between 2^-3 and 2^3 (every mantissa).
    pub fn e4m3_scales(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| ((4 + self.below(7) as u8) << 3) | self.below(8) as u8)
            .collect()
    }

    /// `n` random e4m3fn bytes, NaN encodings (0x7f, 0xff) excluded.
    pub fn fp8_bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n)
            .map(|_| loop {
                let b = (self.next_u64() >> 56) as u8;
                if b & 0x7f != 0x7f {
                    break b;
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reproducible_and_not_degenerate() {
        let mut a = Rng::new(5);
        let mut b = Rng::new(5);
        let xa: Vec<u64> = (0..8).map(|_| a.next_u64()).collect();
        let xb: Vec<u64> = (0..8).map(|_| b.next_u64()).collect();
        assert_eq!(xa, xb);
        let v = Rng::new(1).normals_f32(10_000, 1.0);
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / 1e4;
        let var = v.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / 1e4;
        assert!(mean.abs() < 0.05 && (var - 1.0).abs() < 0.1, "{mean} {var}");
        assert!(Rng::new(2).fp8_bytes(4096).iter().all(|b| b & 0x7f != 0x7f));
    }
}

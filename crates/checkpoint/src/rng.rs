//! Deterministic random values for synthetic checkpoints (weights and codec): one ChaCha stream
//! per (seed, name, piece), so the bytes never depend on order or thread count.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use sha2::{Digest, Sha256};

/// A ChaCha stream for (seed, key, piece): independent of order and threads.
pub fn stream(seed: u64, key: &str, piece: u64) -> ChaCha8Rng {
    let mut h = Sha256::new();
    h.update(b"dramatis-fixture-v1\0");
    h.update(seed.to_le_bytes());
    h.update(key.as_bytes());
    let mut rng = ChaCha8Rng::from_seed(h.finalize().into());
    rng.set_stream(piece);
    rng
}

/// Approximately N(0, 1): Irwin-Hall sum of four 16-bit uniforms, rescaled (tails at ±3.46).
#[inline]
pub fn normal(rng: &mut ChaCha8Rng) -> f32 {
    let x = rng.next_u64();
    let s: u32 = (0..4).map(|i| ((x >> (16 * i)) & 0xffff) as u32).sum();
    // Sum of four U(0,1) has mean 2 and variance 1/3.
    ((s as f32 + 2.0) / 65536.0 - 2.0) * 3f32.sqrt()
}

/// U(0, 1) with 24 random bits.
#[inline]
pub fn uniform(rng: &mut ChaCha8Rng) -> f32 {
    (rng.next_u64() >> 40) as f32 / (1u32 << 24) as f32
}

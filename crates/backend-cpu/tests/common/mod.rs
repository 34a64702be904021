//! Test data shared by the op tests: a deterministic RNG and a buffer helper.
#![allow(dead_code)]

use backend_cpu::{CpuBackend, CpuBuf};
use model::Backend;

/// xorshift64*: deterministic test data without a dependency.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1), never exactly 0.
    pub fn f(&mut self) -> f32 {
        let u = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        let v = 2.0 * u - 1.0;
        if v == 0.0 {
            0.5
        } else {
            v
        }
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f() * scale).collect()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

pub fn buf(rows: usize, cols: usize, data: Vec<f32>) -> CpuBuf {
    CpuBackend.upload(&data, rows, cols).unwrap()
}

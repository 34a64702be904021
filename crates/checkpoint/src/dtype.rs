//! Stored element types and their conversion to f32. Conversions are table-driven or bit-exact;
//! no value is ever rounded on the way to f32.

use serde::Serialize;
use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum DType {
    BF16,
    F16,
    F32,
    F64,
    I64,
    U8,
    F8E4M3,
}

impl DType {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "BF16" => Self::BF16,
            "F16" => Self::F16,
            "F32" => Self::F32,
            "F64" => Self::F64,
            "I64" => Self::I64,
            "U8" => Self::U8,
            "F8_E4M3" => Self::F8E4M3,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::BF16 => "BF16",
            Self::F16 => "F16",
            Self::F32 => "F32",
            Self::F64 => "F64",
            Self::I64 => "I64",
            Self::U8 => "U8",
            Self::F8E4M3 => "F8_E4M3",
        }
    }

    pub fn size(self) -> usize {
        match self {
            Self::BF16 | Self::F16 => 2,
            Self::F32 => 4,
            Self::F64 | Self::I64 => 8,
            Self::U8 | Self::F8E4M3 => 1,
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Round-to-nearest-even f32 -> bf16 bits (NaN stays NaN).
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// E4M3FN (no infinities; 0x7f/0xff are NaN) to f32, exact.
pub fn f8e4m3_to_f32(b: u8) -> f32 {
    f8_table()[b as usize]
}

pub fn f8_table() -> &'static [f32; 256] {
    static T: OnceLock<[f32; 256]> = OnceLock::new();
    T.get_or_init(|| {
        let mut t = [0f32; 256];
        for (i, v) in t.iter_mut().enumerate() {
            let b = i as u8;
            let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
            let e = ((b >> 3) & 0xf) as i32;
            let m = (b & 7) as f32;
            *v = if e == 0xf && (b & 7) == 7 {
                f32::NAN
            } else if e == 0 {
                sign * m / 8.0 * 2f32.powi(-6)
            } else {
                sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
            };
        }
        t
    })
}

/// f32 -> E4M3FN, round to nearest even, saturating at ±448 (the fixture's quantiser convention).
pub fn f32_to_f8e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let t = f8_table();
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(448.0);
    // Positive codes 0..=0x7e are monotonic in value; binary search the nearest.
    let (mut lo, mut hi) = (0usize, 0x7eusize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if t[mid] <= a {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    let (dl, dh) = (a - t[lo], t[hi] - a);
    let code = if dl < dh || (dl == dh && lo % 2 == 0) {
        lo
    } else {
        hi
    };
    sign | code as u8
}

/// E2M1 (NVFP4 element) to f32: values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign in bit 3.
pub fn e2m1_to_f32(nibble: u8) -> f32 {
    const V: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let v = V[(nibble & 7) as usize];
    if nibble & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Decodes little-endian stored elements of `dtype` to f32 (integers converted by value).
pub fn decode_to_f32(dtype: DType, bytes: &[u8], out: &mut Vec<f32>) {
    out.clear();
    match dtype {
        DType::BF16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]]))),
        ),
        DType::F16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()),
        ),
        DType::F32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        DType::F64 => out.extend(bytes.chunks_exact(8).map(|c| {
            f64::from_le_bytes(c.try_into().expect("chunks_exact(8) yields 8 bytes")) as f32
        })),
        DType::I64 => out.extend(bytes.chunks_exact(8).map(|c| {
            i64::from_le_bytes(c.try_into().expect("chunks_exact(8) yields 8 bytes")) as f32
        })),
        DType::U8 => out.extend(bytes.iter().map(|&b| b as f32)),
        DType::F8E4M3 => {
            let t = f8_table();
            out.extend(bytes.iter().map(|&b| t[b as usize]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f8_known_values() {
        assert_eq!(f8e4m3_to_f32(0x00), 0.0);
        assert_eq!(f8e4m3_to_f32(0x38), 1.0);
        assert_eq!(f8e4m3_to_f32(0x7e), 448.0);
        assert_eq!(f8e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(f8e4m3_to_f32(0xb8), -1.0);
        assert!(f8e4m3_to_f32(0x7f).is_nan());
        assert!(f8e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn f8_round_trip_every_code() {
        for b in 0u8..=255 {
            let v = f8e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            let back = f32_to_f8e4m3(v);
            // -0 and +0 both decode to 0.
            assert_eq!(f8e4m3_to_f32(back), v, "code {b:#x}");
        }
        assert_eq!(f8e4m3_to_f32(f32_to_f8e4m3(1000.0)), 448.0);
        // 1.0625 lies halfway between 1.0 (even mantissa) and 1.125.
        assert_eq!(f8e4m3_to_f32(f32_to_f8e4m3(1.0625)), 1.0);
    }

    #[test]
    fn bf16_exact() {
        let x = 1.0f32 + 2f32.powi(-7);
        assert_eq!(bf16_to_f32(f32_to_bf16(x)), x);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
    }

    #[test]
    fn e2m1_values() {
        assert_eq!(e2m1_to_f32(0x7), 6.0);
        assert_eq!(e2m1_to_f32(0xf), -6.0);
        assert_eq!(e2m1_to_f32(0x1), 0.5);
    }
}

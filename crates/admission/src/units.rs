//! One newtype per unit (ADMISSION.md "Units: never mix them").
//!
//! Every quantity is a `u64` underneath; the type says what it counts, and its `Display` names the
//! unit, so a limit message can never print "8190" without saying "frames".

use serde::{Deserialize, Serialize};
use std::fmt;

macro_rules! unit {
    ($(#[$doc:meta])* $name:ident, $unit:literal) => {
        $(#[$doc])*
        #[derive(
            Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
        )]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The unit's name as it appears in messages.
            pub const UNIT: &'static str = $unit;

            pub const fn new(value: u64) -> Self {
                Self(value)
            }

            pub const fn get(self) -> u64 {
                self.0
            }

            /// From a `usize` (always fits on the 64-bit targets we build for; refused otherwise).
            pub fn from_usize(value: usize) -> Option<Self> {
                u64::try_from(value).ok().map(Self)
            }

            pub fn checked_add(self, other: Self) -> Option<Self> {
                self.0.checked_add(other.0).map(Self)
            }

            pub fn checked_sub(self, other: Self) -> Option<Self> {
                self.0.checked_sub(other.0).map(Self)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{} {}", self.0, $unit)
            }
        }
    };
}

unit!(
    /// UTF-8 bytes of request input as sent (HTTP body or request text).
    InputBytes,
    "bytes"
);
unit!(
    /// Unicode scalar values of the request text.
    CodePoints,
    "code points"
);
unit!(
    /// Tokens of the request text after tokenization.
    TextTokens,
    "text tokens"
);
unit!(
    /// Wrapper tokens of the prompt template (`<|im_start|>`, `system`, newlines, `<|voice|>`...).
    StructuralTokens,
    "structural tokens"
);
unit!(
    /// Tokens of one reference passage's transcript.
    TranscriptTokens,
    "reference transcript tokens"
);
unit!(
    /// UTF-8 bytes of one reference passage's transcript.
    TranscriptBytes,
    "reference transcript bytes"
);
unit!(
    /// Acoustic code rows (10 codebooks each) of one reference passage.
    ReferenceFrames,
    "reference frames"
);
unit!(
    /// Reference passages in one request.
    ReferencePassages,
    "reference passages"
);
unit!(
    /// P: every row the backbone consumes before the first generated frame.
    PromptRows,
    "prompt rows"
);
unit!(
    /// F: generated frames (one backbone row and 10 codes each).
    Frames,
    "frames"
);
unit!(
    /// C: rows of position state reserved for one request (one lane).
    Window,
    "window rows"
);
unit!(
    /// Rows of KV state held by the pool or by one reservation (P + F + 1 per request).
    Rows,
    "KV rows"
);
unit!(
    /// Concurrent requests (each with its own recurrent state).
    Lanes,
    "lanes"
);
unit!(
    /// Memory bytes.
    Bytes,
    "B"
);
unit!(
    /// PCM samples (mono).
    Samples,
    "samples"
);

const GIB: u64 = 1 << 30;

impl Bytes {
    pub const fn from_mib(mib: u64) -> Option<Self> {
        match mib.checked_mul(1 << 20) {
            Some(b) => Some(Self(b)),
            None => None,
        }
    }

    pub const fn from_gib(gib: u64) -> Option<Self> {
        match gib.checked_mul(GIB) {
            Some(b) => Some(Self(b)),
            None => None,
        }
    }

    /// A fractional GiB figure from the command line (`--device-gib 79.5`). `None` when it is not
    /// finite, negative, or does not fit in `u64` bytes.
    pub fn from_gib_f64(gib: f64) -> Option<Self> {
        if !gib.is_finite() || gib < 0.0 {
            return None;
        }
        let bytes = (gib * 1_073_741_824.0).floor();
        // 2^64 is exactly representable; anything at or above it does not fit.
        if bytes >= 18_446_744_073_709_551_616.0 {
            return None;
        }
        // The range was checked just above, so the float-to-int conversion is exact and in range.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(Self(bytes as u64))
    }

    /// GiB with three decimals, by integer arithmetic (no float rounding of large sizes).
    pub fn gib_string(self) -> String {
        let milli = (u128::from(self.0) * 1000 + u128::from(GIB) / 2) / u128::from(GIB);
        format!("{}.{:03}", milli / 1000, milli % 1000)
    }
}

impl Frames {
    /// PCM samples for this many frames (`frame_length` samples each); `None` on overflow.
    pub fn samples(self, frame_length: u64) -> Option<Samples> {
        self.0.checked_mul(frame_length).map(Samples)
    }
}

impl PromptRows {
    /// The window's minimum prompt: two rows (ADMISSION.md: `P >= 2`).
    pub const MIN: Self = Self(2);
}

/// The parts of an assembled prompt, each in its own unit; `rows()` is P.
///
/// Each text, structural and transcript token is one row; each reference frame is one row.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptComposition {
    pub structural: StructuralTokens,
    pub text: TextTokens,
    pub reference_transcripts: Vec<TranscriptTokens>,
    pub reference_frames: Vec<ReferenceFrames>,
}

impl PromptComposition {
    /// P, with checked sums (`None` on overflow, which the caller refuses).
    pub fn rows(&self) -> Option<PromptRows> {
        let mut rows = self.structural.0.checked_add(self.text.0)?;
        for t in &self.reference_transcripts {
            rows = rows.checked_add(t.0)?;
        }
        for f in &self.reference_frames {
            rows = rows.checked_add(f.0)?;
        }
        Some(PromptRows(rows))
    }
}

/// Thousands separators for human output: `12348030976` -> `12,348,030,976`.
pub fn group_digits(value: u64) -> String {
    let digits = value.to_string();
    let head = match digits.len() % 3 {
        0 => 3,
        r => r,
    };
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    out.push_str(&digits[..head]);
    let mut i = head;
    while i < digits.len() {
        out.push(',');
        out.push_str(&digits[i..i + 3]);
        i += 3;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_unit() {
        assert_eq!(Frames(8190).to_string(), "8190 frames");
        assert_eq!(CodePoints(3).to_string(), "3 code points");
        assert_eq!(Window(8192).to_string(), "8192 window rows");
        assert_eq!(
            TranscriptBytes(4097).to_string(),
            "4097 reference transcript bytes"
        );
    }

    #[test]
    fn serde_is_transparent() {
        assert_eq!(serde_json::to_string(&PromptRows(7)).unwrap(), "7");
        let w: Window = serde_json::from_str("262144").unwrap();
        assert_eq!(w, Window(262144));
    }

    #[test]
    fn gib_conversions() {
        assert_eq!(Bytes::from_gib(1), Some(Bytes(1 << 30)));
        assert_eq!(Bytes::from_gib(u64::MAX), None);
        assert_eq!(Bytes::from_gib_f64(0.5), Some(Bytes(1 << 29)));
        assert_eq!(Bytes::from_gib_f64(-1.0), None);
        assert_eq!(Bytes::from_gib_f64(f64::NAN), None);
        assert_eq!(Bytes::from_gib_f64(f64::INFINITY), None);
        assert_eq!(Bytes::from_gib_f64(1e12), None);
        assert_eq!(Bytes(12_348_030_976).gib_string(), "11.500");
        assert_eq!(Bytes(u64::MAX).gib_string(), "17179869184.000");
    }

    #[test]
    fn scale_figure_samples() {
        // ADMISSION.md: F = 262141 frames at 2048 samples per frame.
        assert_eq!(Frames(262_141).samples(2048), Some(Samples(536_864_768)));
        assert_eq!(Frames(u64::MAX).samples(2048), None);
    }

    #[test]
    fn grouping() {
        assert_eq!(group_digits(0), "0");
        assert_eq!(group_digits(999), "999");
        assert_eq!(group_digits(1000), "1,000");
        assert_eq!(group_digits(12_348_030_976), "12,348,030,976");
    }

    #[test]
    fn composition_sums_rows_and_refuses_overflow() {
        let c = PromptComposition {
            structural: StructuralTokens(9),
            text: TextTokens(20),
            reference_transcripts: vec![TranscriptTokens(5)],
            reference_frames: vec![ReferenceFrames(646)],
        };
        assert_eq!(c.rows(), Some(PromptRows(680)));
        let big = PromptComposition {
            structural: StructuralTokens(u64::MAX),
            text: TextTokens(1),
            ..Default::default()
        };
        assert_eq!(big.rows(), None);
    }
}

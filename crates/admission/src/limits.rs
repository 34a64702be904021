//! Input and reference limits (ADMISSION.md "Starting limits"): each in its own unit, configured and
//! reported separately, and never relabelled as a window limit.

use crate::error::LimitError;
use crate::units::{
    CodePoints, Frames, InputBytes, ReferenceFrames, ReferencePassages, TranscriptBytes,
};
use serde::{Deserialize, Serialize};

/// The HTTP input policy (`/v1/models` `input_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InputPolicy {
    pub max_body_bytes: InputBytes,
    pub max_text_bytes: InputBytes,
    pub max_code_points: CodePoints,
}

/// Reference safety limits (`/v1/models` `reference_limits`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReferenceLimits {
    pub max_passages: ReferencePassages,
    pub max_transcript_bytes: TranscriptBytes,
    /// Per passage.
    pub max_frames: ReferenceFrames,
}

/// Every non-window limit, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub input_policy: InputPolicy,
    pub reference_limits: ReferenceLimits,
    /// The frame cap when a request names none; it alone may shrink to fit the window.
    pub default_frame_cap: Frames,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            input_policy: InputPolicy {
                max_body_bytes: InputBytes(32 << 20),
                max_text_bytes: InputBytes(1 << 20),
                max_code_points: CodePoints(262_144),
            },
            reference_limits: ReferenceLimits {
                max_passages: ReferencePassages(4),
                max_transcript_bytes: TranscriptBytes(4096),
                max_frames: ReferenceFrames(646),
            },
            default_frame_cap: Frames(1024),
        }
    }
}

impl Limits {
    pub fn check_body(&self, body: InputBytes) -> Result<(), LimitError> {
        let limit = self.input_policy.max_body_bytes;
        if body > limit {
            return Err(LimitError::BodyTooLarge { body, limit });
        }
        Ok(())
    }

    /// Bytes first (cheap, and a code point is at least one byte), then code points.
    pub fn check_text(&self, text: &str) -> Result<(), LimitError> {
        let bytes = InputBytes::from_usize(text.len()).ok_or(LimitError::Overflow {
            what: "request text bytes",
        })?;
        let limit = self.input_policy.max_text_bytes;
        if bytes > limit {
            return Err(LimitError::TextTooLongBytes { text: bytes, limit });
        }
        let points = CodePoints::from_usize(text.chars().count()).ok_or(LimitError::Overflow {
            what: "request text code points",
        })?;
        let limit = self.input_policy.max_code_points;
        if points > limit {
            return Err(LimitError::TextTooLongCodePoints {
                text: points,
                limit,
            });
        }
        Ok(())
    }

    pub fn check_passages(&self, passages: ReferencePassages) -> Result<(), LimitError> {
        let limit = self.reference_limits.max_passages;
        if passages > limit {
            return Err(LimitError::TooManyReferences { passages, limit });
        }
        Ok(())
    }

    /// `index` is the passage's position in the request (0-based), for the message.
    pub fn check_transcript(&self, index: u64, transcript: &str) -> Result<(), LimitError> {
        let bytes = TranscriptBytes::from_usize(transcript.len()).ok_or(LimitError::Overflow {
            what: "reference transcript bytes",
        })?;
        let limit = self.reference_limits.max_transcript_bytes;
        if bytes > limit {
            return Err(LimitError::TranscriptTooLong {
                index,
                transcript: bytes,
                limit,
            });
        }
        Ok(())
    }

    pub fn check_reference_frames(
        &self,
        index: u64,
        frames: ReferenceFrames,
    ) -> Result<(), LimitError> {
        let limit = self.reference_limits.max_frames;
        if frames > limit {
            return Err(LimitError::ReferenceTooLong {
                index,
                frames,
                limit,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_admission_md() {
        let l = Limits::default();
        assert_eq!(l.input_policy.max_body_bytes, InputBytes(33_554_432));
        assert_eq!(l.input_policy.max_text_bytes, InputBytes(1_048_576));
        assert_eq!(l.input_policy.max_code_points, CodePoints(262_144));
        assert_eq!(l.reference_limits.max_passages, ReferencePassages(4));
        assert_eq!(
            l.reference_limits.max_transcript_bytes,
            TranscriptBytes(4096)
        );
        assert_eq!(l.reference_limits.max_frames, ReferenceFrames(646));
        assert_eq!(l.default_frame_cap, Frames(1024));
    }

    #[test]
    fn serialises_with_spec_field_names() {
        let v = serde_json::to_value(Limits::default()).unwrap();
        assert_eq!(v["input_policy"]["max_body_bytes"], 33_554_432);
        assert_eq!(v["input_policy"]["max_code_points"], 262_144);
        assert_eq!(v["reference_limits"]["max_passages"], 4);
        assert_eq!(v["reference_limits"]["max_transcript_bytes"], 4096);
        assert_eq!(v["reference_limits"]["max_frames"], 646);
        assert_eq!(v["default_frame_cap"], 1024);
    }

    #[test]
    fn body_boundary() {
        let l = Limits::default();
        assert!(l.check_body(InputBytes(32 << 20)).is_ok());
        let e = l.check_body(InputBytes((32 << 20) + 1)).unwrap_err();
        assert_eq!(e.code(), "body_too_large");
        assert_eq!(e.kind().http_status(), 413);
        assert!(e.to_string().contains("33554433 bytes"));
        assert!(e.to_string().contains("33554432 bytes"));
    }

    #[test]
    fn text_bytes_and_code_points_are_distinct_limits() {
        let mut l = Limits::default();
        l.input_policy.max_text_bytes = InputBytes(8);
        l.input_policy.max_code_points = CodePoints(3);
        // 4 code points, 4 bytes: over the code-point limit only.
        let e = l.check_text("abcd").unwrap_err();
        assert_eq!(e.code(), "text_too_long_code_points");
        assert!(e.to_string().contains("4 code points"), "{e}");
        // 3 code points, 9 bytes: over the byte limit only.
        let e = l.check_text("ééé\u{20ac}").unwrap_err();
        assert_eq!(e.code(), "text_too_long_bytes");
        assert!(e.to_string().contains("9 bytes"), "{e}");
        assert!(l.check_text("éé€").is_ok());
    }

    #[test]
    fn reference_limits_name_their_units() {
        let l = Limits::default();
        assert!(l.check_passages(ReferencePassages(4)).is_ok());
        let e = l.check_passages(ReferencePassages(5)).unwrap_err();
        assert_eq!(e.code(), "too_many_references");
        assert!(e.to_string().contains("5 reference passages"));

        assert!(l.check_transcript(0, &"a".repeat(4096)).is_ok());
        let e = l.check_transcript(2, &"a".repeat(4097)).unwrap_err();
        assert_eq!(e.code(), "transcript_too_long_bytes");
        assert!(e.to_string().contains("4097 reference transcript bytes"));
        assert!(e.to_string().contains("passage 2"));

        assert!(l.check_reference_frames(0, ReferenceFrames(646)).is_ok());
        let e = l
            .check_reference_frames(1, ReferenceFrames(647))
            .unwrap_err();
        assert_eq!(e.code(), "reference_too_long_frames");
        assert!(e.to_string().contains("647 reference frames"));
        // Never relabelled as a window limit.
        assert!(!e.to_string().contains("window"));
    }
}

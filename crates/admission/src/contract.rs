//! The window contract: `P >= 2`, `F >= 1`, `P + F + 1 <= C`, `C <= max_position_embeddings`.
//!
//! Every comparison is a subtraction from C (which is bounded), so no figure a request sends, up to
//! `u64::MAX`, can overflow here.

use crate::error::LimitError;
use crate::units::{Frames, PromptRows, Rows, Window};
use serde::{Deserialize, Serialize};

/// Rows reserved beyond P + F.
pub const RESERVED_ROWS: u64 = 1;
/// The smallest window: P = 2, F = 1, one reserved row.
pub const MIN_WINDOW: Window = Window(4);

/// The frame budget a request asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind", content = "frames")]
pub enum FrameCap {
    /// Honoured exactly or refused.
    Explicit(Frames),
    /// The configured default cap; it alone may shrink to fit.
    Default,
}

/// Which cap applied to an admitted request (reported in the reply).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CapKind {
    Explicit,
    Default,
    /// The default cap, shrunk to `C - P - 1`.
    DefaultShrunk,
}

impl CapKind {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Explicit => "explicit",
            Self::Default => "default",
            Self::DefaultShrunk => "default_shrunk",
        }
    }
}

/// A configured window, checked against the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct WindowContract {
    pub window: Window,
    pub max_position_embeddings: Window,
    pub default_frame_cap: Frames,
}

/// An admitted request: the frame cap generation will run to (end of speech may stop earlier).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Admission {
    pub prompt_rows: PromptRows,
    pub frames: Frames,
    pub window: Window,
    pub cap: CapKind,
}

impl Admission {
    /// P + F + 1: the KV rows this request reserves. For an admission made by
    /// [`WindowContract::admit`] this never exceeds C; a hand-built one saturates rather than wraps.
    pub fn rows(&self) -> Rows {
        Rows(
            self.prompt_rows
                .0
                .saturating_add(self.frames.0)
                .saturating_add(RESERVED_ROWS),
        )
    }
}

impl WindowContract {
    /// `window` defaults (at the caller) to the model maximum; anything above it is refused.
    pub fn new(
        window: Window,
        max_position_embeddings: Window,
        default_frame_cap: Frames,
    ) -> Result<Self, LimitError> {
        if window > max_position_embeddings {
            return Err(LimitError::ContextOverModelMax {
                window,
                max: max_position_embeddings,
            });
        }
        if window < MIN_WINDOW {
            return Err(LimitError::WindowTooSmall {
                window,
                min: MIN_WINDOW,
            });
        }
        if default_frame_cap.0 == 0 {
            return Err(LimitError::FramesZero);
        }
        Ok(Self {
            window,
            max_position_embeddings,
            default_frame_cap,
        })
    }

    /// The largest P that leaves room for one frame: `C - 2`.
    pub fn prompt_rows_max(&self) -> PromptRows {
        PromptRows(self.window.0.saturating_sub(1 + RESERVED_ROWS))
    }

    /// The largest F for the smallest prompt: `C - 3`.
    pub fn frames_max(&self) -> Frames {
        self.largest_frames(PromptRows::MIN)
    }

    /// `C - P - 1`, or 0 when P leaves no room.
    pub fn largest_frames(&self, prompt_rows: PromptRows) -> Frames {
        Frames(
            self.window
                .0
                .saturating_sub(RESERVED_ROWS)
                .saturating_sub(prompt_rows.0),
        )
    }

    /// The contract for one request.
    pub fn admit(&self, prompt_rows: PromptRows, cap: FrameCap) -> Result<Admission, LimitError> {
        if prompt_rows < PromptRows::MIN {
            return Err(LimitError::PromptTooShort {
                prompt_rows,
                min: PromptRows::MIN,
            });
        }
        if let FrameCap::Explicit(Frames(0)) = cap {
            return Err(LimitError::FramesZero);
        }
        if prompt_rows > self.prompt_rows_max() {
            return Err(LimitError::WindowExceeded {
                prompt_rows,
                window: self.window,
                prompt_rows_max: self.prompt_rows_max(),
            });
        }
        let largest = self.largest_frames(prompt_rows);
        let (frames, kind) = match cap {
            FrameCap::Explicit(frames) if frames <= largest => (frames, CapKind::Explicit),
            FrameCap::Explicit(frames) => {
                return Err(LimitError::FramesExceeded {
                    prompt_rows,
                    frames,
                    window: self.window,
                    largest_frames: largest,
                })
            }
            FrameCap::Default if self.default_frame_cap <= largest => {
                (self.default_frame_cap, CapKind::Default)
            }
            FrameCap::Default => (largest, CapKind::DefaultShrunk),
        };
        Ok(Admission {
            prompt_rows,
            frames,
            window: self.window,
            cap: kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Window = Window(262_144);

    fn contract(c: u64) -> WindowContract {
        WindowContract::new(Window(c), MAX, Frames(1024)).unwrap()
    }

    #[test]
    fn boundary_matrix() {
        for c in [8, 1024, 8192, 262_144] {
            let k = contract(c);
            for p in [2, 3, c / 2, c - 3] {
                // P + F + 1 = C admitted, exactly that F.
                let f = c - p - 1;
                let a = k
                    .admit(PromptRows(p), FrameCap::Explicit(Frames(f)))
                    .unwrap();
                assert_eq!(a.frames, Frames(f));
                assert_eq!(a.cap, CapKind::Explicit);
                assert_eq!(a.rows(), Rows(c));
                // One more frame refused, naming the largest F.
                let e = k
                    .admit(PromptRows(p), FrameCap::Explicit(Frames(f + 1)))
                    .unwrap_err();
                assert_eq!(
                    e,
                    LimitError::FramesExceeded {
                        prompt_rows: PromptRows(p),
                        frames: Frames(f + 1),
                        window: Window(c),
                        largest_frames: Frames(f),
                    }
                );
                assert_eq!(e.code(), "frames_exceeded");
                // One more prompt row refused.
                let e = k
                    .admit(PromptRows(p + 1), FrameCap::Explicit(Frames(f)))
                    .unwrap_err();
                assert_eq!(e.code(), "frames_exceeded");
                assert_eq!(e.kind().http_status(), 413);
            }
            // A prompt that leaves no room for one frame.
            let e = k
                .admit(PromptRows(c - 1), FrameCap::Explicit(Frames(1)))
                .unwrap_err();
            assert_eq!(e.code(), "window_exceeded");
            let e = k.admit(PromptRows(c - 1), FrameCap::Default).unwrap_err();
            assert_eq!(e.code(), "window_exceeded");
            // F = 0 and P < 2 refused.
            let e = k
                .admit(PromptRows(2), FrameCap::Explicit(Frames(0)))
                .unwrap_err();
            assert_eq!(e, LimitError::FramesZero);
            assert_eq!(e.kind().http_status(), 400);
            for p in [0, 1] {
                let e = k.admit(PromptRows(p), FrameCap::Default).unwrap_err();
                assert_eq!(e.code(), "prompt_too_short");
            }
        }
    }

    #[test]
    fn the_peer_failure_8190_in_8192_is_exact() {
        let a = contract(8192)
            .admit(PromptRows(2), FrameCap::Explicit(Frames(8189)))
            .unwrap();
        assert_eq!(a.frames, Frames(8189));
        let e = contract(8192)
            .admit(PromptRows(2), FrameCap::Explicit(Frames(8190)))
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("8190 frames"), "{msg}");
        assert!(msg.contains("2 prompt rows"), "{msg}");
        assert!(msg.contains("8192 window rows"), "{msg}");
        assert!(
            msg.contains("largest cap that fits is 8189 frames"),
            "{msg}"
        );
    }

    #[test]
    fn model_maximum() {
        assert!(WindowContract::new(Window(262_144), MAX, Frames(1024)).is_ok());
        let e = WindowContract::new(Window(262_145), MAX, Frames(1024)).unwrap_err();
        assert_eq!(e.code(), "context_over_model_max");
        assert!(e.to_string().contains("262145 window rows"));
        assert!(e.to_string().contains("262144 window rows"));
        let e = WindowContract::new(Window(3), MAX, Frames(1024)).unwrap_err();
        assert_eq!(e.code(), "window_too_small");
        assert!(WindowContract::new(Window(4), MAX, Frames(1024)).is_ok());
        let k = contract(262_144);
        assert_eq!(k.prompt_rows_max(), PromptRows(262_142));
        assert_eq!(k.frames_max(), Frames(262_141));
    }

    #[test]
    fn default_cap_shrinks_and_says_so() {
        let k = contract(8192);
        let a = k.admit(PromptRows(100), FrameCap::Default).unwrap();
        assert_eq!((a.frames, a.cap), (Frames(1024), CapKind::Default));
        // Exactly at the boundary the default still applies unshrunk.
        let a = k.admit(PromptRows(8192 - 1025), FrameCap::Default).unwrap();
        assert_eq!((a.frames, a.cap), (Frames(1024), CapKind::Default));
        let a = k.admit(PromptRows(8192 - 1024), FrameCap::Default).unwrap();
        assert_eq!((a.frames, a.cap), (Frames(1023), CapKind::DefaultShrunk));
        assert_eq!(a.rows(), Rows(8192));
        let a = contract(100)
            .admit(PromptRows(2), FrameCap::Default)
            .unwrap();
        assert_eq!((a.frames, a.cap), (Frames(97), CapKind::DefaultShrunk));
        // An explicit cap never shrinks.
        let e = contract(100)
            .admit(PromptRows(2), FrameCap::Explicit(Frames(1024)))
            .unwrap_err();
        assert_eq!(e.code(), "frames_exceeded");
    }

    #[test]
    fn figures_near_u64_max_refuse_without_panic() {
        let k = contract(262_144);
        let e = k
            .admit(PromptRows(2), FrameCap::Explicit(Frames(u64::MAX)))
            .unwrap_err();
        assert_eq!(e.code(), "frames_exceeded");
        let e = k
            .admit(PromptRows(u64::MAX), FrameCap::Default)
            .unwrap_err();
        assert_eq!(e.code(), "window_exceeded");
        let e = k
            .admit(PromptRows(u64::MAX), FrameCap::Explicit(Frames(u64::MAX)))
            .unwrap_err();
        assert_eq!(e.code(), "window_exceeded");
        let big = u64::try_from(usize::MAX).unwrap();
        let e = k
            .admit(PromptRows(big - 1), FrameCap::Explicit(Frames(big)))
            .unwrap_err();
        assert_eq!(e.code(), "window_exceeded");
        let e = WindowContract::new(Window(u64::MAX), Window(u64::MAX), Frames(u64::MAX));
        let k = e.unwrap();
        let a = k
            .admit(PromptRows(u64::MAX - 3), FrameCap::Explicit(Frames(2)))
            .unwrap();
        assert_eq!(a.rows(), Rows(u64::MAX));
        let e = k
            .admit(PromptRows(u64::MAX - 3), FrameCap::Explicit(Frames(3)))
            .unwrap_err();
        assert_eq!(e.code(), "frames_exceeded");
    }
}

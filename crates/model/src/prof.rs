//! Host time per phase of the frame round (`DRAMATIS_PROFILE=1`), printed to stderr when the
//! model is dropped: where a frame's time goes outside the backend's ops (sampling, the model's
//! own bookkeeping) next to the phases that wait on the device.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

/// The phases of one round, in order.
#[derive(Clone, Copy, Debug)]
pub enum Phase {
    /// Candidate logits of every lane (and guidance branch), downloaded.
    MainLogits,
    /// Guidance mix, logits hook, main-token draws.
    SampleMain,
    /// The tower's layers and head logits (includes the head draws below).
    Tower,
    /// The nine head draws.
    SampleHeads,
    /// The frame fed back through the backbone.
    Advance,
}

const PHASES: [(Phase, &str); 5] = [
    (Phase::MainLogits, "main logits"),
    (Phase::SampleMain, "sample main"),
    (Phase::Tower, "tower"),
    (Phase::SampleHeads, "sample heads"),
    (Phase::Advance, "advance"),
];

static NS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
static CALLS: [AtomicU64; 5] = [const { AtomicU64::new(0) }; 5];
static ROUNDS: AtomicU64 = AtomicU64::new(0);

/// Whether `DRAMATIS_PROFILE` is set (read once).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("DRAMATIS_PROFILE").is_some())
}

/// Times a phase until dropped (nothing when profiling is off).
pub struct Span {
    phase: Phase,
    t0: Option<Instant>,
}

pub fn span(phase: Phase) -> Span {
    Span {
        phase,
        t0: enabled().then(Instant::now),
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(t0) = self.t0 {
            let i = self.phase as usize;
            NS[i].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            CALLS[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Counts one frame round.
pub fn round() {
    if enabled() {
        ROUNDS.fetch_add(1, Ordering::Relaxed);
    }
}

/// The table so far: phase, calls, total ms, ms per round.
pub fn report() -> String {
    let rounds = ROUNDS.load(Ordering::Relaxed).max(1) as f64;
    let mut out = format!(
        "model profile: {} frame rounds\nphase           calls     total ms   ms/round\n",
        ROUNDS.load(Ordering::Relaxed)
    );
    for (p, name) in PHASES {
        let ns = NS[p as usize].load(Ordering::Relaxed) as f64;
        out.push_str(&format!(
            "{name:<14} {:>6} {:>12.1} {:>10.3}\n",
            CALLS[p as usize].load(Ordering::Relaxed),
            ns / 1e6,
            ns / 1e6 / rounds
        ));
    }
    out
}

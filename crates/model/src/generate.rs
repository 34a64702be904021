//! The frame loop (DRAMA3.md §4.7): main token with RAS, the tower's 9 head draws, then the
//! frame fed back through the backbone. Batched rounds give each lane exactly its solo result.

use crate::backend::{Backend, Branch, RoundLane};
use crate::lane::{LaneState, RAS_WINDOW};
use crate::model::{Model, Row};
use crate::prof::Phase;
use crate::sampling::{cfg_mix, sample_head, sample_main, SamplingParams};
use crate::ModelError;

/// What one frame round produced for a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameOut {
    /// End of speech: nothing emitted, the lane is finished.
    Eos,
    /// `[main, c0, …, c9]`, already fed back as the lane's next backbone row.
    Frame(Row),
}

/// One lane's settings for a round.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LaneStep {
    pub params: SamplingParams,
    pub seed: u64,
    /// Frame index within the request (the RNG counter).
    pub step: u64,
}

/// Values seen during a round, per lane (for goldens and debugging).
#[derive(Debug, Clone, Default)]
pub struct StepTrace {
    /// Final hidden the frame was predicted from, `[H]`.
    pub hidden: Vec<f32>,
    /// Candidate logits after any hook, `[candidates]`.
    pub main_logits: Vec<f32>,
    /// Head r's logits, `[codebooks-1][CB]` (empty on EOS).
    pub head_logits: Vec<Vec<f32>>,
}

/// Classifier-free guidance for one round: per lane an optional unconditional branch and its γ.
pub struct Guidance<'a, B: Backend> {
    pub uncond: Vec<Option<&'a mut LaneState<B>>>,
    pub gamma: Vec<f32>,
    /// Both branches in one batched step (same bits as separate steps; fewer launches).
    pub batched: bool,
}

/// A hook on each lane's candidate logits before sampling (lane index, logits): where
/// classifier-free guidance mixes in the unconditional branch (`sampling::cfg_mix`).
pub type LogitsHook<'a> = &'a mut dyn FnMut(usize, &mut [f32]) -> Result<(), ModelError>;

impl<B: Backend> Model<B> {
    /// One frame for one lane.
    pub fn step_frame(
        &self,
        lane: &mut LaneState<B>,
        params: &SamplingParams,
        seed: u64,
        step: u64,
    ) -> Result<FrameOut, ModelError> {
        let s = LaneStep {
            params: *params,
            seed,
            step,
        };
        Ok(self.step_frames(&mut [lane], &[s], None, None)?[0])
    }

    /// One frame for one lane, with the values it saw.
    pub fn step_frame_traced(
        &self,
        lane: &mut LaneState<B>,
        params: &SamplingParams,
        seed: u64,
        step: u64,
    ) -> Result<(FrameOut, StepTrace), ModelError> {
        let s = LaneStep {
            params: *params,
            seed,
            step,
        };
        let mut tr = Vec::new();
        let out = self.step_frames(&mut [lane], &[s], None, Some(&mut tr))?;
        Ok((out[0], tr.pop().unwrap_or_default()))
    }

    /// One shared frame round over several lanes (`steps[i]` for `lanes[i]`). Lanes that end
    /// (EOS) are not advanced. Each lane's result equals its solo [`Model::step_frame`] bit for bit.
    pub fn step_frames(
        &self,
        lanes: &mut [&mut LaneState<B>],
        steps: &[LaneStep],
        hook: Option<LogitsHook<'_>>,
        trace: Option<&mut Vec<StepTrace>>,
    ) -> Result<Vec<FrameOut>, ModelError> {
        self.step_frames_guided(lanes, steps, None, hook, trace)
    }

    /// A frame round with classifier-free guidance (DRAMA3.md section 7): lane i's unconditional
    /// branch (`guidance.uncond[i]`, its own backbone state only) gives `l_u`, and the lane samples
    /// from `l_c + γ_i (l_c − l_u)`; the tower and heads run on the conditional branch alone, and
    /// both branches advance with the same frame. Rows are exact, so batching the two branches in
    /// one backbone call (`guidance.batched`) gives the same bits as separate calls.
    ///
    /// Without a hook or trace, a backend that keeps rounds runs the round there, guidance
    /// included ([`Model::step_frames_kept_guided`]); otherwise [`Model::step_frames_host`].
    pub fn step_frames_guided(
        &self,
        lanes: &mut [&mut LaneState<B>],
        steps: &[LaneStep],
        guidance: Option<&mut Guidance<'_, B>>,
        hook: Option<LogitsHook<'_>>,
        trace: Option<&mut Vec<StepTrace>>,
    ) -> Result<Vec<FrameOut>, ModelError> {
        // a router trace downloads inside the round: rounds then go through the host
        if hook.is_none()
            && trace.is_none()
            && self.route_trace.is_none()
            && self.backend.resident_rounds()
        {
            return self.step_frames_kept_guided(lanes, steps, guidance);
        }
        self.step_frames_host(lanes, steps, guidance, hook, trace)
    }

    /// [`Model::step_frames_guided`] with every draw on the host after its head's logits are
    /// downloaded, whatever the backend (the reference for kept rounds).
    pub fn step_frames_host(
        &self,
        lanes: &mut [&mut LaneState<B>],
        steps: &[LaneStep],
        mut guidance: Option<&mut Guidance<'_, B>>,
        hook: Option<LogitsHook<'_>>,
        mut trace: Option<&mut Vec<StepTrace>>,
    ) -> Result<Vec<FrameOut>, ModelError> {
        check_lanes(lanes, steps, guidance.as_deref())?;
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let g = &self.geometry;
        let n_lanes = lanes.len();
        bump(&self.round_stats.host, 1);
        crate::prof::round();
        let span = crate::prof::span(Phase::MainLogits);
        // Main logits of both branches: one call when batched, else one per branch.
        let (mut logits, uncond_logits) = match guidance.as_deref_mut() {
            None => (self.main_logits(lanes)?, Vec::new()),
            Some(gd) => {
                if gd.batched {
                    let mut all: Vec<&mut LaneState<B>> =
                        lanes.iter_mut().map(|l| &mut **l).collect();
                    all.extend(gd.uncond.iter_mut().filter_map(|u| u.as_deref_mut()));
                    let mut l = self.main_logits(&all)?;
                    let u = l.split_off(n_lanes);
                    (l, u)
                } else {
                    let c = self.main_logits(lanes)?;
                    let us: Vec<&mut LaneState<B>> = gd
                        .uncond
                        .iter_mut()
                        .filter_map(|u| u.as_deref_mut())
                        .collect();
                    let u = if us.is_empty() {
                        Vec::new()
                    } else {
                        self.main_logits(&us)?
                    };
                    (c, u)
                }
            }
        };
        drop(span);
        let span = crate::prof::span(Phase::SampleMain);
        if let Some(gd) = guidance.as_deref() {
            let mut j = 0;
            for (i, u) in gd.uncond.iter().enumerate() {
                if u.is_some() {
                    cfg_mix(&mut logits[i], &uncond_logits[j], gd.gamma[i]);
                    j += 1;
                }
            }
        }
        if let Some(h) = hook {
            for (i, l) in logits.iter_mut().enumerate() {
                h(i, l)?;
            }
        }
        if let Some(t) = trace.as_deref_mut() {
            for (l, lg) in lanes.iter().zip(&logits) {
                let hidden = match &l.last_hidden {
                    Some(h) => self.backend.download(h)?,
                    None => Vec::new(),
                };
                t.push(StepTrace {
                    hidden,
                    main_logits: lg.clone(),
                    head_logits: Vec::new(),
                });
            }
        }
        let mut out = vec![FrameOut::Eos; lanes.len()];
        let (mut active, mut mains) = (Vec::new(), Vec::new());
        // Each lane's draw depends on its own logits, history and counter: lanes draw in
        // parallel when there are several.
        let draw = |i: usize| {
            let c = sample_main(
                &logits[i],
                self.candidates(),
                |t| g.is_semantic(i64::from(t)),
                lanes[i].recent_main_tokens(),
                &steps[i].params,
                steps[i].seed,
                steps[i].step,
            );
            self.candidates()[c]
        };
        let toks: Vec<u32> = crate::lanes_map(n_lanes, draw);
        for (i, tok) in toks.into_iter().enumerate() {
            if g.is_semantic(i64::from(tok)) {
                active.push(i);
                mains.push(tok);
            }
        }
        drop(span);
        if active.is_empty() {
            return Ok(out);
        }
        let mut sub: Vec<&mut LaneState<B>> = Vec::with_capacity(active.len());
        {
            let mut want = active.iter().peekable();
            for (i, l) in lanes.iter_mut().enumerate() {
                if want.peek() == Some(&&i) {
                    want.next();
                    sub.push(&mut **l);
                }
            }
        }
        let mut heads = Vec::new();
        let span = crate::prof::span(Phase::Tower);
        let frames = self.tower_step(
            &mut sub,
            &mains,
            &|r, i, row| {
                let _s = crate::prof::span(Phase::SampleHeads);
                let s = &steps[active[i]];
                sample_head(row, &s.params, s.seed, s.step, r) as u32
            },
            // head logits are kept only for a trace
            if trace.is_some() {
                Some(&mut heads)
            } else {
                None
            },
        )?;
        drop(span);
        let _span = crate::prof::span(Phase::Advance);
        // The unconditional branches of the lanes that produced a frame follow with that frame.
        let mut sub_u: Vec<&mut LaneState<B>> = Vec::new();
        let mut frames_u: Vec<Row> = Vec::new();
        let batched = guidance.as_deref().map(|g| g.batched).unwrap_or(false);
        if let Some(gd) = guidance {
            let mut want = active.iter().enumerate().peekable();
            for (i, u) in gd.uncond.iter_mut().enumerate() {
                if let Some(&(j, &a)) = want.peek() {
                    if a == i {
                        want.next();
                        if let Some(u) = u.as_deref_mut() {
                            sub_u.push(u);
                            frames_u.push(frames[j]);
                        }
                    }
                }
            }
        }
        if batched && !sub_u.is_empty() {
            let mut all = sub;
            all.extend(sub_u);
            let mut all_frames = frames.clone();
            all_frames.extend_from_slice(&frames_u);
            self.advance(&mut all, &all_frames)?;
        } else {
            self.advance(&mut sub, &frames)?;
            if !sub_u.is_empty() {
                self.advance(&mut sub_u, &frames_u)?;
            }
        }
        let n = active.len();
        for (j, &i) in active.iter().enumerate() {
            out[i] = FrameOut::Frame(frames[j]);
            if let Some(t) = trace.as_deref_mut() {
                // `heads` is [head][lane].
                t[i].head_logits = heads.iter().skip(j).step_by(n).cloned().collect();
            }
        }
        Ok(out)
    }
}

/// Step settings for each lane, guidance (if any) for each lane, and each lane and
/// unconditional branch able to take a frame: room for its backbone row (checked before
/// anything is drawn) and not spent by an EOS in a kept round.
fn check_lanes<B: Backend>(
    lanes: &[&mut LaneState<B>],
    steps: &[LaneStep],
    guidance: Option<&Guidance<'_, B>>,
) -> Result<(), ModelError> {
    if lanes.len() != steps.len() {
        return Err(ModelError::Unsupported(format!(
            "{} lanes but {} step settings",
            lanes.len(),
            steps.len()
        )));
    }
    if let Some(gd) = guidance {
        if gd.uncond.len() != lanes.len() || gd.gamma.len() != lanes.len() {
            return Err(ModelError::Unsupported(format!(
                "{} lanes but guidance for {} (gamma for {})",
                lanes.len(),
                gd.uncond.len(),
                gd.gamma.len()
            )));
        }
    }
    let branches = guidance.into_iter().flat_map(|g| g.uncond.iter().flatten());
    for l in lanes.iter().map(|l| &**l).chain(branches.map(|u| &**u)) {
        l.check_room(1)?;
        if l.ended {
            return Err(ModelError::Unsupported(
                "the lane drew EOS in a round kept on the backend, which also fed its state \
                 forward; it cannot continue"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// Rounds a lane set runs as issued before it is recorded (see [`KeptRound`]'s `runs`).
const RECORD_AFTER: u64 = 2;

/// Lane sets whose recording may fail before the model stops recording altogether.
const CAPTURE_TRIES: u64 = 3;

/// Rounds ghosts may run with no further lane retiring before the round is rebuilt without
/// them (about a recording's cost in ghost rows at 32 lanes, a guess to check with receipts).
const GHOST_ROUNDS: u64 = 16;

/// How frame rounds ran, counted since the model was loaded (shared: [`Model::round_stats`]).
/// A kept round is replayed (a recorded graph), recorded (then replayed), or issued (its
/// launches made one by one); every new lane set is a set change.
#[derive(Debug, Default)]
pub struct RoundStats {
    pub host: std::sync::atomic::AtomicU64,
    pub kept: std::sync::atomic::AtomicU64,
    pub replayed: std::sync::atomic::AtomicU64,
    pub recorded: std::sync::atomic::AtomicU64,
    pub issued: std::sync::atomic::AtomicU64,
    pub set_changes: std::sync::atomic::AtomicU64,
    /// Nanoseconds spent recording (the round's own time included).
    pub record_ns: std::sync::atomic::AtomicU64,
    /// Nanoseconds from the start of a kept round to its frames on the host.
    pub kept_ns: std::sync::atomic::AtomicU64,
}

/// A copy of [`RoundStats`] at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct RoundCounts {
    pub host: u64,
    pub kept: u64,
    pub replayed: u64,
    pub recorded: u64,
    pub issued: u64,
    pub set_changes: u64,
    pub record_ns: u64,
    pub kept_ns: u64,
}

impl RoundStats {
    pub fn counts(&self) -> RoundCounts {
        use std::sync::atomic::Ordering::Relaxed;
        RoundCounts {
            host: self.host.load(Relaxed),
            kept: self.kept.load(Relaxed),
            replayed: self.replayed.load(Relaxed),
            recorded: self.recorded.load(Relaxed),
            issued: self.issued.load(Relaxed),
            set_changes: self.set_changes.load(Relaxed),
            record_ns: self.record_ns.load(Relaxed),
            kept_ns: self.kept_ns.load(Relaxed),
        }
    }
}

impl RoundCounts {
    /// What happened between `earlier` and this copy.
    pub fn since(&self, earlier: &RoundCounts) -> RoundCounts {
        RoundCounts {
            host: self.host - earlier.host,
            kept: self.kept - earlier.kept,
            replayed: self.replayed - earlier.replayed,
            recorded: self.recorded - earlier.recorded,
            issued: self.issued - earlier.issued,
            set_changes: self.set_changes - earlier.set_changes,
            record_ns: self.record_ns - earlier.record_ns,
            kept_ns: self.kept_ns - earlier.kept_ns,
        }
    }
}

fn bump(c: &std::sync::atomic::AtomicU64, by: u64) {
    c.fetch_add(by, std::sync::atomic::Ordering::Relaxed);
}

/// A frame round kept on the backend for one lane set, with the lane buffers it reads and
/// writes: a slot per lane (drawing slots first). Rebuilt when a lane joins, a lane's
/// newest-hidden buffer changes, or a lane leaves that was not handed back with
/// [`Model::retire`]; a retired lane keeps its slot as a ghost, computed and ignored, so lanes
/// finishing one by one do not each cost a new recording.
pub(crate) struct KeptRound<B: Backend> {
    /// `(id, gen)` of the lane in each slot.
    key: Vec<(u64, u64)>,
    round: B::Round,
    /// Rounds run through it. The first runs as issued: it compiles kernels and builds
    /// tables, which a recording must not. A lane set is recorded only once it has run
    /// [`RECORD_AFTER`] rounds: recording costs about a third of a 32-lane round and pays back
    /// only over several replays, and lanes joining and leaving change the set often.
    runs: u64,
    /// Set when recording this lane set failed: its rounds run as issued.
    no_record: bool,
    /// Rounds since a lane last retired into a ghost (ghosts that linger cost every round,
    /// while a rebuild is paid once: after [`GHOST_ROUNDS`] the round is rebuilt).
    since_retire: u64,
    /// The drawing slots (`0..leaders`).
    leaders: usize,
    /// The inputs last written to each slot; a ghost's stay as they were when it retired, its
    /// counters at the lane's final rows, so each round rewrites the row after them.
    inputs: Vec<RoundLane>,
    /// Retired lanes still in their slots. Declared after `round`, so they are dropped after
    /// it (and after its recording, which names their buffers).
    ghosts: Vec<Ghost<B>>,
}

/// A retired lane kept in its slot of a [`KeptRound`].
pub(crate) struct Ghost<B: Backend> {
    slot: usize,
    lane: LaneState<B>,
}

impl<B: Backend> KeptRound<B> {
    /// The slot of each lane of `key` (with `branch`, the first `leaders` drawing) if this
    /// round can run them: every slot is one of them or a ghost, and they keep their roles
    /// and guidance pairs. (Ghosts are never more than the lanes: `retire` drops a round
    /// before they would be.)
    fn seat(&self, key: &[(u64, u64)], branch: &[Branch], leaders: usize) -> Option<Vec<usize>> {
        if !self.ghosts.is_empty() && self.since_retire >= GHOST_ROUNDS {
            return None;
        }
        let slot_of = key
            .iter()
            .map(|id| self.key.iter().position(|k| k == id))
            .collect::<Option<Vec<usize>>>()?;
        let mut filled = vec![false; self.key.len()];
        for s in slot_of.iter().chain(self.ghosts.iter().map(|g| &g.slot)) {
            if std::mem::replace(&mut filled[*s], true) {
                return None;
            }
        }
        if filled.contains(&false) {
            return None;
        }
        for (i, &s) in slot_of.iter().enumerate() {
            if (i < leaders) != (s < self.leaders)
                || self.inputs[s].branch != slot_branch(branch[i], &slot_of)
            {
                return None;
            }
        }
        Some(slot_of)
    }
}

/// `b` (naming lanes) with the lanes' slots.
fn slot_branch(b: Branch, slot_of: &[usize]) -> Branch {
    match b {
        Branch::Own => Branch::Own,
        Branch::Guided { uncond, gamma } => Branch::Guided {
            uncond: slot_of[uncond],
            gamma,
        },
        Branch::Uncond { of } => Branch::Uncond { of: slot_of[of] },
    }
}

impl<B: Backend> Model<B> {
    /// [`Model::step_frames`] without a hook or trace on a backend that keeps rounds: the
    /// draws run on the backend (same RNG counters and arithmetic), the round is recorded once
    /// per lane set and replayed, and the frames come back in one download. Lanes that draw EOS
    /// are spent: see [`LaneState`]'s `ended`.
    pub fn step_frames_kept(
        &self,
        lanes: &mut [&mut LaneState<B>],
        steps: &[LaneStep],
    ) -> Result<Vec<FrameOut>, ModelError> {
        self.step_frames_kept_guided(lanes, steps, None)
    }

    /// [`Model::step_frames_kept`] with classifier-free guidance: each guided lane's
    /// unconditional branch joins the round after the drawing lanes (its backbone row batched
    /// with theirs, its main logits mixed into its lane's on the backend), and follows with the
    /// lane's frame. A branch is spent with its lane when the lane draws EOS.
    pub fn step_frames_kept_guided(
        &self,
        lanes: &mut [&mut LaneState<B>],
        steps: &[LaneStep],
        guidance: Option<&mut Guidance<'_, B>>,
    ) -> Result<Vec<FrameOut>, ModelError> {
        check_lanes(lanes, steps, guidance.as_deref())?;
        let leaders = lanes.len();
        let mut branch = vec![Branch::Own; leaders];
        let mut all: Vec<&mut LaneState<B>> = lanes.iter_mut().map(|l| &mut **l).collect();
        let mut all_steps = steps.to_vec();
        if let Some(gd) = guidance {
            for (i, u) in gd.uncond.iter_mut().enumerate() {
                if let Some(u) = u.as_deref_mut() {
                    branch[i] = Branch::Guided {
                        uncond: all.len(),
                        gamma: gd.gamma[i],
                    };
                    branch.push(Branch::Uncond { of: i });
                    all.push(u);
                    all_steps.push(steps[i]);
                }
            }
        }
        self.kept_round(&mut all, &all_steps, &branch, leaders)
    }

    /// Hands back a lane that is done (its job finished or failed). If the kept round has a
    /// slot for it, it stays there as a ghost (computed, ignored) until the round is rebuilt, so
    /// the next rounds of the other lanes replay the same recording; otherwise it is dropped.
    /// A lane without room for one more row is dropped (a ghost rewrites the row after its
    /// last).
    pub fn retire(&self, lane: LaneState<B>) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = kept.as_mut() {
            let slot = k.key.iter().position(|&x| x == (lane.id, lane.gen));
            if let Some(s) = slot {
                // only a lane exactly one round past the inputs its slot last ran, with its
                // buffers in place (not one a failed prefill or round left part-way)
                let drew = s < k.leaders;
                let fits = lane.last_hidden.is_some()
                    && lane.rows == k.inputs[s].rows + 1
                    && (!drew || lane.tower_rows == k.inputs[s].tower_rows + 1)
                    && lane.check_room(1).is_ok();
                if fits {
                    k.inputs[s].rows = lane.rows;
                    k.inputs[s].tower_rows = lane.tower_rows;
                    k.ghosts.push(Ghost { slot: s, lane });
                    k.since_retire = 0;
                    if 2 * k.ghosts.len() > k.key.len() {
                        // more ghosts than lanes: the round will not run again, and holding it
                        // would hold every lane's memory while the engine waits
                        *kept = None;
                    }
                    return;
                }
            }
        }
        drop(kept);
        drop(lane);
    }

    /// Drops the kept round if it holds ghosts: called before a lane is made, so the memory of
    /// lanes that are done is free before new lanes take theirs.
    pub(crate) fn drop_ghosts(&self) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.as_ref().is_some_and(|k| !k.ghosts.is_empty()) {
            *kept = None;
        }
    }

    /// A kept round over `lanes` (the first `leaders` draw; the rest are their unconditional
    /// branches), with each lane's part in `branch`.
    fn kept_round(
        &self,
        lanes: &mut [&mut LaneState<B>],
        steps: &[LaneStep],
        branch: &[Branch],
        leaders: usize,
    ) -> Result<Vec<FrameOut>, ModelError> {
        let be = &self.backend;
        let g = &self.geometry;
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        let mut inputs = Vec::with_capacity(lanes.len());
        for (i, ((l, s), &b)) in lanes.iter().zip(steps).zip(branch).enumerate() {
            if i < leaders && !l.has_tower() {
                return Err(ModelError::Unsupported(
                    "a backbone-only lane (guidance branch) cannot run the tower".into(),
                ));
            }
            let last = l.last_row.ok_or(ModelError::NotPrefilled)?;
            if l.last_hidden.is_none() {
                return Err(ModelError::NotPrefilled);
            }
            let mut recent = [0i64; RAS_WINDOW];
            for (d, r) in recent.iter_mut().zip(l.recent_main_tokens()) {
                *d = r;
            }
            inputs.push(RoundLane {
                rows: l.rows,
                tower_rows: l.tower_rows,
                last,
                params: s.params,
                seed: s.seed,
                step: s.step,
                recent,
                n_recent: l.recent.len(),
                branch: b,
            });
        }
        crate::prof::round();
        let _span = crate::prof::span(Phase::Tower);
        let stats = &self.round_stats;
        let t_round = std::time::Instant::now();
        let key: Vec<(u64, u64)> = lanes.iter().map(|l| (l.id, l.gen)).collect();
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let seated = kept.as_ref().and_then(|k| k.seat(&key, branch, leaders));
        let slot_of = match seated {
            Some(slot_of) => {
                let Some(k) = kept.as_mut() else {
                    unreachable!("seated in it")
                };
                for (inp, &s) in inputs.iter().zip(&slot_of) {
                    k.inputs[s] = RoundLane {
                        branch: slot_branch(inp.branch, &slot_of),
                        ..*inp
                    };
                }
                slot_of
            }
            None => {
                // the old round's recording and buffers go first, then its ghosts
                *kept = None;
                bump(&stats.set_changes, 1);
                *kept = Some(KeptRound {
                    key,
                    round: be.round_new(lanes.len(), &self.round_spec())?,
                    runs: 0,
                    no_record: false,
                    since_retire: 0,
                    leaders,
                    // a new set's slots are its lanes in order
                    inputs,
                    ghosts: Vec::new(),
                });
                (0..lanes.len()).collect()
            }
        };
        let Some(k) = kept.as_mut() else {
            unreachable!("set above")
        };
        let KeptRound {
            round,
            runs,
            no_record,
            since_retire,
            leaders: slot_leaders,
            inputs: slot_inputs,
            ghosts,
            ..
        } = k;
        let slot_leaders = *slot_leaders;
        let has_ghosts = !ghosts.is_empty();
        // every slot's lane: the caller's, or a ghost
        let mut seats: Vec<Option<&mut LaneState<B>>> =
            (0..slot_inputs.len()).map(|_| None).collect();
        for (l, &s) in lanes.iter_mut().zip(&slot_of) {
            seats[s] = Some(&mut **l);
        }
        for gh in ghosts.iter_mut() {
            seats[gh.slot] = Some(&mut gh.lane);
        }
        let mut slots = seats
            .into_iter()
            .collect::<Option<Vec<&mut LaneState<B>>>>()
            .ok_or_else(|| ModelError::Unsupported("a kept round slot has no lane".into()))?;
        be.round_write(round, slot_inputs)?;
        if be.round_replay(round)? {
            bump(&stats.replayed, 1);
        } else {
            let record = *runs >= RECORD_AFTER
                && !*no_record
                && self
                    .capture_failures
                    .load(std::sync::atomic::Ordering::Relaxed)
                    < CAPTURE_TRIES
                && be.capture_begin()?;
            if record {
                let t0 = std::time::Instant::now();
                let body = self.round_body(&mut slots, round, slot_leaders);
                let ended = be.capture_end(round, body.is_ok());
                bump(&stats.record_ns, t0.elapsed().as_nanos() as u64);
                tracing::info!(
                    lanes = slots.len(),
                    ms = t0.elapsed().as_secs_f64() * 1e3,
                    "recorded a frame round"
                );
                match body.and(ended.map_err(ModelError::from)) {
                    Ok(()) => {
                        if !be.round_replay(round)? {
                            return Err(ModelError::Unsupported(
                                "the backend recorded a round but kept no graph".into(),
                            ));
                        }
                        bump(&stats.recorded, 1);
                    }
                    Err(e) => {
                        // Nothing ran and no host state moved (round ops leave the host
                        // counters to the bookkeeping below): run the round as issued. Only if
                        // that works was the failure the recording's, and later rounds are
                        // issued too; otherwise the error is the round's and is returned.
                        self.round_body(&mut slots, round, slot_leaders)?;
                        bump(&stats.issued, 1);
                        // this lane set runs as issued; a later set tries again (a failure can
                        // be passing, e.g. memory), until CAPTURE_TRIES sets have failed
                        *no_record = true;
                        let failed = 1 + self
                            .capture_failures
                            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::warn!(
                            failed,
                            "frame round not recorded, this lane set runs as issued{}: {e}",
                            if failed >= CAPTURE_TRIES {
                                "; no more recordings"
                            } else {
                                ""
                            }
                        );
                    }
                }
            } else {
                self.round_body(&mut slots, round, slot_leaders)?;
                bump(&stats.issued, 1);
            }
        }
        *runs += 1;
        *since_retire += 1;
        let all = match be.round_frames(round) {
            Ok(all) => all,
            Err(e @ crate::BackendError::NonFinite { .. }) if has_ghosts => {
                // A device error flag is one for the whole round, and a ghost (a finished lane
                // computing on) may have raised it. The round ran to its end, so if every
                // lane's newest hidden is finite their frames stand, and the round is rebuilt
                // without its ghosts next time; otherwise the error is a lane's.
                let mut lanes_finite = true;
                for &s in &slot_of {
                    let h = slots[s]
                        .last_hidden
                        .as_ref()
                        .ok_or(ModelError::NotPrefilled)?;
                    lanes_finite &= be.download(h)?.iter().all(|v| v.is_finite());
                }
                if !lanes_finite {
                    return Err(e.into());
                }
                tracing::warn!("a kept round's ghost slot raised an error, rebuilding: {e}");
                *since_retire = GHOST_ROUNDS;
                be.round_frames(round)?
            }
            Err(e) => return Err(e.into()),
        };
        drop(slots);
        let frames: Vec<Row> = slot_of.iter().map(|&s| all[s]).collect();
        bump(&stats.kept, 1);
        bump(&stats.kept_ns, t_round.elapsed().as_nanos() as u64);
        let mut out = Vec::with_capacity(leaders);
        for (i, (l, f)) in lanes.iter_mut().zip(frames).enumerate() {
            l.rows += 1;
            if i < leaders {
                l.tower_rows += 1;
            }
            // an unconditional branch ran the backbone only (a tower it may carry did not move)
            let tower = if i < leaders {
                &mut l.tower_kv[..]
            } else {
                &mut [][..]
            };
            for (kv, want) in
                l.kv.iter_mut()
                    .map(|k| (k, l.rows))
                    .chain(tower.iter_mut().map(|k| (k, l.tower_rows)))
            {
                be.kv_note(kv, 1)?;
                // a round op that also counted its append would leave the cache ahead here
                if be.kv_len(kv) != want {
                    return Err(ModelError::Unsupported(format!(
                        "after a kept round a cache holds {} rows where its lane has {want}",
                        be.kv_len(kv)
                    )));
                }
            }
            l.last_row = Some(f);
            l.push_main(f[0]);
            let frame = if g.is_semantic(f[0]) {
                FrameOut::Frame(f)
            } else {
                l.ended = true;
                FrameOut::Eos
            };
            if i < leaders {
                out.push(frame);
            }
        }
        Ok(out)
    }
}

//! The frame loop (DRAMA3.md §4.7): main token with RAS, the tower's 9 head draws, then the
//! frame fed back through the backbone. Batched rounds give each lane exactly its solo result.

use crate::backend::Backend;
use crate::lane::LaneState;
use crate::model::{Model, Row};
use crate::sampling::{sample_head, sample_main, SamplingParams};
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
        mut trace: Option<&mut Vec<StepTrace>>,
    ) -> Result<Vec<FrameOut>, ModelError> {
        if lanes.len() != steps.len() {
            return Err(ModelError::Unsupported(format!(
                "{} lanes but {} step settings",
                lanes.len(),
                steps.len()
            )));
        }
        if lanes.is_empty() {
            return Ok(Vec::new());
        }
        for l in lanes.iter() {
            // Room for the frame's backbone row, checked before anything is sampled.
            l.check_room(1)?;
        }
        let g = &self.geometry;
        let mut logits = self.main_logits(lanes)?;
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
        for (i, (l, s)) in lanes.iter().zip(steps).enumerate() {
            let c = sample_main(
                &logits[i],
                self.candidates(),
                |t| g.is_semantic(i64::from(t)),
                l.recent_main_tokens(),
                &s.params,
                s.seed,
                s.step,
            );
            let tok = self.candidates()[c];
            if g.is_semantic(i64::from(tok)) {
                active.push(i);
                mains.push(tok);
            }
        }
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
        let frames = self.tower_step(
            &mut sub,
            &mains,
            &mut |r, i, row| {
                let s = &steps[active[i]];
                sample_head(row, &s.params, s.seed, s.step, r) as u32
            },
            Some(&mut heads),
        )?;
        self.advance(&mut sub, &frames)?;
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

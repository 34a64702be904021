//! Frame rounds on the CPU: the reference for the device's round ops. The round's inputs and
//! frames are host memory, and the draws are `model::sampling`'s own functions.

use model::backend::{
    gather_row, round_frames_of, round_leaders, BResult, Branch, CodeTerm, Counter, RoundLane,
    RoundSpec, Slot,
};
use model::sampling::{cfg_mix, sample_head, sample_main};
use model::{BackendError, GatherRow, Row, ROW_WIDTH};
use rayon::prelude::*;

use crate::CpuBuf;

/// A round's per-lane inputs (written before each round) and the frames it draws.
pub struct CpuRound {
    pub spec: RoundSpec,
    pub lanes: Vec<RoundLane>,
    /// The drawing lanes (`lanes[..leaders]`; the rest are unconditional branches).
    leaders: usize,
    frames: Vec<Row>,
}

fn shape_err(op: &'static str, why: String) -> BackendError {
    BackendError::Shape { op, why }
}

impl CpuRound {
    pub fn new(lanes: usize, spec: &RoundSpec) -> Self {
        Self {
            spec: spec.clone(),
            lanes: Vec::with_capacity(lanes),
            leaders: 0,
            frames: vec![[0; ROW_WIDTH]; lanes],
        }
    }

    pub fn write(&mut self, lanes: &[RoundLane]) -> BResult<()> {
        if lanes.len() != self.frames.len() {
            return Err(shape_err(
                "round_write",
                format!("{} lanes for a round of {}", lanes.len(), self.frames.len()),
            ));
        }
        self.leaders = round_leaders(lanes)?;
        self.lanes = lanes.to_vec();
        Ok(())
    }

    /// The frames drawn, each unconditional branch's being its drawing lane's.
    pub fn frames(&self) -> Vec<Row> {
        round_frames_of(&self.lanes, &self.frames)
    }

    /// How many lanes `c` covers: all for the backbone, the drawing ones for the tower.
    fn covered(&self, c: Counter) -> usize {
        match c {
            Counter::Backbone => self.lanes.len(),
            Counter::Tower => self.leaders,
        }
    }

    /// Refuses `rows` rows unless the round's lanes are written and `rows` is what `c` covers.
    fn check_written(&self, op: &'static str, rows: usize, c: Counter) -> BResult<()> {
        if self.lanes.len() != self.frames.len() || rows != self.covered(c) {
            return Err(shape_err(
                op,
                format!(
                    "{rows} rows for a round of {} lanes ({} written, {} drawing; {c:?} rows \
                     wanted)",
                    self.frames.len(),
                    self.lanes.len(),
                    self.leaders
                ),
            ));
        }
        Ok(())
    }

    /// The covered lanes' counter, checked to be written.
    pub fn counter(&self, op: &'static str, rows: usize, c: Counter) -> BResult<Vec<usize>> {
        self.check_written(op, rows, c)?;
        Ok(self.lanes[..rows]
            .iter()
            .map(|l| match c {
                Counter::Backbone => l.rows,
                Counter::Tower => l.tower_rows,
            })
            .collect())
    }

    pub fn sample(&mut self, logits: &CpuBuf, slot: Slot) -> BResult<()> {
        // main logits cover every lane (a guided lane mixes in its branch's row), a head's
        // only the drawing lanes
        let covers = match slot {
            Slot::Main => Counter::Backbone,
            Slot::Head(_) => Counter::Tower,
        };
        self.check_written("round_sample", logits.rows, covers)?;
        let n = self.leaders;
        if let Slot::Main = slot {
            if logits.cols != self.spec.candidates.len() {
                return Err(shape_err(
                    "round_sample",
                    format!(
                        "{} main logits per row for {} candidates",
                        logits.cols,
                        self.spec.candidates.len()
                    ),
                ));
            }
        }
        if let Slot::Head(r) = slot {
            if 2 + r >= ROW_WIDTH {
                return Err(shape_err(
                    "round_sample",
                    format!("head {r} of {}", ROW_WIDTH - 2),
                ));
            }
        }
        let this = &*self;
        let picks: Vec<i64> = (0..n)
            .into_par_iter()
            .map(|i| {
                let l = &this.lanes[i];
                let row = logits.row(i);
                match slot {
                    Slot::Main => {
                        let mixed;
                        let row = match l.branch {
                            Branch::Guided { uncond, gamma } => {
                                let mut m = row.to_vec();
                                cfg_mix(&mut m, logits.row(uncond), gamma);
                                mixed = m;
                                &mixed[..]
                            }
                            _ => row,
                        };
                        let c = sample_main(
                            row,
                            &this.spec.candidates,
                            |t| this.spec.is_semantic(i64::from(t)),
                            l.recent[..l.n_recent].iter().copied(),
                            &l.params,
                            l.seed,
                            l.step,
                        );
                        i64::from(this.spec.candidates[c])
                    }
                    Slot::Head(r) => sample_head(row, &l.params, l.seed, l.step, r) as i64,
                }
            })
            .collect();
        for (f, p) in self.frames.iter_mut().zip(picks) {
            match slot {
                Slot::Main => {
                    f[0] = p;
                    f[1] = p - i64::from(self.spec.semantic_start);
                }
                Slot::Head(r) => f[2 + r] = p,
            }
        }
        Ok(())
    }

    /// The picks of each covered lane's row (`model::backend::gather_row`).
    pub fn embed_rows(
        &self,
        terms: &[CodeTerm],
        scale: f32,
        lanes: Counter,
    ) -> BResult<Vec<GatherRow>> {
        let rows = self.covered(lanes);
        self.check_written("round_embed", rows, lanes)?;
        Ok(self
            .frames()
            .iter()
            .zip(&self.lanes)
            .take(rows)
            .map(|(f, l)| gather_row(terms, scale, f, &l.last, |t| self.spec.is_semantic(t)))
            .collect())
    }
}

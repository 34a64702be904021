//! Frame rounds on the CPU: the reference for the device's round ops. The round's inputs and
//! frames are host memory, and the draws are `model::sampling`'s own functions.

use model::backend::{BResult, CodeTerm, Counter, Frame, RoundLane, RoundSpec, Slot};
use model::sampling::{sample_head, sample_main};
use model::{BackendError, Row, ROW_WIDTH};
use rayon::prelude::*;

use crate::{CpuBuf, CpuWeight};

/// A round's per-lane inputs (written before each round) and the frames it draws.
pub struct CpuRound {
    pub spec: RoundSpec,
    pub lanes: Vec<RoundLane>,
    pub frames: Vec<Row>,
}

fn shape_err(op: &'static str, why: String) -> BackendError {
    BackendError::Shape { op, why }
}

impl CpuRound {
    pub fn new(lanes: usize, spec: &RoundSpec) -> Self {
        Self {
            spec: spec.clone(),
            lanes: Vec::with_capacity(lanes),
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
        self.lanes = lanes.to_vec();
        Ok(())
    }

    /// The lanes' counter, checked to be written.
    pub fn counter(&self, op: &'static str, rows: usize, c: Counter) -> BResult<Vec<usize>> {
        if self.lanes.len() != rows {
            return Err(shape_err(
                op,
                format!("{rows} rows for {} written round lanes", self.lanes.len()),
            ));
        }
        Ok(self
            .lanes
            .iter()
            .map(|l| match c {
                Counter::Backbone => l.rows,
                Counter::Tower => l.tower_rows,
            })
            .collect())
    }

    fn is_semantic(&self, tok: i64) -> bool {
        tok >= i64::from(self.spec.semantic_start) && tok <= i64::from(self.spec.semantic_end)
    }

    pub fn sample(&mut self, logits: &CpuBuf, slot: Slot) -> BResult<()> {
        let n = self
            .counter("round_sample", logits.rows, Counter::Backbone)?
            .len();
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
                        let c = sample_main(
                            row,
                            &this.spec.candidates,
                            |t| this.is_semantic(i64::from(t)),
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

    pub fn embed(&self, tables: &[&CpuWeight], terms: &[CodeTerm], scale: f32) -> BResult<CpuBuf> {
        let cols = tables.first().map_or(0, |t| t.cols);
        let n = self
            .counter("round_embed", self.frames.len(), Counter::Backbone)?
            .len();
        let mut d = vec![0f32; n * cols];
        let mut tmp = vec![0f32; cols];
        for (i, out) in d.chunks_mut(cols.max(1)).enumerate() {
            let cur = &self.frames[i];
            for t in terms {
                let f = match t.frame {
                    Frame::Current => cur,
                    Frame::Last => &self.lanes[i].last,
                };
                if t.guarded && !self.is_semantic(f[0]) {
                    continue;
                }
                let table = tables.get(t.table).ok_or_else(|| {
                    shape_err(
                        "round_embed",
                        format!("table {} of {}", t.table, tables.len()),
                    )
                })?;
                let code = f.get(t.col).copied().unwrap_or(-1);
                let row = i64::from(t.offset) + code;
                if row < 0 || row as usize >= table.rows || table.cols != cols {
                    return Err(shape_err(
                        "round_embed",
                        format!("row {row} of a {}x{} table", table.rows, table.cols),
                    ));
                }
                table.row_f32(row as usize, &mut tmp);
                out.iter_mut().zip(&tmp).for_each(|(o, x)| *o += x);
            }
            let s = if self.is_semantic(cur[0]) { scale } else { 1.0 };
            out.iter_mut().for_each(|o| *o *= s);
        }
        Ok(CpuBuf::new(n, cols, d))
    }
}

//! Per-request state: everything one sequence carries between frames, sized once for its
//! capacity in rows (admission reserves P + F + 1).

use std::collections::VecDeque;

use crate::backend::Backend;
use crate::model::{Model, Row};
use crate::ModelError;

/// Main tokens the repetition-aware resampling looks back over (DRAMA3.md §7).
pub const RAS_WINDOW: usize = 16;

/// Source of [`LaneState`] ids.
static NEXT_LANE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One sequence's state on backend `B`.
pub struct LaneState<B: Backend> {
    /// Unique for the process: with `gen`, what a kept frame round is keyed by.
    pub(crate) id: u64,
    /// Bumped whenever `last_hidden` is replaced by a new buffer (a kept round reads and
    /// writes the buffer it was made with).
    pub(crate) gen: u64,
    /// Set when a round kept on the backend drew EOS: that round also fed the lane's state
    /// forward, so the lane cannot continue.
    pub(crate) ended: bool,
    pub(crate) capacity: usize,
    /// Backbone rows consumed so far (= next backbone position).
    pub(crate) rows: usize,
    /// Tower positions filled so far (one behind `rows` once the tower caught up).
    pub(crate) tower_rows: usize,
    /// Backbone K/V per full-attention layer.
    pub(crate) kv: Vec<B::Kv>,
    /// Conv history and recurrent state per Gated DeltaNet layer.
    pub(crate) gdn: Vec<B::Gdn>,
    /// K/V per tower layer.
    pub(crate) tower_kv: Vec<B::Kv>,
    /// Final-normed hidden of the newest row (`[1, H]`): what the next frame is predicted from.
    pub(crate) last_hidden: Option<B::Buf>,
    pub(crate) last_row: Option<Row>,
    /// The last main tokens (prompt rows included), newest last.
    pub(crate) recent: VecDeque<i64>,
}

impl<B: Backend> LaneState<B> {
    pub(crate) fn new(m: &Model<B>, capacity: usize, with_tower: bool) -> Result<Self, ModelError> {
        let g = &m.geometry;
        let max = m.config.text_config.max_position_embeddings;
        if capacity == 0 || capacity > max {
            return Err(ModelError::LaneSize {
                requested: capacity,
                max,
            });
        }
        // lanes that are done and still held as ghosts of the kept round give their memory
        // back before this one takes its own
        m.drop_ghosts();
        let be = &m.backend;
        let kv = (0..g.full_layers())
            .map(|_| be.kv_new(capacity, g.attn.kv_heads, g.attn.head_dim))
            .collect::<Result<Vec<_>, _>>()?;
        let gdn = (0..g.linear_layers())
            .map(|_| be.gdn_new(&g.gdn))
            .collect::<Result<Vec<_>, _>>()?;
        let tower_layers = if with_tower { g.tower_layers } else { 0 };
        let tower_kv = (0..tower_layers)
            .map(|_| be.kv_new(capacity, g.tower_attn.kv_heads, g.tower_attn.head_dim))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            id: NEXT_LANE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            gen: 0,
            ended: false,
            capacity,
            rows: 0,
            tower_rows: 0,
            kv,
            gdn,
            tower_kv,
            last_hidden: None,
            last_row: None,
            recent: VecDeque::with_capacity(RAS_WINDOW),
        })
    }

    /// A new lane of `capacity` rows holding an exact copy of this one's state (the reference
    /// prefill cache restores a prefix this way; continuing from the copy gives the same bits).
    pub fn fork(&self, m: &Model<B>, capacity: usize) -> Result<Self, ModelError> {
        if capacity < self.rows {
            return Err(ModelError::Capacity {
                rows: self.rows,
                add: 0,
                capacity,
            });
        }
        let mut out = Self::new(m, capacity, self.has_tower())?;
        let be = &m.backend;
        for (d, s) in out.kv.iter_mut().zip(&self.kv) {
            be.kv_copy(s, d)?;
        }
        for (d, s) in out.gdn.iter_mut().zip(&self.gdn) {
            be.gdn_copy(s, d)?;
        }
        for (d, s) in out.tower_kv.iter_mut().zip(&self.tower_kv) {
            be.kv_copy(s, d)?;
        }
        out.rows = self.rows;
        out.tower_rows = self.tower_rows;
        out.last_hidden = match &self.last_hidden {
            Some(h) => Some(be.rows(h, 0, be.shape(h).0)?),
            None => None,
        };
        out.last_row = self.last_row;
        out.recent = self.recent.clone();
        out.ended = self.ended;
        Ok(out)
    }

    /// Whether the lane carries the tower's K/V (false for a guidance branch: backbone only).
    pub fn has_tower(&self) -> bool {
        !self.tower_kv.is_empty()
    }

    /// Rows this lane was sized for.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Backbone rows consumed (prompt rows plus frames fed back).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The newest main tokens, oldest first (at most [`RAS_WINDOW`]).
    pub fn recent_main_tokens(&self) -> impl Iterator<Item = i64> + '_ {
        self.recent.iter().copied()
    }

    /// Replaces the newest hidden (a new buffer: any kept round over this lane is stale).
    pub(crate) fn set_hidden(&mut self, h: B::Buf) {
        self.last_hidden = Some(h);
        self.gen += 1;
    }

    /// Refuses, before any work, to go past the capacity.
    pub fn check_room(&self, add: usize) -> Result<(), ModelError> {
        match self.rows.checked_add(add) {
            Some(n) if n <= self.capacity => Ok(()),
            _ => Err(ModelError::Capacity {
                rows: self.rows,
                add,
                capacity: self.capacity,
            }),
        }
    }

    pub(crate) fn push_main(&mut self, tok: i64) {
        if self.recent.len() == RAS_WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(tok);
    }
}

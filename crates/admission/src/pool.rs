//! The KV pool: rows of attention state sized at start-up, shared by all lanes.
//!
//! A request reserves its P + F + 1 rows (not C rows per lane) and one lane (its recurrent and conv
//! state). The reservation is a guard: dropping it gives rows and lane back.

use crate::contract::Admission;
use crate::error::PoolError;
use crate::units::{Lanes, Rows};
use serde::Serialize;
use std::sync::{Arc, Mutex, MutexGuard};

#[derive(Debug)]
struct State {
    free_rows: u64,
    free_lanes: Vec<u64>,
}

/// The pool. Cheap to clone (shared state).
#[derive(Clone, Debug)]
pub struct KvPool {
    capacity: Rows,
    lanes: Lanes,
    state: Arc<Mutex<State>>,
}

/// A point-in-time view, for metrics and `/v1/models`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PoolUsage {
    pub capacity: Rows,
    pub free: Rows,
    pub lanes: Lanes,
    pub lanes_free: Lanes,
}

impl KvPool {
    /// A pool of `capacity` rows and `lanes` lanes (indices `0..lanes`).
    ///
    /// `lanes` must be enumerable in memory; an absurd count is refused with `None`.
    pub fn new(capacity: Rows, lanes: Lanes) -> Option<Self> {
        let count = usize::try_from(lanes.0).ok()?;
        let mut free_lanes = Vec::new();
        free_lanes.try_reserve_exact(count).ok()?;
        // Lowest index on top, so lanes are handed out 0, 1, 2, ...
        free_lanes.extend((0..lanes.0).rev());
        Some(Self {
            capacity,
            lanes,
            state: Arc::new(Mutex::new(State {
                free_rows: capacity.0,
                free_lanes,
            })),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state is two counters updated atomically under the lock; a panic elsewhere while
        // holding it cannot leave it half-written, so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn capacity(&self) -> Rows {
        self.capacity
    }

    pub fn usage(&self) -> PoolUsage {
        let s = self.lock();
        PoolUsage {
            capacity: self.capacity,
            free: Rows(s.free_rows),
            lanes: self.lanes,
            lanes_free: Lanes(u64::try_from(s.free_lanes.len()).unwrap_or(u64::MAX)),
        }
    }

    /// Reserve rows and a lane. `NeverFits` when the idle pool could not hold it; `Busy` when it
    /// could but others hold what it needs now.
    pub fn reserve(&self, rows: Rows) -> Result<Reservation, PoolError> {
        if rows.0 == 0 {
            return Err(PoolError::Empty);
        }
        if rows > self.capacity || self.lanes.0 == 0 {
            return Err(PoolError::NeverFits {
                requested: rows,
                capacity: self.capacity,
            });
        }
        let mut s = self.lock();
        let lane = if rows.0 <= s.free_rows {
            s.free_lanes.pop()
        } else {
            None
        };
        let Some(lane) = lane else {
            return Err(PoolError::Busy {
                requested: rows,
                free: Rows(s.free_rows),
                capacity: self.capacity,
                lanes_free: Lanes(u64::try_from(s.free_lanes.len()).unwrap_or(u64::MAX)),
                lanes: self.lanes,
            });
        };
        s.free_rows -= rows.0;
        Ok(Reservation {
            state: Arc::clone(&self.state),
            rows,
            lane,
        })
    }

    /// Reserve what an admitted request needs: P + F + 1 rows.
    pub fn reserve_for(&self, admission: &Admission) -> Result<Reservation, PoolError> {
        self.reserve(admission.rows())
    }
}

/// Rows and a lane held by one request; released on drop.
#[derive(Debug)]
pub struct Reservation {
    state: Arc<Mutex<State>>,
    rows: Rows,
    lane: u64,
}

impl Reservation {
    pub fn rows(&self) -> Rows {
        self.rows
    }

    /// Which lane's recurrent and conv state this request owns.
    pub fn lane(&self) -> u64 {
        self.lane
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        // Rows were taken from this counter, so giving them back cannot exceed the capacity.
        s.free_rows = s.free_rows.saturating_add(self.rows.0);
        s.free_lanes.push(self.lane);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::contract::{FrameCap, WindowContract};
    use crate::units::{Frames, PromptRows, Window};

    #[test]
    fn reserve_and_release() {
        let pool = KvPool::new(Rows(100), Lanes(2)).unwrap();
        let a = pool.reserve(Rows(60)).unwrap();
        assert_eq!(a.lane(), 0);
        assert_eq!(pool.usage().free, Rows(40));
        // Fits the idle pool, not now.
        let e = pool.reserve(Rows(41)).unwrap_err();
        assert_eq!(e.code(), "pool_busy");
        assert_eq!(e.kind().http_status(), 503);
        let b = pool.reserve(Rows(40)).unwrap();
        assert_eq!(b.lane(), 1);
        assert_eq!(pool.usage().free, Rows(0));
        drop(a);
        assert_eq!(pool.usage().free, Rows(60));
        assert_eq!(pool.usage().lanes_free, Lanes(1));
        let c = pool.reserve(Rows(41)).unwrap();
        assert_eq!(c.lane(), 0);
        drop(b);
        drop(c);
        assert_eq!(
            pool.usage(),
            PoolUsage {
                capacity: Rows(100),
                free: Rows(100),
                lanes: Lanes(2),
                lanes_free: Lanes(2)
            }
        );
    }

    #[test]
    fn lanes_run_out_before_rows() {
        let pool = KvPool::new(Rows(100), Lanes(1)).unwrap();
        let a = pool.reserve(Rows(10)).unwrap();
        let e = pool.reserve(Rows(10)).unwrap_err();
        assert!(matches!(
            e,
            PoolError::Busy {
                lanes_free: Lanes(0),
                ..
            }
        ));
        drop(a);
        assert!(pool.reserve(Rows(10)).is_ok());
    }

    #[test]
    fn never_fits_differs_from_busy() {
        let pool = KvPool::new(Rows(100), Lanes(4)).unwrap();
        let e = pool.reserve(Rows(101)).unwrap_err();
        assert_eq!(
            e,
            PoolError::NeverFits {
                requested: Rows(101),
                capacity: Rows(100)
            }
        );
        assert_eq!(e.code(), "pool_too_small");
        assert_eq!(e.kind().http_status(), 413);
        assert_eq!(
            pool.reserve(Rows(u64::MAX)).unwrap_err().code(),
            "pool_too_small"
        );
        assert_eq!(pool.reserve(Rows(0)).unwrap_err(), PoolError::Empty);
        let none = KvPool::new(Rows(100), Lanes(0)).unwrap();
        assert_eq!(none.reserve(Rows(1)).unwrap_err().code(), "pool_too_small");
        assert!(KvPool::new(Rows(1), Lanes(u64::MAX)).is_none());
    }

    #[test]
    fn a_request_reserves_p_plus_f_plus_1_not_c() {
        let k = WindowContract::new(Window(8192), Window(262_144), Frames(1024)).unwrap();
        let pool = KvPool::new(Rows(8192), Lanes(4)).unwrap();
        let a = k.admit(PromptRows(100), FrameCap::Default).unwrap();
        let r = pool.reserve_for(&a).unwrap();
        assert_eq!(r.rows(), Rows(1125));
        // Several short requests share a pool one window deep.
        let r2 = pool.reserve_for(&a).unwrap();
        let r3 = pool.reserve_for(&a).unwrap();
        assert_eq!(pool.usage().free, Rows(8192 - 3 * 1125));
        // A full-window request waits for them (busy), it is not refused forever.
        let full = k
            .admit(PromptRows(2), FrameCap::Explicit(Frames(8189)))
            .unwrap();
        assert_eq!(pool.reserve_for(&full).unwrap_err().code(), "pool_busy");
        drop((r, r2, r3));
        assert_eq!(pool.reserve_for(&full).unwrap().rows(), Rows(8192));
    }

    #[test]
    fn guards_release_across_threads() {
        let pool = KvPool::new(Rows(1000), Lanes(8)).unwrap();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..200 {
                        if let Ok(r) = pool.reserve(Rows(100)) {
                            assert!(r.lane() < 8);
                        }
                    }
                });
            }
        });
        assert_eq!(pool.usage().free, Rows(1000));
        assert_eq!(pool.usage().lanes_free, Lanes(8));
    }
}

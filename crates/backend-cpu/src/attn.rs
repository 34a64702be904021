//! Rotary embedding, the f32 KV cache and causal GQA attention (DRAMA3.md §4.4).

use model::{AttnDims, BackendError, Rope};

use crate::linear::dot;

/// One layer's K/V of one lane: `[len, kv_heads·hd]` each, room reserved for `capacity` rows.
pub struct CpuKv {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub len: usize,
    pub capacity: usize,
    pub width: usize,
    /// Round appended K/V to BF16 (as a BF16 cache stores them), for numerics comparisons with
    /// CUDA's opt-in BF16 cache: `DRAMATIS_CPU_KV=bf16`.
    pub round_bf16: bool,
}

impl CpuKv {
    pub fn new(capacity: usize, kv_heads: usize, head_dim: usize) -> Result<Self, BackendError> {
        let width = kv_heads
            .checked_mul(head_dim)
            .ok_or_else(|| BackendError::Shape {
                op: "kv_new",
                why: format!("{kv_heads} kv heads x {head_dim} dims overflows"),
            })?;
        let elems = capacity
            .checked_mul(width)
            .ok_or_else(|| BackendError::Shape {
                op: "kv_new",
                why: format!("{capacity} rows x {width} values overflows"),
            })?;
        Ok(Self {
            k: Vec::with_capacity(elems),
            v: Vec::with_capacity(elems),
            len: 0,
            capacity,
            width,
            round_bf16: std::env::var("DRAMATIS_CPU_KV")
                .is_ok_and(|v| v.eq_ignore_ascii_case("bf16")),
        })
    }

    pub fn append(&mut self, k: &[f32], v: &[f32], rows: usize) -> Result<(), BackendError> {
        self.len = self.write(k, v, rows)?;
        Ok(())
    }

    /// Writes one row at index `len` without counting it (a kept frame round's append; the
    /// round's bookkeeping counts it with [`CpuKv::note`]).
    pub fn stage(&mut self, k: &[f32], v: &[f32]) -> Result<(), BackendError> {
        self.write(k, v, 1).map(drop)
    }

    /// Writes `rows` rows from index `len` (over any staged row) and returns the length that
    /// counts them.
    fn write(&mut self, k: &[f32], v: &[f32], rows: usize) -> Result<usize, BackendError> {
        let need = model::check::kv_room(self.len, rows, self.capacity)?;
        let n = rows * self.width;
        self.k.truncate(self.len * self.width);
        self.v.truncate(self.len * self.width);
        if self.round_bf16 {
            let r = |x: &f32| half::bf16::from_f32(*x).to_f32();
            self.k.extend(k[..n].iter().map(r));
            self.v.extend(v[..n].iter().map(r));
        } else {
            self.k.extend_from_slice(&k[..n]);
            self.v.extend_from_slice(&v[..n]);
        }
        Ok(need)
    }

    /// Counts `rows` rows already written past `len` (by [`CpuKv::stage`]).
    pub fn note(&mut self, rows: usize) -> Result<(), BackendError> {
        let need = self.len.saturating_add(rows);
        if need * self.width > self.k.len() {
            return Err(BackendError::Shape {
                op: "kv_note",
                why: format!(
                    "{rows} rows noted past {} but only {} are written",
                    self.len,
                    self.k.len() / self.width.max(1)
                ),
            });
        }
        self.len = need;
        Ok(())
    }
}

/// Rotary embedding in place on `[n, heads·hd]`, row i at `positions[i]`.
pub fn rope(
    x: &mut [f32],
    cols: usize,
    hd: usize,
    rot: usize,
    theta: f64,
    style: Rope,
    positions: &[usize],
) {
    let half = rot / 2;
    let inv: Vec<f64> = (0..half)
        .map(|i| theta.powf(-((2 * i) as f64) / rot as f64))
        .collect();
    for (row, &p) in x.chunks_mut(cols).zip(positions) {
        let cs: Vec<(f32, f32)> = inv
            .iter()
            .map(|f| {
                let a = p as f64 * f;
                (a.cos() as f32, a.sin() as f32)
            })
            .collect();
        for head in row.chunks_mut(hd) {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match style {
                    Rope::Neox => (i, i + half),
                    Rope::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x1 * c + x0 * s;
            }
        }
    }
}

/// One query row (all heads) against cache rows `0..upto`: softmax(q·k/√hd) v per head.
pub fn attend_row(q: &[f32], kv: &CpuKv, upto: usize, d: &AttnDims, out: &mut [f32]) {
    let hd = d.head_dim;
    let group = d.q_heads / d.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut p = vec![0f32; upto];
    for h in 0..d.q_heads {
        let kh = h / group;
        let qh = &q[h * hd..(h + 1) * hd];
        let mut max = f32::NEG_INFINITY;
        for (j, pj) in p.iter_mut().enumerate() {
            let k = &kv.k[j * kv.width + kh * hd..j * kv.width + (kh + 1) * hd];
            *pj = dot(qh, k) * scale;
            max = max.max(*pj);
        }
        let mut sum = 0f32;
        for pj in p.iter_mut() {
            *pj = (*pj - max).exp();
            sum += *pj;
        }
        let o = &mut out[h * hd..(h + 1) * hd];
        o.iter_mut().for_each(|x| *x = 0.0);
        for (j, pj) in p.iter().enumerate() {
            let v = &kv.v[j * kv.width + kh * hd..j * kv.width + (kh + 1) * hd];
            for (x, y) in o.iter_mut().zip(v) {
                *x += pj * y;
            }
        }
        let inv = 1.0 / sum;
        o.iter_mut().for_each(|x| *x *= inv);
    }
}

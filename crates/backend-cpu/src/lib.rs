//! backend-cpu: the reference [`Backend`]. f32 activations and KV; weights read from the mmap in
//! stored precision (BF16, FP8 block-scaled, NVFP4 packed) and dequantised inside each op;
//! threads via rayon, prefill matmuls via `matrixmultiply`. Every `Rows::Exact` op computes a row
//! by the same arithmetic whatever the batch, so batched decode equals solo decode bit for bit.
//!
//! It is not the fast path (CUDA is); it is the one every test and golden runs on.

pub mod attn;
pub mod gdn;
pub mod linear;
pub mod round;

use checkpoint::{Checkpoint, DType, TensorView};
use model::backend::BResult;
use model::backend::{CodeTerm, Counter, RoundLane, RoundSpec, Slot};
use model::check;
use model::{AttnDims, Backend, BackendError, Expert, GatherRow, GdnDims, Rope, Route, Rows};
use rayon::prelude::*;

pub use attn::CpuKv;
pub use gdn::CpuGdn;
pub use linear::{Bytes, CpuWeight, Format};

/// An activation matrix `[rows, cols]`, row-major f32.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuBuf {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl CpuBuf {
    fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        debug_assert_eq!(data.len(), rows * cols);
        Self { rows, cols, data }
    }
    fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.cols..(i + 1) * self.cols]
    }
    fn shape(&self) -> check::Shape {
        (self.rows, self.cols)
    }
}

/// A small tensor, flattened to f32.
pub struct CpuVector(pub Vec<f32>);

#[derive(Debug, Clone, Copy, Default)]
pub struct CpuBackend;

/// A test hook: while set, [`Backend::aside_begin`] opens side branches (for up to 64 rows), so
/// the model's branch path runs on the CPU too; the CPU runs a branch's ops in order, as
/// issued, so the results must equal those without it bit for bit (`tests/aside.rs`).
pub static ASIDE_FOR_TESTS: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Side branches opened under [`ASIDE_FOR_TESTS`] so far (a test checks its path was taken).
pub static ASIDES_OPENED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

impl CpuBackend {
    pub fn new() -> Self {
        Self
    }
}

fn shape_err(op: &'static str, why: String) -> BackendError {
    BackendError::Shape { op, why }
}

/// Row i of `q` attends over lane i's cache: its counted rows plus `staged`.
fn attend_lanes(q: &CpuBuf, d: &AttnDims, caches: &[&mut CpuKv], staged: usize) -> CpuBuf {
    let width = d.q_heads * d.head_dim;
    let mut out = vec![0f32; q.rows * width];
    out.par_chunks_mut(width).enumerate().for_each(|(i, o)| {
        attn::attend_row(q.row(i), caches[i], caches[i].len + staged, d, o);
    });
    CpuBuf::new(q.rows, width, out)
}

fn same_shape(op: &'static str, a: &CpuBuf, b: &CpuBuf) -> BResult<()> {
    check::same_shape(op, a.shape(), b.shape())
}

fn mapped(ck: &Checkpoint, v: &TensorView<'_>) -> Bytes {
    Bytes::Mapped {
        shard: ck.store.shards[v.info.shard].clone(),
        start: v.info.start,
        end: v.info.end,
    }
}

/// An NVFP4 matrix of `rows` x `cols` values, its scales kept on the mmap (checks in
/// `model::stored`).
fn nvfp4_format(ck: &Checkpoint, name: &str, rows: usize, cols: usize) -> BResult<Format> {
    let p = model::stored::nvfp4_parts(ck, name, rows, cols / 2)?;
    Ok(Format::Nvfp4 {
        scale: mapped(ck, &p.scales),
        global: p.global,
    })
}

impl Backend for CpuBackend {
    fn aside_begin(&self, rows: usize) -> BResult<bool> {
        let on = rows <= 64 && ASIDE_FOR_TESTS.load(std::sync::atomic::Ordering::Relaxed);
        if on {
            ASIDES_OPENED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(on)
    }

    type Buf = CpuBuf;
    type Weight = CpuWeight;
    type Vector = CpuVector;
    type Kv = CpuKv;
    type Gdn = CpuGdn;
    type Route = Route;
    type Round = round::CpuRound;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, data: &[f32], rows: usize, cols: usize) -> BResult<CpuBuf> {
        check::upload(data.len(), rows, cols)?;
        Ok(CpuBuf::new(rows, cols, data.to_vec()))
    }

    fn download(&self, x: &CpuBuf) -> BResult<Vec<f32>> {
        Ok(x.data.clone())
    }

    fn shape(&self, x: &CpuBuf) -> (usize, usize) {
        (x.rows, x.cols)
    }

    fn cols(&self, x: &CpuBuf, start: usize, len: usize) -> BResult<CpuBuf> {
        self.cols_grouped(x, x.cols, start, len)
    }

    fn cols_grouped(&self, x: &CpuBuf, group: usize, offset: usize, len: usize) -> BResult<CpuBuf> {
        check::cols_grouped(x.shape(), group, offset, len)?;
        let groups = x.cols / group;
        let mut d = Vec::with_capacity(x.rows * groups * len);
        for r in 0..x.rows {
            let row = x.row(r);
            for g in 0..groups {
                d.extend_from_slice(&row[g * group + offset..g * group + offset + len]);
            }
        }
        Ok(CpuBuf::new(x.rows, groups * len, d))
    }

    fn rows(&self, x: &CpuBuf, start: usize, len: usize) -> BResult<CpuBuf> {
        check::rows(x.shape(), start, len)?;
        Ok(CpuBuf::new(
            len,
            x.cols,
            x.data[start * x.cols..(start + len) * x.cols].to_vec(),
        ))
    }

    fn concat_cols(&self, a: &CpuBuf, b: &CpuBuf) -> BResult<CpuBuf> {
        check::concat_cols(a.shape(), b.shape())?;
        let mut d = Vec::with_capacity(a.rows * (a.cols + b.cols));
        for r in 0..a.rows {
            d.extend_from_slice(a.row(r));
            d.extend_from_slice(b.row(r));
        }
        Ok(CpuBuf::new(a.rows, a.cols + b.cols, d))
    }

    fn concat_rows(&self, parts: &[&CpuBuf]) -> BResult<CpuBuf> {
        let cols = parts.first().map_or(0, |p| p.cols);
        let mut d = Vec::new();
        let mut rows = 0;
        for p in parts {
            check::concat_rows(cols, p.shape())?;
            d.extend_from_slice(&p.data);
            rows += p.rows;
        }
        Ok(CpuBuf::new(rows, cols, d))
    }

    fn weight(&self, ck: &Checkpoint, name: &str) -> BResult<CpuWeight> {
        let v = ck.tensor(name)?;
        let (rows, mut cols) = model::stored::matrix_shape(name, v.shape())?;
        let format = match v.dtype() {
            DType::BF16 => Format::Bf16,
            DType::F32 => Format::F32,
            DType::F8E4M3 => {
                let sname = format!("{name}_scale_inv");
                let s = ck.tensor(&sname)?;
                let want = [
                    rows.div_ceil(linear::FP8_BLOCK),
                    cols.div_ceil(linear::FP8_BLOCK),
                ];
                if s.dtype() != DType::F32 || s.shape() != want {
                    return Err(BackendError::Weight {
                        name: sname,
                        why: format!("expected F32 {want:?}, found {} {:?}", s.dtype(), s.shape()),
                    });
                }
                Format::Fp8 {
                    scale: s.to_f32(),
                    scale_cols: want[1],
                }
            }
            DType::U8 => {
                cols *= 2;
                nvfp4_format(ck, name, rows, cols)?
            }
            d => {
                return Err(BackendError::Weight {
                    name: name.into(),
                    why: format!("dtype {d} is not a supported weight format"),
                })
            }
        };
        Ok(CpuWeight {
            bytes: mapped(ck, &v),
            format,
            rows,
            cols,
        })
    }

    fn weight_rows(&self, ck: &Checkpoint, name: &str, rows: &[u32]) -> BResult<CpuWeight> {
        let (out, cols) = model::stored::bf16_rows(ck, name, rows)?;
        Ok(CpuWeight {
            bytes: Bytes::Owned(out),
            format: Format::Bf16,
            rows: rows.len(),
            cols,
        })
    }

    fn vector(&self, ck: &Checkpoint, name: &str) -> BResult<CpuVector> {
        Ok(CpuVector(ck.tensor(name)?.to_f32()))
    }

    fn kv_new(&self, capacity: usize, kv_heads: usize, head_dim: usize) -> BResult<CpuKv> {
        CpuKv::new(capacity, kv_heads, head_dim)
    }

    fn vector_len(&self, v: &CpuVector) -> usize {
        v.0.len()
    }

    fn kv_len(&self, kv: &CpuKv) -> usize {
        kv.len
    }

    fn gdn_new(&self, dims: &GdnDims) -> BResult<CpuGdn> {
        Ok(CpuGdn::new(dims))
    }

    fn gdn_fits(&self, st: &CpuGdn, dims: &GdnDims) -> bool {
        // the sizes `CpuGdn::new` gives, without making one
        st.conv.len() == dims.conv_kernel.saturating_sub(1) * dims.channels()
            && st.s.len() == dims.v_heads * dims.k_dim * dims.v_dim
    }

    fn kv_copy(&self, src: &CpuKv, dst: &mut CpuKv) -> BResult<()> {
        if dst.len != 0 || dst.width != src.width || dst.capacity < src.len {
            return Err(BackendError::Shape {
                op: "kv_copy",
                why: format!(
                    "source holds {} rows of width {}; destination holds {} rows of width {} with capacity {}",
                    src.len, src.width, dst.len, dst.width, dst.capacity
                ),
            });
        }
        dst.k.extend_from_slice(&src.k);
        dst.v.extend_from_slice(&src.v);
        dst.len = src.len;
        Ok(())
    }

    fn gdn_copy(&self, src: &CpuGdn, dst: &mut CpuGdn) -> BResult<()> {
        if dst.conv.len() != src.conv.len() || dst.s.len() != src.s.len() {
            return Err(BackendError::Shape {
                op: "gdn_copy",
                why: "source and destination have different GDN geometry".into(),
            });
        }
        dst.conv.copy_from_slice(&src.conv);
        dst.s.copy_from_slice(&src.s);
        Ok(())
    }

    fn gather_sum(&self, tables: &[&CpuWeight], rows: &[GatherRow]) -> BResult<CpuBuf> {
        let cols = tables.first().map_or(0, |t| t.cols);
        for (i, t) in tables.iter().enumerate() {
            if t.cols != cols {
                return Err(shape_err(
                    "gather_sum",
                    format!("table {i} has {} cols, table 0 has {cols}", t.cols),
                ));
            }
        }
        let mut d = vec![0f32; rows.len() * cols];
        let mut tmp = vec![0f32; cols];
        for (gr, out) in rows.iter().zip(d.chunks_mut(cols.max(1))) {
            for &(t, r) in &gr.picks {
                let table = tables.get(t).ok_or_else(|| {
                    shape_err("gather_sum", format!("table {t} of {}", tables.len()))
                })?;
                if r as usize >= table.rows {
                    return Err(shape_err(
                        "gather_sum",
                        format!("row {r} of a {}-row table", table.rows),
                    ));
                }
                table.row_f32(r as usize, &mut tmp);
                out.iter_mut().zip(&tmp).for_each(|(o, x)| *o += x);
            }
            out.iter_mut().for_each(|o| *o *= gr.scale);
        }
        Ok(CpuBuf::new(rows.len(), cols, d))
    }

    fn rms_norm(
        &self,
        x: &CpuBuf,
        w: &CpuVector,
        group: usize,
        eps: f32,
        plus_one: bool,
    ) -> BResult<CpuBuf> {
        check::rms_norm("rms_norm", x.shape(), group, w.0.len())?;
        let wp: Vec<f32> =
            w.0.iter()
                .map(|v| if plus_one { 1.0 + v } else { *v })
                .collect();
        let mut d = x.data.clone();
        let norm = |g: &mut [f32]| {
            let inv = 1.0 / (linear::dot(g, g) / group as f32 + eps).sqrt();
            for (v, w) in g.iter_mut().zip(&wp) {
                *v = *v * inv * w;
            }
        };
        if d.len() < linear::PARALLEL_MIN_MACS {
            d.chunks_mut(group).for_each(norm);
        } else {
            d.par_chunks_mut(group).for_each(norm);
        }
        Ok(CpuBuf::new(x.rows, x.cols, d))
    }

    fn linear(&self, x: &CpuBuf, w: &CpuWeight, rows: Rows) -> BResult<CpuBuf> {
        check::linear(x.shape(), (w.rows, w.cols))?;
        let y = match rows {
            // joined prompts are each under bulk_min_rows (joined_rows), where Bulk is exact too
            Rows::Exact | Rows::Joined => linear::linear_exact(&x.data, x.rows, w),
            Rows::Bulk => linear::linear_bulk(&x.data, x.rows, w),
        };
        Ok(CpuBuf::new(x.rows, w.rows, y))
    }

    fn add(&self, a: &CpuBuf, b: &CpuBuf) -> BResult<CpuBuf> {
        same_shape("add", a, b)?;
        let d = a.data.iter().zip(&b.data).map(|(x, y)| x + y).collect();
        Ok(CpuBuf::new(a.rows, a.cols, d))
    }

    fn silu_mul(&self, gate: &CpuBuf, up: &CpuBuf) -> BResult<CpuBuf> {
        same_shape("silu_mul", gate, up)?;
        let d = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(g, u)| gdn::silu(*g) * u)
            .collect();
        Ok(CpuBuf::new(gate.rows, gate.cols, d))
    }

    fn sigmoid_mul(&self, x: &CpuBuf, gate: &CpuBuf) -> BResult<CpuBuf> {
        check::gate("sigmoid_mul", x.shape(), gate.shape())?;
        let mut d = x.data.clone();
        for (r, row) in d.chunks_mut(x.cols.max(1)).enumerate() {
            let g = gate.row(r);
            for (c, v) in row.iter_mut().enumerate() {
                *v *= gdn::sigmoid(g[if gate.cols == 1 { 0 } else { c }]);
            }
        }
        Ok(CpuBuf::new(x.rows, x.cols, d))
    }

    fn rope(
        &self,
        x: &CpuBuf,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        positions: &[usize],
    ) -> BResult<CpuBuf> {
        check::rope(x.shape(), positions.len(), head_dim, rot_dims)?;
        let mut d = x.data.clone();
        attn::rope(&mut d, x.cols, head_dim, rot_dims, theta, style, positions);
        Ok(CpuBuf::new(x.rows, x.cols, d))
    }

    fn attn_prefill(
        &self,
        q: &CpuBuf,
        k: &CpuBuf,
        v: &CpuBuf,
        d: &AttnDims,
        cache: &mut CpuKv,
    ) -> BResult<CpuBuf> {
        check_attn(q, k, v, d, cache.width)?;
        let base = cache.len;
        cache.append(&k.data, &v.data, k.rows)?;
        let width = d.q_heads * d.head_dim;
        let mut out = vec![0f32; q.rows * width];
        let cache = &*cache;
        out.par_chunks_mut(width).enumerate().for_each(|(i, o)| {
            attn::attend_row(q.row(i), cache, base + i + 1, d, o);
        });
        Ok(CpuBuf::new(q.rows, width, out))
    }

    fn attn_step(
        &self,
        q: &CpuBuf,
        k: &CpuBuf,
        v: &CpuBuf,
        d: &AttnDims,
        caches: &mut [&mut CpuKv],
    ) -> BResult<CpuBuf> {
        check::lanes("attn_step", q.rows, caches.len())?;
        for (i, c) in caches.iter_mut().enumerate() {
            check_attn(q, k, v, d, c.width)?;
            c.append(k.row(i), v.row(i), 1)?;
        }
        Ok(attend_lanes(q, d, caches, 0))
    }

    fn gdn_conv(
        &self,
        x: &CpuBuf,
        w: &CpuVector,
        d: &GdnDims,
        state: &mut CpuGdn,
    ) -> BResult<CpuBuf> {
        check_conv(x, w, d)?;
        Ok(CpuBuf::new(
            x.rows,
            x.cols,
            gdn::conv(&x.data, x.rows, &w.0, d, state),
        ))
    }

    fn gdn_conv_step(
        &self,
        x: &CpuBuf,
        w: &CpuVector,
        d: &GdnDims,
        states: &mut [&mut CpuGdn],
    ) -> BResult<CpuBuf> {
        check_conv(x, w, d)?;
        check::lanes("gdn_conv_step", x.rows, states.len())?;
        let mut out = Vec::with_capacity(x.data.len());
        for (i, s) in states.iter_mut().enumerate() {
            out.extend(gdn::conv(x.row(i), 1, &w.0, d, s));
        }
        Ok(CpuBuf::new(x.rows, x.cols, out))
    }

    fn gdn_prefill(
        &self,
        qkv: &CpuBuf,
        b: &CpuBuf,
        a: &CpuBuf,
        a_log: &CpuVector,
        dt_bias: &CpuVector,
        d: &GdnDims,
        state: &mut CpuGdn,
        chunked: bool,
    ) -> BResult<CpuBuf> {
        check_gdn(qkv, b, a, a_log, dt_bias, d)?;
        let o = gdn::delta_rule(
            &qkv.data,
            &b.data,
            &a.data,
            &a_log.0,
            &dt_bias.0,
            d,
            qkv.rows,
            &mut state.s,
            chunked,
        );
        Ok(CpuBuf::new(qkv.rows, d.v_heads * d.v_dim, o))
    }

    fn gdn_step(
        &self,
        qkv: &CpuBuf,
        b: &CpuBuf,
        a: &CpuBuf,
        a_log: &CpuVector,
        dt_bias: &CpuVector,
        d: &GdnDims,
        states: &mut [&mut CpuGdn],
    ) -> BResult<CpuBuf> {
        check_gdn(qkv, b, a, a_log, dt_bias, d)?;
        check::lanes("gdn_step", qkv.rows, states.len())?;
        let outs: Vec<Vec<f32>> = states
            .par_iter_mut()
            .enumerate()
            .map(|(i, s)| {
                gdn::delta_rule(
                    qkv.row(i),
                    b.row(i),
                    a.row(i),
                    &a_log.0,
                    &dt_bias.0,
                    d,
                    1,
                    &mut s.s,
                    false,
                )
            })
            .collect();
        Ok(CpuBuf::new(qkv.rows, d.v_heads * d.v_dim, outs.concat()))
    }

    fn route(&self, logits: &CpuBuf, k: usize, keep: Option<&[bool]>) -> BResult<Route> {
        let kept = check::route(logits.cols, k, keep)?;
        let (mut experts, mut weights) = (Vec::new(), Vec::new());
        for r in 0..logits.rows {
            let (ids, w) = route_row(logits.row(r), k, keep).ok_or_else(|| {
                let row = logits.row(r);
                BackendError::NonFinite {
                    op: "route",
                    why: format!(
                        "row {r}: every kept router logit is NaN or -inf ({} NaN, {} -inf of {kept} \
                         kept); the hidden state feeding the router is not finite",
                        row.iter().filter(|v| v.is_nan()).count(),
                        row.iter().filter(|v| **v == f32::NEG_INFINITY).count(),
                    ),
                }
            })?;
            experts.push(ids);
            weights.push(w);
        }
        Ok(Route { experts, weights })
    }

    fn route_host(&self, route: &Route) -> BResult<Route> {
        Ok(route.clone())
    }

    /// Bulk linears (the experts' too, per expert) take the exact path below
    /// `linear::bulk_min_rows` rows, so a prompt under that joins with the same bits.
    fn joined_rows(&self) -> usize {
        linear::bulk_min_rows() - 1
    }

    fn moe_experts(
        &self,
        x: &CpuBuf,
        route: &Route,
        experts: &[Option<Expert<CpuWeight>>],
        rows: Rows,
    ) -> BResult<CpuBuf> {
        // Rows per expert, so each expert's matrices are read once per call.
        let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); experts.len()];
        for (r, ids) in route.experts.iter().enumerate() {
            for &e in ids {
                let slot = by_expert.get_mut(e as usize).ok_or_else(|| {
                    shape_err("moe_experts", format!("expert {e} of {}", experts.len()))
                })?;
                slot.push(r);
            }
        }
        // y[e] holds expert e's output for its rows, in by_expert order.
        let mut y: Vec<Vec<f32>> = vec![Vec::new(); experts.len()];
        for (e, rs) in by_expert.iter().enumerate() {
            if rs.is_empty() {
                continue;
            }
            let ex = experts[e].as_ref().ok_or_else(|| {
                shape_err(
                    "moe_experts",
                    format!("expert {e} was routed to but is pruned"),
                )
            })?;
            let mut xs = Vec::with_capacity(rs.len() * x.cols);
            for &r in rs {
                xs.extend_from_slice(x.row(r));
            }
            let xs = CpuBuf::new(rs.len(), x.cols, xs);
            let g = self.linear(&xs, &ex.gate, rows)?;
            let u = self.linear(&xs, &ex.up, rows)?;
            y[e] = self.linear(&self.silu_mul(&g, &u)?, &ex.down, rows)?.data;
        }
        let h = experts
            .iter()
            .flatten()
            .next()
            .map_or(x.cols, |e| e.down.rows);
        let mut out = vec![0f32; x.rows * h];
        let mut cursor = vec![0usize; experts.len()];
        // Walk rows in order so each expert's cursor follows by_expert's order.
        for (r, (ids, ws)) in route.experts.iter().zip(&route.weights).enumerate() {
            let o = &mut out[r * h..(r + 1) * h];
            for (&e, &w) in ids.iter().zip(ws) {
                let e = e as usize;
                let idx = cursor[e];
                cursor[e] += 1;
                for (a, b) in o.iter_mut().zip(&y[e][idx * h..(idx + 1) * h]) {
                    *a += w * b;
                }
            }
        }
        Ok(CpuBuf::new(x.rows, h, out))
    }

    fn write_rows(&self, src: &CpuBuf, dst: &mut [&mut CpuBuf]) -> BResult<()> {
        check::lanes("write_rows", src.rows, dst.len())?;
        for (i, d) in dst.iter_mut().enumerate() {
            if d.shape() != (1, src.cols) {
                return Err(shape_err(
                    "write_rows",
                    format!(
                        "row {i} goes to a {:?} buffer, not [1, {}]",
                        d.shape(),
                        src.cols
                    ),
                ));
            }
            d.data.copy_from_slice(src.row(i));
        }
        Ok(())
    }

    fn kv_note(&self, kv: &mut CpuKv, rows: usize) -> BResult<()> {
        kv.note(rows)
    }

    fn round_new(&self, lanes: usize, spec: &RoundSpec) -> BResult<round::CpuRound> {
        Ok(round::CpuRound::new(lanes, spec))
    }

    fn round_write(&self, round: &mut round::CpuRound, lanes: &[RoundLane]) -> BResult<()> {
        round.write(lanes)
    }

    fn round_frames(&self, round: &round::CpuRound) -> BResult<Vec<model::Row>> {
        Ok(round.frames())
    }

    fn round_sample(
        &self,
        logits: &CpuBuf,
        round: &mut round::CpuRound,
        slot: Slot,
    ) -> BResult<()> {
        round.sample(logits, slot)
    }

    fn round_embed(
        &self,
        tables: &[&CpuWeight],
        round: &round::CpuRound,
        terms: &[CodeTerm],
        scale: f32,
        lanes: Counter,
    ) -> BResult<CpuBuf> {
        self.gather_sum(tables, &round.embed_rows(terms, scale, lanes)?)
    }

    fn rope_round(
        &self,
        x: &CpuBuf,
        head_dim: usize,
        rot_dims: usize,
        theta: f64,
        style: Rope,
        round: &round::CpuRound,
        counter: Counter,
    ) -> BResult<CpuBuf> {
        let p = round.counter("rope_round", x.rows, counter)?;
        self.rope(x, head_dim, rot_dims, theta, style, &p)
    }

    fn attn_step_round(
        &self,
        q: &CpuBuf,
        k: &CpuBuf,
        v: &CpuBuf,
        d: &AttnDims,
        caches: &mut [&mut CpuKv],
        round: &round::CpuRound,
        counter: Counter,
    ) -> BResult<CpuBuf> {
        check::lanes("attn_step_round", q.rows, caches.len())?;
        let lens = round.counter("attn_step_round", q.rows, counter)?;
        for (i, c) in caches.iter_mut().enumerate() {
            check_attn(q, k, v, d, c.width)?;
            if c.len != lens[i] {
                return Err(shape_err(
                    "attn_step_round",
                    format!(
                        "lane {i}'s cache holds {} rows, its round counter {}",
                        c.len, lens[i]
                    ),
                ));
            }
            c.stage(k.row(i), v.row(i))?;
        }
        // the staged row is seen, not yet counted
        Ok(attend_lanes(q, d, caches, 1))
    }
}

/// One row of [`Backend::route`], the reference definition every backend follows:
///
/// - Only kept experts (`keep[i]`, all when `None`) take part; a pruned one is never chosen.
/// - NaN logits count as −∞. A kept expert at −∞ has probability 0; it is chosen only when fewer
///   than `k` kept experts have a larger logit, and then with weight exactly 0.
/// - Ranking is by logit, descending; equal logits (−0 = +0) go to the lower expert ID.
/// - Probabilities are the softmax over the kept experts (shifted by their maximum, summed in
///   ID order), renormalised over the chosen `k` (summed in rank order). If some kept logit is
///   +∞, the +∞ experts share the mass equally (the softmax limit) and every other gets 0.
/// - A row whose kept logits are all NaN or −∞ has no distribution: it is an error
///   (`None` here, [`BackendError::NonFinite`] from `route`), never a silent pick.
///
/// `k` must be at most the kept count (`route` checks it).
pub fn route_row(logits: &[f32], k: usize, keep: Option<&[bool]>) -> Option<(Vec<u32>, Vec<f32>)> {
    let kept = |i: usize| keep.is_none_or(|m| m[i]);
    let l = |i: usize| {
        let v = logits[i];
        if v.is_nan() {
            f32::NEG_INFINITY
        } else {
            v
        }
    };
    let max = (0..logits.len())
        .filter(|&i| kept(i))
        .map(l)
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    let p: Vec<f32> = (0..logits.len())
        .map(|i| match (kept(i), max == f32::INFINITY) {
            (false, _) => 0.0,
            (true, false) => (l(i) - max).exp(),
            (true, true) => f32::from(u8::from(l(i) == f32::INFINITY)),
        })
        .collect();
    let sum: f32 = p.iter().sum();
    let p: Vec<f32> = p.iter().map(|v| v / sum).collect();
    let mut order: Vec<usize> = (0..logits.len()).filter(|&i| kept(i)).collect();
    // Stable sort on NaN-free logits: equal logits keep ascending expert order.
    order.sort_by(|&a, &b| l(b).partial_cmp(&l(a)).unwrap_or(std::cmp::Ordering::Equal));
    order.truncate(k);
    let total: f32 = order.iter().map(|&i| p[i]).sum();
    let ids = order.iter().map(|&i| i as u32).collect();
    let w = order.iter().map(|&i| p[i] / total).collect();
    Some((ids, w))
}

fn check_attn(q: &CpuBuf, k: &CpuBuf, v: &CpuBuf, d: &AttnDims, width: usize) -> BResult<()> {
    check::attn(q.shape(), k.shape(), v.shape(), d, width)
}

fn check_conv(x: &CpuBuf, w: &CpuVector, d: &GdnDims) -> BResult<()> {
    check::conv(x.shape(), w.0.len(), d)
}

fn check_gdn(
    qkv: &CpuBuf,
    b: &CpuBuf,
    a: &CpuBuf,
    a_log: &CpuVector,
    dt: &CpuVector,
    d: &GdnDims,
) -> BResult<()> {
    check::gdn(
        qkv.shape(),
        b.shape(),
        a.shape(),
        a_log.0.len(),
        dt.0.len(),
        d,
    )
}

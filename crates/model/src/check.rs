//! Argument checks of the [`crate::Backend`] ops, shared by every backend so that a misuse is
//! refused with the same message everywhere. They read shapes only; a backend adds its own
//! device limits (kernel head-dim bounds, 32-bit grids) after them.

use crate::backend::{AttnDims, BResult, BackendError, GdnDims};

/// `(rows, cols)` of an activation or weight matrix.
pub type Shape = (usize, usize);

fn err(op: &'static str, why: String) -> BResult<()> {
    Err(BackendError::Shape { op, why })
}

/// `data.len()` values for a `[rows, cols]` matrix.
pub fn upload(len: usize, rows: usize, cols: usize) -> BResult<()> {
    if rows.checked_mul(cols) != Some(len) {
        return err("upload", format!("{len} values for [{rows}, {cols}]"));
    }
    Ok(())
}

/// Cols `offset..offset+len` of each group of `group` cols of `x`.
pub fn cols_grouped(x: Shape, group: usize, offset: usize, len: usize) -> BResult<()> {
    if group == 0 || !x.1.is_multiple_of(group) || offset.checked_add(len).is_none_or(|e| e > group)
    {
        return err(
            "cols_grouped",
            format!(
                "cols {offset}..{} of groups of {group} in a {}-col matrix",
                offset.saturating_add(len),
                x.1
            ),
        );
    }
    Ok(())
}

/// Rows `start..start+len` of `x`.
pub fn rows(x: Shape, start: usize, len: usize) -> BResult<()> {
    if start.checked_add(len).is_none_or(|e| e > x.0) {
        return err(
            "rows",
            format!("rows {start}..{} of {}", start.saturating_add(len), x.0),
        );
    }
    Ok(())
}

/// `[a | b]` row by row: equal row counts.
pub fn concat_cols(a: Shape, b: Shape) -> BResult<()> {
    if a.0 != b.0 {
        return err("concat_cols", format!("{} rows vs {}", a.0, b.0));
    }
    Ok(())
}

/// Parts stacked vertically: every part has `cols` cols.
pub fn concat_rows(cols: usize, part: Shape) -> BResult<()> {
    if part.1 != cols {
        return err("concat_rows", format!("{} cols vs {cols}", part.1));
    }
    Ok(())
}

/// Elementwise ops: both operands `[rows, cols]` alike.
pub fn same_shape(op: &'static str, a: Shape, b: Shape) -> BResult<()> {
    if a != b {
        return err(op, format!("[{}, {}] vs [{}, {}]", a.0, a.1, b.0, b.1));
    }
    Ok(())
}

/// RMSNorm over groups of `group` cols with a `w_len`-entry weight.
pub fn rms_norm(op: &'static str, x: Shape, group: usize, w_len: usize) -> BResult<()> {
    if group == 0 || !x.1.is_multiple_of(group) || w_len != group {
        return err(op, format!("{} cols, group {group}, weight {w_len}", x.1));
    }
    Ok(())
}

/// `y = x Wᵀ` with `W` `[out, in]`.
pub fn linear(x: Shape, w: Shape) -> BResult<()> {
    if x.1 != w.1 {
        return err(
            "linear",
            format!("input has {} cols, weight [{}, {}]", x.1, w.0, w.1),
        );
    }
    Ok(())
}

/// A sigmoid gate `[rows, cols]` or `[rows, 1]` on `x` `[rows, cols]`.
pub fn gate(op: &'static str, x: Shape, gate: Shape) -> BResult<()> {
    if gate.0 != x.0 || (gate.1 != x.1 && gate.1 != 1) {
        return err(
            op,
            format!("x [{}, {}], gate [{}, {}]", x.0, x.1, gate.0, gate.1),
        );
    }
    Ok(())
}

/// Rotary embedding of `x` with one position per row.
pub fn rope(x: Shape, positions: usize, head_dim: usize, rot_dims: usize) -> BResult<()> {
    if positions != x.0
        || head_dim == 0
        || !x.1.is_multiple_of(head_dim)
        || rot_dims > head_dim
        || !rot_dims.is_multiple_of(2)
    {
        return err(
            "rope",
            format!(
                "[{}, {}] with {positions} positions, head_dim {head_dim}, rot {rot_dims}",
                x.0, x.1
            ),
        );
    }
    Ok(())
}

/// Attention inputs against their geometry and a cache of `cache_width` = kv heads x head dim.
pub fn attn(q: Shape, k: Shape, v: Shape, d: &AttnDims, cache_width: usize) -> BResult<()> {
    let kvw = d.kv_heads * d.head_dim;
    if q.1 != d.q_heads * d.head_dim
        || k.1 != kvw
        || v.1 != kvw
        || cache_width != kvw
        || k.0 != q.0
        || v.0 != q.0
        || d.kv_heads == 0
        || !d.q_heads.is_multiple_of(d.kv_heads)
    {
        return err(
            "attention",
            format!(
                "q [{}, {}], k [{}, {}], v [{}, {}], cache width {cache_width} for {d:?}",
                q.0, q.1, k.0, k.1, v.0, v.1
            ),
        );
    }
    Ok(())
}

/// One row per lane.
pub fn lanes(op: &'static str, rows: usize, lanes: usize) -> BResult<()> {
    if rows != lanes {
        return err(op, format!("{rows} rows for {lanes} lanes"));
    }
    Ok(())
}

/// The causal conv's input and `[C, K]` taps.
pub fn conv(x: Shape, taps: usize, d: &GdnDims) -> BResult<()> {
    if x.1 != d.channels() || taps != d.channels() * d.conv_kernel || d.conv_kernel == 0 {
        return err(
            "gdn_conv",
            format!(
                "x has {} cols, taps {taps}, for {} channels x {} taps",
                x.1,
                d.channels(),
                d.conv_kernel
            ),
        );
    }
    Ok(())
}

/// The gated delta rule's inputs: conv output, `b`, `a` and the per-head vectors.
pub fn gdn(
    qkv: Shape,
    b: Shape,
    a: Shape,
    a_log: usize,
    dt_bias: usize,
    d: &GdnDims,
) -> BResult<()> {
    let nv = d.v_heads;
    if qkv.1 != d.channels()
        || b.1 != nv
        || a.1 != nv
        || b.0 != qkv.0
        || a.0 != qkv.0
        || a_log != nv
        || dt_bias != nv
        || d.k_heads == 0
        || !nv.is_multiple_of(d.k_heads)
    {
        return err(
            "gated delta rule",
            format!(
                "qkv [{}, {}], b [{}, {}], a [{}, {}], a_log {a_log}, dt_bias {dt_bias} values for {d:?}",
                qkv.0, qkv.1, b.0, b.1, a.0, a.1
            ),
        );
    }
    Ok(())
}

/// Top-`k` of `e` router columns with an optional keep mask; returns the kept count.
pub fn route(e: usize, k: usize, keep: Option<&[bool]>) -> BResult<usize> {
    let kept = keep.map_or(e, |m| m.iter().filter(|&&b| b).count());
    if k == 0 || k > kept || keep.is_some_and(|m| m.len() != e) {
        err(
            "route",
            format!(
                "top-{k} of {e} experts, {kept} kept (keep mask {:?} long)",
                keep.map(<[bool]>::len)
            ),
        )?;
    }
    Ok(kept)
}

/// The length after appending `add` rows to a cache of `len` rows, or [`BackendError::KvFull`]
/// past its capacity.
pub fn kv_room(len: usize, add: usize, capacity: usize) -> BResult<usize> {
    let need = len.saturating_add(add);
    if need > capacity {
        return Err(BackendError::KvFull {
            len,
            add,
            need,
            capacity,
        });
    }
    Ok(need)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Rope;

    fn is_shape_err(r: BResult<impl Sized>, op: &str) -> bool {
        matches!(r, Err(BackendError::Shape { op: o, .. }) if o == op)
    }

    #[test]
    fn each_check_accepts_the_right_shapes_and_names_its_op() {
        assert!(upload(6, 2, 3).is_ok());
        assert!(is_shape_err(upload(5, 2, 3), "upload"));
        assert!(cols_grouped((2, 12), 6, 2, 4).is_ok());
        assert!(is_shape_err(cols_grouped((2, 12), 6, 3, 4), "cols_grouped"));
        assert!(is_shape_err(
            cols_grouped((2, 12), 6, usize::MAX, 2),
            "cols_grouped"
        ));
        assert!(rows((4, 2), 1, 3).is_ok());
        assert!(is_shape_err(rows((4, 2), 2, 3), "rows"));
        assert!(is_shape_err(rows((4, 2), usize::MAX, 2), "rows"));
        assert!(concat_cols((3, 1), (3, 5)).is_ok());
        assert!(is_shape_err(concat_cols((3, 1), (2, 5)), "concat_cols"));
        assert!(concat_rows(4, (9, 4)).is_ok());
        assert!(is_shape_err(concat_rows(4, (9, 5)), "concat_rows"));
        assert!(same_shape("add", (2, 3), (2, 3)).is_ok());
        assert!(is_shape_err(same_shape("add", (2, 3), (3, 2)), "add"));
        assert!(rms_norm("rms_norm", (2, 128), 64, 64).is_ok());
        assert!(is_shape_err(
            rms_norm("rms_norm", (2, 100), 64, 64),
            "rms_norm"
        ));
        assert!(is_shape_err(
            rms_norm("rms_norm", (2, 128), 0, 0),
            "rms_norm"
        ));
        assert!(linear((4, 16), (8, 16)).is_ok());
        assert!(is_shape_err(linear((4, 16), (16, 8)), "linear"));
        assert!(gate("sigmoid_mul", (3, 8), (3, 1)).is_ok());
        assert!(gate("sigmoid_mul", (3, 8), (3, 8)).is_ok());
        assert!(is_shape_err(
            gate("sigmoid_mul", (3, 8), (3, 2)),
            "sigmoid_mul"
        ));
        assert!(rope((2, 64), 2, 32, 8).is_ok());
        assert!(is_shape_err(rope((2, 64), 1, 32, 8), "rope"));
        assert!(is_shape_err(rope((2, 64), 2, 32, 7), "rope"));
        let d = AttnDims {
            q_heads: 4,
            kv_heads: 2,
            head_dim: 8,
            rot_dims: 2,
            theta: 1e4,
            rope: Rope::Neox,
        };
        assert!(attn((3, 32), (3, 16), (3, 16), &d, 16).is_ok());
        assert!(is_shape_err(
            attn((3, 32), (3, 16), (2, 16), &d, 16),
            "attention"
        ));
        assert!(is_shape_err(
            attn((3, 32), (3, 16), (3, 16), &d, 8),
            "attention"
        ));
        assert!(lanes("attn_step", 3, 3).is_ok());
        assert!(is_shape_err(lanes("attn_step", 3, 2), "attn_step"));
        let g = GdnDims {
            k_heads: 2,
            v_heads: 4,
            k_dim: 4,
            v_dim: 4,
            conv_kernel: 4,
        };
        let c = g.channels();
        assert!(conv((1, c), c * 4, &g).is_ok());
        assert!(is_shape_err(conv((1, c), c * 3, &g), "gdn_conv"));
        assert!(gdn((2, c), (2, 4), (2, 4), 4, 4, &g).is_ok());
        assert!(is_shape_err(
            gdn((2, c), (2, 4), (1, 4), 4, 4, &g),
            "gated delta rule"
        ));
        assert_eq!(route(8, 2, None).unwrap(), 8);
        assert_eq!(route(4, 2, Some(&[true, false, true, true])).unwrap(), 3);
        assert!(is_shape_err(
            route(4, 4, Some(&[true, false, true, true])),
            "route"
        ));
        assert!(is_shape_err(route(4, 0, None), "route"));
        assert!(is_shape_err(route(4, 1, Some(&[true])), "route"));
    }
}

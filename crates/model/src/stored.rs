//! Stored-precision weight forms every backend accepts, checked once here so that the backends
//! only upload or map what these functions return.

use checkpoint::{Checkpoint, DType, TensorView};

use crate::backend::{BResult, BackendError};

/// Values per NVFP4 scale group.
pub const NVFP4_GROUP: usize = 16;

/// `(rows, cols)` of a stored 2-D matrix, or the tensor named with the shape it has.
pub fn matrix_shape(name: &str, shape: &[usize]) -> BResult<(usize, usize)> {
    match shape {
        [r, c] => Ok((*r, *c)),
        s => Err(BackendError::Weight {
            name: name.into(),
            why: format!("expected a 2-D matrix, found shape {s:?}"),
        }),
    }
}

/// The listed rows of BF16 matrix `name`, in that order, as stored bytes (the
/// candidate-restricted lm_head); returns the bytes and the column count.
pub fn bf16_rows(ck: &Checkpoint, name: &str, rows: &[u32]) -> BResult<(Vec<u8>, usize)> {
    let v = ck.tensor(name)?;
    let (n, cols) = matrix_shape(name, v.shape())?;
    if v.dtype() != DType::BF16 {
        return Err(BackendError::Weight {
            name: name.into(),
            why: format!("row gathering needs BF16, found {}", v.dtype()),
        });
    }
    let mut out = Vec::with_capacity(rows.len() * cols * 2);
    for &r in rows {
        let r = r as usize;
        if r >= n {
            return Err(BackendError::Weight {
                name: name.into(),
                why: format!("row {r} is outside its {n} rows"),
            });
        }
        out.extend_from_slice(&v.bytes[r * cols * 2..(r + 1) * cols * 2]);
    }
    Ok((out, cols))
}

/// The parts of an NVFP4 matrix `<stem>.weight` (U8 `[rows, cols/2]`, two E2M1 codes per byte,
/// low nibble = even column): `<stem>.weight_scale` F8_E4M3 `[rows, cols/16]` and
/// `<stem>.weight_scale_2`, one F32. Value = (e2m1 × e4m3) × global.
pub struct Nvfp4Parts<'a> {
    pub rows: usize,
    pub cols: usize,
    pub codes: TensorView<'a>,
    pub scales: TensorView<'a>,
    pub global: f32,
}

/// Checks and returns the parts of NVFP4 matrix `name` of `rows` x `col_bytes` code bytes.
/// NaN or negative scale codes, and a global scale that is not finite and non-negative, are
/// refused with the tensor named.
pub fn nvfp4_parts<'a>(
    ck: &'a Checkpoint,
    name: &str,
    rows: usize,
    col_bytes: usize,
) -> BResult<Nvfp4Parts<'a>> {
    let bad = |n: &str, why: String| BackendError::Weight {
        name: n.into(),
        why,
    };
    let stem = name.strip_suffix(".weight").ok_or_else(|| {
        bad(
            name,
            "a U8 (NVFP4) matrix must be named <stem>.weight, beside <stem>.weight_scale and \
             <stem>.weight_scale_2"
                .into(),
        )
    })?;
    let cols = col_bytes
        .checked_mul(2)
        .ok_or_else(|| bad(name, format!("{col_bytes} code bytes per row overflow")))?;
    if !cols.is_multiple_of(NVFP4_GROUP) {
        return Err(bad(
            name,
            format!("NVFP4 needs a multiple of {NVFP4_GROUP} columns, found {cols}"),
        ));
    }
    let sname = format!("{stem}.weight_scale");
    let scales = ck.tensor(&sname)?;
    let want = [rows, cols / NVFP4_GROUP];
    if scales.dtype() != DType::F8E4M3 || scales.shape() != want {
        return Err(bad(
            &sname,
            format!(
                "expected F8_E4M3 {want:?}, found {} {:?}",
                scales.dtype(),
                scales.shape()
            ),
        ));
    }
    if let Some(i) = scales
        .bytes
        .iter()
        .position(|&b| b & 0x7f == 0x7f || b > 0x80)
    {
        return Err(bad(
            &sname,
            format!(
                "scale code {:#04x} at element {i} is NaN or negative",
                scales.bytes[i]
            ),
        ));
    }
    let gname = format!("{stem}.weight_scale_2");
    let gv = ck.tensor(&gname)?;
    let g = gv.to_f32();
    if gv.dtype() != DType::F32 || g.len() != 1 {
        return Err(bad(
            &gname,
            format!(
                "expected one F32 value, found {} {:?}",
                gv.dtype(),
                gv.shape()
            ),
        ));
    }
    if !(g[0].is_finite() && g[0] >= 0.0) {
        return Err(bad(
            &gname,
            format!("global scale {} is not finite and non-negative", g[0]),
        ));
    }
    Ok(Nvfp4Parts {
        rows,
        cols,
        codes: ck.tensor(name)?,
        scales,
        global: g[0],
    })
}

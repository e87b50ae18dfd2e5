//! Fallbacks of fused ops composed from basic ops, for backends that do not (yet) provide the
//! fused kernel (their [`BackendStorage`](crate::backend::BackendStorage) method answers
//! `Ok(None)`). Each computes in [`compute_dtype`] of its input and returns what the fused op
//! returns (dtypes and shapes included); results agree with the fused kernels up to rounding
//! (the order of operations differs), which the tests of each file check against the CPU's
//! kernels (forced by declining fused kernels on the test's thread).
//!
//! Every function takes contiguous tensors shaped as the calling op passes them. One file per
//! op or family: `basic` (linear), `optim` (AdamW, SGD). The ops
//! moved to `ops/fused/` keep their fallback in their own folder (`fallback.rs`); this module
//! also holds the helpers those share ([`widen`], [`shifted`], [`replace`], [`column`],
//! [`row_sum`]).

mod basic;
mod optim;
#[cfg(test)]
pub(crate) mod testutil;

pub(crate) use basic::linear;
pub(crate) use optim::{adamw, sgd};

use super::compute_dtype;
use crate::{DType, Result, Tensor};

/// `t` converted to its compute precision.
pub(crate) fn widen(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(compute_dtype(t.dtype()))
}

/// Row max subtracted, so `exp` cannot overflow: `(x - max, max)` over the last dim (kept).
pub(crate) fn shifted(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let m = x.max(-1, true)?;
    Ok((x.sub(&m)?, m))
}

/// `x` with the elements equal to `from` (a value of `x`'s dtype) replaced by `to`.
pub(crate) fn replace(x: &Tensor, from: f64, to: f64) -> Result<Tensor> {
    let f = Tensor::scalar(from, x.dtype(), x.device())?;
    let t = Tensor::scalar(to, x.dtype(), x.device())?;
    x.eq(&f)?.where_cond(&t, x)
}

/// `x`'s statistic `s` (shape `[rows]`) as a `[rows, 1]` column in compute precision.
pub(crate) fn column(s: &Tensor, rows: usize) -> Result<Tensor> {
    widen(s)?.reshape((rows, 1))
}

/// A weight gradient `Σ_rows g` of `[rows, cols]` `g`, in `dtype` (zeros when there are no rows).
pub(crate) fn row_sum(g: &Tensor, cols: usize, dtype: DType) -> Result<Tensor> {
    if g.elem_count() == 0 {
        return Tensor::zeros(cols, dtype, g.device());
    }
    g.sum(&[0], false)?.to_dtype(dtype)
}

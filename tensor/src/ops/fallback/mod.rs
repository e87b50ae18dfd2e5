//! What the composed fallbacks of the fused ops share. Every fused op of `ops/fused/` keeps its
//! fallback (the op composed of basic ops, for a backend whose fused path answers `Ok(None)`)
//! in its own folder (`fallback.rs`); each computes in [`compute_dtype`] of its input and
//! returns what the fused op returns (dtypes and shapes included), and the tests beside it check
//! it against the CPU's kernels (forced by declining fused kernels on the test's thread, with
//! [`testutil`]). The helpers here: [`widen`], [`shifted`], [`replace`], [`column`],
//! [`row_sum`], [`norm_input_grad`], [`optimizer_dtype`] and [`scalar_like`].

#[cfg(test)]
pub(crate) mod testutil;

use super::compute_dtype;
use crate::{DType, Error, Result, Tensor};

/// Refuses parameter dtypes the optimizer kernels do not take (half types: the state would
/// lose the small updates).
pub(crate) fn optimizer_dtype(op: &'static str, p: &Tensor) -> Result<()> {
    match p.dtype() {
        DType::F32 | DType::F64 => Ok(()),
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// A scalar of `p`'s dtype on its device.
pub(crate) fn scalar_like(v: f64, p: &Tensor) -> Result<Tensor> {
    Tensor::scalar(v, p.dtype(), p.device())
}

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

/// The input gradient of a norm over the rows of `x` (layer norm when `centred`, RMSNorm
/// otherwise) in `x`'s dtype and shape, from `dyc` (`dy` in compute precision, `[rows, cols]`),
/// the optional weight, the normalised input `xhat` and the `[rows, 1]` column `rs` of `rstd`:
/// with `g = weight · dy` (or `dy`), `rstd (g - mean(g) - xhat mean(g xhat))`, without the
/// `mean(g)` term for RMSNorm.
pub(crate) fn norm_input_grad(
    x: &Tensor,
    w: Option<&Tensor>,
    [dyc, xhat, rs]: [&Tensor; 3],
    centred: bool,
) -> Result<Tensor> {
    if x.elem_count() == 0 {
        return x.zeros_like();
    }
    let g = match w {
        Some(w) => dyc.mul(&widen(w)?)?,
        None => dyc.clone(),
    };
    let gx_mean = g.mul(xhat)?.mean(&[-1], true)?;
    let g = if centred {
        g.sub(&g.mean(&[-1], true)?)?
    } else {
        g
    };
    let dx = g.sub(&xhat.mul(&gx_mean)?)?.mul(rs)?;
    dx.to_dtype(x.dtype())?.reshape(x.shape().clone())
}

/// A weight gradient `Σ_rows g` of `[rows, cols]` `g`, in `dtype` (zeros when there are no rows).
pub(crate) fn row_sum(g: &Tensor, cols: usize, dtype: DType) -> Result<Tensor> {
    if g.elem_count() == 0 {
        return Tensor::zeros(cols, dtype, g.device());
    }
    g.sum(&[0], false)?.to_dtype(dtype)
}

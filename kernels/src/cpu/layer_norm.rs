//! Fused layer norm over the last dimension of a contiguous `[rows, cols]` buffer.

use crate::Float;

/// `y = (x - mean) * rstd * weight + bias` row-wise, with `rstd = 1/sqrt(var + eps)` (biased
/// variance). Writes the per-row `mean` and `rstd` (length `rows`) for the backward pass.
/// `weight`/`bias` (length `cols`) are optional (absent = 1 and 0).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<T: Float>(
    x: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    rows: usize,
    cols: usize,
    eps: f64,
    y: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
) {
    let _ = (x, weight, bias, rows, cols, eps, y, mean, rstd);
    todo!("layer_norm_forward")
}

/// Backward of [`layer_norm_forward`]: writes (overwrites) `dx`, and `dweight` / `dbias`
/// (length `cols`, summed over rows in increasing row order) when given.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<T: Float>(
    x: &[T],
    weight: Option<&[T]>,
    mean: &[T],
    rstd: &[T],
    dy: &[T],
    rows: usize,
    cols: usize,
    dx: &mut [T],
    dweight: Option<&mut [T]>,
    dbias: Option<&mut [T]>,
) {
    let _ = (x, weight, mean, rstd, dy, rows, cols, dx, dweight, dbias);
    todo!("layer_norm_backward")
}

//! Fused cross-entropy over logits `[rows, cols]` and integer targets, with its gradient.

use crate::{Float, KernelError};

/// Per row: `loss[r] = logsumexp(logits[r]) - logits[r, targets[r]]`, and `lse[r]` is written
/// for the backward pass. Rows whose target equals `ignore_index` get loss 0. A target outside
/// `0..cols` (and not ignored) is an error naming the row and the value.
pub fn cross_entropy_forward<T: Float>(
    logits: &[T],
    targets: &[i64],
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
    loss: &mut [T],
    lse: &mut [T],
) -> Result<(), KernelError> {
    let _ = (logits, targets, rows, cols, ignore_index, loss, lse);
    todo!("cross_entropy_forward")
}

/// `dlogits[r] = dloss[r] * (softmax(logits[r]) - onehot(targets[r]))`, zero for ignored rows;
/// overwrites `dlogits`.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward<T: Float>(
    logits: &[T],
    lse: &[T],
    targets: &[i64],
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
    dloss: &[T],
    dlogits: &mut [T],
) {
    let _ = (logits, lse, targets, rows, cols, ignore_index, dloss, dlogits);
    todo!("cross_entropy_backward")
}

//! Embedding lookup (gather rows) and its backward (scatter-add rows).

use crate::{Float, KernelError};

/// `out[i] = weight[ids[i]]` for a `[vocab, dim]` table; an id outside `0..vocab` is an error
/// naming its position and value.
pub fn embedding_forward<T: Copy + Send + Sync>(
    weight: &[T],
    vocab: usize,
    dim: usize,
    ids: &[i64],
    out: &mut [T],
) -> Result<(), KernelError> {
    let _ = (weight, vocab, dim, ids, out);
    todo!("embedding_forward")
}

/// `dweight[ids[i]] += dout[i]`, accumulated in increasing `i` for each row (deterministic).
pub fn embedding_backward<T: Float>(
    dout: &[T],
    ids: &[i64],
    vocab: usize,
    dim: usize,
    dweight: &mut [T],
) -> Result<(), KernelError> {
    let _ = (dout, ids, vocab, dim, dweight);
    todo!("embedding_backward")
}

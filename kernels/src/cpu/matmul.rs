//! Batched matrix multiplication with arbitrary strides (no transposes are materialised).

use crate::Float;

/// Where a batch of matrices lives in a flat buffer: element offset and strides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixLayout {
    /// Offset of batch 0's element (0, 0).
    pub offset: usize,
    /// Stride between consecutive matrices of the batch (0 broadcasts one matrix to all).
    pub batch_stride: usize,
    /// Stride between rows.
    pub row_stride: usize,
    /// Stride between columns.
    pub col_stride: usize,
}

/// For each `b < batch`: `C[b] = A[b] · B[b]` (or `C[b] += A[b] · B[b]` when `accumulate`), with
/// A `m×k`, B `k×n`, C `m×n`, each described by its layout. Uses the `gemm` crate (which takes
/// arbitrary row/column strides) and its own parallelism; `k == 0` gives zeros (or leaves C when
/// accumulating).
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Float>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_layout: MatrixLayout,
    b: &[T],
    b_layout: MatrixLayout,
    c: &mut [T],
    c_layout: MatrixLayout,
    accumulate: bool,
) {
    let _ = (batch, m, n, k, a, a_layout, b, b_layout, c, c_layout, accumulate);
    todo!("matmul")
}

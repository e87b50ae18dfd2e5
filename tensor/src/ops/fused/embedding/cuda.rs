//! Embedding lookup on CUDA, forward and backward: the kernels of `kernels/cuda/embedding.cu`,
//! launched by `cuda_backend/basic/indexing.rs` (which shares the id checks with gather and
//! index_select). Every dtype the CPU takes is provided.

use super::{Embedding, EmbeddingBackward};
use crate::cuda_backend::basic;
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// See [`Embedding`] and `basic::embedding`.
pub(super) fn forward(a: &Embedding<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    basic::embedding(a.table, a.ids, a.vocab, a.dim).map(Some)
}

/// See [`EmbeddingBackward`] and `basic::embedding_backward`.
pub(super) fn backward(a: &EmbeddingBackward<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    basic::embedding_backward(a.dout, a.ids, a.vocab, a.dim).map(Some)
}

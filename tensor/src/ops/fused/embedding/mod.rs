//! Embedding lookup and its backward: the argument structs [`Embedding`] and
//! [`EmbeddingBackward`], their paths (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the tensor ops
//! [`Tensor::embedding`] and [`Tensor::embedding_backward`]. The CPU kernels are
//! `meshgrad_kernels::cpu::embedding`, the CUDA ones those of `kernels/cuda/embedding.cu`
//! (launched by `cuda_backend/basic/indexing.rs`, beside gather and index_select); the autograd
//! rule is `Var::embedding`.

pub(crate) mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod fallback;

use meshgrad_derive::FusedArgs;

use super::{fused_op, run};
use crate::ops::same_device;
use crate::{Error, Result, Tensor};

/// Rows of `table` (`[vocab, dim]`, contiguous) picked by the integer `ids` (contiguous, any
/// shape): a tensor of dims `out_dims` (`ids`' dims and `dim`) in the table's dtype. An id
/// outside `0..vocab` is an error.
#[derive(Clone, Debug, FusedArgs)]
pub(crate) struct Embedding<T> {
    /// The table.
    pub table: T,
    /// The ids (i64, u32 or u8).
    pub ids: T,
    /// Rows of the table.
    pub vocab: usize,
    /// Columns of the table.
    pub dim: usize,
    /// The result's dims.
    pub out_dims: Vec<usize>,
}

/// The backward of [`Embedding`]: the rows of `dout` (`ids`' elements times `dim`, contiguous)
/// scatter-added into a zero `[vocab, dim]` gradient in `dout`'s dtype, in increasing position
/// order.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct EmbeddingBackward<T> {
    /// The gradient of the lookup's result.
    pub dout: T,
    /// The lookup's ids.
    pub ids: T,
    /// Rows of the table.
    pub vocab: usize,
    /// Columns of the table.
    pub dim: usize,
}

fused_op!(Embedding, "embedding", forward, |a| a.out_dims.clone());
fused_op!(EmbeddingBackward, "embedding_backward", backward, |a| (
    a.vocab, a.dim
));

impl Tensor {
    /// Embedding lookup: rows of `self` (`[vocab, dim]`) picked by integer `ids` of any shape;
    /// the result has shape `ids.shape + [dim]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        let _prof = crate::profile::scope("embedding");
        same_device("embedding", self, ids)?;
        if self.rank() != 2 {
            crate::bail!(
                "embedding: the table must be [vocab, dim], got {}",
                self.shape()
            );
        }
        let (vocab, dim) = (self.dims()[0], self.dims()[1]);
        let (w, i) = (self.contiguous()?, ids.contiguous()?);
        let mut out_dims = ids.dims().to_vec();
        out_dims.push(dim);
        run(&Embedding {
            table: &w,
            ids: &i,
            vocab,
            dim,
            out_dims,
        })
    }

    /// The backward of [`Tensor::embedding`]: scatter-adds `self` (`ids.shape + [dim]`) into a
    /// zero `[vocab, dim]` gradient, in increasing position order (deterministic).
    pub fn embedding_backward(&self, ids: &Tensor, vocab: usize) -> Result<Tensor> {
        let _prof = crate::profile::scope("embedding_backward");
        same_device("embedding_backward", self, ids)?;
        let dim = *self.dims().last().unwrap_or(&0);
        if self.elem_count() != ids.elem_count() * dim {
            return Err(Error::shape_mismatch(
                "embedding_backward",
                self.shape(),
                ids.shape(),
            ));
        }
        let (d, i) = (self.contiguous()?, ids.contiguous()?);
        run(&EmbeddingBackward {
            dout: &d,
            ids: &i,
            vocab,
            dim,
        })
    }
}

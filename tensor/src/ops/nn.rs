//! Embedding lookups (and their backward) and dropout masks.

use super::same_device;
use crate::{backend, DType, Error, Result, Shape, Tensor};

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
        let (gw, gi) = (w.read_storage("embedding")?, i.read_storage("embedding")?);
        let s = backend::embedding((&gw, w.layout()), (&gi, i.layout()), vocab, dim)?;
        let mut shape = ids.dims().to_vec();
        shape.push(dim);
        Ok(Tensor::from_storage(s, shape))
    }

    /// The backward of [`Tensor::embedding`]: scatter-adds `self` (`ids.shape + [dim]`) into a
    /// zero `[vocab, dim]` gradient, in increasing position order (deterministic).
    pub fn embedding_backward(&self, ids: &Tensor, vocab: usize) -> Result<Tensor> {
        let _prof = crate::profile::scope("embedding_backward");
        same_device("embedding_backward", self, ids)?;
        let dim = *self.dims().last().unwrap_or(&0);
        if self.elem_count() != ids.elem_count() * dim {
            return Err(Error::ShapeMismatch {
                op: "embedding_backward",
                lhs: self.shape().clone(),
                rhs: ids.shape().clone(),
            });
        }
        let (d, i) = (self.contiguous()?, ids.contiguous()?);
        let (gd, gi) = (
            d.read_storage("embedding_backward")?,
            i.read_storage("embedding_backward")?,
        );
        let s = backend::embedding_backward((&gd, d.layout()), (&gi, i.layout()), vocab, dim)?;
        Ok(Tensor::from_storage(s, (vocab, dim)))
    }

    /// A dropout mask of `shape`: `1/(1-p)` where the counter-based uniform `(seed, start + i)`
    /// is at least `p`, else 0. Element `i` (row-major) of a shard built with its global `start`
    /// matches the same element of the whole tensor.
    pub fn dropout_mask(
        seed: u64,
        start: u64,
        p: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: crate::Device,
    ) -> Result<Tensor> {
        if !(0.0..1.0).contains(&p) {
            crate::bail!("dropout: probability {p} must be in [0, 1)");
        }
        // Drawn and built on `device` (every backend runs the same counter-based stream).
        let u = crate::Random::new(seed)
            .offset(start)
            .device(device)
            .uniform(shape, 0.0, 1.0)?;
        let keep = u.ge(&Tensor::scalar(p, DType::F32, device)?)?;
        let scale = Tensor::scalar(1.0 / (1.0 - p), dtype, device)?;
        let zero = Tensor::scalar(0.0, dtype, device)?;
        keep.where_cond(&scale, &zero)
    }
}

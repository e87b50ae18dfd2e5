//! Fused neural-network ops and their backward passes: softmax, cross-entropy,
//! embedding, dropout masks (attention is in `attention.rs`).

use super::{same_device, same_kind};
use crate::{backend, DType, Error, Result, Shape, Tensor};

fn rows_cols(t: &Tensor) -> (usize, usize) {
    let cols = *t.dims().last().unwrap_or(&1);
    let rows = t.elem_count().checked_div(cols).unwrap_or(0);
    (rows, cols)
}

impl Tensor {
    fn softmax_impl(&self, dim: isize, log: bool) -> Result<Tensor> {
        let _prof = crate::profile::scope("softmax");
        let name = if log { "log_softmax" } else { "softmax" };
        let d = self.dim(name, dim)?;
        let last = self.rank() - 1;
        if d != last {
            return self
                .transpose(d as isize, last as isize)?
                .softmax_impl(-1, log)?
                .transpose(d as isize, last as isize);
        }
        let x = self.contiguous()?;
        let (rows, cols) = rows_cols(&x);
        let s = {
            let g = x.read_storage(name)?;
            backend::softmax((&g, x.layout()), rows, cols, log)?
        };
        match s {
            Some(s) => Ok(Tensor::from_storage(s, x.shape())),
            None => super::fallback::softmax(&x, log),
        }
    }

    /// Softmax along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, false)
    }

    /// Log-softmax along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        self.softmax_impl(dim, true)
    }

    /// The input gradient of softmax (`log = false`, `self` = the softmax output) or
    /// log-softmax (`log = true`, `self` = the log-softmax output) along `dim`, from `dy`.
    pub fn softmax_backward(&self, dy: &Tensor, dim: isize, log: bool) -> Result<Tensor> {
        let _prof = crate::profile::scope("softmax_backward");
        same_kind("softmax_backward", self, dy)?;
        let d = self.dim("softmax_backward", dim)?;
        let last = self.rank() - 1;
        if d != last {
            let (a, b) = (d as isize, last as isize);
            return self
                .transpose(a, b)?
                .softmax_backward(&dy.transpose(a, b)?, -1, log)?
                .transpose(a, b);
        }
        let (y, dy) = (self.contiguous()?, dy.contiguous()?);
        let (rows, cols) = rows_cols(&y);
        let s = {
            let (gy, gd) = (
                y.read_storage("softmax_backward")?,
                dy.read_storage("softmax_backward")?,
            );
            backend::softmax_backward((&gy, y.layout()), (&gd, dy.layout()), rows, cols, log)?
        };
        match s {
            Some(s) => Ok(Tensor::from_storage(s, y.shape())),
            None => super::fallback::softmax_backward(&y, &dy, log),
        }
    }

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

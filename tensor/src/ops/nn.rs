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

    /// Checks logits `[..., V]` against integer targets `[...]` (the leading dims); returns
    /// `(rows, V)` with `rows` the product of the leading dims.
    fn check_targets(
        logits: &Tensor,
        targets: &Tensor,
        op: &'static str,
    ) -> Result<(usize, usize)> {
        same_device(op, logits, targets)?;
        let r = logits.rank();
        if r == 0 || targets.dims() != &logits.dims()[..r - 1] {
            crate::bail!(
                "{op}: expected logits [..., V] and targets of their leading dims [...], got logits {} and targets {}",
                logits.shape(),
                targets.shape()
            );
        }
        if !targets.dtype().is_int() {
            return Err(Error::UnsupportedDType {
                op: "cross_entropy (targets must be integer ids)",
                dtype: targets.dtype(),
            });
        }
        let cols = logits.dims()[r - 1];
        Ok((targets.elem_count(), cols))
    }

    /// Fused cross-entropy of `self` (logits `[..., V]`, classes in the last dim) against
    /// integer `targets` shaped like the leading dims `[...]`: returns the per-position losses
    /// `logsumexp(logits) - logits[target]` (0 where the target is `ignore_index`) and the
    /// per-position log-sum-exp, both shaped like `targets`, in compute precision (f32 for f32
    /// and half types, f64 for f64). The leading dims are folded into rows; no probability
    /// tensor is materialised. A target outside `0..V` that is not `ignore_index` is an error.
    pub fn cross_entropy_rows(
        &self,
        targets: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<(Tensor, Tensor)> {
        let _prof = crate::profile::scope("cross_entropy");
        let (rows, cols) = Tensor::check_targets(self, targets, "cross_entropy")?;
        let (x, t) = (self.contiguous()?, targets.contiguous()?);
        let context = |e: Error| {
            Error::msg(format!(
                "{e} (logits {}, targets {} folded into {rows} rows, ignore_index {ignore_index:?})",
                self.shape(),
                targets.shape()
            ))
        };
        let r = {
            let (gx, gt) = (
                x.read_storage("cross_entropy")?,
                t.read_storage("cross_entropy")?,
            );
            backend::cross_entropy(
                (&gx, x.layout()),
                (&gt, t.layout()),
                rows,
                cols,
                ignore_index,
            )
            .map_err(context)?
        };
        let Some((loss, lse)) = r else {
            return super::fallback::cross_entropy(&x, &t, rows, cols, ignore_index)
                .map_err(context);
        };
        Ok((
            Tensor::from_storage(loss, targets.shape()),
            Tensor::from_storage(lse, targets.shape()),
        ))
    }

    /// The backward of [`Tensor::cross_entropy_rows`] (`self` is the logits `[..., V]`):
    /// `dlogits = dloss * (softmax(logits) - onehot(target))` per position, 0 where the target
    /// is ignored, from the saved `lse` and the per-position upstream `dloss` (each with one
    /// element per position, shaped like `targets` or flat). Returns the logits' shape and dtype.
    pub fn cross_entropy_backward(
        &self,
        lse: &Tensor,
        targets: &Tensor,
        dloss: &Tensor,
        ignore_index: Option<i64>,
    ) -> Result<Tensor> {
        let _prof = crate::profile::scope("cross_entropy_backward");
        let (rows, cols) = Tensor::check_targets(self, targets, "cross_entropy_backward")?;
        for (what, t) in [("lse", lse), ("dloss", dloss)] {
            if t.elem_count() != rows {
                crate::bail!(
                    "cross_entropy_backward: {what} {} must have one element per position of targets {} (logits {})",
                    t.shape(),
                    targets.shape(),
                    self.shape()
                );
            }
        }
        let c = |t: &Tensor| t.contiguous();
        let dloss = dloss.to_dtype(lse.dtype())?;
        let (x, l, t, d) = (c(self)?, c(lse)?, c(targets)?, c(&dloss)?);
        let op = "cross_entropy_backward";
        let r = {
            let (gx, gl, gt, gd) = (
                x.read_storage(op)?,
                l.read_storage(op)?,
                t.read_storage(op)?,
                d.read_storage(op)?,
            );
            backend::cross_entropy_backward(
                (&gx, x.layout()),
                (&gl, l.layout()),
                (&gt, t.layout()),
                (&gd, d.layout()),
                rows,
                cols,
                ignore_index,
            )?
        };
        match r {
            Some(s) => Ok(Tensor::from_storage(s, x.shape())),
            None => {
                super::fallback::cross_entropy_backward(&x, &l, &t, &d, rows, cols, ignore_index)
            }
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

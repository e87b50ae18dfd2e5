//! Fused neural-network ops and their backward passes: softmax, layer norm, attention,
//! cross-entropy, embedding, dropout masks.

use meshgrad_kernels::cpu::attention::AttentionShape;

use super::{same_device, same_kind};
use crate::{backend, DType, Error, Result, Shape, Tensor};

/// The results of [`Tensor::layer_norm`]: output and per-row statistics for the backward pass.
#[derive(Clone, Debug)]
pub struct LayerNormOutput {
    /// The normalised output, shaped like the input.
    pub y: Tensor,
    /// Per-row mean (compute precision), shape `[rows]`.
    pub mean: Tensor,
    /// Per-row `1/sqrt(var + eps)`, shape `[rows]`.
    pub rstd: Tensor,
}

/// The results of [`Tensor::attention`].
#[derive(Clone, Debug)]
pub struct AttentionOutput {
    /// `softmax(scale q kᵀ + mask) v`, shaped like `q`.
    pub out: Tensor,
    /// Row log-sum-exp of the scaled scores (compute precision), `q`'s shape without the last dim.
    pub lse: Tensor,
}

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
        let g = x.read_storage(name)?;
        let s = backend::softmax((&g, x.layout()), rows, cols, log)?;
        Ok(Tensor::from_storage(s, x.shape()))
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
        let (gy, gd) = (
            y.read_storage("softmax_backward")?,
            dy.read_storage("softmax_backward")?,
        );
        let s = backend::softmax_backward((&gy, y.layout()), (&gd, dy.layout()), rows, cols, log)?;
        Ok(Tensor::from_storage(s, y.shape()))
    }

    /// Layer norm over the last dim with optional affine `weight` and `bias` (shape `[C]`).
    pub fn layer_norm(
        &self,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<LayerNormOutput> {
        let _prof = crate::profile::scope("layer_norm");
        let (rows, cols) = rows_cols(self);
        for p in [weight, bias].into_iter().flatten() {
            same_device("layer_norm", self, p)?;
            if p.dims() != [cols] {
                return Err(Error::ShapeMismatch {
                    op: "layer_norm (weight/bias vs last dim)",
                    lhs: self.shape().clone(),
                    rhs: p.shape().clone(),
                });
            }
        }
        let x = self.contiguous()?;
        let w = weight.map(|w| w.contiguous()).transpose()?;
        let b = bias.map(|b| b.contiguous()).transpose()?;
        let gx = x.read_storage("layer_norm")?;
        let gw = w
            .as_ref()
            .map(|w| w.read_storage("layer_norm"))
            .transpose()?;
        let gb = b
            .as_ref()
            .map(|b| b.read_storage("layer_norm"))
            .transpose()?;
        let (y, mean, rstd) = backend::layer_norm(
            (&gx, x.layout()),
            gw.as_ref().zip(w.as_ref()).map(|(g, t)| (&**g, t.layout())),
            gb.as_ref().zip(b.as_ref()).map(|(g, t)| (&**g, t.layout())),
            rows,
            cols,
            eps,
        )?;
        Ok(LayerNormOutput {
            y: Tensor::from_storage(y, x.shape()),
            mean: Tensor::from_storage(mean, rows),
            rstd: Tensor::from_storage(rstd, rows),
        })
    }

    /// The backward of [`Tensor::layer_norm`] (`self` is its input): returns `dx` and, when
    /// `weight` was given, `(dweight, dbias)`.
    pub fn layer_norm_backward(
        &self,
        weight: Option<&Tensor>,
        mean: &Tensor,
        rstd: &Tensor,
        dy: &Tensor,
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let _prof = crate::profile::scope("layer_norm_backward");
        same_kind("layer_norm_backward", self, dy)?;
        let (rows, cols) = rows_cols(self);
        let (x, dy, mean, rstd) = (
            self.contiguous()?,
            dy.contiguous()?,
            mean.contiguous()?,
            rstd.contiguous()?,
        );
        let w = weight.map(|w| w.contiguous()).transpose()?;
        let op = "layer_norm_backward";
        let (gx, gd, gm, gr) = (
            x.read_storage(op)?,
            dy.read_storage(op)?,
            mean.read_storage(op)?,
            rstd.read_storage(op)?,
        );
        let gw = w.as_ref().map(|w| w.read_storage(op)).transpose()?;
        let (dx, dw, db) = backend::layer_norm_backward(
            (&gx, x.layout()),
            gw.as_ref().zip(w.as_ref()).map(|(g, t)| (&**g, t.layout())),
            (&gm, mean.layout()),
            (&gr, rstd.layout()),
            (&gd, dy.layout()),
            rows,
            cols,
            weight.is_some(),
        )?;
        let pg = match (dw, db) {
            (Some(dw), Some(db)) => Some((
                Tensor::from_storage(dw, cols),
                Tensor::from_storage(db, cols),
            )),
            _ => None,
        };
        Ok((Tensor::from_storage(dx, x.shape()), pg))
    }

    fn attention_shape(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<AttentionShape> {
        same_kind("attention", q, k)?;
        same_kind("attention", q, v)?;
        if q.rank() < 2 || k.shape() != v.shape() || k.rank() != q.rank() {
            crate::bail!(
                "attention: q {}, k {}, v {} must be [..., T, D] with k and v equal",
                q.shape(),
                k.shape(),
                v.shape()
            );
        }
        let r = q.rank();
        if q.dims()[..r - 2] != k.dims()[..r - 2] || q.dims()[r - 1] != k.dims()[r - 1] {
            crate::bail!(
                "attention: q {} and k {} disagree on batch dims or head dim",
                q.shape(),
                k.shape()
            );
        }
        let (seq_q, seq_k) = (q.dims()[r - 2], k.dims()[r - 2]);
        if causal && seq_k < seq_q {
            crate::bail!(
                "attention: causal attention needs seq_k >= seq_q, got q {} and k {}",
                q.shape(),
                k.shape()
            );
        }
        Ok(AttentionShape {
            batch_heads: q.dims()[..r - 2].iter().product(),
            seq_q,
            seq_k,
            head_dim: q.dims()[r - 1],
            causal,
            scale,
        })
    }

    /// Fused scaled dot-product attention `softmax(scale q kᵀ [+ causal mask]) v` over
    /// `q [..., Tq, D]`, `k, v [..., Tk, D]` (flash-style; the score matrix is never stored).
    pub fn attention(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<AttentionOutput> {
        let _prof = crate::profile::scope("attention");
        let shape = Tensor::attention_shape(q, k, v, causal, scale)?;
        let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
        let op = "attention";
        let (gq, gk, gv) = (
            q.read_storage(op)?,
            k.read_storage(op)?,
            v.read_storage(op)?,
        );
        let (out, lse) = backend::attention(
            (&gq, q.layout()),
            (&gk, k.layout()),
            (&gv, v.layout()),
            shape,
        )?;
        let lse_shape = q.dims()[..q.rank() - 1].to_vec();
        Ok(AttentionOutput {
            out: Tensor::from_storage(out, q.shape()),
            lse: Tensor::from_storage(lse, lse_shape),
        })
    }

    /// The backward of [`Tensor::attention`]: `(dq, dk, dv)`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_backward(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        causal: bool,
        scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let _prof = crate::profile::scope("attention_backward");
        let shape = Tensor::attention_shape(q, k, v, causal, scale)?;
        let c = |t: &Tensor| t.contiguous();
        let (q, k, v, out, lse, dout) = (c(q)?, c(k)?, c(v)?, c(out)?, c(lse)?, c(dout)?);
        let op = "attention_backward";
        fn g<'a>(t: &'a Tensor, op: &'static str) -> Result<crate::storage::StorageRead<'a>> {
            t.read_storage(op)
        }
        let (gq, gk, gv, go, gl, gd) = (
            g(&q, op)?,
            g(&k, op)?,
            g(&v, op)?,
            g(&out, op)?,
            g(&lse, op)?,
            g(&dout, op)?,
        );
        let (dq, dk, dv) = backend::attention_backward(
            (&gq, q.layout()),
            (&gk, k.layout()),
            (&gv, v.layout()),
            (&go, out.layout()),
            (&gl, lse.layout()),
            (&gd, dout.layout()),
            shape,
        )?;
        Ok((
            Tensor::from_storage(dq, q.shape()),
            Tensor::from_storage(dk, k.shape()),
            Tensor::from_storage(dv, v.shape()),
        ))
    }

    fn qkv_shape(qkv: &Tensor, heads: usize, causal: bool, scale: f64) -> Result<AttentionShape> {
        if qkv.rank() != 3 || heads == 0 || !qkv.dims()[2].is_multiple_of(3 * heads) {
            crate::bail!(
                "attention_qkv: expected a fused qkv tensor [B, T, 3C] with C divisible by {heads} heads, got {}",
                qkv.shape()
            );
        }
        if !qkv.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "attention_qkv",
                dtype: qkv.dtype(),
            });
        }
        let (b, t, c3) = (qkv.dims()[0], qkv.dims()[1], qkv.dims()[2]);
        Ok(AttentionShape {
            batch_heads: b * heads,
            seq_q: t,
            seq_k: t,
            head_dim: c3 / 3 / heads,
            causal,
            scale,
        })
    }

    /// Multi-head attention read straight from a fused qkv projection `self` (`[B, T, 3C]`: q, k,
    /// v each `[B, T, C]` side by side, `C = heads * D`, head `h` at columns `h*D .. (h+1)*D` of
    /// each): the output comes back as `[B, T, C]` (heads side by side), `lse` as `[B, heads, T]`.
    /// The same values as splitting, moving heads forward, [`Tensor::attention`] and moving them
    /// back, without any of the copies.
    pub fn attention_qkv(&self, heads: usize, causal: bool, scale: f64) -> Result<AttentionOutput> {
        let _prof = crate::profile::scope("attention");
        let shape = Tensor::qkv_shape(self, heads, causal, scale)?;
        let x = self.contiguous()?;
        let g = x.read_storage("attention_qkv")?;
        let (out, lse) = backend::attention_qkv((&g, x.layout()), shape, heads)?;
        let (b, t, c3) = (x.dims()[0], x.dims()[1], x.dims()[2]);
        Ok(AttentionOutput {
            out: Tensor::from_storage(out, (b, t, c3 / 3)),
            lse: Tensor::from_storage(lse, (b, heads, t)),
        })
    }

    /// The backward of [`Tensor::attention_qkv`] (`self` is its qkv input): `dqkv [B, T, 3C]`.
    pub fn attention_qkv_backward(
        &self,
        out: &Tensor,
        lse: &Tensor,
        dout: &Tensor,
        heads: usize,
        causal: bool,
        scale: f64,
    ) -> Result<Tensor> {
        let _prof = crate::profile::scope("attention_backward");
        let shape = Tensor::qkv_shape(self, heads, causal, scale)?;
        same_kind("attention_qkv_backward", self, out)?;
        same_kind("attention_qkv_backward", self, dout)?;
        let (b, t, c3) = (self.dims()[0], self.dims()[1], self.dims()[2]);
        if out.dims() != [b, t, c3 / 3]
            || dout.dims() != [b, t, c3 / 3]
            || lse.dims() != [b, heads, t]
        {
            crate::bail!(
                "attention_qkv_backward: qkv {}, out {}, dout {}, lse {} do not fit together",
                self.shape(),
                out.shape(),
                dout.shape(),
                lse.shape()
            );
        }
        let c = |t: &Tensor| t.contiguous();
        let (x, o, l, d) = (c(self)?, c(out)?, c(lse)?, c(dout)?);
        let op = "attention_qkv_backward";
        let (gx, go, gl, gd) = (
            x.read_storage(op)?,
            o.read_storage(op)?,
            l.read_storage(op)?,
            d.read_storage(op)?,
        );
        let s = backend::attention_qkv_backward(
            (&gx, x.layout()),
            (&go, o.layout()),
            (&gl, l.layout()),
            (&gd, d.layout()),
            shape,
            heads,
        )?;
        Ok(Tensor::from_storage(s, x.shape()))
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
        let (gx, gt) = (
            x.read_storage("cross_entropy")?,
            t.read_storage("cross_entropy")?,
        );
        let (loss, lse) = backend::cross_entropy(
            (&gx, x.layout()),
            (&gt, t.layout()),
            rows,
            cols,
            ignore_index,
        )
        .map_err(|e| {
            Error::msg(format!(
                "{e} (logits {}, targets {} folded into {rows} rows, ignore_index {ignore_index:?})",
                self.shape(),
                targets.shape()
            ))
        })?;
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
        let (gx, gl, gt, gd) = (
            x.read_storage(op)?,
            l.read_storage(op)?,
            t.read_storage(op)?,
            d.read_storage(op)?,
        );
        let s = backend::cross_entropy_backward(
            (&gx, x.layout()),
            (&gl, l.layout()),
            (&gt, t.layout()),
            (&gd, d.layout()),
            rows,
            cols,
            ignore_index,
        )?;
        Ok(Tensor::from_storage(s, x.shape()))
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
        let u = crate::Random::new(seed)
            .offset(start)
            .uniform(shape, 0.0, 1.0)?;
        let keep = u.ge(&Tensor::scalar(p, DType::F32, crate::Device::Cpu)?)?;
        let scale = Tensor::scalar(1.0 / (1.0 - p), dtype, crate::Device::Cpu)?;
        let zero = Tensor::scalar(0.0, dtype, crate::Device::Cpu)?;
        keep.where_cond(&scale, &zero)?.to_device(device)
    }
}

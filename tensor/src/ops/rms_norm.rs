//! Fused RMSNorm over the last dim (Llama's norm), forward and backward.

use super::{same_device, same_kind};
use crate::{backend, Error, Result, Tensor};

/// The results of [`Tensor::rms_norm`]: output and per-row statistic for the backward pass.
#[derive(Clone, Debug)]
pub struct RmsNormOutput {
    /// The normalised output, shaped like the input.
    pub y: Tensor,
    /// Per-row `1/sqrt(mean(x²) + eps)` (compute precision), shape `[rows]` (the input's element
    /// count over its last dim).
    pub rstd: Tensor,
}

/// `(rows, cols)` of a tensor normalised over its last dim.
fn rows_cols(t: &Tensor) -> (usize, usize) {
    let cols = *t.dims().last().unwrap_or(&1);
    let rows = t.elem_count().checked_div(cols).unwrap_or(0);
    (rows, cols)
}

/// Checks the optional weight against the input's last dim.
fn check_weight(op: &'static str, x: &Tensor, weight: Option<&Tensor>) -> Result<()> {
    if let Some(w) = weight {
        same_device(op, x, w)?;
        if !w.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op,
                dtype: w.dtype(),
            });
        }
        if w.dims() != [rows_cols(x).1] || x.rank() == 0 {
            return Err(Error::ShapeMismatch {
                op,
                lhs: x.shape().clone(),
                rhs: w.shape().clone(),
            });
        }
    }
    Ok(())
}

impl Tensor {
    /// RMSNorm over the last dim: `y = x / sqrt(mean(x²) + eps) * weight`, with an optional
    /// `weight` of shape `[C]` (`C` the last dim; absent = 1), fused in one pass that also saves
    /// the per-row reciprocal RMS for [`Tensor::rms_norm_backward`]. `eps` must be `>= 0` and
    /// finite. Half-precision inputs are computed in f32.
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<RmsNormOutput> {
        let _prof = crate::profile::scope("rms_norm");
        if !(eps >= 0.0 && eps.is_finite()) {
            crate::bail!(
                "rms_norm: eps {eps} must be >= 0 and finite (input {})",
                self.shape()
            );
        }
        if !self.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "rms_norm",
                dtype: self.dtype(),
            });
        }
        check_weight("rms_norm (weight vs last dim)", self, weight)?;
        let (rows, cols) = rows_cols(self);
        let x = self.contiguous()?;
        let w = weight.map(|w| w.contiguous()).transpose()?;
        let r = {
            let gx = x.read_storage("rms_norm")?;
            let gw = w.as_ref().map(|w| w.read_storage("rms_norm")).transpose()?;
            backend::rms_norm(
                (&gx, x.layout()),
                gw.as_ref().zip(w.as_ref()).map(|(g, t)| (&**g, t.layout())),
                rows,
                cols,
                eps,
            )?
        };
        let Some((y, rstd)) = r else {
            let (y, rstd) = super::fallback::rms_norm(&x, w.as_ref(), rows, cols, eps)?;
            return Ok(RmsNormOutput { y, rstd });
        };
        Ok(RmsNormOutput {
            y: Tensor::from_storage(y, x.shape()),
            rstd: Tensor::from_storage(rstd, rows),
        })
    }

    /// The backward of [`Tensor::rms_norm`] (`self` is its input, `rstd` its saved statistic)
    /// from `dy`: returns `dx` and, when `weight_grad` (which needs a `weight`), `dweight` in the
    /// weight's dtype, summed over rows in increasing order.
    pub fn rms_norm_backward(
        &self,
        weight: Option<&Tensor>,
        rstd: &Tensor,
        dy: &Tensor,
        weight_grad: bool,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let _prof = crate::profile::scope("rms_norm_backward");
        same_kind("rms_norm_backward", self, dy)?;
        check_weight("rms_norm_backward (weight vs last dim)", self, weight)?;
        let (rows, cols) = rows_cols(self);
        if dy.shape() != self.shape() || rstd.dims() != [rows] {
            crate::bail!(
                "rms_norm_backward: x {}, dy {}, rstd {} do not fit together (rstd must be [{rows}])",
                self.shape(),
                dy.shape(),
                rstd.shape()
            );
        }
        if weight_grad && weight.is_none() {
            crate::bail!("rms_norm_backward: a weight gradient needs the weight");
        }
        let (x, dy, rstd) = (self.contiguous()?, dy.contiguous()?, rstd.contiguous()?);
        let w = weight.map(|w| w.contiguous()).transpose()?;
        let op = "rms_norm_backward";
        let r = {
            let (gx, gd, gr) = (
                x.read_storage(op)?,
                dy.read_storage(op)?,
                rstd.read_storage(op)?,
            );
            let gw = w.as_ref().map(|w| w.read_storage(op)).transpose()?;
            backend::rms_norm_backward(
                (&gx, x.layout()),
                gw.as_ref().zip(w.as_ref()).map(|(g, t)| (&**g, t.layout())),
                (&gr, rstd.layout()),
                (&gd, dy.layout()),
                rows,
                cols,
                weight_grad,
            )?
        };
        match r {
            Some((dx, dw)) => Ok((
                Tensor::from_storage(dx, x.shape()),
                dw.map(|s| Tensor::from_storage(s, cols)),
            )),
            None => super::fallback::rms_norm_backward(
                &x,
                w.as_ref(),
                &rstd,
                &dy,
                rows,
                cols,
                weight_grad,
            ),
        }
    }
}

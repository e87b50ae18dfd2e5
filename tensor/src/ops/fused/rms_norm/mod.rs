//! RMSNorm over the last dim (Llama's norm), forward and backward: the argument structs
//! [`RmsNorm`] and [`RmsNormBackward`], their paths (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the
//! tensor ops [`Tensor::rms_norm`] and [`Tensor::rms_norm_backward`]. The CPU kernels are
//! `meshgrad_kernels::cpu::rms_norm`, the CUDA ones `rms_norm_fwd_<t>` / `rms_norm_bwd_<t>` of
//! `kernels/cuda/rms_norm.cu`; the autograd rule is `Var::rms_norm`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_op, fused_paths, rows_cols, run, FusedOp};
use crate::backend::Variant;
use crate::ops::float_only;
use crate::ops::{same_device, same_kind};
use crate::{Error, Result, Tensor};
use meshgrad_derive::FusedArgs;

/// The results of [`Tensor::rms_norm`]: output and per-row statistic for the backward pass.
#[derive(Clone, Debug)]
pub struct RmsNormOutput {
    /// The normalised output, shaped like the input.
    pub y: Tensor,
    /// Per-row `1/sqrt(mean(x²) + eps)` (compute precision), shape `[rows]` (the input's element
    /// count over its last dim).
    pub rstd: Tensor,
}

/// RMSNorm of `x` viewed as `[rows, cols]` over its rows: `y = x rstd · w` with
/// `rstd = 1/sqrt(mean(x²) + eps)` per row. Operands contiguous; returns `(y, rstd)`, `y` in
/// `x`'s dtype, `rstd` `[rows]` in compute precision.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct RmsNorm<T> {
    /// The input, `rows * cols` elements.
    pub x: T,
    /// The optional weight, `cols` elements (absent: 1).
    pub w: Option<T>,
    /// Rows normalised.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Added to the mean square.
    pub eps: f64,
}

/// The backward of [`RmsNorm`] from its saved `rstd`: `(dx, dweight)`, `dx` in `x`'s dtype,
/// `dweight` (when `weight_grad`) in the weight's dtype, summed over rows in increasing order.
/// Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct RmsNormBackward<T> {
    /// The forward's input, `rows * cols` elements.
    pub x: T,
    /// The forward's weight, `cols` elements.
    pub w: Option<T>,
    /// The forward's statistic, `rows` elements.
    pub rstd: T,
    /// The gradient of the output, `rows * cols` elements.
    pub dy: T,
    /// Rows normalised.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Whether to return the weight's gradient (needs `w`).
    pub weight_grad: bool,
}

impl FusedOp for RmsNorm<&Tensor> {
    const NAME: &'static str = "rms_norm";
    type Out<S> = (S, S);
    type Output = RmsNormOutput;

    fn finish<S: Variant>(&self, (y, rstd): (S, S)) -> RmsNormOutput {
        RmsNormOutput {
            y: Tensor::from_storage(y.wrap(), self.x.shape()),
            rstd: Tensor::from_storage(rstd.wrap(), self.rows),
        }
    }

    fused_paths!(forward);
}

fused_op!(RmsNormBackward, "rms_norm_backward", backward, |a| (S, Option<S>) => (
    a.x.shape(),
    a.cols
));

/// Checks the optional weight against the input's last dim.
fn check_weight(op: &'static str, x: &Tensor, weight: Option<&Tensor>) -> Result<()> {
    if let Some(w) = weight {
        same_device(op, x, w)?;
        float_only(op, w)?;
        if w.dims() != [rows_cols(x).1] || x.rank() == 0 {
            return Err(Error::shape_mismatch(op, x.shape(), w.shape()));
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
        float_only("rms_norm", self)?;
        check_weight("rms_norm (weight vs last dim)", self, weight)?;
        let (rows, cols) = rows_cols(self);
        let x = self.contiguous()?;
        let w = weight.map(|w| w.contiguous()).transpose()?;
        run(&RmsNorm {
            x: &x,
            w: w.as_ref(),
            rows,
            cols,
            eps,
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
        run(&RmsNormBackward {
            x: &x,
            w: w.as_ref(),
            rstd: &rstd,
            dy: &dy,
            rows,
            cols,
            weight_grad,
        })
    }
}

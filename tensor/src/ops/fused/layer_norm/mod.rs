//! Layer norm over the last dim (GPT-2's and BERT's norm), forward and backward: the argument
//! structs [`LayerNorm`] and [`LayerNormBackward`], their paths (`cpu.rs`, `cuda.rs`,
//! `fallback.rs`) and the tensor ops [`Tensor::layer_norm`] and [`Tensor::layer_norm_backward`].
//! The CPU kernels are `meshgrad_kernels::cpu::layer_norm`, the CUDA ones `layer_norm_fwd_<t>` /
//! `layer_norm_bwd_<t>` of `kernels/cuda/layer_norm.cu`; the autograd rule is `Var::layer_norm`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_paths, rows_cols, run, FusedOp};
use crate::backend::Variant;
use crate::ops::{same_device, same_kind};
use crate::{Error, Result, Tensor};
use meshgrad_derive::FusedArgs;

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

/// Layer norm of `x` viewed as `[rows, cols]` over its rows:
/// `y = (x - mean) rstd · w + b` with `rstd = 1/sqrt(var + eps)` per row. Operands contiguous;
/// returns `(y, mean, rstd)`, `y` in `x`'s dtype, the statistics `[rows]` in compute precision.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct LayerNorm<T> {
    /// The input, `rows * cols` elements.
    pub x: T,
    /// The optional weight, `cols` elements (absent: 1).
    pub w: Option<T>,
    /// The optional bias, `cols` elements (absent: 0).
    pub b: Option<T>,
    /// Rows normalised.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Added to the variance.
    pub eps: f64,
}

/// The backward of [`LayerNorm`] from its saved `mean` and `rstd`: `(dx, dweight, dbias)`, `dx`
/// in `x`'s dtype, the parameter gradients (when `param_grads`) in the weight's dtype (`x`'s
/// without a weight), summed over rows in increasing order. Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct LayerNormBackward<T> {
    /// The forward's input, `rows * cols` elements.
    pub x: T,
    /// The forward's weight, `cols` elements.
    pub w: Option<T>,
    /// The forward's per-row mean, `rows` elements.
    pub mean: T,
    /// The forward's per-row `1/sqrt(var + eps)`, `rows` elements.
    pub rstd: T,
    /// The gradient of the output, `rows * cols` elements.
    pub dy: T,
    /// Rows normalised.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Whether to return the weight's and bias's gradients.
    pub param_grads: bool,
}

impl FusedOp for LayerNorm<&Tensor> {
    const NAME: &'static str = "layer_norm";
    type Out<S> = (S, S, S);
    type Output = LayerNormOutput;

    fn finish<S: Variant>(&self, (y, mean, rstd): (S, S, S)) -> LayerNormOutput {
        LayerNormOutput {
            y: Tensor::from_storage(y.wrap(), self.x.shape()),
            mean: Tensor::from_storage(mean.wrap(), self.rows),
            rstd: Tensor::from_storage(rstd.wrap(), self.rows),
        }
    }

    fused_paths!(forward);
}

/// What a backend's path of [`LayerNormBackward`] returns: `(dx, dweight, dbias)`.
pub(crate) type Grads<S> = (S, Option<S>, Option<S>);

impl FusedOp for LayerNormBackward<&Tensor> {
    const NAME: &'static str = "layer_norm_backward";
    type Out<S> = Grads<S>;
    type Output = Grads<Tensor>;

    fn finish<S: Variant>(&self, (dx, dw, db): Grads<S>) -> Grads<Tensor> {
        let param = |s: S| Tensor::from_storage(s.wrap(), self.cols);
        (
            Tensor::from_storage(dx.wrap(), self.x.shape()),
            dw.map(param),
            db.map(param),
        )
    }

    fused_paths!(backward);
}

impl Tensor {
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
                return Err(Error::shape_mismatch(
                    "layer_norm (weight/bias vs last dim)",
                    self.shape(),
                    p.shape(),
                ));
            }
        }
        let x = self.contiguous()?;
        let w = weight.map(|w| w.contiguous()).transpose()?;
        let b = bias.map(|b| b.contiguous()).transpose()?;
        run(&LayerNorm {
            x: &x,
            w: w.as_ref(),
            b: b.as_ref(),
            rows,
            cols,
            eps,
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
        let c = |t: &Tensor| t.contiguous();
        let (x, dy, mean, rstd) = (c(self)?, c(dy)?, c(mean)?, c(rstd)?);
        let w = weight.map(c).transpose()?;
        let (dx, dw, db) = run(&LayerNormBackward {
            x: &x,
            w: w.as_ref(),
            mean: &mean,
            rstd: &rstd,
            dy: &dy,
            rows,
            cols,
            param_grads: weight.is_some(),
        })?;
        Ok((dx, dw.zip(db)))
    }
}

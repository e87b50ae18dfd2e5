//! Elementwise math beside the basic unary set (`sin`, `cos`, `silu`, `clamp`, with the fused
//! backward passes of `silu` and `clamp`) and the `logsumexp` reduction.

use crate::{Result, Tensor};
use meshgrad_kernels::ops::{UnaryGrad, UnaryOp};

/// Resolves clamp bounds to `(lo, hi)` (an absent bound is infinite), refusing no bounds at
/// all, NaN bounds and `min > max`.
fn clamp_bounds(op: &'static str, min: Option<f64>, max: Option<f64>) -> Result<(f64, f64)> {
    if min.is_none() && max.is_none() {
        crate::bail!("{op}: at least one of min and max must be given");
    }
    let (lo, hi) = (
        min.unwrap_or(f64::NEG_INFINITY),
        max.unwrap_or(f64::INFINITY),
    );
    if lo.is_nan() || hi.is_nan() {
        crate::bail!("{op}: bounds must not be NaN (min {min:?}, max {max:?})");
    }
    if lo > hi {
        crate::bail!("{op}: min {lo} is greater than max {hi}");
    }
    Ok((lo, hi))
}

impl Tensor {
    /// `sin x` (radians), elementwise; float dtypes (half types computed in f32).
    pub fn sin(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Sin, "sin")
    }

    /// `cos x` (radians), elementwise; float dtypes (half types computed in f32).
    pub fn cos(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Cos, "cos")
    }

    /// SiLU (swish) `x * sigmoid(x) = x / (1 + e^-x)`, elementwise, as one fused op.
    pub fn silu(&self) -> Result<Tensor> {
        self.unary_op(UnaryOp::Silu, "silu")
    }

    /// Clamps every element to `[min, max]` (`None`: no bound on that side), as
    /// `torch.clamp` does; NaN stays NaN. Bounds are rounded to the tensor's dtype. An error if
    /// both bounds are `None`, a bound is NaN, or `min > max`; float dtypes only.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        let (lo, hi) = clamp_bounds("clamp", min, max)?;
        self.unary_op(UnaryOp::Clamp(lo, hi), "clamp")
    }

    /// The SiLU backward, fused (`self` is the forward input):
    /// `dy * s (1 + x (1 - s))` with `s = sigmoid(x)`.
    pub fn silu_backward(&self, dy: &Tensor) -> Result<Tensor> {
        self.unary_backward(dy, UnaryGrad::Silu, "silu_backward")
    }

    /// The clamp backward (`self` is the forward input, the bounds those of [`Tensor::clamp`]):
    /// `dy` where `min <= x <= max` (bounds included, as PyTorch does), 0 elsewhere.
    pub fn clamp_backward(
        &self,
        dy: &Tensor,
        min: Option<f64>,
        max: Option<f64>,
    ) -> Result<Tensor> {
        let (lo, hi) = clamp_bounds("clamp_backward", min, max)?;
        self.unary_backward(dy, UnaryGrad::Clamp(lo, hi), "clamp_backward")
    }
}

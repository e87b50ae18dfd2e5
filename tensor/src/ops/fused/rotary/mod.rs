//! Rotary position embedding (RoPE, Hugging Face Llama's "rotate half" convention), both
//! directions: the argument struct [`Rotary`], its paths (`cpu.rs`, `cuda.rs`, `fallback.rs`)
//! and the tensor ops [`Tensor::rotary_embedding`] and [`Tensor::rotary_embedding_backward`].
//! The CPU kernel is `meshgrad_kernels::cpu::rotary`, the CUDA one `rotary_<t>` of
//! `kernels/cuda/rotary.cu`; the autograd rule is `Var::rotary_embedding`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_op, run};
use crate::ops::float_only;
use crate::ops::same_device;
use crate::{Error, Result, Tensor};
use meshgrad_derive::FusedArgs;

/// Rotary embedding of `x` (`[B, T, H, D]`, `dims`, `D` even) by integer `positions` (`[T]`):
/// the pair `(i, i + D/2)` at sequence index `t` rotated by `±positions[t] · theta^(-2i/D)`
/// (`-` when `inverse`, the backward). Out in `x`'s dtype. Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct Rotary<T> {
    /// The input, `[B, T, H, D]`.
    pub x: T,
    /// Integer positions, `[T]`.
    pub positions: T,
    /// `[B, T, H, D]`.
    pub dims: [usize; 4],
    /// The frequency base.
    pub theta: f64,
    /// Rotate by the negative angles (the backward).
    pub inverse: bool,
}

fused_op!(Rotary, "rotary_embedding", rotary, |a| a.x.shape());

impl Tensor {
    fn rotary_dims(&self, positions: &Tensor, theta: f64, op: &'static str) -> Result<[usize; 4]> {
        same_device(op, self, positions)?;
        float_only(op, self)?;
        if !positions.dtype().is_int() {
            return Err(Error::UnsupportedDType {
                op: "rotary_embedding (positions must be integers)",
                dtype: positions.dtype(),
            });
        }
        if self.rank() != 4 || !self.dims()[3].is_multiple_of(2) {
            crate::bail!(
                "{op}: expected x [B, T, H, D] with an even head dim D, got {}",
                self.shape()
            );
        }
        if positions.dims() != [self.dims()[1]] {
            crate::bail!(
                "{op}: positions {} must be [T] = [{}] for x {}",
                positions.shape(),
                self.dims()[1],
                self.shape()
            );
        }
        if !(theta > 0.0 && theta.is_finite()) {
            crate::bail!("{op}: theta {theta} must be positive and finite");
        }
        let d = self.dims();
        Ok([d[0], d[1], d[2], d[3]])
    }

    fn rotary_impl(&self, positions: &Tensor, theta: f64, inverse: bool) -> Result<Tensor> {
        let op = if inverse {
            "rotary_embedding_backward"
        } else {
            "rotary_embedding"
        };
        let _prof = crate::profile::scope(op);
        let dims = self.rotary_dims(positions, theta, op)?;
        let (x, p) = (self.contiguous()?, positions.contiguous()?);
        run(&Rotary {
            x: &x,
            positions: &p,
            dims,
            theta,
            inverse,
        })
    }

    /// Rotary position embedding of `self` (`[B, T, H, D]`, `D` even) in the "rotate half"
    /// convention of Hugging Face's Llama: element `i < D/2` of each head pairs with element
    /// `i + D/2`, and the pair at sequence index `t` is rotated by the angle
    /// `positions[t] · theta^(-2i/D)`:
    /// `y_i = x_i cos a - x_{i+D/2} sin a`, `y_{i+D/2} = x_{i+D/2} cos a + x_i sin a`.
    ///
    /// `positions` is an integer tensor `[T]`; `theta` (10000 in Llama 2, 500000 in Llama 3) must
    /// be positive and finite. Fused: angles are computed in f64 inside the kernel, no cos/sin
    /// tensors are needed.
    pub fn rotary_embedding(&self, positions: &Tensor, theta: f64) -> Result<Tensor> {
        self.rotary_impl(positions, theta, false)
    }

    /// The backward of [`Tensor::rotary_embedding`] (`self` is the output gradient): the
    /// rotation by the negative angles.
    pub fn rotary_embedding_backward(&self, positions: &Tensor, theta: f64) -> Result<Tensor> {
        self.rotary_impl(positions, theta, true)
    }
}

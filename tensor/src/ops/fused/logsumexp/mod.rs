//! Log-sum-exp over one dim: the argument struct [`Logsumexp`], its paths (`cpu.rs`, `cuda.rs`,
//! `fallback.rs`) and the tensor op [`Tensor::logsumexp`]. The CPU kernel is
//! `meshgrad_kernels::cpu::logsumexp`, the CUDA ones `logsumexp_lastdim_<t>` /
//! `logsumexp_strided_<t>` of `kernels/cuda/logsumexp.cu`; the autograd rule is `Var::logsumexp`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_op, run};
use crate::ops::float_only;
use crate::{Result, Shape, Tensor};
use meshgrad_derive::FusedArgs;

/// `ln Σ exp(x)` over the middle dim of `x` viewed as `[outer, red, inner]`, shaped `out` (the
/// `[outer, inner]` elements) in `x`'s dtype. Operand contiguous.
#[derive(Clone, Debug, FusedArgs)]
pub(crate) struct Logsumexp<T> {
    /// The input, `outer * red * inner` elements.
    pub x: T,
    /// The product of the dims before the reduced one.
    pub outer: usize,
    /// The reduced dim.
    pub red: usize,
    /// The product of the dims after the reduced one.
    pub inner: usize,
    /// The result's shape (`outer * inner` elements).
    pub out: Shape,
}

fused_op!(Logsumexp, "logsumexp", forward, |a| a.out.clone());

impl Tensor {
    /// `ln Σ exp(x)` along `dim` (negative counts from the end), computed stably: shifted by
    /// the maximum, so large inputs neither overflow nor lose the small terms. A slice of all
    /// `-inf` (or an empty dim) gives `-inf`, one holding `+inf` gives `+inf`, NaN propagates.
    /// `keepdim` keeps `dim` as size 1. Float dtypes (half types computed in f32).
    pub fn logsumexp(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let _prof = crate::profile::scope("logsumexp");
        let d = self.dim("logsumexp", dim)?;
        float_only("logsumexp", self)?;
        let dims = self.dims();
        let mut out = dims.to_vec();
        if keepdim {
            out[d] = 1;
        } else {
            out.remove(d);
        }
        let x = self.contiguous()?;
        run(&Logsumexp {
            x: &x,
            outer: dims[..d].iter().product(),
            red: dims[d],
            inner: dims[d + 1..].iter().product(),
            out: out.into(),
        })
    }
}

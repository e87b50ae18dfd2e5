//! Softmax and log-softmax over one dim, forward and backward: the argument structs
//! [`Softmax`] and [`SoftmaxBackward`] (rows of the last dim; another dim is transposed there),
//! their paths (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the tensor ops [`Tensor::softmax`],
//! [`Tensor::log_softmax`] and [`Tensor::softmax_backward`]. The CPU kernels are
//! `meshgrad_kernels::cpu::softmax`, the CUDA ones `{softmax,log_softmax}_{fwd,bwd}_<t>` of
//! `kernels/cuda/softmax.cu`; the autograd rules are `Var::softmax` and `Var::log_softmax`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_op, rows_cols, run};
use crate::ops::same_kind;
use crate::{Result, Tensor};
use meshgrad_derive::FusedArgs;

/// Softmax (or, with `log`, log-softmax) of each row of `x` viewed as `[rows, cols]`, in `x`'s
/// dtype. Operand contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct Softmax<T> {
    /// The input, `rows * cols` elements.
    pub x: T,
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// Log-softmax rather than softmax.
    pub log: bool,
}

/// The backward of [`Softmax`] from its output `y` and the gradient `dy`, in `y`'s dtype.
/// Operands contiguous, of one shape.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct SoftmaxBackward<T> {
    /// The forward's output, `rows * cols` elements.
    pub y: T,
    /// The gradient of the output, `rows * cols` elements.
    pub dy: T,
    /// Rows.
    pub rows: usize,
    /// Elements per row.
    pub cols: usize,
    /// The forward was log-softmax.
    pub log: bool,
}

fused_op!(Softmax, "softmax", forward, |a| a.x.shape());

fused_op!(SoftmaxBackward, "softmax_backward", backward, |a| a
    .y
    .shape());

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
        run(&Softmax {
            x: &x,
            rows,
            cols,
            log,
        })
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
        run(&SoftmaxBackward {
            y: &y,
            dy: &dy,
            rows,
            cols,
            log,
        })
    }
}

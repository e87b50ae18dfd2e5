//! The fully connected layer and its epilogues: the argument structs [`Linear`] (`x Wᵀ + bias`)
//! and [`LinearGelu`] (the same with GELU applied, keeping the pre-activation), their paths
//! (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the tensor ops [`Tensor::linear`],
//! [`Tensor::linear_gelu`] and [`Tensor::linear_backward`] (composed of products). The CPU
//! kernel is `meshgrad_kernels::cpu::matmul`, the CUDA path one cuBLASLt call with the bias or
//! GELU epilogue (`cuda_backend/blas/ops.rs`); the autograd rule is `Var::linear`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use meshgrad_derive::FusedArgs;
use meshgrad_kernels::ops::MatrixLayout;

use super::{fused_op, run};
use crate::backend::Product;
use crate::ops::float_only;
use crate::ops::same_kind;
use crate::{Error, GeluKind, Result, Tensor};

/// `x Wᵀ + bias` as one product: `x` (`[m, k]`, read through `p.al`), `W` (read as the `k × n`
/// matrix `p.bl`, the transposed view of a `[n, k]` weight), the optional contiguous bias
/// (`[n]`); `p.batch` is 1. The result is contiguous, shaped `out_dims`.
#[derive(Clone, Debug, FusedArgs)]
pub(crate) struct Linear<T> {
    /// The input.
    pub x: T,
    /// The weight.
    pub w: T,
    /// The optional bias.
    pub bias: Option<T>,
    /// The product.
    pub p: Product,
    /// The output's dims (`[..., n]`).
    pub out_dims: Vec<usize>,
}

/// [`Linear`] with GELU applied: `(gelu(pre), pre)` with `pre = x Wᵀ + bias`, both contiguous
/// and shaped `out_dims`. `tanh_form`: the tanh approximation (else the erf form).
#[derive(Clone, Debug, FusedArgs)]
pub(crate) struct LinearGelu<T> {
    /// The product and its bias.
    pub lin: Linear<T>,
    /// Whether GELU is the tanh approximation (else the erf form).
    pub tanh_form: bool,
}

fused_op!(Linear, "linear", forward, |a| a.out_dims.clone());

fused_op!(LinearGelu, "linear_gelu", gelu, |a| (S, S) => (
    a.lin.out_dims.clone(),
    a.lin.out_dims.clone()
));

/// The operands of one [`Tensor::linear`] (or [`Tensor::linear_gelu`]) as its argument struct
/// takes them: the input folded to `[rows, in]`, the bias made contiguous, the product (the
/// matrix layouts of `x` and of `Wᵀ`, the sizes) and the output's dims.
struct Prepared {
    x: Tensor,
    bias: Option<Tensor>,
    p: Product,
    out_dims: Vec<usize>,
}

impl Prepared {
    /// Checks devices, dtypes and shapes of `x [..., in]`, `weight [out, in]` and `bias [out]`.
    fn new(op: &'static str, x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Self> {
        same_kind(op, x, weight)?;
        if let Some(b) = bias {
            same_kind(op, x, b)?;
        }
        let in_f = *x.dims().last().unwrap_or(&0);
        if x.rank() < 1 || weight.rank() != 2 || weight.dims()[1] != in_f {
            return Err(Error::ShapeMismatch {
                op: "linear (input [..., in] vs weight [out, in])",
                lhs: x.shape().clone(),
                rhs: weight.shape().clone(),
            });
        }
        let out_f = weight.dims()[0];
        if let Some(b) = bias {
            if b.dims() != [out_f] {
                return Err(Error::ShapeMismatch {
                    op: "linear (bias vs weight [out, in])",
                    lhs: b.shape().clone(),
                    rhs: weight.shape().clone(),
                });
            }
        }
        let rows = x.elem_count().checked_div(in_f).unwrap_or(0);
        let mut out_dims = x.dims().to_vec();
        *out_dims.last_mut().expect("rank >= 1") = out_f;
        let x = x.reshape((rows, in_f))?;
        let xl = MatrixLayout {
            offset: x.layout().offset(),
            batch_stride: 0,
            row_stride: x.layout().strides()[0],
            col_stride: x.layout().strides()[1],
        };
        let wl = MatrixLayout {
            offset: weight.layout().offset(),
            batch_stride: 0,
            row_stride: weight.layout().strides()[1],
            col_stride: weight.layout().strides()[0],
        };
        let bias = bias.map(|b| b.contiguous()).transpose()?;
        let p = Product {
            al: xl,
            bl: wl,
            batch: 1,
            m: rows,
            n: out_f,
            k: in_f,
        };
        Ok(Prepared {
            x,
            bias,
            p,
            out_dims,
        })
    }
}

impl Tensor {
    /// The fully connected layer `self Wᵀ + bias` for `self [..., in]`, `weight [out, in]` and an
    /// optional `bias [out]`: one gemm over all rows, reading `Wᵀ` through its strides, with the
    /// bias written into the output before the product accumulates onto it (no separate add).
    pub fn linear(&self, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let _prof = crate::profile::scope("linear");
        let a = Prepared::new("linear", self, weight, bias)?;
        run(&Linear {
            x: &a.x,
            w: weight,
            bias: a.bias.as_ref(),
            p: a.p,
            out_dims: a.out_dims,
        })
    }

    /// `gelu(self Wᵀ + bias)` and the pre-activation `self Wᵀ + bias`, as `(y, pre)` (both
    /// `[..., out]`): [`Tensor::linear`] followed by [`Tensor::gelu`] of `kind`, in one pass
    /// where the backend fuses them (on CUDA, cuBLASLt's GELU epilogue writing the
    /// pre-activation as its auxiliary output, tanh form only). Elsewhere it is exactly
    /// `linear` then `gelu` (so a CPU result is bit-identical to the unfused one). The
    /// pre-activation is what the backward needs ([`Tensor::gelu_backward`] at `pre`, then
    /// [`Tensor::linear_backward`]).
    pub fn linear_gelu(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
        kind: GeluKind,
    ) -> Result<(Tensor, Tensor)> {
        let _prof = crate::profile::scope("linear_gelu");
        let a = Prepared::new("linear_gelu", self, weight, bias)?;
        float_only("linear_gelu", &a.x)?;
        run(&LinearGelu {
            lin: Linear {
                x: &a.x,
                w: weight,
                bias: a.bias.as_ref(),
                p: a.p,
                out_dims: a.out_dims,
            },
            tanh_form: kind == GeluKind::Tanh,
        })
    }
}

/// The gradients of [`Tensor::linear`]: `(dx, dweight, dbias)`, each when asked for.
pub type LinearGrads = (Option<Tensor>, Option<Tensor>, Option<Tensor>);

impl Tensor {
    /// The backward of [`Tensor::linear`] (`self` is its input `x [..., in]`) from `dy [..., out]`:
    /// `dx = dy W`, `dW = dyᵀ x` (straight into the weight's `[out, in]` layout) and
    /// `dbias = Σ_rows dy`, each computed only when its flag is set. `dx` and `dW` are
    /// independent products of equal size: they run side by side on two rayon tasks, each one
    /// whole single-threaded product (so the results do not depend on the thread count).
    pub fn linear_backward(
        &self,
        weight: &Tensor,
        dy: &Tensor,
        want: (bool, bool, bool),
    ) -> Result<LinearGrads> {
        let _prof = crate::profile::scope("linear_backward");
        let (out_f, in_f) = (weight.dims()[0], weight.dims()[1]);
        let rows = dy.elem_count().checked_div(out_f).unwrap_or(0);
        let g2 = dy.reshape((rows, out_f))?;
        let dx = || -> Result<Option<Tensor>> {
            if !want.0 {
                return Ok(None);
            }
            Ok(Some(g2.matmul(weight)?.reshape(self.shape().clone())?))
        };
        // The bias gradient (a column sum, cheap) rides along with dW.
        let dw_db = || -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dw = if want.1 {
                Some(g2.t()?.matmul(&self.reshape((rows, in_f))?)?)
            } else {
                None
            };
            let db = if want.2 {
                Some(g2.sum(&[0], false)?)
            } else {
                None
            };
            Ok((dw, db))
        };
        let (dx, dw_db) = if want.0 && want.1 {
            for t in [self, weight, dy] {
                t.ensure_materialized()?;
            }
            crate::alloc::join(dx, dw_db)
        } else {
            (dx(), dw_db())
        };
        let (dw, db) = dw_db?;
        Ok((dx?, dw, db))
    }
}

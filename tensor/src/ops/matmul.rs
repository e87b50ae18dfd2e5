//! Matrix multiplication with broadcast batch dims; transposed operands are read through their
//! strides, never copied.

use super::same_kind;
use crate::{backend, Error, GeluKind, Layout, Result, Shape, Tensor};
use meshgrad_kernels::ops::MatrixLayout;

/// Collapses the batch dims of a broadcast layout into one stride when they form a single
/// arithmetic progression; `None` when they do not.
fn batch_stride(l: &Layout, nbatch: usize) -> Option<usize> {
    let dims = &l.dims()[..nbatch];
    let strides = &l.strides()[..nbatch];
    let live: Vec<(usize, usize)> = dims
        .iter()
        .zip(strides)
        .filter(|(&d, _)| d != 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    if live.is_empty() {
        return Some(0);
    }
    if live.iter().all(|&(_, s)| s == 0) {
        return Some(0);
    }
    for w in live.windows(2) {
        if w[0].1 != w[1].0 * w[1].1 {
            return None;
        }
    }
    Some(live.last().expect("non-empty").1)
}

impl Tensor {
    /// `self @ rhs` for operands of rank >= 2 (`[..., m, k] @ [..., k, n]`), batch dims broadcast.
    pub fn matmul(&self, rhs: &Tensor) -> Result<Tensor> {
        let _prof = crate::profile::scope("matmul");
        same_kind("matmul", self, rhs)?;
        if self.rank() < 2 || rhs.rank() < 2 {
            crate::bail!(
                "matmul: operands need rank >= 2, got {} and {}",
                self.shape(),
                rhs.shape()
            );
        }
        let (m, k) = (self.dims()[self.rank() - 2], self.dims()[self.rank() - 1]);
        let (k2, n) = (rhs.dims()[rhs.rank() - 2], rhs.dims()[rhs.rank() - 1]);
        if k != k2 {
            return Err(Error::ShapeMismatch {
                op: "matmul",
                lhs: self.shape().clone(),
                rhs: rhs.shape().clone(),
            });
        }
        let ba = Shape::from(&self.dims()[..self.rank() - 2]);
        let bb = Shape::from(&rhs.dims()[..rhs.rank() - 2]);
        let batch_shape =
            Shape::broadcast("matmul", &ba, &bb).map_err(|_| Error::ShapeMismatch {
                op: "matmul",
                lhs: self.shape().clone(),
                rhs: rhs.shape().clone(),
            })?;
        let nb = batch_shape.rank();
        let batch = batch_shape.elem_count();
        let mut out_dims = batch_shape.dims().to_vec();
        out_dims.extend([m, n]);

        let full = |t: &Tensor, r: usize, c: usize| -> Result<Layout> {
            let mut d = batch_shape.dims().to_vec();
            d.extend([r, c]);
            t.layout().broadcast_as(&Shape::new(d))
        };
        let mut a = self.clone();
        let mut la = full(&a, m, k)?;
        let mut b = rhs.clone();
        let mut lb = full(&b, k, n)?;

        // Fold a batched lhs into one tall matrix when rhs is shared across the batch.
        let sa = batch_stride(&la, nb);
        let sb = batch_stride(&lb, nb);
        if sb == Some(0) && batch > 1 {
            if let Some(sa) = sa.filter(|&s| s != 0) {
                let (rs, cs) = (la.strides()[nb], la.strides()[nb + 1]);
                // Row i of batch b sits at b*sa + i*rs; that is one progression of batch*m rows
                // when sa == m*rs (or trivially when m == 1).
                let row_stride = if m == 1 {
                    Some(sa)
                } else {
                    (sa == m * rs).then_some(rs)
                };
                if let Some(row_stride) = row_stride {
                    let al = MatrixLayout {
                        offset: la.offset(),
                        batch_stride: 0,
                        row_stride,
                        col_stride: cs,
                    };
                    let bl = mat(&lb, nb, 0);
                    let (ga, gb) = (a.read_storage("matmul")?, b.read_storage("matmul")?);
                    let s = backend::matmul(&ga, al, &gb, bl, 1, batch * m, n, k)?;
                    return Ok(Tensor::from_storage(s, out_dims));
                }
            }
        }
        let sa = match sa {
            Some(s) => s,
            None => {
                a = a.expand(Shape::new(la.dims().to_vec()))?.contiguous()?;
                la = a.layout().clone();
                m * k
            }
        };
        let sb = match sb {
            Some(s) => s,
            None => {
                b = b.expand(Shape::new(lb.dims().to_vec()))?.contiguous()?;
                lb = b.layout().clone();
                k * n
            }
        };
        let (ga, gb) = (a.read_storage("matmul")?, b.read_storage("matmul")?);
        let s = backend::matmul(&ga, mat(&la, nb, sa), &gb, mat(&lb, nb, sb), batch, m, n, k)?;
        Ok(Tensor::from_storage(s, out_dims))
    }
}

/// The operands of one [`Tensor::linear`] (or [`Tensor::linear_gelu`]) as the backend takes
/// them: the input folded to `[rows, in]`, the matrix layouts of `x` and of `Wᵀ`, the bias made
/// contiguous, the sizes and the output's dims.
struct LinearArgs {
    x: Tensor,
    xl: MatrixLayout,
    wl: MatrixLayout,
    bias: Option<Tensor>,
    rows: usize,
    in_f: usize,
    out_f: usize,
    out_dims: Vec<usize>,
}

impl LinearArgs {
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
        Ok(LinearArgs {
            x,
            xl,
            wl,
            bias,
            rows,
            in_f,
            out_f,
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
        let a = LinearArgs::new("linear", self, weight, bias)?;
        let s = {
            let (gx, gw) = (a.x.read_storage("linear")?, weight.read_storage("linear")?);
            let b = a.bias.as_ref();
            let gb = b.map(|b| b.read_storage("linear")).transpose()?;
            backend::linear(
                &gx,
                a.xl,
                &gw,
                a.wl,
                gb.as_ref().zip(b).map(|(g, t)| (&**g, t.layout())),
                a.rows,
                a.out_f,
                a.in_f,
            )?
        };
        match s {
            Some(s) => Ok(Tensor::from_storage(s, a.out_dims)),
            None => super::fallback::linear(&a.x, weight, a.bias.as_ref())?.reshape(a.out_dims),
        }
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
        let a = LinearArgs::new("linear_gelu", self, weight, bias)?;
        if !a.x.dtype().is_float() {
            return Err(Error::UnsupportedDType {
                op: "linear_gelu",
                dtype: a.x.dtype(),
            });
        }
        let s = {
            let (gx, gw) = (
                a.x.read_storage("linear_gelu")?,
                weight.read_storage("linear_gelu")?,
            );
            let b = a.bias.as_ref();
            let gb = b.map(|b| b.read_storage("linear_gelu")).transpose()?;
            backend::linear_gelu(
                &gx,
                a.xl,
                &gw,
                a.wl,
                gb.as_ref().zip(b).map(|(g, t)| (&**g, t.layout())),
                a.rows,
                a.out_f,
                a.in_f,
                kind == GeluKind::Tanh,
            )?
        };
        match s {
            Some((y, pre)) => Ok((
                Tensor::from_storage(y, a.out_dims.clone()),
                Tensor::from_storage(pre, a.out_dims),
            )),
            None => {
                let pre = self.linear(weight, bias)?;
                Ok((pre.gelu(kind)?, pre))
            }
        }
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

fn mat(l: &Layout, nb: usize, batch_stride: usize) -> MatrixLayout {
    MatrixLayout {
        offset: l.offset(),
        batch_stride,
        row_stride: l.strides()[nb],
        col_stride: l.strides()[nb + 1],
    }
}

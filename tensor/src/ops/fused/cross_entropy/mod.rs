//! Cross-entropy of logits rows against integer targets (with `ignore_index`), forward and
//! backward: the argument structs [`CrossEntropy`] and [`CrossEntropyBackward`], their paths
//! (`cpu.rs`, `cuda.rs`, `fallback.rs`) and the tensor ops [`Tensor::cross_entropy_rows`] and
//! [`Tensor::cross_entropy_backward`]. The CPU kernels are
//! `meshgrad_kernels::cpu::cross_entropy`, the CUDA ones `cross_entropy_fused_<t>` /
//! `cross_entropy_bwd_<t>` of `kernels/cuda/cross_entropy.cu`; the autograd rule is
//! `Var::cross_entropy`.

mod cpu;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
mod fallback;

use super::{fused_op, run};
use crate::ops::same_device;
use crate::{Error, Result, Tensor};
use meshgrad_derive::FusedArgs;

/// Cross-entropy of `[rows, cols]` logits against `[rows]` integer targets: `(loss, lse)` per
/// row in compute precision, shaped like `targets`; the loss is 0 where the target is
/// `ignore_index` (whose `lse` is still computed). A target outside `0..cols` that is not
/// ignored is an error. Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct CrossEntropy<T> {
    /// The logits, `rows * cols` elements.
    pub logits: T,
    /// The integer targets, `rows` elements.
    pub targets: T,
    /// Rows (positions).
    pub rows: usize,
    /// Classes per row.
    pub cols: usize,
    /// The target whose rows count no loss.
    pub ignore_index: Option<i64>,
}

/// The backward of [`CrossEntropy`] from its saved per-row `lse` and the upstream `dloss` (one
/// element per row each): `dloss (softmax(logits) - onehot(target))` per row, zero for ignored
/// rows, in the logits' dtype and shape. Operands contiguous.
#[derive(Clone, Copy, Debug, FusedArgs)]
pub(crate) struct CrossEntropyBackward<T> {
    /// The forward's logits, `rows * cols` elements.
    pub logits: T,
    /// The forward's per-row log-sum-exp, `rows` elements.
    pub lse: T,
    /// The forward's targets, `rows` elements.
    pub targets: T,
    /// The gradient of the per-row loss, `rows` elements.
    pub dloss: T,
    /// Rows (positions).
    pub rows: usize,
    /// Classes per row.
    pub cols: usize,
    /// The target whose rows get no gradient.
    pub ignore_index: Option<i64>,
}

fused_op!(CrossEntropy, "cross_entropy", forward, |a| (S, S) => (
    a.targets.shape(),
    a.targets.shape()
));

fused_op!(
    CrossEntropyBackward,
    "cross_entropy_backward",
    backward,
    |a| a.logits.shape()
);

/// Checks logits `[..., V]` against integer targets `[...]` (the leading dims); returns
/// `(rows, V)` with `rows` the product of the leading dims.
fn check_targets(logits: &Tensor, targets: &Tensor, op: &'static str) -> Result<(usize, usize)> {
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

impl Tensor {
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
        let (rows, cols) = check_targets(self, targets, "cross_entropy")?;
        let (x, t) = (self.contiguous()?, targets.contiguous()?);
        run(&CrossEntropy {
            logits: &x,
            targets: &t,
            rows,
            cols,
            ignore_index,
        })
        .map_err(|e| {
            Error::msg(format!(
                "{e} (logits {}, targets {} folded into {rows} rows, ignore_index {ignore_index:?})",
                self.shape(),
                targets.shape()
            ))
        })
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
        let (rows, cols) = check_targets(self, targets, "cross_entropy_backward")?;
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
        run(&CrossEntropyBackward {
            logits: &x,
            lse: &l,
            targets: &t,
            dloss: &d,
            rows,
            cols,
            ignore_index,
        })
    }
}

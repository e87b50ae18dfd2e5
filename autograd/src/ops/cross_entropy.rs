//! Mean cross-entropy of logits against integer targets (fused forward and backward).

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// Mean cross-entropy of `self` (logits `[..., V]`, classes in the last dim, for example
    /// `[B, T, V]` or `[N, V]`) against integer `targets` shaped like the leading dims (`[B, T]`
    /// or `[N]`), over the positions whose target is not `ignore_index` (0 when every position
    /// is ignored). Fused: the leading dims are folded into rows of one kernel, and the gradient
    /// is computed from the saved per-position log-sum-exp, never from stored probabilities.
    ///
    /// Errors: a targets shape other than the logits' leading dims (naming both shapes),
    /// non-integer targets, or a target outside `0..V` that is not `ignore_index`.
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: Option<i64>) -> Result<Var> {
        let logits = self.tensor().clone();
        let (rows, lse) = logits.cross_entropy_rows(targets, ignore_index)?;
        let count = match ignore_index {
            None => targets.elem_count(),
            Some(ix) => targets
                .to_vec_f64()?
                .iter()
                .filter(|&&t| t as i64 != ix)
                .count(),
        };
        let scale = 1.0 / count.max(1) as f64;
        let v = rows.sum_all()?.mul_scalar(scale)?;
        let targets = targets.clone();
        Ok(Var::from_op(
            "cross_entropy",
            v,
            &[self],
            Box::new(move |g, _| {
                let dloss = g
                    .to_dtype(lse.dtype())?
                    .mul_scalar(scale)?
                    .expand(lse.shape().clone())?
                    .contiguous()?;
                Ok(vec![Some(logits.cross_entropy_backward(
                    &lse,
                    &targets,
                    &dloss,
                    ignore_index,
                )?)])
            }),
        ))
    }
}

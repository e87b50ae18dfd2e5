//! Cross-entropy composed of basic ops, forward and backward, and the tests that it agrees
//! with the fused paths.

use super::{CrossEntropy, CrossEntropyBackward};
use crate::ops::fallback::{shifted, widen};
use crate::{DType, Result, Tensor};

/// `(keep, safe)` for `[rows]` i64 targets: `keep` (u8) is 0 where the target is
/// `ignore_index`, `safe` the targets with the ignored ones replaced by 0 (a valid index).
fn kept_targets(t: &Tensor, ignore_index: Option<i64>) -> Result<(Option<Tensor>, Tensor)> {
    match ignore_index {
        None => Ok((None, t.clone())),
        Some(i) => {
            let keep = t.ne(&Tensor::scalar(i as f64, t.dtype(), t.device())?)?;
            let safe = keep.where_cond(t, &t.zeros_like()?)?;
            Ok((Some(keep), safe))
        }
    }
}

/// See [`CrossEntropy`]: `lse = log Σ exp(x)` (shifted by the row maximum) and
/// `loss = lse - x[target]`, in compute precision.
pub(super) fn forward(a: &CrossEntropy<&Tensor>) -> Result<(Tensor, Tensor)> {
    let (logits, targets, rows, cols, ignore_index) =
        (a.logits, a.targets, a.rows, a.cols, a.ignore_index);
    let x = widen(logits)?.reshape((rows, cols))?;
    let t = targets.to_dtype(crate::DType::I64)?.reshape(rows)?;
    let (z, m) = shifted(&x)?;
    let lse = z.exp()?.sum(&[-1], true)?.log()?.add(&m)?.reshape(rows)?;
    let (keep, safe) = kept_targets(&t, ignore_index)?;
    let picked = x.gather(-1, &safe.unsqueeze(-1)?)?.reshape(rows)?;
    let mut loss = lse.sub(&picked)?;
    if let Some(k) = &keep {
        loss = k.where_cond(&loss, &loss.zeros_like()?)?;
    }
    Ok((
        loss.reshape(targets.shape().clone())?,
        lse.reshape(targets.shape().clone())?,
    ))
}

/// See [`CrossEntropyBackward`]: `dloss (exp(x - lse) - onehot(target))` per row (compute
/// precision), zero for ignored rows. Targets are taken as valid (the forward checked them): a
/// non-ignored target outside `0..cols` matches no column.
pub(super) fn backward(a: &CrossEntropyBackward<&Tensor>) -> Result<Tensor> {
    let (logits, lse, targets, dloss) = (a.logits, a.lse, a.targets, a.dloss);
    let (rows, cols, ignore_index) = (a.rows, a.cols, a.ignore_index);
    let x = widen(logits)?.reshape((rows, cols))?;
    let l = widen(lse)?.reshape((rows, 1))?;
    let g = widen(dloss)?.reshape((rows, 1))?;
    let t = targets.to_dtype(DType::I64)?.reshape((rows, 1))?;
    let classes = Tensor::arange(0, cols as i64, DType::I64, t.device())?.reshape((1, cols))?;
    let onehot = classes.eq(&t)?;
    let zero = Tensor::scalar(0.0, x.dtype(), x.device())?;
    let mut dx = x
        .sub(&l)?
        .exp()?
        .mul(&g)?
        .sub(&onehot.where_cond(&g, &zero)?)?;
    if let (Some(keep), _) = kept_targets(&t, ignore_index)? {
        dx = keep.where_cond(&dx, &zero)?;
    }
    dx.to_dtype(logits.dtype())?.reshape(logits.shape().clone())
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close, rand};
    use crate::{Device, Random, Tensor};

    /// Targets `[2, 7]` in `0..11`, with position 3 set to `-100` when `ignored`.
    fn targets(ignored: bool) -> Tensor {
        let t = Random::new(8).randint((2, 7), 0, 11).unwrap();
        let mut v = t.to_vec::<i64>().unwrap();
        if ignored {
            v[3] = -100;
        }
        Tensor::from_vec(v, (2, 7), Device::Cpu).unwrap()
    }

    #[test]
    fn cross_entropy_matches_its_composition() {
        for (dt, rel, [logits]) in cases(7, [&[2, 7, 11]]) {
            for ignore in [None, Some(-100)] {
                let t = targets(ignore.is_some());
                let (a, c) = both(|| logits.cross_entropy_rows(&t, ignore).unwrap());
                let what = format!("cross_entropy {dt} ignore={ignore:?}");
                close(&what, &a.0, &c.0, rel);
                close(&what, &a.1, &c.1, rel);
            }
        }
    }

    #[test]
    fn cross_entropy_backward_matches_its_composition() {
        for (dt, rel, [logits]) in cases(26, [&[2, 7, 11]]) {
            for ignore in [None, Some(-100)] {
                let t = targets(ignore.is_some());
                let (_, lse) = logits.cross_entropy_rows(&t, ignore).unwrap();
                let dloss = rand(&[2, 7], 27, lse.dtype());
                let (a, c) = both(|| {
                    logits
                        .cross_entropy_backward(&lse, &t, &dloss, ignore)
                        .unwrap()
                });
                let what = format!("cross_entropy_backward {dt} ignore={ignore:?}");
                close(&what, &a, &c, rel);
                if ignore.is_some() {
                    // The ignored position's row is zero on both sides.
                    let row = |d: &Tensor| {
                        d.reshape((14, 11))
                            .unwrap()
                            .narrow(0, 3, 1)
                            .unwrap()
                            .to_vec_f64()
                            .unwrap()
                    };
                    assert!(row(&c).iter().all(|&v| v == 0.0), "{what}");
                }
            }
        }
    }
}

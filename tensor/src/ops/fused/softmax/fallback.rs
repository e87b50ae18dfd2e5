//! Softmax and log-softmax composed of basic ops, forward and backward, and the tests that they
//! agree with the fused paths.

use super::{Softmax, SoftmaxBackward};
use crate::ops::fallback::{shifted, widen};
use crate::{Result, Tensor};

/// See [`Softmax`]: `exp(z) / Σ exp(z)` or `z - log Σ exp(z)` with `z = x - max(x)` per row, in
/// compute precision.
pub(super) fn forward(&Softmax { x, log, .. }: &Softmax<&Tensor>) -> Result<Tensor> {
    if x.elem_count() == 0 {
        return x.zeros_like();
    }
    let (z, _) = shifted(&widen(x)?)?;
    let e = z.exp()?;
    let s = e.sum(&[-1], true)?;
    let y = if log { z.sub(&s.log()?)? } else { e.div(&s)? };
    y.to_dtype(x.dtype())
}

/// See [`SoftmaxBackward`]: `y (dy - Σ dy·y)` for softmax, `dy - exp(y) Σ dy` for log-softmax,
/// per row in compute precision.
pub(super) fn backward(
    &SoftmaxBackward { y, dy, log, .. }: &SoftmaxBackward<&Tensor>,
) -> Result<Tensor> {
    if y.elem_count() == 0 {
        return y.zeros_like();
    }
    let (yc, dc) = (widen(y)?, widen(dy)?);
    let dx = if log {
        dc.sub(&yc.exp()?.mul(&dc.sum(&[-1], true)?)?)?
    } else {
        yc.mul(&dc.sub(&dc.mul(&yc)?.sum(&[-1], true)?)?)?
    };
    dx.to_dtype(y.dtype())
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close};

    #[test]
    fn softmax_matches_its_composition() {
        for (dt, rel, [x]) in cases(1, [&[3, 5, 17]]) {
            for log in [false, true] {
                let (a, b) = both(|| {
                    if log {
                        x.log_softmax(1).unwrap()
                    } else {
                        x.softmax(-1).unwrap()
                    }
                });
                close(&format!("softmax {dt} log={log}"), &a, &b, rel);
            }
        }
    }

    #[test]
    fn softmax_backward_matches_its_composition() {
        for (dt, rel, [x, dy]) in cases(13, [&[3, 4, 19], &[3, 4, 19]]) {
            for log in [false, true] {
                let y = if log {
                    x.log_softmax(-1).unwrap()
                } else {
                    x.softmax(-1).unwrap()
                };
                let (a, b) = both(|| y.softmax_backward(&dy, -1, log).unwrap());
                close(&format!("softmax_backward {dt} log={log}"), &a, &b, rel);
            }
        }
    }
}

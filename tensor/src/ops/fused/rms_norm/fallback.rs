//! RMSNorm composed of basic ops, forward and backward, and the tests that it agrees with the
//! fused paths.

use super::{RmsNorm, RmsNormBackward, RmsNormOutput};
use crate::ops::fallback::{column, norm_input_grad, row_sum, widen};
use crate::{Result, Tensor};

/// See [`RmsNorm`]: `y = x rstd · w` with `rstd = 1/sqrt(mean(x²) + eps)`, computed in compute
/// precision.
pub(super) fn forward(a: &RmsNorm<&Tensor>) -> Result<RmsNormOutput> {
    let (x, w, rows, cols, eps) = (a.x, a.w, a.rows, a.cols, a.eps);
    let xc = widen(x)?.reshape((rows, cols))?;
    let ms = xc.sqr()?.mean(&[-1], true)?;
    let rstd = ms.add_scalar(eps)?.sqrt()?.recip()?;
    let mut y = xc.mul(&rstd)?;
    if let Some(w) = w {
        y = y.mul(&widen(w)?)?;
    }
    Ok(RmsNormOutput {
        y: y.to_dtype(x.dtype())?.reshape(x.shape().clone())?,
        rstd: rstd.reshape(rows)?,
    })
}

/// See [`RmsNormBackward`]: with `xhat = x rstd` and `g = weight · dy` (or `dy`),
/// `dx = rstd (g - xhat mean(g xhat))` and `dweight = Σ_rows dy xhat`.
pub(super) fn backward(a: &RmsNormBackward<&Tensor>) -> Result<(Tensor, Option<Tensor>)> {
    let (x, w, rstd, dy) = (a.x, a.w, a.rstd, a.dy);
    let (rows, cols, weight_grad) = (a.rows, a.cols, a.weight_grad);
    let wdt = w.map_or(x.dtype(), |w| w.dtype());
    let xc = widen(x)?.reshape((rows, cols))?;
    let dyc = widen(dy)?.reshape((rows, cols))?;
    let rs = column(rstd, rows)?;
    let xhat = xc.mul(&rs)?;
    let dx = norm_input_grad(x, w, [&dyc, &xhat, &rs], false)?;
    let dw = if weight_grad {
        Some(row_sum(&dyc.mul(&xhat)?, cols, wdt)?)
    } else {
        None
    };
    Ok((dx, dw))
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close};

    #[test]
    fn rms_norm_matches_its_composition() {
        for (dt, rel, [x, w]) in cases(5, [&[5, 40], &[40]]) {
            for wo in [None, Some(&w)] {
                let (a, c) = both(|| x.rms_norm(wo, 1e-6).unwrap());
                let what = format!("rms_norm {dt} weight={}", wo.is_some());
                close(&what, &a.y, &c.y, rel);
                close(&what, &a.rstd, &c.rstd, rel);
            }
        }
    }

    #[test]
    fn rms_norm_backward_matches_its_composition() {
        for (dt, rel, [x, w, dy]) in cases(23, [&[3, 5, 40], &[40], &[3, 5, 40]]) {
            for (wo, wg) in [(None, false), (Some(&w), false), (Some(&w), true)] {
                let fwd = x.rms_norm(wo, 1e-6).unwrap();
                let (a, c) = both(|| x.rms_norm_backward(wo, &fwd.rstd, &dy, wg).unwrap());
                let what = format!("rms_norm_backward {dt} weight={} grad={wg}", wo.is_some());
                close(&what, &a.0, &c.0, rel);
                assert_eq!(a.1.is_some(), wg, "{what}");
                assert_eq!(c.1.is_some(), wg, "{what}");
                if let (Some(aw), Some(cw)) = (&a.1, &c.1) {
                    close(&format!("{what} dweight"), aw, cw, rel);
                }
            }
        }
    }
}

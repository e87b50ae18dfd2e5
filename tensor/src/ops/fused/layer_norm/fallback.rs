//! Layer norm composed of basic ops, forward and backward, and the tests that it agrees with
//! the fused paths.

use super::{Grads, LayerNorm, LayerNormBackward, LayerNormOutput};
use crate::ops::fallback::{column, norm_input_grad, row_sum, widen};
use crate::{Result, Tensor};

/// See [`LayerNorm`]: `y = (x - mean) rstd · w + b` with `mean`, `rstd` (shape `[rows]`) in
/// compute precision.
pub(super) fn forward(a: &LayerNorm<&Tensor>) -> Result<LayerNormOutput> {
    let (x, w, b, rows, cols, eps) = (a.x, a.w, a.b, a.rows, a.cols, a.eps);
    let xc = widen(x)?.reshape((rows, cols))?;
    let mean = xc.mean(&[-1], true)?;
    let d = xc.sub(&mean)?;
    let var = d.sqr()?.mean(&[-1], true)?;
    let rstd = var.add_scalar(eps)?.sqrt()?.recip()?;
    let mut y = d.mul(&rstd)?;
    if let Some(w) = w {
        y = y.mul(&widen(w)?)?;
    }
    if let Some(b) = b {
        y = y.add(&widen(b)?)?;
    }
    Ok(LayerNormOutput {
        y: y.to_dtype(x.dtype())?.reshape(x.shape().clone())?,
        mean: mean.reshape(rows)?,
        rstd: rstd.reshape(rows)?,
    })
}

/// See [`LayerNormBackward`]: with `xhat = (x - mean) rstd` and `g = weight · dy` (or `dy`),
/// `dx = rstd (g - mean(g) - xhat mean(g xhat))` in `x`'s dtype and, when `param_grads`,
/// `dweight = Σ_rows dy xhat`, `dbias = Σ_rows dy` in the weight's dtype (`x`'s without one).
pub(super) fn backward(a: &LayerNormBackward<&Tensor>) -> Result<Grads<Tensor>> {
    let (x, w, mean, rstd, dy) = (a.x, a.w, a.mean, a.rstd, a.dy);
    let (rows, cols, param_grads) = (a.rows, a.cols, a.param_grads);
    let wdt = w.map_or(x.dtype(), |w| w.dtype());
    let xc = widen(x)?.reshape((rows, cols))?;
    let dyc = widen(dy)?.reshape((rows, cols))?;
    let rs = column(rstd, rows)?;
    let xhat = xc.sub(&column(mean, rows)?)?.mul(&rs)?;
    let dx = norm_input_grad(x, w, [&dyc, &xhat, &rs], true)?;
    if !param_grads {
        return Ok((dx, None, None));
    }
    let dw = row_sum(&dyc.mul(&xhat)?, cols, wdt)?;
    let db = row_sum(&dyc, cols, wdt)?;
    Ok((dx, Some(dw), Some(db)))
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close};

    #[test]
    fn layer_norm_matches_its_composition() {
        for (dt, rel, [x, w, b]) in cases(2, [&[4, 6, 33], &[33], &[33]]) {
            for affine in [false, true] {
                let (wo, bo) = if affine {
                    (Some(&w), Some(&b))
                } else {
                    (None, None)
                };
                let (a, c) = both(|| x.layer_norm(wo, bo, 1e-5).unwrap());
                let what = format!("layer_norm {dt} affine={affine}");
                close(&what, &a.y, &c.y, rel);
                close(&what, &a.mean, &c.mean, rel);
                close(&what, &a.rstd, &c.rstd, rel);
            }
        }
    }

    #[test]
    fn layer_norm_backward_matches_its_composition() {
        for (dt, rel, [x, w, dy]) in cases(20, [&[4, 6, 33], &[33], &[4, 6, 33]]) {
            for wo in [None, Some(&w)] {
                let fwd = x.layer_norm(wo, None, 1e-5).unwrap();
                let (a, c) = both(|| {
                    x.layer_norm_backward(wo, &fwd.mean, &fwd.rstd, &dy)
                        .unwrap()
                });
                let what = format!("layer_norm_backward {dt} weight={}", wo.is_some());
                close(&what, &a.0, &c.0, rel);
                assert_eq!(a.1.is_some(), wo.is_some(), "{what}");
                assert_eq!(a.1.is_some(), c.1.is_some(), "{what}");
                if let (Some((aw, ab)), Some((cw, cb))) = (&a.1, &c.1) {
                    close(&format!("{what} dweight"), aw, cw, rel);
                    close(&format!("{what} dbias"), ab, cb, rel);
                }
            }
        }
    }
}

//! Layer norm, forward and backward, composed.

use super::{column, row_sum, widen};
use crate::{Result, Tensor};

/// Layer norm over the last dim of `x` viewed as `[rows, cols]`: `(y, mean, rstd)` with `y` in
/// `x`'s dtype and `mean`, `rstd` (shape `[rows]`) in compute precision.
pub(crate) fn layer_norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
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
    Ok((
        y.to_dtype(x.dtype())?.reshape(x.shape().clone())?,
        mean.reshape(rows)?,
        rstd.reshape(rows)?,
    ))
}

/// The backward of [`layer_norm`] from its saved `mean` and `rstd`: with
/// `xhat = (x - mean) rstd` and `g = weight · dy` (or `dy`),
/// `dx = rstd (g - mean(g) - xhat mean(g xhat))` in `x`'s dtype and, when `param_grads`,
/// `dweight = Σ_rows dy xhat`, `dbias = Σ_rows dy` in the weight's dtype (`x`'s without one).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn layer_norm_backward(
    x: &Tensor,
    w: Option<&Tensor>,
    mean: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
    rows: usize,
    cols: usize,
    param_grads: bool,
) -> Result<(Tensor, Option<Tensor>, Option<Tensor>)> {
    let wdt = w.map_or(x.dtype(), |w| w.dtype());
    let xc = widen(x)?.reshape((rows, cols))?;
    let dyc = widen(dy)?.reshape((rows, cols))?;
    let rs = column(rstd, rows)?;
    let xhat = xc.sub(&column(mean, rows)?)?.mul(&rs)?;
    let dx = if x.elem_count() == 0 {
        x.zeros_like()?
    } else {
        let g = match w {
            Some(w) => dyc.mul(&widen(w)?)?,
            None => dyc.clone(),
        };
        let g_mean = g.mean(&[-1], true)?;
        let gx_mean = g.mul(&xhat)?.mean(&[-1], true)?;
        let dx = g.sub(&g_mean)?.sub(&xhat.mul(&gx_mean)?)?.mul(&rs)?;
        dx.to_dtype(x.dtype())?.reshape(x.shape().clone())?
    };
    if !param_grads {
        return Ok((dx, None, None));
    }
    let dw = row_sum(&dyc.mul(&xhat)?, cols, wdt)?;
    let db = row_sum(&dyc, cols, wdt)?;
    Ok((dx, Some(dw), Some(db)))
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{both, close, rand, CASES};

    #[test]
    fn layer_norm_matches_its_composition() {
        for (dt, rel) in CASES {
            let x = rand(&[4, 6, 33], 2, dt);
            let w = rand(&[33], 3, dt);
            let b = rand(&[33], 4, dt);
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
        for (dt, rel) in CASES {
            let x = rand(&[4, 6, 33], 20, dt);
            let w = rand(&[33], 21, dt);
            let dy = rand(&[4, 6, 33], 22, dt);
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

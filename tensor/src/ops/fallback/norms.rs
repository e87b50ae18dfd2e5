//! Layer norm and RMS norm, forward and backward, composed.

use super::widen;
use crate::{DType, Result, Tensor};

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

/// RMS norm over the last dim of `x` viewed as `[rows, cols]`: `(y, rstd)` with `y` in `x`'s
/// dtype and `rstd` (shape `[rows]`) in compute precision.
pub(crate) fn rms_norm(
    x: &Tensor,
    w: Option<&Tensor>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let xc = widen(x)?.reshape((rows, cols))?;
    let ms = xc.sqr()?.mean(&[-1], true)?;
    let rstd = ms.add_scalar(eps)?.sqrt()?.recip()?;
    let mut y = xc.mul(&rstd)?;
    if let Some(w) = w {
        y = y.mul(&widen(w)?)?;
    }
    Ok((
        y.to_dtype(x.dtype())?.reshape(x.shape().clone())?,
        rstd.reshape(rows)?,
    ))
}

/// `x`'s statistic `s` (shape `[rows]`) as a `[rows, 1]` column in compute precision.
fn column(s: &Tensor, rows: usize) -> Result<Tensor> {
    widen(s)?.reshape((rows, 1))
}

/// A weight gradient `Σ_rows g` of `[rows, cols]` `g`, in `dtype` (zeros when there are no rows).
fn row_sum(g: &Tensor, cols: usize, dtype: DType) -> Result<Tensor> {
    if g.elem_count() == 0 {
        return Tensor::zeros(cols, dtype, g.device());
    }
    g.sum(&[0], false)?.to_dtype(dtype)
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

/// The backward of [`rms_norm`] from its saved `rstd`: with `xhat = x rstd` and
/// `g = weight · dy` (or `dy`), `dx = rstd (g - xhat mean(g xhat))` in `x`'s dtype and, when
/// `weight_grad`, `dweight = Σ_rows dy xhat` in the weight's dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_backward(
    x: &Tensor,
    w: Option<&Tensor>,
    rstd: &Tensor,
    dy: &Tensor,
    rows: usize,
    cols: usize,
    weight_grad: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let wdt = w.map_or(x.dtype(), |w| w.dtype());
    let xc = widen(x)?.reshape((rows, cols))?;
    let dyc = widen(dy)?.reshape((rows, cols))?;
    let rs = column(rstd, rows)?;
    let xhat = xc.mul(&rs)?;
    let dx = if x.elem_count() == 0 {
        x.zeros_like()?
    } else {
        let g = match w {
            Some(w) => dyc.mul(&widen(w)?)?,
            None => dyc.clone(),
        };
        let gx_mean = g.mul(&xhat)?.mean(&[-1], true)?;
        let dx = g.sub(&xhat.mul(&gx_mean)?)?.mul(&rs)?;
        dx.to_dtype(x.dtype())?.reshape(x.shape().clone())?
    };
    let dw = if weight_grad {
        Some(row_sum(&dyc.mul(&xhat)?, cols, wdt)?)
    } else {
        None
    };
    Ok((dx, dw))
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

    #[test]
    fn rms_norm_matches_its_composition() {
        for (dt, rel) in CASES {
            let x = rand(&[5, 40], 5, dt);
            let w = rand(&[40], 6, dt);
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
        for (dt, rel) in CASES {
            let x = rand(&[3, 5, 40], 23, dt);
            let w = rand(&[40], 24, dt);
            let dy = rand(&[3, 5, 40], 25, dt);
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

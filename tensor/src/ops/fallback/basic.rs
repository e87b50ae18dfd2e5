//! Linear, softmax (and its backward), the unary derivatives (SiLU, clamp) and
//! log-sum-exp, composed.

use meshgrad_kernels::ops::UnaryGrad;

use super::{replace, shifted, widen};
use crate::{Result, Tensor};

/// `x Wᵀ + bias` for `x [rows, in]`, `weight [out, in]`, `bias [out]`: one product and a
/// broadcast add in compute precision, rounded once to `x`'s dtype.
pub(crate) fn linear(x: &Tensor, weight: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut y = widen(x)?.matmul(&widen(weight)?.t()?)?;
    if let Some(b) = bias {
        y = y.add(&widen(b)?)?;
    }
    y.to_dtype(x.dtype())
}

/// Softmax (or log-softmax) over the last dim of `x`, in `x`'s dtype.
pub(crate) fn softmax(x: &Tensor, log: bool) -> Result<Tensor> {
    if x.elem_count() == 0 {
        return x.zeros_like();
    }
    let (z, _) = shifted(&widen(x)?)?;
    let e = z.exp()?;
    let s = e.sum(&[-1], true)?;
    let y = if log { z.sub(&s.log()?)? } else { e.div(&s)? };
    y.to_dtype(x.dtype())
}

/// The backward of [`softmax`] over the last dim from its output `y`, in `y`'s dtype:
/// `y (dy - Σ dy·y)` for softmax, `dy - exp(y) Σ dy` for log-softmax.
pub(crate) fn softmax_backward(y: &Tensor, dy: &Tensor, log: bool) -> Result<Tensor> {
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

/// `dy * f'(x)` in `x`'s dtype for the fused unary derivatives: SiLU's
/// `s (1 + x (1 - s))` with `s = sigmoid(x)`, and clamp's 1 where `lo <= x <= hi` (bounds
/// rounded to the compute precision, NaN excluded), else 0.
pub(crate) fn unary_backward(x: &Tensor, dy: &Tensor, op: UnaryGrad) -> Result<Tensor> {
    let xc = widen(x)?;
    match op {
        UnaryGrad::Silu => {
            let s = xc.sigmoid()?;
            let slope = s.mul(&s.neg()?.add_scalar(1.0)?.mul(&xc)?.add_scalar(1.0)?)?;
            widen(dy)?.mul(&slope)?.to_dtype(x.dtype())
        }
        UnaryGrad::Clamp(lo, hi) => {
            let bound = |v: f64| Tensor::scalar(v, xc.dtype(), xc.device());
            let zero = dy.zeros_like()?;
            let below_hi = xc.le(&bound(hi)?)?.where_cond(dy, &zero)?;
            xc.ge(&bound(lo)?)?.where_cond(&below_hi, &zero)
        }
    }
}

/// `ln Σ exp(x)` over the middle dim of `x` viewed as `[outer, red, inner]`, shaped
/// `[outer, inner]` in `x`'s dtype: shifted by the maximum, or by 0 where the maximum is
/// infinite (so a slice of all `-inf`, or an empty one, gives `-inf` and one holding `+inf`
/// gives `+inf`); NaN propagates.
pub(crate) fn logsumexp(x: &Tensor, outer: usize, red: usize, inner: usize) -> Result<Tensor> {
    let xc = widen(x)?.reshape((outer, red, inner))?;
    if red == 0 || outer * inner == 0 {
        return Tensor::full(f64::NEG_INFINITY, (outer, inner), x.dtype(), x.device());
    }
    let m = xc.max(1, true)?;
    let shift = replace(&replace(&m, f64::INFINITY, 0.0)?, f64::NEG_INFINITY, 0.0)?;
    let s = xc.sub(&shift)?.exp()?.sum(&[1], true)?.log()?;
    shift.add(&s)?.reshape((outer, inner))?.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{both, close, rand, CASES};
    use crate::{DType, Device, Tensor};

    #[test]
    fn declining_reaches_the_backend() {
        // The switch makes the dispatch report "not provided", so the comparisons of these
        // tests do run the compositions.
        let x = rand(&[2, 3], 0, DType::F32);
        let g = x.read_storage("test").unwrap();
        let run = || crate::backend::softmax((&g, x.layout()), 2, 3, false).unwrap();
        assert!(run().is_some());
        assert!(crate::backend::with_fused_declined(run).is_none());
    }

    #[test]
    fn softmax_matches_its_composition() {
        for (dt, rel) in CASES {
            let x = rand(&[3, 5, 17], 1, dt);
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
    fn linear_matches_its_composition() {
        for (dt, rel) in CASES {
            let x = rand(&[2, 5, 24], 15, dt);
            let w = rand(&[7, 24], 16, dt);
            let b = rand(&[7], 17, dt);
            // A transposed weight view too (the fused op reads it through its strides).
            let wt = rand(&[24, 7], 18, dt).t().unwrap();
            for (w, bias) in [(&w, None), (&w, Some(&b)), (&wt, Some(&b))] {
                let (a, c) = both(|| x.linear(w, bias).unwrap());
                close(&format!("linear {dt} bias={}", bias.is_some()), &a, &c, rel);
            }
        }
    }

    #[test]
    fn softmax_backward_matches_its_composition() {
        for (dt, rel) in CASES {
            let x = rand(&[3, 4, 19], 13, dt);
            let dy = rand(&[3, 4, 19], 14, dt);
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

    #[test]
    fn unary_backward_matches_its_composition() {
        for (dt, rel) in CASES {
            // Values on the clamp bounds (included) and a NaN (excluded) too.
            let mut v = rand(&[3, 30], 40, DType::F64).to_vec::<f64>().unwrap();
            v[2] = -1.0;
            v[5] = 1.5;
            v[9] = f64::NAN;
            let x = Tensor::from_vec(v, (3, 30), Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let dy = rand(&[3, 30], 41, dt);
            let (a, c) = both(|| x.silu_backward(&dy).unwrap());
            // The NaN input gives NaN on both sides: compare the rest.
            let keep = |t: &Tensor| t.narrow(1, 10, 20).unwrap();
            close(&format!("silu_backward {dt}"), &keep(&a), &keep(&c), rel);
            assert!(a.to_vec_f64().unwrap()[9].is_nan() && c.to_vec_f64().unwrap()[9].is_nan());
            for (lo, hi) in [
                (Some(-1.0), Some(1.5)),
                (None, Some(0.5)),
                (Some(0.0), None),
            ] {
                let (a, c) = both(|| x.clamp_backward(&dy, lo, hi).unwrap());
                close(&format!("clamp_backward {dt} {lo:?}..{hi:?}"), &a, &c, rel);
            }
        }
    }

    #[test]
    fn logsumexp_matches_its_composition() {
        for (dt, rel) in CASES {
            let mut v = rand(&[4, 6, 5], 42, DType::F64).to_vec::<f64>().unwrap();
            // One slice (dim 1, fixed [0, *, 0]) all -inf, one holding +inf.
            for r in 0..6 {
                v[r * 5] = f64::NEG_INFINITY;
            }
            v[30 + 7] = f64::INFINITY;
            let x = Tensor::from_vec(v, (4, 6, 5), Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            for (dim, keep) in [(0, false), (1, true), (2, false), (-1, true)] {
                let (a, c) = both(|| x.logsumexp(dim, keep).unwrap());
                close(&format!("logsumexp {dt} dim={dim}"), &a, &c, rel);
            }
            let empty = Tensor::zeros((3, 0), dt, Device::Cpu).unwrap();
            let (a, c) = both(|| empty.logsumexp(1, false).unwrap());
            close(&format!("logsumexp {dt} empty"), &a, &c, rel);
        }
    }
}

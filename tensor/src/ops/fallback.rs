//! Fallbacks of fused ops composed from basic ops, for backends that do not (yet) provide the
//! fused kernel (their [`BackendStorage`](crate::backend::BackendStorage) method answers
//! `Ok(None)`). Each computes in [`compute_dtype`] of its input and returns what the fused op
//! returns (dtypes and shapes included); results agree with the fused kernels up to rounding
//! (the order of operations differs), which the tests below check against the CPU's kernels.
//!
//! Every function takes contiguous tensors shaped as the calling op passes them.

use super::compute_dtype;
use crate::{Result, Tensor};

/// `t` converted to its compute precision.
fn widen(t: &Tensor) -> Result<Tensor> {
    t.to_dtype(compute_dtype(t.dtype()))
}

/// Row max subtracted, so `exp` cannot overflow: `(x - max, max)` over the last dim (kept).
fn shifted(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let m = x.max(-1, true)?;
    Ok((x.sub(&m)?, m))
}

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

/// Cross-entropy of `[rows, cols]` logits (any leading shape folded) against integer `targets`:
/// `(loss, lse)` per row in compute precision, shaped like `targets`; loss 0 where the target is
/// `ignore_index` (whose `lse` is still computed). A target outside `0..cols` that is not
/// ignored is an error.
pub(crate) fn cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
) -> Result<(Tensor, Tensor)> {
    let x = widen(logits)?.reshape((rows, cols))?;
    let t = targets.to_dtype(crate::DType::I64)?.reshape(rows)?;
    let (z, m) = shifted(&x)?;
    let lse = z.exp()?.sum(&[-1], true)?.log()?.add(&m)?.reshape(rows)?;
    let keep = match ignore_index {
        Some(i) => Some(t.ne(&Tensor::full(i as f64, rows, t.dtype(), t.device())?)?),
        None => None,
    };
    let safe = match &keep {
        Some(k) => k.where_cond(&t, &t.zeros_like()?)?,
        None => t,
    };
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

/// `silu(gate) * up`, in `gate`'s dtype.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    widen(gate)?
        .silu()?
        .mul(&widen(up)?)?
        .to_dtype(gate.dtype())
}

/// `dy * gelu'(x)` in `x`'s dtype: the tanh form
/// `0.5 (1 + t) + 0.5 x (1 - t²) c (1 + 3 a x²)` with `t = tanh(c (x + a x³))`,
/// `c = sqrt(2/π)`, `a = 0.044715`; the erf form `Φ(x) + x φ(x)` with `Φ(x) = gelu(x) / x`
/// (0.5 at 0) and `φ(x) = exp(-x²/2) / sqrt(2π)`.
pub(crate) fn gelu_backward(x: &Tensor, dy: &Tensor, tanh_form: bool) -> Result<Tensor> {
    const C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
    const A: f64 = 0.044_715;
    const INV_SQRT_2PI: f64 = 0.398_942_280_401_432_7;
    let xc = widen(x)?;
    let x2 = xc.sqr()?;
    let grad = if tanh_form {
        let t = xc
            .mul(&x2.mul_scalar(A)?.add_scalar(1.0)?)?
            .mul_scalar(C)?
            .tanh()?;
        let left = t.add_scalar(1.0)?.mul_scalar(0.5)?;
        let one_minus_t2 = t.sqr()?.neg()?.add_scalar(1.0)?;
        let slope = x2
            .mul_scalar(3.0 * A)?
            .add_scalar(1.0)?
            .mul_scalar(0.5 * C)?;
        left.add(&xc.mul(&one_minus_t2)?.mul(&slope)?)?
    } else {
        let zero = xc.zeros_like()?;
        let at_zero = xc.eq(&zero)?;
        let cdf = at_zero.where_cond(
            &zero.add_scalar(0.5)?,
            &xc.gelu(super::GeluKind::Erf)?.div(&xc)?,
        )?;
        let pdf = x2.mul_scalar(-0.5)?.exp()?.mul_scalar(INV_SQRT_2PI)?;
        cdf.add(&xc.mul(&pdf)?)?
    };
    grad.mul(&widen(dy)?)?.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    //! Every fused CPU kernel with a fallback against that fallback (forced by declining fused
    //! kernels on this thread). Tolerance: f32 within 1e-5 relative to the largest magnitude of
    //! the compared tensor (plus 1e-6 absolute), f64 within 1e-12; bf16 within 2^-7 relative
    //! (one bf16 rounding of each side).
    use crate::backend::with_fused_declined;
    use crate::{DType, Device, GeluKind, Random, Tensor};

    fn close(what: &str, fused: &Tensor, composed: &Tensor, rel: f64) {
        assert_eq!(fused.dims(), composed.dims(), "{what}: shapes");
        assert_eq!(fused.dtype(), composed.dtype(), "{what}: dtypes");
        let (a, b) = (fused.to_vec_f64().unwrap(), composed.to_vec_f64().unwrap());
        let scale = a.iter().fold(0f64, |m, v| m.max(v.abs())).max(1.0);
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= rel * scale + rel / 10.0,
                "{what}: element {i}: fused {x} vs composed {y} (rel {rel})"
            );
        }
    }

    fn both<T>(f: impl Fn() -> T) -> (T, T) {
        (f(), with_fused_declined(&f))
    }

    fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
        Random::new(seed)
            .dtype(dtype)
            .normal(shape.to_vec(), 0.0, 2.0)
            .unwrap()
    }

    #[test]
    fn declining_reaches_the_backend() {
        // An op with no fallback yet reports the missing kernel, so the comparisons below do
        // run the compositions.
        let x = rand(&[2, 3], 0, DType::F32);
        let e = with_fused_declined(|| x.logsumexp(-1, false)).unwrap_err();
        assert!(
            matches!(
                e,
                crate::Error::NotImplemented {
                    op: "logsumexp",
                    device: Device::Cpu
                }
            ),
            "{e}"
        );
        assert!(x.logsumexp(-1, false).is_ok());
    }

    const CASES: [(DType, f64); 3] = [(DType::F32, 1e-5), (DType::F64, 1e-12), (DType::BF16, 1e-2)];

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
    fn cross_entropy_matches_its_composition() {
        for (dt, rel) in CASES {
            let logits = rand(&[2, 7, 11], 7, dt);
            let t = Random::new(8).randint((2, 7), 0, 11).unwrap();
            let mut v = t.to_vec::<i64>().unwrap();
            v[3] = -100;
            let with_ignored = Tensor::from_vec(v, (2, 7), Device::Cpu).unwrap();
            for ignore in [None, Some(-100)] {
                let targets = if ignore.is_some() { &with_ignored } else { &t };
                let (a, c) = both(|| logits.cross_entropy_rows(targets, ignore).unwrap());
                let what = format!("cross_entropy {dt} ignore={ignore:?}");
                close(&what, &a.0, &c.0, rel);
                close(&what, &a.1, &c.1, rel);
            }
        }
    }

    #[test]
    fn swiglu_matches_its_composition() {
        for (dt, rel) in CASES {
            let g = rand(&[3, 50], 9, dt);
            let u = rand(&[3, 50], 10, dt);
            let (a, c) = both(|| Tensor::swiglu(&g, &u).unwrap());
            close(&format!("swiglu {dt}"), &a, &c, rel);
        }
    }

    #[test]
    fn gelu_backward_matches_its_composition() {
        for (dt, rel) in CASES {
            // Include an exact zero (the erf form's special case).
            let mut v = rand(&[4, 25], 11, DType::F64).to_vec::<f64>().unwrap();
            v[7] = 0.0;
            let x = Tensor::from_vec(v, (4, 25), Device::Cpu)
                .unwrap()
                .to_dtype(dt)
                .unwrap();
            let dy = rand(&[4, 25], 12, dt);
            for kind in [GeluKind::Tanh, GeluKind::Erf] {
                let (a, c) = both(|| x.gelu_backward(&dy, kind).unwrap());
                close(&format!("gelu_backward {dt} {kind:?}"), &a, &c, rel);
            }
        }
    }
}

//! Layer norm on the CPU, forward and backward: resolve dtypes, then call
//! `meshgrad_kernels::cpu::layer_norm` (weight and bias are computed in the input's precision).

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::{Grads, LayerNorm, LayerNormBackward};
use crate::cpu_backend::{floats, pick, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::{Error, Result};

/// See [`LayerNorm`]: `(y, mean, rstd)`.
pub(super) fn forward(a: &LayerNorm<CpuIn<'_>>) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    let (x, w, b, rows, cols, eps) = (a.x, a.w, a.b, a.rows, a.cols, a.eps);
    let dt = x.0.dtype();
    // Weight and bias are computed in the input's precision.
    let wv = w
        .map(|(s, l)| floats(s, range(l), "layer_norm (weight)"))
        .transpose()?;
    let bv = b
        .map(|(s, l)| floats(s, range(l), "layer_norm (bias)"))
        .transpose()?;
    Ok(match floats(x.0, range(x.1), "layer_norm")? {
        Floats::F32(xv) => {
            let wf = as_f32(&wv)?;
            let bf = as_f32(&bv)?;
            let mut y: Vec<f32> = crate::pool::output(rows * cols);
            let (mut m, mut r) = (vec![0f32; rows], vec![0f32; rows]);
            cpu::layer_norm::layer_norm_forward(
                &xv, wf, bf, rows, cols, eps, &mut y, &mut m, &mut r,
            );
            (y.into_storage(dt), CpuStorage::F32(m), CpuStorage::F32(r))
        }
        Floats::F64(xv) => {
            let wf = as_f64(&wv)?;
            let bf = as_f64(&bv)?;
            let mut y = vec![0f64; rows * cols];
            let (mut m, mut r) = (vec![0f64; rows], vec![0f64; rows]);
            cpu::layer_norm::layer_norm_forward(
                xv, wf, bf, rows, cols, eps, &mut y, &mut m, &mut r,
            );
            (CpuStorage::F64(y), CpuStorage::F64(m), CpuStorage::F64(r))
        }
    })
}

/// An optional f32 parameter (an f64 one does not fit an f32 input).
fn as_f32<'a>(v: &'a Option<Floats<'_>>) -> Result<Option<&'a [f32]>> {
    match v {
        None => Ok(None),
        Some(Floats::F32(c)) => Ok(Some(c)),
        Some(Floats::F64(_)) => Err(Error::msg(
            "layer_norm: weight/bias dtype differs from the input's",
        )),
    }
}

/// An optional f64 parameter (an f32 one does not fit an f64 input).
fn as_f64<'a>(v: &'a Option<Floats<'_>>) -> Result<Option<&'a [f64]>> {
    match v {
        None => Ok(None),
        Some(Floats::F64(c)) => Ok(Some(c)),
        Some(Floats::F32(_)) => Err(Error::msg(
            "layer_norm: weight/bias dtype differs from the input's",
        )),
    }
}

/// See [`LayerNormBackward`]: `(dx, dweight, dbias)`; the last two when `param_grads` (bias
/// grads are computed together with weight grads since they come from the same pass).
pub(super) fn backward(a: &LayerNormBackward<CpuIn<'_>>) -> Result<Grads<CpuStorage>> {
    let (x, w, mean, rstd, dy) = (a.x, a.w, a.mean, a.rstd, a.dy);
    let (rows, cols, param_grads) = (a.rows, a.cols, a.param_grads);
    let dt = x.0.dtype();
    let wv = w
        .map(|(s, l)| floats(s, range(l), "layer_norm_backward (weight)"))
        .transpose()?;
    let wdt = w.map(|(s, _)| s.dtype()).unwrap_or(dt);
    Ok(
        with_floats!("layer_norm_backward", (x.0, range(x.1)) => xv, (mean.0, range(mean.1)) => mv, (rstd.0, range(rstd.1)) => rv, (dy.0, range(dy.1)) => gv; {
            let mut dx = crate::pool::output(rows * cols);
            let mut dwv = vec![Float::ZERO; if param_grads { cols } else { 0 }];
            let mut dbv = vec![Float::ZERO; if param_grads { cols } else { 0 }];
            let wslice = match &wv {
                None => None,
                Some(f) => Some(pick(f, xv)?),
            };
            cpu::layer_norm::layer_norm_backward(
                xv,
                wslice,
                mv,
                rv,
                gv,
                rows,
                cols,
                &mut dx,
                param_grads.then_some(&mut dwv[..]),
                param_grads.then_some(&mut dbv[..]),
            );
            let dw = param_grads.then(|| dwv.into_storage(wdt));
            let db = param_grads.then(|| dbv.into_storage(wdt));
            (dx.into_storage(dt), dw, db)
        }),
    )
}

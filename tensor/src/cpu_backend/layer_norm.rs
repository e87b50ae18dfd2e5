//! Layer norm on the CPU, forward and backward: resolve dtypes, then call
//! `meshgrad_kernels::cpu::layer_norm`.

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::{floats, pick, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Error, Layout, Result};

type In<'a> = (&'a CpuStorage, &'a Layout);

/// Returns `(y, mean, rstd)`.
pub(crate) fn layer_norm(
    x: In<'_>,
    w: Option<In<'_>>,
    b: Option<In<'_>>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
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

fn as_f32<'a>(v: &'a Option<Floats<'_>>) -> Result<Option<&'a [f32]>> {
    match v {
        None => Ok(None),
        Some(Floats::F32(c)) => Ok(Some(c)),
        Some(Floats::F64(_)) => Err(Error::msg(
            "layer_norm: weight/bias dtype differs from the input's",
        )),
    }
}

fn as_f64<'a>(v: &'a Option<Floats<'_>>) -> Result<Option<&'a [f64]>> {
    match v {
        None => Ok(None),
        Some(Floats::F64(c)) => Ok(Some(c)),
        Some(Floats::F32(_)) => Err(Error::msg(
            "layer_norm: weight/bias dtype differs from the input's",
        )),
    }
}

/// Returns `(dx, dweight, dbias)`; the last two when the weight was given (bias grads are
/// computed together with weight grads since they come from the same pass).
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    x: In<'_>,
    w: Option<In<'_>>,
    mean: In<'_>,
    rstd: In<'_>,
    dy: In<'_>,
    rows: usize,
    cols: usize,
    param_grads: bool,
) -> Result<(CpuStorage, Option<CpuStorage>, Option<CpuStorage>)> {
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

//! RMSNorm on the CPU, forward and backward: resolve dtypes, then call
//! `meshgrad_kernels::cpu::rms_norm` (the weight is computed in the input's precision).

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::{RmsNorm, RmsNormBackward};
use crate::cpu_backend::{floats, pick, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`RmsNorm`]: `(y, rstd)`.
pub(super) fn forward(a: &RmsNorm<CpuIn<'_>>) -> Result<(CpuStorage, CpuStorage)> {
    let (x, w, rows, cols, eps) = (a.x, a.w, a.rows, a.cols, a.eps);
    let dt = x.0.dtype();
    let wv = w
        .map(|(s, l)| floats(s, range(l), "rms_norm (weight)"))
        .transpose()?;
    Ok(with_floats!("rms_norm", (x.0, range(x.1)) => xv; {
        let ws = match &wv {
            None => None,
            Some(f) => Some(pick(f, xv)?),
        };
        let mut y = crate::pool::output(rows * cols);
        let mut rstd = vec![Float::ZERO; rows];
        cpu::rms_norm::rms_norm_forward(xv, ws, rows, cols, eps, &mut y, &mut rstd);
        (y.into_storage(dt), rstd.into_storage(crate::DType::F32))
    }))
}

/// See [`RmsNormBackward`]: `(dx, dweight)`.
pub(super) fn backward(a: &RmsNormBackward<CpuIn<'_>>) -> Result<(CpuStorage, Option<CpuStorage>)> {
    let (x, w, rstd, dy) = (a.x, a.w, a.rstd, a.dy);
    let (rows, cols, weight_grad) = (a.rows, a.cols, a.weight_grad);
    let dt = x.0.dtype();
    let wdt = w.map(|(s, _)| s.dtype()).unwrap_or(dt);
    let wv = w
        .map(|(s, l)| floats(s, range(l), "rms_norm_backward (weight)"))
        .transpose()?;
    Ok(
        with_floats!("rms_norm_backward", (x.0, range(x.1)) => xv, (rstd.0, range(rstd.1)) => rv, (dy.0, range(dy.1)) => gv; {
            let ws = match &wv {
                None => None,
                Some(f) => Some(pick(f, xv)?),
            };
            let mut dx = crate::pool::output(rows * cols);
            let mut dw = weight_grad.then(|| vec![Float::ZERO; cols]);
            cpu::rms_norm::rms_norm_backward(xv, ws, rv, gv, rows, cols, &mut dx, dw.as_deref_mut());
            (dx.into_storage(dt), dw.map(|d| d.into_storage(wdt)))
        }),
    )
}

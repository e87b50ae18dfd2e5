//! The fused ops of Llama-style models on the CPU (RMSNorm, rotary embedding, SwiGLU): resolve
//! dtypes, then call `meshgrad_kernels::cpu::{rms_norm, rotary, swiglu}`.

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::fused::pick;
use super::{floats, ids, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Layout, Result};

type In<'a> = (&'a CpuStorage, &'a Layout);

/// Returns `(y, rstd)`; the weight is computed in the input's precision.
pub(crate) fn rms_norm(
    x: In<'_>,
    w: Option<In<'_>>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage)> {
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

/// Returns `(dx, dweight)`, the latter when `weight_grad` (in the weight's dtype).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rms_norm_backward(
    x: In<'_>,
    w: Option<In<'_>>,
    rstd: In<'_>,
    dy: In<'_>,
    rows: usize,
    cols: usize,
    weight_grad: bool,
) -> Result<(CpuStorage, Option<CpuStorage>)> {
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

/// RoPE of a contiguous `[B, T, H, D]` buffer by integer `positions [T]` (inverse rotation when
/// `inverse`).
pub(crate) fn rotary_embedding(
    x: In<'_>,
    positions: In<'_>,
    dims: [usize; 4],
    theta: f64,
    inverse: bool,
) -> Result<CpuStorage> {
    let dt = x.0.dtype();
    let p = ids(positions.0, positions.1, "rotary_embedding (positions)")?;
    let [b, t, h, d] = dims;
    Ok(with_floats!("rotary_embedding", (x.0, range(x.1)) => xv; {
        let mut out = crate::pool::output(b * t * h * d);
        cpu::rotary::rotary_embedding(xv, &p, b, t, h, d, theta, inverse, &mut out);
        out.into_storage(dt)
    }))
}

/// `silu(gate) * up`.
pub(crate) fn swiglu(gate: In<'_>, up: In<'_>) -> Result<CpuStorage> {
    let dt = gate.0.dtype();
    Ok(
        with_floats!("swiglu", (gate.0, range(gate.1)) => g, (up.0, range(up.1)) => u; {
            let mut out = crate::pool::output(g.len());
            cpu::swiglu::swiglu_forward(g, u, &mut out);
            out.into_storage(dt)
        }),
    )
}

/// Returns `(dgate, dup)`.
pub(crate) fn swiglu_backward(
    gate: In<'_>,
    up: In<'_>,
    dy: In<'_>,
) -> Result<(CpuStorage, CpuStorage)> {
    let dt = gate.0.dtype();
    Ok(
        with_floats!("swiglu_backward", (gate.0, range(gate.1)) => g, (up.0, range(up.1)) => u, (dy.0, range(dy.1)) => d; {
            let mut dg = crate::pool::output(g.len());
            let mut du = crate::pool::output(g.len());
            cpu::swiglu::swiglu_backward(g, u, d, &mut dg, &mut du);
            (dg.into_storage(dt), du.into_storage(dt))
        }),
    )
}

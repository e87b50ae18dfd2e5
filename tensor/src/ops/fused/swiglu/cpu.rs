//! SwiGLU on the CPU, forward and backward: resolve dtypes, then call
//! `meshgrad_kernels::cpu::swiglu`.

use meshgrad_kernels::cpu;

use super::{Swiglu, SwigluBackward};
use crate::cpu_backend::{floats, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`Swiglu`].
pub(super) fn forward(&Swiglu { gate, up }: &Swiglu<CpuIn<'_>>) -> Result<CpuStorage> {
    let dt = gate.0.dtype();
    Ok(
        with_floats!("swiglu", (gate.0, range(gate.1)) => g, (up.0, range(up.1)) => u; {
            let mut out = crate::pool::output(g.len());
            cpu::swiglu::swiglu_forward(g, u, &mut out);
            out.into_storage(dt)
        }),
    )
}

/// See [`SwigluBackward`]: `(dgate, dup)`.
pub(super) fn backward(
    &SwigluBackward { gate, up, dy }: &SwigluBackward<CpuIn<'_>>,
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

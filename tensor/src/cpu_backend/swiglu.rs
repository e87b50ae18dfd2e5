//! SwiGLU on the CPU, forward and backward: resolve dtypes, then call
//! `meshgrad_kernels::cpu::swiglu`.

use meshgrad_kernels::cpu;

use super::{floats, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Layout, Result};

type In<'a> = (&'a CpuStorage, &'a Layout);

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

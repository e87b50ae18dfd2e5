//! Rotary position embedding on the CPU: resolve dtypes, then call
//! `meshgrad_kernels::cpu::rotary`.

use meshgrad_kernels::cpu;

use super::Rotary;
use crate::cpu_backend::{floats, ids, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`Rotary`].
pub(super) fn rotary(a: &Rotary<CpuIn<'_>>) -> Result<CpuStorage> {
    let (x, positions, dims, theta, inverse) = (a.x, a.positions, a.dims, a.theta, a.inverse);
    let dt = x.0.dtype();
    let p = ids(positions.0, positions.1, "rotary_embedding (positions)")?;
    let [b, t, h, d] = dims;
    Ok(with_floats!("rotary_embedding", (x.0, range(x.1)) => xv; {
        let mut out = crate::pool::output(b * t * h * d);
        cpu::rotary::rotary_embedding(xv, &p, b, t, h, d, theta, inverse, &mut out);
        out.into_storage(dt)
    }))
}

//! Rotary position embedding on the CPU: resolve dtypes, then call
//! `meshgrad_kernels::cpu::rotary`.

use meshgrad_kernels::cpu;

use super::{floats, ids, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Layout, Result};

type In<'a> = (&'a CpuStorage, &'a Layout);

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

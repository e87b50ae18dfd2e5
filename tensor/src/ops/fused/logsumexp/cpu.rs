//! Log-sum-exp on the CPU: resolve dtypes, then call `meshgrad_kernels::cpu::logsumexp`.

use meshgrad_kernels::cpu;

use super::Logsumexp;
use crate::cpu_backend::{floats, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`Logsumexp`]: in the input's dtype (half types computed in f32).
pub(super) fn forward(a: &Logsumexp<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((s, l), outer, red, inner) = (a.x, a.outer, a.red, a.inner);
    let dt = s.dtype();
    Ok(with_floats!("logsumexp", (s, range(l)) => x; {
        let mut out = crate::pool::output(outer * inner);
        cpu::logsumexp::logsumexp(x, outer, red, inner, &mut out);
        out.into_storage(dt)
    }))
}

//! Log-sum-exp on the CPU: resolve dtypes, then call `meshgrad_kernels::cpu::logsumexp`.

use meshgrad_kernels::cpu;

use super::{floats, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Layout, Result};

/// Log-sum-exp over the middle dim of a contiguous buffer viewed as `[outer, red, inner]`, in
/// the input's dtype (half types computed in f32).
pub(crate) fn logsumexp(
    s: &CpuStorage,
    l: &Layout,
    outer: usize,
    red: usize,
    inner: usize,
) -> Result<CpuStorage> {
    let dt = s.dtype();
    Ok(with_floats!("logsumexp", (s, range(l)) => x; {
        let mut out = crate::pool::output(outer * inner);
        cpu::logsumexp::logsumexp(x, outer, red, inner, &mut out);
        out.into_storage(dt)
    }))
}

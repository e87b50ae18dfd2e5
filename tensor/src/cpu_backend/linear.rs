//! The fused linear layer on the CPU (`x Wᵀ + bias` as one gemm): resolve dtypes, then call
//! `meshgrad_kernels::cpu::matmul`.

use meshgrad_kernels::cpu;

use super::{floats, full, pick, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Layout, Result};

type In<'a> = (&'a CpuStorage, &'a Layout);

/// `x Wᵀ (+ bias)` as one gemm: `x` is `m × k` (layout `xl`), `W` is read as the `k × n`
/// matrix `wl` (the transposed view of a `[n, k]` weight), the bias (`[n]`, contiguous) is
/// written into every output row first and the product accumulates onto it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    x: &CpuStorage,
    xl: meshgrad_kernels::ops::MatrixLayout,
    w: &CpuStorage,
    wl: meshgrad_kernels::ops::MatrixLayout,
    bias: Option<In<'_>>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<CpuStorage> {
    let dt = x.dtype();
    let bv = bias
        .map(|(s, l)| floats(s, range(l), "linear (bias)"))
        .transpose()?;
    let cl = meshgrad_kernels::ops::MatrixLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: n,
        col_stride: 1,
    };
    Ok(
        with_floats!("linear", (x, full(x)) => a, (w, full(w)) => b; {
            let mut out = crate::pool::output(m * n);
            let accumulate = match &bv {
                None => false,
                Some(f) => {
                    let bs = pick(f, a)?;
                    for row in out.chunks_exact_mut(n) {
                        row.copy_from_slice(bs);
                    }
                    true
                }
            };
            cpu::matmul::matmul(1, m, n, k, a, xl, b, wl, &mut out, cl, accumulate);
            out.into_storage(dt)
        }),
    )
}

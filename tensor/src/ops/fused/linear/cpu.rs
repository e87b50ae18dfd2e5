//! The linear layer on the CPU (`x Wᵀ + bias` as one gemm): resolve dtypes, then call
//! `meshgrad_kernels::cpu::matmul`. GELU's epilogue is not fused here
//! (see [`super::LinearGelu`]).

use meshgrad_kernels::cpu;
use meshgrad_kernels::ops::MatrixLayout;

use super::{Linear, LinearGelu};
use crate::cpu_backend::{entire, floats, pick, range, with_floats, Floats, IntoStorage};
use crate::ops::fused::CpuIn;
use crate::storage::CpuStorage;
use crate::Result;

/// See [`Linear`]: the bias (`[n]`, contiguous) is written into every output row first and the
/// product accumulates onto it.
pub(super) fn forward(a: &Linear<CpuIn<'_>>) -> Result<CpuStorage> {
    let ((x, _), (w, _), bias) = (a.x, a.w, a.bias);
    let (xl, wl, m, n, k) = (a.p.al, a.p.bl, a.p.m, a.p.n, a.p.k);
    let dt = x.dtype();
    let bv = bias
        .map(|(s, l)| floats(s, range(l), "linear (bias)"))
        .transpose()?;
    let cl = MatrixLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: n,
        col_stride: 1,
    };
    Ok(
        with_floats!("linear", (x, entire(x)) => a, (w, entire(w)) => b; {
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

/// See [`LinearGelu`]: not provided, the composition runs `linear` then `gelu`, which is what an
/// unfused model computes, so fusing changes no bit of a CPU run (and a CPU kernel would save
/// only one elementwise pass over the output).
pub(super) fn gelu(_a: &LinearGelu<CpuIn<'_>>) -> Result<Option<(CpuStorage, CpuStorage)>> {
    Ok(None)
}

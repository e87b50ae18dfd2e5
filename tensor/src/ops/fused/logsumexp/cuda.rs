//! Log-sum-exp on CUDA: the kernels `logsumexp_lastdim_<t>` and `logsumexp_strided_<t>` of
//! `kernels/cuda/logsumexp.cu`. f32, bf16 and f16 (computed in f32) and f64 (computed in f64):
//! logsumexp.cu instantiates log-sum-exp with the basic kernels' dtypes.

use super::Logsumexp;
use crate::cuda_backend::basic::basic_sfx;
use crate::cuda_backend::fused::args::{args, flat_grid, row_grid, Launch, BLOCK_1D};
use crate::cuda_backend::fused::operand::{check_len, contiguous, output};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// `logsumexp_lastdim_<t>(x, out, rows, red)` (one block per row) when `inner == 1`, else
/// `logsumexp_strided_<t>(x, out, outer, red, inner)` (one thread per output).
pub(crate) fn logsumexp_launch(
    t: &str,
    [x, out]: [u64; 2],
    outer: usize,
    red: usize,
    inner: usize,
) -> Launch {
    let (kind, grid, sizes) = if inner == 1 {
        (
            "lastdim",
            row_grid(outer),
            args![size outer, size red].to_vec(),
        )
    } else {
        let sizes = args![size outer, size red, size inner].to_vec();
        ("strided", flat_grid(outer * inner), sizes)
    };
    let mut args = args![ptr x, ptr out].to_vec();
    args.extend(sizes);
    Launch {
        file: "logsumexp.cu",
        entry: format!("logsumexp_{kind}_{t}"),
        grid,
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// See [`Logsumexp`]: the result in the input's dtype; `Ok(None)` for a dtype logsumexp.cu does
/// not instantiate.
pub(super) fn forward(a: &Logsumexp<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    let (x, outer, red, inner) = (a.x, a.outer, a.red, a.inner);
    let dt = x.0.dtype();
    let Ok(t) = basic_sfx("logsumexp", dt) else {
        return Ok(None);
    };
    check_len("logsumexp", "x", x.1, outer * red * inner)?;
    let xo = contiguous(x)?;
    let ctx = x.0.ctx();
    let out = output(ctx, dt, outer * inner)?;
    if outer * inner > 0 {
        logsumexp_launch(t, [xo.ptr(), out.device_ptr()], outer, red, inner).run(ctx, || {
            format!("logsumexp over [{outer}, {red}, {inner}] {dt:?}")
        })?;
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::assert_launch;
    use crate::cuda_backend::fused::args::Kind::*;

    #[test]
    fn launch_picks_the_lastdim_or_strided_kernel() {
        // logsumexp_lastdim_<t>(const T *x, T *out, i64 rows, i64 red)
        let l = logsumexp_launch("f32", [1, 2], 7, 9, 1);
        assert_launch(&l, "logsumexp_lastdim_f32", &[P, P, I64, I64]);
        assert_eq!(l.args[2..], args![i64 7, i64 9]);
        assert_eq!(l.grid, (7, 1, 1));
        // logsumexp_strided_<t>(const T *x, T *out, i64 outer, i64 red, i64 inner)
        let l = logsumexp_launch("bf16", [1, 2], 7, 9, 300);
        assert_launch(&l, "logsumexp_strided_bf16", &[P, P, I64, I64, I64]);
        assert_eq!(l.args[2..], args![i64 7, i64 9, i64 300]);
        assert_eq!(l.grid, (2100usize.div_ceil(256) as u32, 1, 1));
    }
}

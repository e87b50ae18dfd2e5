//! Rotary position embedding on CUDA (rotary.cu), both directions. f32, bf16 and f16 (computed
//! in f32); f64 is not provided on CUDA (`Ok(None)`: the composed fallback runs).

use super::Rotary;
use crate::cuda_backend::fused::args::{args, flat_grid, sfx, Launch, BLOCK_1D};
use crate::cuda_backend::fused::operand::{check_len, contiguous, ids_i64, output};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::Result;

/// `rotary_<t>(x, positions, out, batch, seq, heads, head_dim, theta, inverse)` over
/// `[batch, seq, heads, head_dim]`, one thread per pair.
pub(crate) fn rotary_launch(
    t: &str,
    x: u64,
    positions: u64,
    out: u64,
    [b, s, h, d]: [usize; 4],
    theta: f64,
    inverse: bool,
) -> Launch {
    Launch {
        file: "rotary.cu",
        entry: format!("rotary_{t}"),
        grid: flat_grid(b * s * h * (d / 2)),
        block: BLOCK_1D,
        shared: 0,
        args: args![ptr x, ptr positions, ptr out, size b, size s, size h, size d, f64 theta, i32 inverse as i32].to_vec(),
    }
}

/// See [`Rotary`] (integer positions are widened to i64); `Ok(None)` for f64.
pub(super) fn rotary(a: &Rotary<CudaIn<'_>>) -> Result<Option<CudaStorage>> {
    let (x, positions, dims, theta, inverse) = (a.x, a.positions, a.dims, a.theta, a.inverse);
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let op = "rotary_embedding";
    let n: usize = dims.iter().product();
    check_len(op, "x", x.1, n)?;
    check_len(op, "positions", positions.1, dims[1])?;
    if !dims[3].is_multiple_of(2) {
        return Err(crate::Error::Msg(format!(
            "{op} (CUDA): head dim {} of x {dims:?} must be even",
            dims[3]
        )));
    }
    let (xo, po) = (
        contiguous(x)?,
        ids_i64(positions, "rotary_embedding (positions)")?,
    );
    let ctx = x.0.ctx();
    let out = output(ctx, dt, n)?;
    if n > 0 {
        rotary_launch(
            t,
            xo.ptr(),
            po.ptr(),
            out.device_ptr(),
            dims,
            theta,
            inverse,
        )
        .run(ctx, || {
            format!("{op} (inverse {inverse}) of [B, T, H, D] = {dims:?} {dt:?}")
        })?;
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::args;
    use crate::cuda_backend::fused::args::assert_launch;
    use crate::cuda_backend::fused::args::Kind::*;

    #[test]
    fn rotary_launch_matches_the_kernel_signature() {
        // rotary_<t>(const T *x, const i64 *positions, T *out, i64 batch, i64 seq, i64 heads,
        //            i64 head_dim, double theta, int inverse)
        let l = rotary_launch("bf16", 1, 2, 3, [2, 8, 4, 64], 10000.0, true);
        assert_launch(&l, "rotary_bf16", &[P, P, P, I64, I64, I64, I64, F64, I32]);
        assert_eq!(
            l.args[3..],
            args![i64 2, i64 8, i64 4, i64 64, f64 10000.0, i32 1]
        );
        // One thread per pair: 2 * 8 * 4 * 32 pairs.
        assert_eq!(l.grid, ((2 * 8 * 4 * 32usize).div_ceil(256) as u32, 1, 1));
    }
}

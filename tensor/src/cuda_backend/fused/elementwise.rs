//! What the CUDA paths of the elementwise fused ops (`ops/fused/gelu/`, `ops/fused/swiglu/`,
//! `ops/fused/unary_backward/`) share: their kernels' launch ([`elementwise_launch`]: the
//! buffers, the element count, then the op's scalars) and the run around it ([`run_elementwise`]:
//! operands checked and made contiguous in the first one's dtype, outputs allocated;
//! [`run_backward`] for a backward pass).

use super::args::{flat_grid, i64_of, sfx, Arg, Launch, BLOCK_1D};
use super::operand::{as_dtype, check_len, contiguous, output};
use crate::cuda_backend::CudaStorage;
use crate::ops::fused::CudaIn;
use crate::{Error, Result};

/// A grid-stride launch of `entry` of `kernels/cuda/<file>` over `n` elements with the
/// parameters `(ptrs..., i64 n, scalars...)`.
pub(crate) fn elementwise_launch(
    file: &'static str,
    entry: String,
    ptrs: &[u64],
    n: usize,
    scalars: &[Arg],
) -> Launch {
    let mut args: Vec<Arg> = ptrs.iter().map(|&p| Arg::Ptr(p)).collect();
    args.push(i64_of(n));
    args.extend_from_slice(scalars);
    Launch {
        file,
        entry,
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// [`run_elementwise`] of an elementwise backward pass: `dx` from `x` and the output's gradient
/// `dy` (converted to `x`'s dtype where it differs).
pub(crate) fn run_backward(
    op: &'static str,
    x: CudaIn<'_>,
    dy: CudaIn<'_>,
    launch: impl FnOnce(&'static str, &[u64], usize) -> Launch,
) -> Result<Option<CudaStorage>> {
    Ok(run_elementwise(op, x, &[("dy", dy)], launch)?.map(|[dx]| dx))
}

/// Runs the elementwise fused op `op` on `x` and the operands `others` (each named for errors,
/// of `x`'s element count, converted to `x`'s dtype where it differs), writing `O` new outputs
/// of `x`'s dtype and element count: `launch(t, ptrs, n)` builds the launch from the kernel
/// suffix `t`, the pointers (`x`, the others, the outputs) and the element count. `Ok(None)`
/// where `x`'s dtype has no kernel (f64: the composed fallback runs).
pub(crate) fn run_elementwise<const O: usize>(
    op: &'static str,
    x: CudaIn<'_>,
    others: &[(&'static str, CudaIn<'_>)],
    launch: impl FnOnce(&'static str, &[u64], usize) -> Launch,
) -> Result<Option<[CudaStorage; O]>> {
    let dt = x.0.dtype();
    let Some(t) = sfx(dt) else { return Ok(None) };
    let n = x.1.shape().elem_count();
    let mut ins = vec![contiguous(x)?];
    for &(name, o) in others {
        check_len(op, name, o.1, n)?;
        ins.push(as_dtype(o, dt)?);
    }
    let ctx = x.0.ctx();
    let outs = (0..O)
        .map(|_| output(ctx, dt, n))
        .collect::<Result<Vec<_>>>()?;
    if n > 0 {
        let ptrs: Vec<u64> = ins
            .iter()
            .map(|o| o.ptr())
            .chain(outs.iter().map(CudaStorage::device_ptr))
            .collect();
        launch(t, &ptrs, n).run(ctx, || format!("{op} of {} {dt:?}", x.1.shape()))?;
    }
    let outs: [CudaStorage; O] = outs
        .try_into()
        .map_err(|_| Error::msg(format!("{op}: not {O} outputs")))?;
    Ok(Some(outs))
}

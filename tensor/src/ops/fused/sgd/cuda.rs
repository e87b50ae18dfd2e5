//! SGD with momentum on CUDA, in place: the kernel `sgd_grad_<g>` of
//! `kernels/cuda/sgd.cu`. Provided as AdamW's (`adamw/cuda.rs`): f32 parameter and
//! momentum buffer with contiguous views, gradient f32 / bf16 / f16; `Ok(None)` otherwise.

use super::Sgd;
use crate::cuda_backend::fused::args::sfx;
use crate::cuda_backend::fused::args::{flat_grid, i64_of, Arg, Launch, BLOCK_1D};
use crate::cuda_backend::fused::operand::{check_len, contiguous, f32_start};
use crate::ops::fused::{CudaIn, CudaMut};
use crate::Result;

/// `sgd_grad_<g>(param, grad, buf, param_bf16, n, lr, momentum, weight_decay, first_step)`;
/// `[param, grad, buf]`, `param_bf16` null; the hyper-parameters rounded to f32 as `sgd_step`
/// does.
pub(crate) fn sgd_launch(
    g: &str,
    p: [u64; 3],
    n: usize,
    [lr, momentum, weight_decay]: [f64; 3],
    first_step: bool,
) -> Launch {
    let mut args: Vec<Arg> = p.iter().map(|&x| Arg::Ptr(x)).collect();
    args.extend([
        Arg::Ptr(0),
        i64_of(n),
        Arg::F32(lr as f32),
        Arg::F32(momentum as f32),
        Arg::F32(weight_decay as f32),
        Arg::I32(first_step as i32),
    ]);
    Launch {
        file: "sgd.cu",
        entry: format!("sgd_grad_{g}"),
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// See [`Sgd`]: f32 parameter and momentum buffer with contiguous views, gradient f32 / bf16 /
/// f16; `Ok(None)` otherwise.
pub(super) fn step(a: &mut Sgd<CudaIn<'_>, CudaMut<'_>>) -> Result<Option<()>> {
    let &mut Sgd {
        grad,
        ref mut param,
        ref mut buf,
        lr,
        momentum,
        weight_decay,
        first_step,
    } = a;
    let (Some(ps), Some(bs), Some(g)) = (
        f32_start(param.0, param.1),
        f32_start(buf.0, buf.1),
        sfx(grad.0.dtype()),
    ) else {
        return Ok(None);
    };
    let op = "sgd_step";
    let n = param.1.shape().elem_count();
    check_len(op, "grad", grad.1, n)?;
    check_len(op, "buf", buf.1, n)?;
    let go = contiguous(grad)?;
    let p = [param.0.ptr_at(ps), go.ptr(), buf.0.ptr_at(bs)];
    if n > 0 {
        let ctx = param.0.ctx();
        sgd_launch(g, p, n, [lr, momentum, weight_decay], first_step).run(ctx, || {
            format!(
                "{op} of {n} f32 parameters, {:?} gradient (lr {lr}, momentum {momentum}, \
                 weight decay {weight_decay}, first step {first_step})",
                grad.0.dtype()
            )
        })?;
    }
    Ok(Some(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::args;
    use crate::cuda_backend::fused::args::assert_launch;
    use crate::cuda_backend::fused::args::Kind::*;

    #[test]
    fn sgd_launch_matches_the_kernel_signature() {
        // sgd_grad_<g>(float *param, const G *grad, float *buf, __nv_bfloat16 *param_bf16,
        //     i64 n, float lr, float momentum, float weight_decay, int first_step)
        let l = sgd_launch("f32", [1, 2, 3], 10, [0.1, 0.9, 0.01], true);
        assert_launch(&l, "sgd_grad_f32", &[P, P, P, P, I64, F32, F32, F32, I32]);
        assert_eq!(
            l.args,
            args![ptr 1, ptr 2, ptr 3, ptr 0, i64 10, f32 0.1, f32 0.9, f32 0.01, i32 1]
        );
    }
}

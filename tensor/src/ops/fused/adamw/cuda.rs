//! AdamW on CUDA, in place: the kernel `adamw_grad_<g>` of `kernels/cuda/adamw.cu`.
//!
//! The kernel keeps the parameter and the moments in f32 and reads the gradient as f32, bf16 or
//! f16. Provided: parameter and moments f32 with contiguous views, gradient of a kernel dtype
//! (a non-contiguous gradient is copied). `Ok(None)` otherwise (f64 or half parameters or
//! moments, strided views). The CPU requires every operand in the parameter's dtype; a half
//! gradient with an f32 parameter is accepted here (widened exactly). The bf16 shadow copy of
//! the kernel (`param_bf16`) is not used (null).

use meshgrad_kernels::ops::AdamWStep;

use super::AdamW;
use crate::cuda_backend::fused::args::{flat_grid, i64_of, sfx, Arg, Launch, BLOCK_1D};
use crate::cuda_backend::fused::operand::{check_len, contiguous, f32_start};
use crate::ops::fused::{CudaIn, CudaMut};
use crate::{Error, Result};

/// The f32 constants of one AdamW step, rounded from f64 as `adamw_step` on the CPU does, in the
/// kernel's order: decay, b1, b2, 1 - b1, 1 - b2, step_size, bc2_sqrt, eps; and apply_decay.
pub(crate) fn adamw_constants(hp: &AdamWStep) -> ([f32; 8], bool) {
    let t = hp.step.min(i32::MAX as u64) as i32;
    let bc1 = 1.0 - hp.beta1.powi(t);
    let bc2 = 1.0 - hp.beta2.powi(t);
    (
        [
            (1.0 - hp.lr * hp.weight_decay) as f32,
            hp.beta1 as f32,
            hp.beta2 as f32,
            (1.0 - hp.beta1) as f32,
            (1.0 - hp.beta2) as f32,
            (hp.lr / bc1) as f32,
            bc2.sqrt() as f32,
            hp.eps as f32,
        ],
        hp.weight_decay != 0.0,
    )
}

/// `adamw_grad_<g>(param, grad, m, v, param_bf16, n, decay, b1, b2, one_minus_b1,
/// one_minus_b2, step_size, bc2_sqrt, eps, apply_decay)` with `g` the gradient's dtype suffix;
/// `[param, grad, m, v]`, `param_bf16` null.
pub(crate) fn adamw_launch(g: &str, p: [u64; 4], n: usize, hp: &AdamWStep) -> Launch {
    let (c, apply_decay) = adamw_constants(hp);
    let mut args: Vec<Arg> = p.iter().map(|&x| Arg::Ptr(x)).collect();
    args.push(Arg::Ptr(0));
    args.push(i64_of(n));
    args.extend(c.iter().map(|&x| Arg::F32(x)));
    args.push(Arg::I32(apply_decay as i32));
    Launch {
        file: "adamw.cu",
        entry: format!("adamw_grad_{g}"),
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// See [`AdamW`]: f32 parameter and moments with contiguous views, gradient f32 / bf16 / f16;
/// `Ok(None)` otherwise.
pub(super) fn step(a: &mut AdamW<CudaIn<'_>, CudaMut<'_>>) -> Result<Option<()>> {
    let AdamW {
        grad,
        param,
        m,
        v,
        hp,
    } = a;
    let (Some(ps), Some(ms), Some(vs), Some(g)) = (
        f32_start(param.0, param.1),
        f32_start(m.0, m.1),
        f32_start(v.0, v.1),
        sfx(grad.0.dtype()),
    ) else {
        return Ok(None);
    };
    let op = "adamw_step";
    let n = param.1.shape().elem_count();
    check_len(op, "grad", grad.1, n)?;
    check_len(op, "m", m.1, n)?;
    check_len(op, "v", v.1, n)?;
    if hp.step == 0 {
        return Err(Error::Msg(format!("{op}: step counts from 1, got 0")));
    }
    let go = contiguous(*grad)?;
    let p = [param.0.ptr_at(ps), go.ptr(), m.0.ptr_at(ms), v.0.ptr_at(vs)];
    if n > 0 {
        let ctx = param.0.ctx();
        adamw_launch(g, p, n, hp).run(ctx, || {
            format!(
                "{op} of {n} f32 parameters, {:?} gradient, {hp:?}",
                grad.0.dtype()
            )
        })?;
    }
    Ok(Some(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_backend::fused::args::assert_launch;
    use crate::cuda_backend::fused::args::Kind::*;

    fn hp() -> AdamWStep {
        AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 3,
        }
    }

    #[test]
    fn adamw_launch_matches_the_kernel_signature() {
        // adamw_grad_<g>(float *param, const G *grad, float *m, float *v,
        //     __nv_bfloat16 *param_bf16, i64 n, float decay, float b1, float b2,
        //     float one_minus_b1, float one_minus_b2, float step_size, float bc2_sqrt,
        //     float eps, int apply_decay)
        let l = adamw_launch("bf16", [1, 2, 3, 4], 1000, &hp());
        assert_launch(
            &l,
            "adamw_grad_bf16",
            &[
                P, P, P, P, P, I64, F32, F32, F32, F32, F32, F32, F32, F32, I32,
            ],
        );
        assert_eq!(l.args[4], Arg::Ptr(0));
        assert_eq!(l.args[5], Arg::I64(1000));
        assert_eq!(l.args[14], Arg::I32(1));
    }

    #[test]
    fn adamw_constants_round_as_the_cpu() {
        let h = hp();
        let (c, decay) = adamw_constants(&h);
        assert!(decay);
        assert_eq!(c[0], (1.0f64 - 1e-4) as f32);
        assert_eq!(c[1], 0.9f32);
        assert_eq!(c[3], (1.0f64 - 0.9) as f32);
        assert_eq!(c[5], (1e-3 / (1.0 - 0.9f64.powi(3))) as f32);
        assert_eq!(c[6], (1.0 - 0.999f64.powi(3)).sqrt() as f32);
        assert_eq!(c[7], 1e-8f32);
        let (_, decay) = adamw_constants(&AdamWStep {
            weight_decay: 0.0,
            ..h
        });
        assert!(!decay);
    }
}

//! AdamW and SGD (momentum) steps in place (optimizer.cu).
//!
//! The kernels keep the parameter and the optimizer state in f32 and read the gradient as f32,
//! bf16 or f16. Provided: parameter and state f32 with contiguous views, gradient of a kernel
//! dtype (a non-contiguous gradient is copied). `Ok(None)` otherwise (f64 or half parameters or
//! state, strided parameter or state views). The CPU requires every operand in the parameter's
//! dtype; a half gradient with an f32 parameter is accepted here (widened exactly). The bf16
//! shadow copy of the kernels (`param_bf16`) is not used (null).

use meshgrad_kernels::ops::AdamWStep;

use super::args::{flat_grid, i64_of, sfx, Arg, Launch, BLOCK_1D};
use super::operand::{check_len, contiguous};
use crate::backend::api::{Fused, In};
use crate::cuda_backend::CudaStorage;
use crate::{DType, Error, Layout};

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
        file: "optimizer.cu",
        entry: format!("adamw_grad_{g}"),
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

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
        file: "optimizer.cu",
        entry: format!("sgd_grad_{g}"),
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

/// The first element of an f32 buffer's contiguous view (`None`: not what the kernels take).
fn f32_start(s: &CudaStorage, l: &Layout) -> Option<usize> {
    (s.dtype() == DType::F32)
        .then(|| l.contiguous_range())
        .flatten()
        .map(|r| r.start)
}

/// See `BackendStorage::adamw`: f32 parameter and state with contiguous views, gradient f32 /
/// bf16 / f16; `Ok(None)` otherwise.
#[allow(clippy::too_many_arguments)]
pub(in crate::cuda_backend) fn adamw(
    param: &mut CudaStorage,
    pl: &Layout,
    grad: In<'_, CudaStorage>,
    m: &mut CudaStorage,
    ml: &Layout,
    v: &mut CudaStorage,
    vl: &Layout,
    hp: &AdamWStep,
) -> Fused<()> {
    let (Some(ps), Some(ms), Some(vs), Some(g)) = (
        f32_start(param, pl),
        f32_start(m, ml),
        f32_start(v, vl),
        sfx(grad.0.dtype()),
    ) else {
        return Ok(None);
    };
    let op = "adamw_step";
    let n = pl.shape().elem_count();
    check_len(op, "grad", grad.1, n)?;
    check_len(op, "m", ml, n)?;
    check_len(op, "v", vl, n)?;
    if hp.step == 0 {
        return Err(Error::Msg(format!("{op}: step counts from 1, got 0")));
    }
    let go = contiguous(grad)?;
    let p = [param.ptr_at(ps), go.ptr(), m.ptr_at(ms), v.ptr_at(vs)];
    if n > 0 {
        let ctx = param.ctx();
        adamw_launch(g, p, n, hp).run(ctx, || {
            format!(
                "{op} of {n} f32 parameters, {:?} gradient, {hp:?}",
                grad.0.dtype()
            )
        })?;
    }
    Ok(Some(()))
}

/// See `BackendStorage::sgd`: f32 parameter and momentum buffer with contiguous views, gradient
/// f32 / bf16 / f16; `Ok(None)` otherwise.
#[allow(clippy::too_many_arguments)]
pub(in crate::cuda_backend) fn sgd(
    param: &mut CudaStorage,
    pl: &Layout,
    grad: In<'_, CudaStorage>,
    buf: &mut CudaStorage,
    bl: &Layout,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    first_step: bool,
) -> Fused<()> {
    let (Some(ps), Some(bs), Some(g)) = (
        f32_start(param, pl),
        f32_start(buf, bl),
        sfx(grad.0.dtype()),
    ) else {
        return Ok(None);
    };
    let op = "sgd_step";
    let n = pl.shape().elem_count();
    check_len(op, "grad", grad.1, n)?;
    check_len(op, "buf", bl, n)?;
    let go = contiguous(grad)?;
    let p = [param.ptr_at(ps), go.ptr(), buf.ptr_at(bs)];
    if n > 0 {
        let ctx = param.ctx();
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
    use super::super::args::assert_known;
    use super::super::args::Kind::*;
    use super::*;

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
        assert_eq!(l.entry, "adamw_grad_bf16");
        assert_eq!(
            l.kinds(),
            vec![P, P, P, P, P, I64, F32, F32, F32, F32, F32, F32, F32, F32, I32]
        );
        assert_eq!(l.args[4], Arg::Ptr(0));
        assert_eq!(l.args[5], Arg::I64(1000));
        assert_eq!(l.args[14], Arg::I32(1));
        assert_known(&l);
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

    #[test]
    fn sgd_launch_matches_the_kernel_signature() {
        // sgd_grad_<g>(float *param, const G *grad, float *buf, __nv_bfloat16 *param_bf16,
        //     i64 n, float lr, float momentum, float weight_decay, int first_step)
        let l = sgd_launch("f32", [1, 2, 3], 10, [0.1, 0.9, 0.01], true);
        assert_eq!(l.entry, "sgd_grad_f32");
        assert_eq!(l.kinds(), vec![P, P, P, P, I64, F32, F32, F32, I32]);
        assert_eq!(
            l.args,
            vec![
                Arg::Ptr(1),
                Arg::Ptr(2),
                Arg::Ptr(3),
                Arg::Ptr(0),
                Arg::I64(10),
                Arg::F32(0.1),
                Arg::F32(0.9),
                Arg::F32(0.01),
                Arg::I32(1)
            ]
        );
        assert_known(&l);
    }
}

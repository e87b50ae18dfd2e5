//! SGD with momentum on the CPU, in place: resolve dtypes, then call
//! `meshgrad_kernels::cpu::sgd::sgd_step`.

use meshgrad_kernels::cpu;

use super::Sgd;
use crate::cpu_backend::in_place::{float_mut, same, same_mut};
use crate::cpu_backend::range;
use crate::ops::fused::{CpuIn, CpuMut};
use crate::Result;

/// See [`Sgd`]: `param`, `buf` and `grad` all of the parameter's dtype (f32 or f64).
pub(super) fn step(a: &mut Sgd<CpuIn<'_>, CpuMut<'_>>) -> Result<()> {
    const OP: &str = "sgd_step";
    let Sgd {
        grad,
        param,
        buf,
        lr,
        momentum,
        weight_decay,
        first_step,
    } = a;
    float_mut!(OP, &mut *param.0, range(param.1), |p| {
        let g = same(grad.0, grad.1, OP)?;
        let b = same_mut(buf.0, buf.1, OP)?;
        cpu::sgd::sgd_step(*lr, *momentum, *weight_decay, *first_step, p, g, b);
    });
    Ok(())
}

//! AdamW on the CPU, in place: resolve dtypes, then call `meshgrad_kernels::cpu::adamw`.

use meshgrad_kernels::cpu;

use super::AdamW;
use crate::cpu_backend::in_place::{float_mut, same, same_mut};
use crate::cpu_backend::range;
use crate::ops::fused::{CpuIn, CpuMut};
use crate::Result;

/// See [`AdamW`]: `param`, `m`, `v` and `grad` all of the parameter's dtype (f32 or f64).
pub(super) fn step(a: &mut AdamW<CpuIn<'_>, CpuMut<'_>>) -> Result<()> {
    const OP: &str = "adamw_step";
    let AdamW {
        grad,
        param,
        m,
        v,
        hp,
    } = a;
    float_mut!(OP, &mut *param.0, range(param.1), |p| {
        let g = same(grad.0, grad.1, OP)?;
        let mm = same_mut(m.0, m.1, OP)?;
        let vv = same_mut(v.0, v.1, OP)?;
        cpu::adamw::adamw_step(hp, p, g, mm, vv);
    });
    Ok(())
}

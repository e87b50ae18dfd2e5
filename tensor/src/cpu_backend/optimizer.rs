//! The optimizer steps on the CPU (AdamW, SGD with momentum), in place: resolve dtypes, then
//! call `meshgrad_kernels::cpu::adamw`.

use meshgrad_kernels::cpu;

use super::range;
use crate::storage::CpuStorage;
use crate::{Error, Layout, Result};

type In<'a> = (&'a CpuStorage, &'a Layout);

/// Runs `f` on mutable and shared f32/f64 slices of matching type; half types are refused.
macro_rules! float_mut {
    ($op:expr, $s:expr, $r:expr, |$x:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(v) => {
                let $x = &mut v[$r];
                $body
            }
            CpuStorage::F64(v) => {
                let $x = &mut v[$r];
                $body
            }
            other => {
                return Err(Error::UnsupportedDType {
                    op: $op,
                    dtype: other.dtype(),
                })
            }
        }
    };
}

fn same<'a, T: 'static>(s: &'a CpuStorage, l: &Layout, op: &'static str) -> Result<&'a [T]> {
    let r = range(l);
    let any: &dyn std::any::Any = match s {
        CpuStorage::F32(v) => v,
        CpuStorage::F64(v) => v,
        other => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: other.dtype(),
            })
        }
    };
    any.downcast_ref::<Vec<T>>().map(|v| &v[r]).ok_or_else(|| {
        Error::msg(format!(
            "{op}: operands must all have the parameter's dtype"
        ))
    })
}

fn same_mut<'a, T: 'static>(
    s: &'a mut CpuStorage,
    l: &Layout,
    op: &'static str,
) -> Result<&'a mut [T]> {
    let r = range(l);
    let dt = s.dtype();
    let any: &mut dyn std::any::Any = match s {
        CpuStorage::F32(v) => v,
        CpuStorage::F64(v) => v,
        _ => return Err(Error::UnsupportedDType { op, dtype: dt }),
    };
    any.downcast_mut::<Vec<T>>()
        .map(|v| &mut v[r])
        .ok_or_else(|| {
            Error::msg(format!(
                "{op}: operands must all have the parameter's dtype"
            ))
        })
}

/// One AdamW step in place on `param`, `m`, `v` (all of the parameter's dtype, contiguous).
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    param: &mut CpuStorage,
    pl: &Layout,
    grad: In<'_>,
    m: &mut CpuStorage,
    ml: &Layout,
    v: &mut CpuStorage,
    vl: &Layout,
    hp: &meshgrad_kernels::ops::AdamWStep,
) -> Result<()> {
    const OP: &str = "adamw_step";
    float_mut!(OP, param, range(pl), |p| {
        let g = same(grad.0, grad.1, OP)?;
        let mm = same_mut(m, ml, OP)?;
        let vv = same_mut(v, vl, OP)?;
        cpu::adamw::adamw_step(hp, p, g, mm, vv);
    });
    Ok(())
}

/// One SGD-with-momentum step in place on `param` and `buf`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd(
    param: &mut CpuStorage,
    pl: &Layout,
    grad: In<'_>,
    buf: &mut CpuStorage,
    bl: &Layout,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    first_step: bool,
) -> Result<()> {
    const OP: &str = "sgd_step";
    float_mut!(OP, param, range(pl), |p| {
        let g = same(grad.0, grad.1, OP)?;
        let b = same_mut(buf, bl, OP)?;
        cpu::adamw::sgd_step(lr, momentum, weight_decay, first_step, p, g, b);
    });
    Ok(())
}

//! Operands of the in-place fused ops on the CPU (the optimizer steps `ops/fused/adamw` and
//! `ops/fused/sgd`): the parameter's f32 or f64 slice, and the other operands as slices of the
//! same type.

use super::range;
use crate::storage::CpuStorage;
use crate::{Error, Layout, Result};

/// Runs `f` on mutable and shared f32/f64 slices of matching type; half types are refused.
macro_rules! float_mut {
    ($op:expr, $s:expr, $r:expr, |$x:ident| $body:expr) => {
        match $s {
            $crate::storage::CpuStorage::F32(v) => {
                let $x = &mut v[$r];
                $body
            }
            $crate::storage::CpuStorage::F64(v) => {
                let $x = &mut v[$r];
                $body
            }
            other => {
                return Err($crate::Error::UnsupportedDType {
                    op: $op,
                    dtype: other.dtype(),
                })
            }
        }
    };
}

pub(crate) fn same<'a, T: 'static>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &'static str,
) -> Result<&'a [T]> {
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

pub(crate) fn same_mut<'a, T: 'static>(
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
pub(crate) use float_mut;

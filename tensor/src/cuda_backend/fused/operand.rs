//! Operands as the kernels take them: contiguous and of the kernel's dtype. A view that already
//! is is used in place (at its first element); otherwise a contiguous or converted copy is made
//! for the launch (kept alive until the op returns; its block goes back to the cache in stream
//! order, after the kernels that read it).

use super::super::{basic, CudaStorage, DeviceContext};
use crate::backend::api::In;
use crate::{DType, Error, Layout, Result};
use meshgrad_kernels::ops::CmpOp;

/// An operand ready for a kernel.
pub(crate) enum Operand<'a> {
    /// The caller's buffer, whose view starts at element `.1`.
    View(&'a CudaStorage, usize),
    /// A copy made for this launch.
    Copy(CudaStorage),
}

impl Operand<'_> {
    /// The device address of the operand's first element.
    pub fn ptr(&self) -> u64 {
        match self {
            Operand::View(s, start) => s.ptr_at(*start),
            Operand::Copy(s) => s.device_ptr(),
        }
    }
}

/// The address of an optional operand (0, the kernels' `nullptr`, when absent).
pub(crate) fn ptr_or_null(o: &Option<Operand<'_>>) -> u64 {
    o.as_ref().map_or(0, Operand::ptr)
}

/// `x` as a contiguous operand: in place when its view is contiguous, else a contiguous copy.
pub(crate) fn contiguous(x: In<'_, CudaStorage>) -> Result<Operand<'_>> {
    match x.1.contiguous_range() {
        Some(r) => Ok(Operand::View(x.0, r.start)),
        None => Ok(Operand::Copy(basic::copy_contiguous(x.0, x.1)?)),
    }
}

/// `x` as a contiguous operand of `dtype`: in place when it already is, else a converted
/// contiguous copy.
pub(crate) fn as_dtype(x: In<'_, CudaStorage>, dtype: DType) -> Result<Operand<'_>> {
    if x.0.dtype() == dtype {
        contiguous(x)
    } else {
        Ok(Operand::Copy(basic::cast(x.0, x.1, dtype)?))
    }
}

/// Integer ids (targets, positions) as a contiguous i64 operand; a float dtype is refused.
///
/// i64 ids are used in place; u8 / u32 ids are widened on the device (`cast_<t>_to_i64`, exact).
pub(crate) fn ids_i64<'a>(x: In<'a, CudaStorage>, op: &'static str) -> Result<Operand<'a>> {
    match x.0.dtype() {
        DType::I64 => contiguous(x),
        DType::U32 | DType::U8 => Ok(Operand::Copy(basic::cast(x.0, x.1, DType::I64)?)),
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// An integer mask (nonzero = keep) as a contiguous u8 operand of 0/1 bytes.
///
/// u8 masks are used in place. u32 / i64 masks are turned into 0/1 bytes on the device: cast to
/// f32 (every nonzero integer stays nonzero) and compared with 0 (the comparison kernels take
/// floats; a direct cast to u8 would saturate negative values to 0).
pub(crate) fn mask_u8<'a>(x: In<'a, CudaStorage>, op: &'static str) -> Result<Operand<'a>> {
    match x.0.dtype() {
        DType::U8 => contiguous(x),
        DType::U32 | DType::I64 => {
            let n = x.1.shape().elem_count();
            let wide = basic::cast(x.0, x.1, DType::F32)?;
            let zero = basic::zeros(x.0.device(), DType::F32, 1)?;
            let wl = Layout::contiguous(n);
            let zl = Layout::contiguous(1).broadcast_as(wl.shape())?;
            Ok(Operand::Copy(basic::compare(
                CmpOp::Ne,
                (&wide, &wl),
                (&zero, &zl),
            )?))
        }
        dtype => Err(Error::UnsupportedDType { op, dtype }),
    }
}

/// Checks that the view `l` of operand `name` has `n` elements (a wrong size would make a
/// kernel read or write out of bounds).
pub(crate) fn check_len(op: &str, name: &str, l: &Layout, n: usize) -> Result<()> {
    let have = l.shape().elem_count();
    if have == n {
        Ok(())
    } else {
        Err(Error::Msg(format!(
            "{op} (CUDA): operand {name} has {have} elements (shape {}), the kernel needs {n}",
            l.shape()
        )))
    }
}

/// A new (uninitialised) output of `len` elements of `dtype` on `ctx`'s device.
pub(crate) fn output(
    ctx: &std::sync::Arc<DeviceContext>,
    dtype: DType,
    len: usize,
) -> Result<CudaStorage> {
    CudaStorage::uninit(ctx, dtype, len)
}

/// The first element of an f32 buffer's contiguous view (`None`: not what the in-place kernels
/// of the optimizer steps take).
pub(crate) fn f32_start(s: &CudaStorage, l: &Layout) -> Option<usize> {
    (s.dtype() == DType::F32)
        .then(|| l.contiguous_range())
        .flatten()
        .map(|r| r.start)
}

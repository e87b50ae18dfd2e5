//! Elementwise ops: unary maps, broadcasting binary ops and comparisons, `where`, and the
//! in-place contiguous accumulation.

use meshgrad_kernels::ops::{BinaryOp, CmpOp, UnaryOp};

use super::strided::{as_word_pairs, strided_args, View};
use super::{args, basic_sfx, contiguous, contiguous_ptr, download, from_host, mover, Mover};
use crate::backend::api::{BackendStorage, In};
use crate::cuda_backend::CudaStorage;
use crate::storage::CpuStorage;
use crate::{DType, Error, Layout, Result};

/// See `BackendStorage::unary`: `unary_<t>` over a contiguous copy of the view (f32, bf16,
/// f16).
pub(crate) fn unary((s, l): In<'_, CudaStorage>, op: UnaryOp) -> Result<CudaStorage> {
    let sfx = basic_sfx("unary", s.dtype())?;
    let n = l.shape().elem_count();
    let out = CudaStorage::uninit(s.ctx(), s.dtype(), n)?;
    if n > 0 {
        let (x, _keep) = contiguous((s, l))?;
        args::unary(sfx, x, out.device_ptr(), n, op).run(s.ctx())?;
    }
    Ok(out)
}

/// The common dtype of two operands of `op`, or [`Error::DTypeMismatch`].
fn same_dtype(op: &'static str, a: &CudaStorage, b: &CudaStorage) -> Result<DType> {
    a.dtype().matching(op, b.dtype())
}

/// See `BackendStorage::binary`: `binary_contig_<t>` when both views are contiguous (same shape
/// by then), else `binary_<t>` over the broadcast layouts (f32, bf16, f16).
pub(crate) fn binary(
    op: BinaryOp,
    (a, al): In<'_, CudaStorage>,
    (b, bl): In<'_, CudaStorage>,
) -> Result<CudaStorage> {
    let sfx = basic_sfx("binary", same_dtype("binary", a, b)?)?;
    let n = al.shape().elem_count();
    let out = CudaStorage::uninit(a.ctx(), a.dtype(), n)?;
    if n == 0 {
        return Ok(out);
    }
    let launch = match (contiguous_ptr(a, al), contiguous_ptr(b, bl)) {
        (Some(x), Some(y)) => args::binary_contig(sfx, op, x, y, out.device_ptr(), n),
        _ => {
            let sa = strided_args("binary", al.dims(), &[View::of(al), View::of(bl)])?;
            args::binary(
                sfx,
                op,
                sa,
                a.device_ptr(),
                b.device_ptr(),
                out.device_ptr(),
            )
        }
    };
    launch.run(a.ctx())?;
    Ok(out)
}

/// See `BackendStorage::compare`: `compare_<t>` over the broadcast layouts, u8 out (f32, bf16,
/// f16).
pub(crate) fn compare(
    op: CmpOp,
    (a, al): In<'_, CudaStorage>,
    (b, bl): In<'_, CudaStorage>,
) -> Result<CudaStorage> {
    let sfx = basic_sfx("compare", same_dtype("compare", a, b)?)?;
    let n = al.shape().elem_count();
    let out = CudaStorage::uninit(a.ctx(), DType::U8, n)?;
    if n > 0 {
        let sa = strided_args("compare", al.dims(), &[View::of(al), View::of(bl)])?;
        args::compare(
            sfx,
            op,
            sa,
            a.device_ptr(),
            b.device_ptr(),
            out.device_ptr(),
        )
        .run(a.ctx())?;
    }
    Ok(out)
}

/// See `BackendStorage::where_cond`: `where_<t>` over the broadcast layouts for every dtype of
/// 2, 4 or 8 bytes (it copies elements without converting them; 8-byte ones as word pairs);
/// u8 values go through the host.
pub(crate) fn where_cond(
    (c, cl): In<'_, CudaStorage>,
    (t, tl): In<'_, CudaStorage>,
    (f, fl): In<'_, CudaStorage>,
) -> Result<CudaStorage> {
    if c.dtype() != DType::U8 {
        return Err(Error::UnsupportedDType {
            op: "where_cond (condition)",
            dtype: c.dtype(),
        });
    }
    let dtype = same_dtype("where_cond", t, f)?;
    let n = cl.shape().elem_count();
    let out = CudaStorage::uninit(c.ctx(), dtype, n)?;
    if n == 0 {
        return Ok(out);
    }
    match mover(dtype) {
        Mover::Kernel { sfx, words } => {
            let (dims, views) = (
                cl.dims().to_vec(),
                vec![View::of(cl), View::of(tl), View::of(fl)],
            );
            let (dims, views) = if words == 2 {
                as_word_pairs(&dims, &views, &[0, 1, 1])
            } else {
                (dims, views)
            };
            let sa = strided_args("where_cond", &dims, &views)?;
            let ptrs = (c.device_ptr(), t.device_ptr(), f.device_ptr());
            args::where_cond(sfx, sa, ptrs.0, ptrs.1, ptrs.2, out.device_ptr()).run(c.ctx())?;
            Ok(out)
        }
        Mover::Host => {
            let (hc, ht, hf) = (download(c)?, download(t)?, download(f)?);
            let r = <CpuStorage as BackendStorage>::where_cond((&hc, cl), (&ht, tl), (&hf, fl))?;
            from_host(c.device(), r)
        }
    }
}

/// See `BackendStorage::add_assign_contiguous`: `binary_contig_<t>` adding `src` into `dst` in
/// place for contiguous f32, bf16, f16 and f64 operands of one element count (the values of
/// `binary(Add)`); `Ok(false)` otherwise.
pub(crate) fn add_assign_contiguous(
    dst: &mut CudaStorage,
    dl: &Layout,
    (src, sl): In<'_, CudaStorage>,
) -> Result<bool> {
    let n = dl.shape().elem_count();
    let (Ok(sfx), Some(d), Some(s)) = (
        basic_sfx("add_assign", dst.dtype()),
        contiguous_ptr(dst, dl),
        contiguous_ptr(src, sl),
    ) else {
        return Ok(false);
    };
    if src.dtype() != dst.dtype() || sl.shape().elem_count() != n {
        return Ok(false);
    }
    if n > 0 {
        args::binary_contig(sfx, BinaryOp::Add, d, s, d, n).run(dst.ctx())?;
    }
    Ok(true)
}

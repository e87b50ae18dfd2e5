//! Casts and copies: contiguous copies of views, writes into views, dtype conversions.

use cudarc::driver::{result, sys};

use super::strided::{as_word_pairs, by_decreasing_stride, pitch_plan, strided_args, View};
use super::{args, contiguous, contiguous_ptr, download, download_view, mover, upload_to, Mover};
use crate::backend::api::In;
use crate::cuda_backend::{CudaStorage, DeviceContext};
use crate::{DType, Error, Layout, Result};

/// More 2-D copies than this for one write into a strided view go through the host instead.
const MAX_PITCHED_COPIES: usize = 4096;

/// See `BackendStorage::copy_contiguous`.
pub(crate) fn copy_contiguous(s: &CudaStorage, l: &Layout) -> Result<CudaStorage> {
    let out = CudaStorage::uninit(s.ctx(), s.dtype(), l.shape().elem_count())?;
    write_contiguous(s, l, out.device_ptr())?;
    Ok(out)
}

/// Writes the elements of the view `l` of `s`, in row-major order, to the contiguous device
/// range at `dst` (room for them, same dtype, not overlapping the view): one device-to-device
/// copy when the view is contiguous, else `copy_strided_<t>` (8-byte elements as word pairs),
/// else (u8) through the host.
fn write_contiguous(s: &CudaStorage, l: &Layout, dst: u64) -> Result<()> {
    let ctx = s.ctx();
    let n = l.shape().elem_count();
    if n == 0 {
        return Ok(());
    }
    if let Some(src) = contiguous_ptr(s, l) {
        return memcpy_dtod(ctx, dst, src, n * s.dtype().size_in_bytes());
    }
    match mover(s.dtype()) {
        Mover::Kernel { sfx, words } => {
            let (dims, views) = (l.dims().to_vec(), vec![View::of(l)]);
            let (dims, views) = if words == 2 {
                as_word_pairs(&dims, &views, &[1])
            } else {
                (dims, views)
            };
            let sa = strided_args("contiguous", &dims, &views)?;
            args::copy_strided(sfx, sa, s.device_ptr(), dst).run(ctx)
        }
        Mover::Host => {
            let host = crate::cpu_backend::copy_contiguous(&download(s)?, l)?;
            upload_to(ctx, dst, host.as_bytes())
        }
    }
}

/// A device-to-device copy of `bytes` bytes on the compute stream.
fn memcpy_dtod(ctx: &DeviceContext, dst: u64, src: u64, bytes: usize) -> Result<()> {
    ctx.bind()?;
    // SAFETY: the callers hand two device ranges of `bytes` bytes on this context that do not
    // overlap; ordered on the compute stream.
    unsafe { result::memcpy_dtod_async(dst, src, bytes, ctx.stream.cu_stream()) }
        .map_err(|e| ctx.err("copying on the device", e))
}

/// See `BackendStorage::copy_into`. The destination view's dims are first ordered by
/// decreasing stride (the source's with them), which makes a transposed contiguous block
/// contiguous. A contiguous destination is then written directly (see [`write_contiguous`]);
/// any other (a slice such as `cat` writes) receives a contiguous copy of the source through
/// pitched 2-D copies (one per index of the dims beyond the two innermost, at most
/// [`MAX_PITCHED_COPIES`], else through the host).
pub(crate) fn copy_into(
    dst: &mut CudaStorage,
    dl: &Layout,
    (src, sl): In<'_, CudaStorage>,
) -> Result<()> {
    dst.dtype().matching("copy_into", src.dtype())?;
    if dl.dims() != sl.dims() {
        return Err(Error::shape_mismatch("copy_into", dl.shape(), sl.shape()));
    }
    if dl.shape().elem_count() == 0 {
        return Ok(());
    }
    let perm = by_decreasing_stride(dl);
    let (dl, sl) = (dl.permute(&perm)?, sl.permute(&perm)?);
    if dl.is_contiguous() {
        return write_contiguous(src, &sl, dst.ptr_at(dl.offset()));
    }
    let plan = pitch_plan(dl.dims(), dl.strides());
    if plan.copies() > MAX_PITCHED_COPIES {
        let mut host = download(dst)?;
        let (s, l) = download_view((src, &sl))?;
        crate::cpu_backend::copy_into(&mut host, &dl, (&s, &l))?;
        return upload_to(dst.ctx(), dst.device_ptr(), host.as_bytes());
    }
    let (src_ptr, _keep) = contiguous((src, &sl))?;
    let ctx = dst.ctx();
    let es = dst.dtype().size_in_bytes();
    ctx.bind()?;
    for k in 0..plan.copies() {
        let d = dst.ptr_at(dl.offset() + plan.dst_offset(k));
        let s = src_ptr + (k * plan.height * plan.run * es) as u64;
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: s,
            srcArray: std::ptr::null_mut(),
            srcPitch: plan.run * es,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: d,
            dstArray: std::ptr::null_mut(),
            dstPitch: plan.pitch * es,
            WidthInBytes: plan.run * es,
            Height: plan.height,
        };
        // SAFETY: the source rows lie in the contiguous source (`height * run` elements per
        // copy, `copies` copies: its element count); the destination rows are elements of the
        // view `dl` inside `dst` (checked against the buffer by the tensor layer); `copy` is
        // read during the call; ordered on the compute stream, where `_keep` (a temporary
        // source) is freed after it.
        unsafe { sys::cuMemcpy2DAsync_v2(&copy, ctx.stream.cu_stream()).result() }.map_err(
            |e| {
                ctx.err(
                    &format!(
                        "copy_into a view of shape {:?} strides {:?} (pitched copy {k})",
                        dl.dims(),
                        dl.strides()
                    ),
                    e,
                )
            },
        )?;
    }
    Ok(())
}

/// The `cast_<a>_to_<b>` kernel of a conversion (every pair of dtypes has one; the suffixes are
/// [`DType::as_str`]).
pub(crate) fn cast_kernel(from: DType, to: DType) -> (&'static str, &'static str) {
    (from.as_str(), to.as_str())
}

/// See `BackendStorage::cast`. `cast_<a>_to_<b>` on the device for every pair, as the CPU
/// converts: to a float type one rounding from the value (through f64), to an integer type
/// Rust's saturating `as` from f64 (truncation toward zero, NaN to 0, clamped to the type's
/// range).
pub(crate) fn cast(s: &CudaStorage, l: &Layout, dtype: DType) -> Result<CudaStorage> {
    if dtype == s.dtype() {
        return copy_contiguous(s, l);
    }
    let n = l.shape().elem_count();
    let (from, to) = cast_kernel(s.dtype(), dtype);
    let out = CudaStorage::uninit(s.ctx(), dtype, n)?;
    if n > 0 {
        let (x, _keep) = contiguous((s, l))?;
        args::cast(from, to, x, out.device_ptr(), n).run(s.ctx())?;
    }
    Ok(out)
}

//! Strided views: gathering a strided view into a contiguous buffer and back.
//!
//! A view is `(offset, shape, strides)` over a flat buffer, strides in elements (0 broadcasts).

/// Copies the view `(offset, shape, strides)` of `src` into the contiguous `dst`
/// (row-major over `shape`; `dst.len()` equals the product of `shape`).
pub fn copy_strided<T: Copy + Send + Sync>(
    src: &[T],
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    dst: &mut [T],
) {
    let _ = (src, offset, shape, strides, dst);
    todo!("copy_strided")
}

/// Writes the contiguous `src` into the view `(offset, shape, strides)` of `dst`
/// (the inverse of [`copy_strided`]; the view must not overlap itself).
pub fn copy_into_strided<T: Copy + Send + Sync>(
    src: &[T],
    dst: &mut [T],
    offset: usize,
    shape: &[usize],
    strides: &[usize],
) {
    let _ = (src, dst, offset, shape, strides);
    todo!("copy_into_strided")
}

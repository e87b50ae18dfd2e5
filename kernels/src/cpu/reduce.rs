//! Reductions over one dimension of a contiguous buffer viewed as `[outer, reduce, inner]`.

use crate::Float;

/// `out[o, i] = sum_r x[o, r, i]`, summed in increasing `r` (a fixed, documented order);
/// `out.len() == outer * inner`.
pub fn sum<T: Float>(x: &[T], outer: usize, reduce: usize, inner: usize, out: &mut [T]) {
    let _ = (x, outer, reduce, inner, out);
    todo!("sum")
}

/// `out[o, i] = max_r x[o, r, i]` (`reduce` must be at least 1).
pub fn max<T: Float>(x: &[T], outer: usize, reduce: usize, inner: usize, out: &mut [T]) {
    let _ = (x, outer, reduce, inner, out);
    todo!("max")
}

/// `out[o, i]` = the smallest `r` at which `x[o, r, i]` is maximal (`reduce` at least 1).
pub fn argmax<T: Float>(x: &[T], outer: usize, reduce: usize, inner: usize, out: &mut [i64]) {
    let _ = (x, outer, reduce, inner, out);
    todo!("argmax")
}

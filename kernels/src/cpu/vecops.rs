//! Small slice helpers shared by the row-wise kernels: sums and dot products with a fixed,
//! documented order that vectorises, and a row-parallel driver.
//!
//! Summation order of [`sum`], [`dot`] and friends: element `i` is added into lane `i % LANES`
//! (for `i` below the largest multiple of `LANES` that fits), lanes are combined by a fixed
//! pairwise tree, and the leftover tail is then added in increasing order. The order depends
//! only on the length, never on the thread count or the CPU's vector width.

use std::sync::atomic::{AtomicBool, Ordering};

use rayon::prelude::*;

use super::strided::{rows_per_task, PAR_THRESHOLD};
use crate::Float;

/// A raw pointer that may be shared with rayon tasks, for kernels whose tasks write provably
/// disjoint elements of one buffer that cannot be split into contiguous sub-slices.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub *mut T);

// SAFETY: the wrapper is only used to hand rayon tasks a pointer into a buffer whose elements
// each task accesses disjointly (argued at every use); the pointee type is Send.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above; tasks never access the same elements through it.
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so that closures capture the whole `Send` wrapper).
    #[inline(always)]
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// Whether [`simd`] may use the AVX2 instance (see [`set_simd_enabled`]).
static SIMD_ENABLED: AtomicBool = AtomicBool::new(true);

/// Enables (the default) or disables the AVX2 instances of the CPU kernels' loops; when disabled
/// every kernel runs its portable (baseline SSE2 on x86-64) code. Results are the same either
/// way; this exists for benchmarks and for tests of that claim.
pub fn set_simd_enabled(enabled: bool) {
    SIMD_ENABLED.store(enabled, Ordering::Relaxed);
}

/// Runs `f`, compiled for AVX2 and FMA when the CPU has them (x86-64), else as it is.
///
/// Kernels wrap their per-chunk work in this so that the loops inside (inlined into the AVX2
/// instance) vectorise 8 lanes wide instead of the baseline SSE2's 4. The arithmetic is the
/// same in both instances (Rust never fuses a multiply and an add on its own, explicit fused
/// multiply-adds ([`Float::fma`]) round once in hardware and in software alike, and every
/// reduction here has an explicit order), so results do not depend on which one runs.
#[inline(always)]
pub(crate) fn simd<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if SIMD_ENABLED.load(Ordering::Relaxed)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            #[target_feature(enable = "avx2,fma")]
            fn run_avx2<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            // SAFETY: the CPU supports AVX2 and FMA, the only features `run_avx2` is compiled
            // for (checked just above).
            return unsafe { run_avx2(f) };
        }
    }
    f()
}

/// Number of independent partial sums.
pub(crate) const LANES: usize = 16;

/// Combines the lanes pairwise: (0+8, 1+9, ...), then (0+4, ...), then (0+2, ...), then (0+1).
///
/// Kept out of line on purpose: when LLVM sees this tree together with the accumulation loop,
/// its SLP vectoriser builds 2-wide vectors for both; behind a call boundary the accumulators
/// become full-width vectors.
#[inline(never)]
fn combine<T: Float>(acc: [T; LANES]) -> T {
    let mut acc = std::hint::black_box(acc);
    let mut width = LANES / 2;
    while width > 0 {
        for j in 0..width {
            let hi = acc[j + width];
            acc[j] += hi;
        }
        width /= 2;
    }
    acc[0]
}

/// Elements mapped per block by [`sum_map`] / [`sum_map2`] before accumulation (a multiple of
/// [`LANES`]).
const MAP_BLOCK: usize = 64;

/// Adds the `LANES`-long chunks of `x` (whose length is a multiple of `LANES`) into `acc`.
#[inline(always)]
fn accumulate<T: Float>(acc: &mut [T; LANES], x: &[T]) {
    for c in x.chunks_exact(LANES) {
        for j in 0..LANES {
            acc[j] += c[j];
        }
    }
}

/// `Σ x[i]` in the lane order described in the module documentation.
#[inline(always)]
pub(crate) fn sum<T: Float>(x: &[T]) -> T {
    let full = x.len() / LANES * LANES;
    let mut acc = [T::ZERO; LANES];
    accumulate(&mut acc, &x[..full]);
    let mut s = combine(acc);
    for &v in &x[full..] {
        s += v;
    }
    s
}

/// `Σ f(x[i])` in the lane order described in the module documentation. The mapped values are
/// staged through a small stack buffer so the map and the accumulation each vectorise.
#[inline(always)]
pub(crate) fn sum_map<T: Float>(x: &[T], f: impl Fn(T) -> T) -> T {
    let full = x.len() / LANES * LANES;
    let mut acc = [T::ZERO; LANES];
    let mut buf = [T::ZERO; MAP_BLOCK];
    for block in x[..full].chunks(MAP_BLOCK) {
        let b = &mut buf[..block.len()];
        for (o, &v) in b.iter_mut().zip(block) {
            *o = f(v);
        }
        accumulate(&mut acc, b);
    }
    let mut s = combine(acc);
    for &v in &x[full..] {
        s += f(v);
    }
    s
}

/// `Σ f(a[i], b[i])` in the lane order described in the module documentation (`a` and `b` of
/// equal length).
#[inline(always)]
pub(crate) fn sum_map2<T: Float>(a: &[T], b: &[T], f: impl Fn(T, T) -> T) -> T {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let full = n / LANES * LANES;
    let mut acc = [T::ZERO; LANES];
    let mut buf = [T::ZERO; MAP_BLOCK];
    for (ba, bb) in a[..full].chunks(MAP_BLOCK).zip(b[..full].chunks(MAP_BLOCK)) {
        let t = &mut buf[..ba.len()];
        for ((o, &x), &y) in t.iter_mut().zip(ba).zip(bb) {
            *o = f(x, y);
        }
        accumulate(&mut acc, t);
    }
    let mut s = combine(acc);
    for (&x, &y) in a[full..].iter().zip(&b[full..]) {
        s += f(x, y);
    }
    s
}

/// `Σ a[i] · b[i]` in the lane order described in the module documentation.
#[inline(always)]
pub(crate) fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let full = n / LANES * LANES;
    let mut acc = [T::ZERO; LANES];
    for (x, y) in a[..full]
        .chunks_exact(LANES)
        .zip(b[..full].chunks_exact(LANES))
    {
        for j in 0..LANES {
            acc[j] += x[j] * y[j];
        }
    }
    let mut s = combine(acc);
    for (&x, &y) in a[full..].iter().zip(&b[full..]) {
        s += x * y;
    }
    s
}

/// The largest of the lanes (out of line for the same reason as [`combine`]).
#[inline(never)]
fn combine_max<T: Float>(acc: [T; LANES]) -> T {
    let acc = std::hint::black_box(acc);
    let mut m = T::NEG_INFINITY;
    for a in acc {
        if a > m {
            m = a;
        }
    }
    m
}

/// The largest element, ignoring NaNs (`NEG_INFINITY` for an empty or all-NaN slice).
#[inline(always)]
pub(crate) fn max<T: Float>(x: &[T]) -> T {
    let full = x.len() / LANES * LANES;
    let mut acc = [T::NEG_INFINITY; LANES];
    for c in x[..full].chunks_exact(LANES) {
        for j in 0..LANES {
            acc[j] = if c[j] > acc[j] { c[j] } else { acc[j] };
        }
    }
    let mut m = combine_max(acc);
    for &v in &x[full..] {
        if v > m {
            m = v;
        }
    }
    m
}

/// `y[i] *= a`.
#[inline(always)]
pub(crate) fn scale<T: Float>(y: &mut [T], a: T) {
    for y in y.iter_mut() {
        *y *= a;
    }
}

/// Calls `f(r, row_r)` for every `row_len`-long row of `out` (row `r` is
/// `out[r * row_len .. (r + 1) * row_len]`), in parallel chunks of rows when `out` is large.
/// Each chunk runs through [`simd`].
pub(crate) fn for_each_row<T: Send>(
    out: &mut [T],
    row_len: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if row_len == 0 || out.is_empty() {
        return;
    }
    let rows = out.len() / row_len;
    let chunk_fn = |r0: usize, chunk: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                for (j, row) in chunk.chunks_mut(row_len).enumerate() {
                    f(r0 + j, row);
                }
            },
        )
    };
    if out.len() < PAR_THRESHOLD || rows < 2 {
        chunk_fn(0, out);
    } else {
        let per = rows_per_task(rows, row_len);
        out.par_chunks_mut(per * row_len)
            .enumerate()
            .for_each(|(c, chunk)| chunk_fn(c * per, chunk));
    }
}

/// Like [`for_each_row`], with two per-row scalar outputs (for example a row's statistics):
/// calls `f(r, row_r, &mut a[r], &mut b[r])`.
pub(crate) fn for_each_row_stats<T: Send, U: Send>(
    out: &mut [T],
    row_len: usize,
    a: &mut [U],
    b: &mut [U],
    f: impl Fn(usize, &mut [T], &mut U, &mut U) + Sync,
) {
    if row_len == 0 || out.is_empty() {
        return;
    }
    let rows = out.len() / row_len;
    assert!(a.len() == rows && b.len() == rows, "one statistic per row");
    let chunk_fn = |r0: usize, chunk: &mut [T], ac: &mut [U], bc: &mut [U]| {
        simd(
            #[inline(always)]
            || {
                let rows = chunk
                    .chunks_mut(row_len)
                    .zip(ac.iter_mut())
                    .zip(bc.iter_mut());
                for (j, ((row, a), b)) in rows.enumerate() {
                    f(r0 + j, row, a, b);
                }
            },
        )
    };
    if out.len() < PAR_THRESHOLD || rows < 2 {
        chunk_fn(0, out, a, b);
    } else {
        let per = rows_per_task(rows, row_len);
        out.par_chunks_mut(per * row_len)
            .zip(a.par_chunks_mut(per).zip(b.par_chunks_mut(per)))
            .enumerate()
            .for_each(|(c, (chunk, (ac, bc)))| chunk_fn(c * per, chunk, ac, bc));
    }
}

/// Calls `f(r, &mut a[r], &mut b[r])` for every `r < a.len()` (`a`, `b` of equal length), in
/// parallel chunks when `a.len() * work_per_item` is large. Each chunk runs through [`simd`].
pub(crate) fn for_each_index2<U: Send>(
    a: &mut [U],
    b: &mut [U],
    work_per_item: usize,
    f: impl Fn(usize, &mut U, &mut U) + Sync,
) {
    assert_eq!(a.len(), b.len());
    let n = a.len();
    let chunk_fn = |r0: usize, ac: &mut [U], bc: &mut [U]| {
        simd(
            #[inline(always)]
            || {
                for (j, (a, b)) in ac.iter_mut().zip(bc.iter_mut()).enumerate() {
                    f(r0 + j, a, b);
                }
            },
        )
    };
    if n.saturating_mul(work_per_item) < PAR_THRESHOLD || n < 2 {
        chunk_fn(0, a, b);
    } else {
        let per = rows_per_task(n, work_per_item);
        a.par_chunks_mut(per)
            .zip(b.par_chunks_mut(per))
            .enumerate()
            .for_each(|(c, (ac, bc))| chunk_fn(c * per, ac, bc));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_follow_the_documented_order() {
        for n in [0usize, 1, 15, 16, 17, 33, 100] {
            let x: Vec<f32> = (0..n)
                .map(|i| 1.0 + (i as f32) * 1e-3 + if i % 3 == 0 { 1e4 } else { 0.0 })
                .collect();
            // Explicit lane model.
            let full = n / LANES * LANES;
            let mut lanes = [0f32; LANES];
            for i in 0..full {
                lanes[i % LANES] += x[i];
            }
            let mut w = LANES / 2;
            while w > 0 {
                for j in 0..w {
                    lanes[j] += lanes[j + w];
                }
                w /= 2;
            }
            let mut want = lanes[0];
            for &v in &x[full..] {
                want += v;
            }
            assert_eq!(sum(&x).to_bits(), want.to_bits(), "n={n}");
            let y: Vec<f32> = x.iter().map(|v| v * 0.5).collect();
            let d: f64 = x.iter().zip(&y).map(|(&a, &b)| a as f64 * b as f64).sum();
            assert!((dot(&x, &y) as f64 - d).abs() <= 1e-6 * d.abs().max(1.0));
            let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&x), m);
        }
    }

    #[test]
    fn row_drivers_visit_every_row_once() {
        for (rows, len) in [(3usize, 5usize), (1000, 100), (7, 10_000)] {
            let mut out = vec![0usize; rows * len];
            let (mut a, mut b) = (vec![0usize; rows], vec![0usize; rows]);
            for_each_row(&mut out, len, |r, row| {
                row.iter_mut().for_each(|v| *v += r + 1)
            });
            for_each_row_stats(&mut out, len, &mut a, &mut b, |r, row, a, b| {
                row.iter_mut().for_each(|v| *v += r + 1);
                *a = r;
                *b = r * 2;
            });
            for r in 0..rows {
                assert!(out[r * len..(r + 1) * len]
                    .iter()
                    .all(|&v| v == 2 * (r + 1)));
                assert_eq!((a[r], b[r]), (r, 2 * r));
            }
            let (mut a, mut b) = (vec![0usize; rows], vec![0usize; rows]);
            for_each_index2(&mut a, &mut b, len, |r, a, b| {
                *a = r + 1;
                *b = r + 2;
            });
            assert!((0..rows).all(|r| a[r] == r + 1 && b[r] == r + 2));
        }
    }
}

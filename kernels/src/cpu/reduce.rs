//! Reductions over one dimension of a contiguous buffer viewed as `[outer, reduce, inner]`.
//!
//! Every output element is reduced in increasing `r`, one element at a time, whatever the sizes
//! or the number of threads: results are deterministic and independent of the parallel split.
//! Parallelism only splits the set of output elements.

use rayon::prelude::*;

use super::strided::PAR_THRESHOLD;
use super::vecops::simd;
use crate::Float;

/// How many independent output rows the `inner == 1` path interleaves (for instruction-level
/// parallelism; each row is still reduced in increasing `r`).
const INTERLEAVE: usize = 8;

/// `v` is NaN (the only value not equal to itself).
#[inline(always)]
#[allow(clippy::eq_op)]
fn is_nan<T: Float>(v: T) -> bool {
    v != v
}

fn check_sizes<T, O>(name: &str, x: &[T], outer: usize, reduce: usize, inner: usize, out: &[O]) {
    assert_eq!(
        x.len(),
        outer * reduce * inner,
        "{name}: input has {} elements, expected [{outer}, {reduce}, {inner}]",
        x.len()
    );
    assert_eq!(
        out.len(),
        outer * inner,
        "{name}: output has {} elements, expected [{outer}, {inner}]",
        out.len()
    );
}

/// Reduces with `init(first)` / `step(acc, v)`, folding over `r` in increasing order; `x` is
/// `[outer, reduce, inner]`. Splits the output across threads when the input is large.
#[inline]
fn reduce_generic<T: Float, A: Copy + Send + Sync>(
    x: &[T],
    outer: usize,
    reduce: usize,
    inner: usize,
    out: &mut [A],
    init: impl Fn(T) -> A + Sync,
    step: impl Fn(A, T, usize) -> A + Sync,
) {
    // `block(o0, out_block, i0)`: the outputs `out[o, i0 .. i0 + width]` for the rows
    // `o0 .. o0 + rows` where `out_block` has `rows * width` elements laid out as rows of `width`
    // (only used with width == inner or rows == 1).
    let inner_block = |o: usize, i0: usize, dst: &mut [A]| {
        simd(
            #[inline(always)]
            || {
                // Row `o`, columns `i0 .. i0 + dst.len()`: accumulate over r in increasing order.
                let w = dst.len();
                let base = o * reduce * inner + i0;
                for (d, &v) in dst.iter_mut().zip(&x[base..base + w]) {
                    *d = init(v);
                }
                for r in 1..reduce {
                    let row = &x[base + r * inner..base + r * inner + w];
                    for (d, &v) in dst.iter_mut().zip(row) {
                        *d = step(*d, v, r);
                    }
                }
            },
        )
    };
    let rows_inner1 = |o0: usize, dst: &mut [A]| {
        simd(
            #[inline(always)]
            || {
                // inner == 1: outputs o0 .. o0 + dst.len(), each the fold of a contiguous row.
                let mut chunks = dst.chunks_mut(INTERLEAVE);
                let mut o = o0;
                for chunk in &mut chunks {
                    if chunk.len() == INTERLEAVE {
                        let rows: [&[T]; INTERLEAVE] =
                            std::array::from_fn(|j| &x[(o + j) * reduce..(o + j + 1) * reduce]);
                        let mut acc: [A; INTERLEAVE] = std::array::from_fn(|j| init(rows[j][0]));
                        #[allow(clippy::needless_range_loop)]
                        for r in 1..reduce {
                            for j in 0..INTERLEAVE {
                                acc[j] = step(acc[j], rows[j][r], r);
                            }
                        }
                        chunk.copy_from_slice(&acc);
                    } else {
                        for (j, d) in chunk.iter_mut().enumerate() {
                            let row = &x[(o + j) * reduce..(o + j + 1) * reduce];
                            let mut acc = init(row[0]);
                            for (r, &v) in row.iter().enumerate().skip(1) {
                                acc = step(acc, v, r);
                            }
                            *d = acc;
                        }
                    }
                    o += chunk.len();
                }
            },
        )
    };
    let parallel = x.len() >= PAR_THRESHOLD;
    if inner == 1 {
        if parallel && outer > 1 {
            let per = outer
                .div_ceil(rayon::current_num_threads() * 4)
                .max((PAR_THRESHOLD / 4).div_ceil(reduce))
                .max(1);
            out.par_chunks_mut(per)
                .enumerate()
                .for_each(|(c, dst)| rows_inner1(c * per, dst));
        } else {
            rows_inner1(0, out);
        }
        return;
    }
    for_each_column_block(out, outer, inner, parallel, inner_block);
}

/// Runs `block(o, i0, dst)` over every output row `o` of `out` (`outer` rows of `inner`
/// columns), `dst` being columns `i0..` of that row. Serially one whole row at a time, or, when
/// `parallel`, with every row split into column blocks (at least 256 columns each) and all
/// (row, block) pairs run in parallel. Each output element is written by exactly one call, so
/// the result does not depend on the split.
pub(crate) fn for_each_column_block<A: Send>(
    out: &mut [A],
    outer: usize,
    inner: usize,
    parallel: bool,
    block: impl Fn(usize, usize, &mut [A]) + Sync,
) {
    if !parallel {
        for (o, dst) in out.chunks_mut(inner).enumerate() {
            block(o, 0, dst);
        }
        return;
    }
    let threads = rayon::current_num_threads();
    let blocks_wanted = (threads * 4).div_ceil(outer).max(1);
    let width = inner.div_ceil(blocks_wanted).max(256).min(inner);
    out.par_chunks_mut(inner).enumerate().for_each(|(o, row)| {
        row.par_chunks_mut(width)
            .enumerate()
            .for_each(|(b, dst)| block(o, b * width, dst));
    });
}

/// `out[o, i] = sum_r x[o, r, i]`, summed in increasing `r` (a fixed, documented order);
/// `out.len() == outer * inner`.
///
/// The sum is one sequential accumulation in `T` per output element, starting from
/// `x[o, 0, i]`; `reduce == 0` gives zeros.
pub fn sum<T: Float>(x: &[T], outer: usize, reduce: usize, inner: usize, out: &mut [T]) {
    check_sizes("sum", x, outer, reduce, inner, out);
    if out.is_empty() {
        return;
    }
    if reduce == 0 {
        out.fill(T::ZERO);
        return;
    }
    reduce_generic(x, outer, reduce, inner, out, |v| v, |a, v, _| a + v);
}

/// `out[o, i] = max_r x[o, r, i]` (`reduce` must be at least 1).
///
/// NaN propagates: a NaN anywhere in the reduced slice makes the result NaN.
pub fn max<T: Float>(x: &[T], outer: usize, reduce: usize, inner: usize, out: &mut [T]) {
    check_sizes("max", x, outer, reduce, inner, out);
    assert!(reduce >= 1 || out.is_empty(), "max over an empty dimension");
    if out.is_empty() {
        return;
    }
    reduce_generic(
        x,
        outer,
        reduce,
        inner,
        out,
        |v| v,
        |a, v, _| if v > a || is_nan(v) { v } else { a },
    );
}

/// `out[o, i]` = the smallest `r` at which `x[o, r, i]` is maximal (`reduce` at least 1).
///
/// NaN counts as larger than every number: the first NaN, if any, is the answer.
pub fn argmax<T: Float>(x: &[T], outer: usize, reduce: usize, inner: usize, out: &mut [i64]) {
    check_sizes("argmax", x, outer, reduce, inner, out);
    assert!(
        reduce >= 1 || out.is_empty(),
        "argmax over an empty dimension"
    );
    if out.is_empty() {
        return;
    }
    let mut pairs = vec![(T::ZERO, 0i64); out.len()];
    reduce_generic(
        x,
        outer,
        reduce,
        inner,
        &mut pairs,
        |v| (v, 0i64),
        |(best, idx), v, r| {
            // Once a NaN is held it is kept (`best != best`); a new NaN or a strictly larger
            // value replaces the current best.
            if !is_nan(best) && (v > best || is_nan(v)) {
                (v, r as i64)
            } else {
                (best, idx)
            }
        },
    );
    for (o, (_, idx)) in out.iter_mut().zip(pairs) {
        *o = idx;
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn float(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        }
    }

    fn shapes(rng: &mut Rng) -> Vec<(usize, usize, usize)> {
        let mut v = vec![
            (1, 1, 1),
            (1, 5, 1),
            (3, 1, 4),
            (17, 33, 1),
            (9, 7, 3),
            (2, 1000, 70),
            (300, 200, 1),
            (1, 50_000, 1),
            (1, 3, 40_000),
            (5, 2, 9_000),
        ];
        for _ in 0..30 {
            v.push((1 + rng.below(20), 1 + rng.below(20), 1 + rng.below(20)));
        }
        v
    }

    #[test]
    fn sum_matches_sequential_reference() {
        let mut rng = Rng(5);
        for (outer, reduce, inner) in shapes(&mut rng) {
            let x: Vec<f32> = (0..outer * reduce * inner)
                .map(|_| rng.float() as f32)
                .collect();
            let mut out = vec![0f32; outer * inner];
            sum(&x, outer, reduce, inner, &mut out);
            let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
            let mut out64 = vec![0f64; outer * inner];
            sum(&x64, outer, reduce, inner, &mut out64);
            for o in 0..outer {
                for i in 0..inner {
                    // The documented order, in f32, must match bit for bit.
                    let mut acc = x[o * reduce * inner + i];
                    let mut acc64 = 0f64;
                    for r in 0..reduce {
                        let v = x[(o * reduce + r) * inner + i];
                        if r > 0 {
                            acc += v;
                        }
                        acc64 += v as f64;
                    }
                    assert_eq!(out[o * inner + i].to_bits(), acc.to_bits());
                    assert!((out64[o * inner + i] - acc64).abs() <= 1e-12 * (1.0 + acc64.abs()));
                    assert!(
                        (out[o * inner + i] as f64 - acc64).abs()
                            <= 1e-4 * (1.0 + (reduce as f64).sqrt())
                    );
                }
            }
        }
        let mut z = vec![1.0f64; 6];
        sum(&[] as &[f64], 2, 0, 3, &mut z);
        assert_eq!(z, vec![0.0; 6]);
        // Empty outputs (inner or outer 0) are fine.
        let mut e: Vec<f64> = vec![];
        sum(&[] as &[f64], 3, 4, 0, &mut e);
        sum(&[] as &[f64], 0, 4, 3, &mut e);
        max(&[] as &[f64], 3, 4, 0, &mut e);
        let mut ei: Vec<i64> = vec![];
        argmax(&[] as &[f64], 0, 4, 3, &mut ei);
    }

    #[test]
    fn max_and_argmax_match_reference() {
        let mut rng = Rng(11);
        for (outer, reduce, inner) in shapes(&mut rng) {
            // Coarse values so that ties happen.
            let x: Vec<f64> = (0..outer * reduce * inner)
                .map(|_| (rng.below(9) as f64) - 4.0)
                .collect();
            let mut mx = vec![0f64; outer * inner];
            let mut am = vec![0i64; outer * inner];
            max(&x, outer, reduce, inner, &mut mx);
            argmax(&x, outer, reduce, inner, &mut am);
            for o in 0..outer {
                for i in 0..inner {
                    let mut best = f64::NEG_INFINITY;
                    let mut best_r = 0;
                    for r in 0..reduce {
                        let v = x[(o * reduce + r) * inner + i];
                        if v > best {
                            best = v;
                            best_r = r;
                        }
                    }
                    assert_eq!(mx[o * inner + i], best);
                    assert_eq!(am[o * inner + i], best_r as i64);
                }
            }
        }
    }

    #[test]
    fn nan_handling() {
        let x = [1.0f32, f32::NAN, 3.0, f32::NAN, 2.0];
        let mut m = [0f32];
        let mut a = [0i64];
        max(&x, 1, 5, 1, &mut m);
        argmax(&x, 1, 5, 1, &mut a);
        assert!(m[0].is_nan());
        assert_eq!(a[0], 1);
        let x = [f32::NAN, 5.0];
        argmax(&x, 1, 2, 1, &mut a);
        assert_eq!(a[0], 0);
        max(&x, 1, 2, 1, &mut m);
        assert!(m[0].is_nan());
        let x = [f32::NEG_INFINITY, f32::NEG_INFINITY];
        argmax(&x, 1, 2, 1, &mut a);
        assert_eq!(a[0], 0);
    }
}

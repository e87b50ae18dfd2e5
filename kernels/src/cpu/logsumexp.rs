//! Log-sum-exp over one dimension of a contiguous buffer viewed as `[outer, reduce, inner]`,
//! shifted by the maximum so that it neither overflows nor underflows.

use rayon::prelude::*;

use super::fastmath::exp;
use super::strided::{rows_per_task, PAR_THRESHOLD};
use super::vecops::{self, simd};
use crate::Float;

/// The shift applied before exponentiating: the maximum, or 0 when the maximum is infinite
/// (all `-inf` or empty: the result is `-inf`; some `+inf`: the result is `+inf`).
#[inline(always)]
fn shift_of<T: Float>(m: T) -> T {
    if m == T::NEG_INFINITY || m == -T::NEG_INFINITY {
        T::ZERO
    } else {
        m
    }
}

/// `out[o, i] = ln Σ_r exp(x[o, r, i])`, computed as `m + ln Σ_r exp(x[o, r, i] - m)` with `m`
/// the maximum over `r` (NaN-ignoring; a NaN input still makes the sum, and so the result, NaN).
///
/// `reduce == 0` gives `-inf`; a slice of all `-inf` gives `-inf`; one containing `+inf` (and no
/// NaN) gives `+inf`. Every output's sum has a fixed order that depends only on the sizes: for
/// `inner == 1` the lane order of the crate's vector helpers, otherwise increasing `r`. Threads
/// only split the set of outputs, so the result does not depend on the thread count.
pub fn logsumexp<T: Float>(x: &[T], outer: usize, reduce: usize, inner: usize, out: &mut [T]) {
    assert_eq!(
        x.len(),
        outer * reduce * inner,
        "logsumexp: input has {} elements, expected [{outer}, {reduce}, {inner}]",
        x.len()
    );
    assert_eq!(
        out.len(),
        outer * inner,
        "logsumexp: output has {} elements, expected [{outer}, {inner}]",
        out.len()
    );
    if out.is_empty() {
        return;
    }
    let parallel = x.len() >= PAR_THRESHOLD;
    if inner == 1 {
        let rows = |o0: usize, dst: &mut [T]| {
            simd(
                #[inline(always)]
                || {
                    for (j, d) in dst.iter_mut().enumerate() {
                        let o = o0 + j;
                        let row = &x[o * reduce..(o + 1) * reduce];
                        let s = shift_of(vecops::max(row));
                        *d = s + vecops::sum_map(row, |v| exp(v - s)).ln();
                    }
                },
            )
        };
        if parallel && outer > 1 {
            let per = rows_per_task(outer, reduce);
            out.par_chunks_mut(per)
                .enumerate()
                .for_each(|(c, dst)| rows(c * per, dst));
        } else {
            rows(0, out);
        }
        return;
    }
    // Columns i0 .. i0 + dst.len() of output row o, each reduced over r in increasing order.
    let block = |o: usize, i0: usize, dst: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                let w = dst.len();
                let base = o * reduce * inner + i0;
                dst.fill(T::NEG_INFINITY);
                for r in 0..reduce {
                    let src = &x[base + r * inner..base + r * inner + w];
                    for (d, &v) in dst.iter_mut().zip(src) {
                        if v > *d {
                            *d = v;
                        }
                    }
                }
                for d in dst.iter_mut() {
                    *d = shift_of(*d);
                }
                let mut acc = vec![T::ZERO; w];
                for r in 0..reduce {
                    let src = &x[base + r * inner..base + r * inner + w];
                    for ((a, &v), &s) in acc.iter_mut().zip(src).zip(dst.iter()) {
                        *a += exp(v - s);
                    }
                }
                for (d, a) in dst.iter_mut().zip(acc) {
                    *d += a.ln();
                }
            },
        )
    };
    super::reduce::for_each_column_block(out, outer, inner, parallel, block);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, to_f32, to_f64, Rng};

    /// Naive reference: max-shifted sum in f64, in increasing r.
    fn reference(x: &[f64], outer: usize, reduce: usize, inner: usize) -> Vec<f64> {
        let mut out = vec![0.0; outer * inner];
        for o in 0..outer {
            for i in 0..inner {
                let at = |r: usize| x[(o * reduce + r) * inner + i];
                let m = (0..reduce).map(at).fold(f64::NEG_INFINITY, f64::max);
                let s: f64 = (0..reduce).map(|r| (at(r) - m).exp()).sum();
                out[o * inner + i] = m + s.ln();
            }
        }
        out
    }

    #[test]
    fn matches_reference_for_all_layouts() {
        let mut rng = Rng(77);
        for (outer, reduce, inner) in [
            (1, 1, 1),
            (3, 5, 1),
            (2, 7, 3),
            (1, 40_000, 1),
            (300, 200, 1),
            (4, 300, 100),
            (1, 9, 5000),
        ] {
            // Large offsets: exp without the shift would overflow.
            let x = rng.vec(outer * reduce * inner, 500.0, 520.0);
            let want = reference(&x, outer, reduce, inner);
            let mut out = vec![f64::NAN; outer * inner];
            logsumexp(&x, outer, reduce, inner, &mut out);
            assert_close("lse f64", &out, &want, 1e-14, 1e-12);
            let x32 = to_f32(&x);
            let want = reference(&to_f64(&x32), outer, reduce, inner);
            let mut out = vec![f32::NAN; outer * inner];
            logsumexp(&x32, outer, reduce, inner, &mut out);
            assert_close("lse f32", &to_f64(&out), &want, 1e-6, 1e-5);
        }
    }

    #[test]
    fn infinities_nan_and_empty() {
        let inf = f64::INFINITY;
        for inner in [1, 2] {
            // Rows (as columns when inner == 2, duplicated): all -inf, one +inf, one NaN, mixed.
            let rows: [[f64; 3]; 4] = [
                [-inf, -inf, -inf],
                [1.0, inf, 2.0],
                [1.0, f64::NAN, 2.0],
                [-inf, 0.0, -inf],
            ];
            let mut x = Vec::new();
            for row in &rows {
                for &v in row {
                    x.extend(std::iter::repeat_n(v, inner));
                }
            }
            let mut out = vec![0.0; 4 * inner];
            logsumexp(&x, 4, 3, inner, &mut out);
            for k in 0..inner {
                assert_eq!(out[k], -inf);
                assert_eq!(out[inner + k], inf);
                assert!(out[2 * inner + k].is_nan());
                assert_eq!(out[3 * inner + k], 0.0);
            }
        }
        let mut out = vec![0.0; 6];
        logsumexp::<f64>(&[], 2, 0, 3, &mut out);
        assert_eq!(out, vec![f64::NEG_INFINITY; 6]);
    }
}

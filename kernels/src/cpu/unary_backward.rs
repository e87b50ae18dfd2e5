//! Fused backward passes of unary ops whose derivative is best computed from the input in one
//! pass: `dx[i] = dy[i] * f'(x[i])`.

use rayon::prelude::*;

use super::fastmath;
use super::strided::{par_chunk_len, PAR_THRESHOLD};
use super::vecops::simd;
use crate::ops::UnaryGrad;
use crate::Float;

/// `dx[i] = dy[i] * f'(x[i])` for the derivative `op`; all three slices contiguous and of equal
/// length. Large inputs are split into chunks across threads (each element is computed
/// independently, so the result does not depend on the split).
///
/// For f32, `Silu`'s sigmoid uses the crate's vectorisable exp (as the forward does).
pub fn unary_backward<T: Float>(op: UnaryGrad, x: &[T], dy: &[T], dx: &mut [T]) {
    assert!(
        x.len() == dy.len() && x.len() == dx.len(),
        "unary_backward: x has {} elements, dy {}, dx {}",
        x.len(),
        dy.len(),
        dx.len()
    );
    let run = |x: &[T], dy: &[T], dx: &mut [T]| {
        simd(
            #[inline(always)]
            || match op {
                UnaryGrad::Silu => {
                    for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
                        let s = T::ONE / (T::ONE + fastmath::exp(-v));
                        *d = g * (s * (T::ONE + v * (T::ONE - s)));
                    }
                }
                UnaryGrad::Clamp(lo, hi) => {
                    let (lo, hi) = (T::from_f64(lo), T::from_f64(hi));
                    for ((d, &v), &g) in dx.iter_mut().zip(x).zip(dy) {
                        *d = if lo <= v && v <= hi { g } else { T::ZERO };
                    }
                }
            },
        )
    };
    if x.len() < PAR_THRESHOLD {
        run(x, dy, dx);
    } else {
        let cl = par_chunk_len(x.len(), 64);
        dx.par_chunks_mut(cl)
            .zip(x.par_chunks(cl).zip(dy.par_chunks(cl)))
            .for_each(|(d, (x, g))| run(x, g, d));
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, to_f32, to_f64, Rng};

    fn silu(x: f64) -> f64 {
        x / (1.0 + (-x).exp())
    }

    #[test]
    fn silu_derivative_matches_finite_differences() {
        let mut rng = Rng(31);
        for n in [0usize, 1, 17, 70_001] {
            let x = rng.vec(n, -8.0, 8.0);
            let dy = rng.vec(n, -2.0, 2.0);
            let mut dx = vec![f64::NAN; n];
            unary_backward(UnaryGrad::Silu, &x, &dy, &mut dx);
            let h = 1e-6;
            let want: Vec<f64> = (0..n)
                .map(|i| dy[i] * (silu(x[i] + h) - silu(x[i] - h)) / (2.0 * h))
                .collect();
            assert_close("silu' f64", &dx, &want, 1e-7, 1e-9);
            let (x32, dy32) = (to_f32(&x), to_f32(&dy));
            let mut dx32 = vec![f32::NAN; n];
            unary_backward(UnaryGrad::Silu, &x32, &dy32, &mut dx32);
            assert_close("silu' f32", &to_f64(&dx32), &want, 1e-5, 1e-5);
        }
        // Saturated tails: derivative 0 far left, 1 far right, no NaN.
        let x = [-1000.0f32, -100.0, 100.0, 1000.0];
        let mut dx = [f32::NAN; 4];
        unary_backward(UnaryGrad::Silu, &x, &[1.0; 4], &mut dx);
        assert_eq!(dx, [0.0, 0.0, 1.0, 1.0]);
    }

    #[test]
    fn clamp_passes_the_gradient_inside_the_closed_interval() {
        let x = [-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, f64::NAN];
        let dy = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let mut dx = [f64::NAN; 8];
        unary_backward(UnaryGrad::Clamp(-1.0, 1.0), &x, &dy, &mut dx);
        assert_eq!(dx, [0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]);
        unary_backward(UnaryGrad::Clamp(f64::NEG_INFINITY, 0.0), &x, &dy, &mut dx);
        assert_eq!(dx, [1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]);
        // Large (parallel) input: the same as the serial rule element by element.
        let mut rng = Rng(32);
        let x = to_f32(&rng.vec(70_001, -2.0, 2.0));
        let dy = to_f32(&rng.vec(70_001, -1.0, 1.0));
        let mut dx = vec![f32::NAN; x.len()];
        unary_backward(UnaryGrad::Clamp(-0.5, 1.5), &x, &dy, &mut dx);
        for i in 0..x.len() {
            let want = if (-0.5..=1.5).contains(&x[i]) {
                dy[i]
            } else {
                0.0
            };
            assert_eq!(dx[i], want, "element {i}");
        }
    }
}

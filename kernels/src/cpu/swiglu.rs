//! Fused SwiGLU, the gated unit of Llama's MLP: `y = silu(gate) · up` with
//! `silu(g) = g · sigmoid(g)`, forward and backward in one pass each over contiguous buffers.
//!
//! With `s = sigmoid(g) = 1 / (1 + e^-g)`: `dup = dy · g s` and
//! `dgate = dy · up · s (1 + g (1 - s))`. The sigmoid is computed with the crate's vectorised
//! `exp` for f32 (exact `std` for f64); it saturates cleanly (`e^-g` overflowing to `inf` gives
//! `s = 0`). Elementwise, so the results do not depend on how the work is split; large buffers
//! run in parallel chunks.

use rayon::prelude::*;

use super::fastmath::exp;
use super::strided::{par_chunk_len, PAR_THRESHOLD};
use super::vecops::simd;
use crate::Float;

#[inline(always)]
fn sigmoid<T: Float>(g: T) -> T {
    T::ONE / (T::ONE + exp(-g))
}

/// Runs `f(start, chunks...)` over matching chunks of the outputs (serially when small).
fn chunked<T: Float>(outs: [&mut [T]; 2], two: bool, f: impl Fn(usize, &mut [T], &mut [T]) + Sync) {
    let [a, b] = outs;
    let n = a.len();
    if n < PAR_THRESHOLD {
        simd(
            #[inline(always)]
            || f(0, a, b),
        );
        return;
    }
    let len = par_chunk_len(n, 64);
    if two {
        a.par_chunks_mut(len)
            .zip(b.par_chunks_mut(len))
            .enumerate()
            .for_each(|(i, (a, b))| {
                simd(
                    #[inline(always)]
                    || f(i * len, a, b),
                )
            });
    } else {
        a.par_chunks_mut(len).enumerate().for_each(|(i, a)| {
            simd(
                #[inline(always)]
                || f(i * len, a, &mut []),
            )
        });
    }
}

/// `out = silu(gate) · up` elementwise (all of equal length).
pub fn swiglu_forward<T: Float>(gate: &[T], up: &[T], out: &mut [T]) {
    assert!(
        gate.len() == up.len() && up.len() == out.len(),
        "swiglu_forward: gate, up, out have {}, {}, {} elements",
        gate.len(),
        up.len(),
        out.len()
    );
    chunked([out, &mut []], false, |s, o, _| {
        let n = o.len();
        for ((o, &g), &u) in o.iter_mut().zip(&gate[s..s + n]).zip(&up[s..s + n]) {
            *o = g * sigmoid(g) * u;
        }
    });
}

/// The backward of [`swiglu_forward`] from `dy`: writes (overwrites) `dgate` and `dup`.
pub fn swiglu_backward<T: Float>(gate: &[T], up: &[T], dy: &[T], dgate: &mut [T], dup: &mut [T]) {
    let n = gate.len();
    assert!(
        up.len() == n && dy.len() == n && dgate.len() == n && dup.len() == n,
        "swiglu_backward: gate, up, dy, dgate, dup have {}, {}, {}, {}, {} elements",
        n,
        up.len(),
        dy.len(),
        dgate.len(),
        dup.len()
    );
    chunked([dgate, dup], true, |s, dg, du| {
        let m = dg.len();
        let it = dg
            .iter_mut()
            .zip(du.iter_mut())
            .zip(&gate[s..s + m])
            .zip(&up[s..s + m])
            .zip(&dy[s..s + m]);
        for ((((dg, du), &g), &u), &d) in it {
            let sg = sigmoid(g);
            *du = d * (g * sg);
            *dg = d * u * (sg * (T::ONE + g * (T::ONE - sg)));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, to_f32, to_f64, Rng};

    fn silu(g: f64) -> f64 {
        g / (1.0 + (-g).exp())
    }

    #[test]
    fn forward_and_backward_match_the_reference() {
        let mut rng = Rng(51);
        for n in [0usize, 1, 7, 100, 40_000, 100_003] {
            let mut g = rng.vec(n, -8.0, 8.0);
            if n > 10 {
                // Saturated values in both directions.
                g[3] = -120.0;
                g[4] = 120.0;
                g[5] = -1e4;
            }
            let u = rng.vec(n, -2.0, 2.0);
            let dy = rng.vec(n, -1.0, 1.0);
            let want: Vec<f64> = g.iter().zip(&u).map(|(&g, &u)| silu(g) * u).collect();
            // Derivatives by central differences of the definition (smooth everywhere).
            let h = 1e-6;
            let dg_want: Vec<f64> = (0..n)
                .map(|i| dy[i] * u[i] * (silu(g[i] + h) - silu(g[i] - h)) / (2.0 * h))
                .collect();
            let du_want: Vec<f64> = (0..n).map(|i| dy[i] * silu(g[i])).collect();
            let mut y = vec![f64::NAN; n];
            swiglu_forward(&g, &u, &mut y);
            assert_close("swiglu f64", &y, &want, 1e-14, 1e-300);
            let (mut dg, mut du) = (vec![f64::NAN; n], vec![f64::NAN; n]);
            swiglu_backward(&g, &u, &dy, &mut dg, &mut du);
            assert_close("swiglu dgate f64", &dg, &dg_want, 1e-7, 1e-9);
            assert_close("swiglu dup f64", &du, &du_want, 1e-14, 1e-300);

            let (g32, u32_, d32) = (to_f32(&g), to_f32(&u), to_f32(&dy));
            let (gr, ur, dr) = (to_f64(&g32), to_f64(&u32_), to_f64(&d32));
            let want: Vec<f64> = gr.iter().zip(&ur).map(|(&g, &u)| silu(g) * u).collect();
            let mut y = vec![f32::NAN; n];
            swiglu_forward(&g32, &u32_, &mut y);
            assert_close("swiglu f32", &to_f64(&y), &want, 1e-6, 1e-30);
            let (mut dg, mut du) = (vec![f32::NAN; n], vec![f32::NAN; n]);
            swiglu_backward(&g32, &u32_, &d32, &mut dg, &mut du);
            let s = |g: f64| 1.0 / (1.0 + (-g).exp());
            let dg_want: Vec<f64> = (0..n)
                .map(|i| dr[i] * ur[i] * s(gr[i]) * (1.0 + gr[i] * (1.0 - s(gr[i]))))
                .collect();
            let du_want: Vec<f64> = (0..n).map(|i| dr[i] * silu(gr[i])).collect();
            // Absolute slack near the zero of silu' (g ≈ -1.28), where the relative error is unbounded.
            assert_close("swiglu dgate f32", &to_f64(&dg), &dg_want, 1e-5, 2e-6);
            assert_close("swiglu dup f32", &to_f64(&du), &du_want, 1e-6, 1e-30);
            assert!(y.iter().chain(&dg).chain(&du).all(|x| x.is_finite()));
        }
    }
}

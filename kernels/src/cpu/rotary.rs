//! Fused rotary position embedding (RoPE) in the "rotate half" convention of Hugging Face's Llama:
//! over `x [batch, seq, heads, head_dim]` (contiguous), element `i < D/2` of a head pairs with
//! element `i + D/2`, and the pair at position `p` is rotated by the angle
//! `p · theta^(-2i/D)`:
//!
//! `y_i = x_i cos a - x_{i+D/2} sin a`, `y_{i+D/2} = x_{i+D/2} cos a + x_i sin a`.
//!
//! The backward is the rotation by `-a` (the transpose of a rotation is its inverse), so both
//! run through [`rotary_embedding`]. Angles, cosines and sines are computed in f64 (one
//! `[seq, D/2]` table per call) and rounded once to `T`; positions rows run in parallel when
//! the buffer is large.

use super::vecops::for_each_row;
use crate::Float;

/// The inverse frequencies `theta^(-2i/D)` of the `head_dim / 2` pairs, in f64.
pub fn inv_frequencies(head_dim: usize, theta: f64) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| theta.powf(-((2 * i) as f64) / head_dim as f64))
        .collect()
}

/// Rotates every head of `x` (`[batch, seq, heads, head_dim]`, contiguous) by the angles of
/// `positions` (`[seq]`, one per sequence index, any integers) into `out` (same shape):
/// by `+angle` for the forward pass, by `-angle` when `inverse` (the backward pass, applied to
/// the output gradient). `head_dim` must be even and `theta` positive and finite.
#[allow(clippy::too_many_arguments)]
pub fn rotary_embedding<T: Float>(
    x: &[T],
    positions: &[i64],
    batch: usize,
    seq: usize,
    heads: usize,
    head_dim: usize,
    theta: f64,
    inverse: bool,
    out: &mut [T],
) {
    let n = batch * seq * heads * head_dim;
    assert!(
        head_dim.is_multiple_of(2),
        "rotary_embedding: head_dim {head_dim} must be even"
    );
    assert!(
        theta > 0.0 && theta.is_finite(),
        "rotary_embedding: theta {theta} must be positive and finite"
    );
    for (what, len) in [("x", x.len()), ("out", out.len())] {
        assert_eq!(
            len, n,
            "rotary_embedding: {what} has {len} elements, expected [{batch}, {seq}, {heads}, {head_dim}]"
        );
    }
    assert_eq!(
        positions.len(),
        seq,
        "rotary_embedding: positions has {} elements, expected {seq}",
        positions.len()
    );
    if n == 0 {
        return;
    }
    let half = head_dim / 2;
    let inv = inv_frequencies(head_dim, theta);
    let sign = if inverse { -1.0 } else { 1.0 };
    // cos and sin of every (position, pair), as T.
    let mut cos = Vec::with_capacity(seq * half);
    let mut sin = Vec::with_capacity(seq * half);
    for &p in positions {
        for &f in &inv {
            let a = p as f64 * f;
            cos.push(T::from_f64(a.cos()));
            sin.push(T::from_f64(sign * a.sin()));
        }
    }
    let row_len = heads * head_dim;
    for_each_row(
        out,
        row_len,
        #[inline(always)]
        |r, orow| {
            let t = r % seq;
            let (c, s) = (
                &cos[t * half..(t + 1) * half],
                &sin[t * half..(t + 1) * half],
            );
            let xrow = &x[r * row_len..(r + 1) * row_len];
            for (xh, oh) in xrow
                .chunks_exact(head_dim)
                .zip(orow.chunks_exact_mut(head_dim))
            {
                let (x1, x2) = xh.split_at(half);
                let (o1, o2) = oh.split_at_mut(half);
                for i in 0..half {
                    o1[i] = x1[i] * c[i] - x2[i] * s[i];
                    o2[i] = x2[i] * c[i] + x1[i] * s[i];
                }
            }
        },
    );
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, to_f32, to_f64, Rng};

    /// RoPE from the definition with explicit index arithmetic, in f64.
    #[allow(clippy::too_many_arguments)]
    fn rope_ref(
        x: &[f64],
        pos: &[i64],
        b: usize,
        t: usize,
        h: usize,
        d: usize,
        theta: f64,
        sign: f64,
    ) -> Vec<f64> {
        let mut y = vec![0.0; x.len()];
        for bi in 0..b {
            for ti in 0..t {
                for hi in 0..h {
                    let base = ((bi * t + ti) * h + hi) * d;
                    for i in 0..d / 2 {
                        let a = sign * pos[ti] as f64 / theta.powf(2.0 * i as f64 / d as f64);
                        let (x1, x2) = (x[base + i], x[base + i + d / 2]);
                        y[base + i] = x1 * a.cos() - x2 * a.sin();
                        y[base + i + d / 2] = x2 * a.cos() + x1 * a.sin();
                    }
                }
            }
        }
        y
    }

    #[test]
    fn matches_the_reference_and_inverts() {
        let mut rng = Rng(41);
        for &(b, t, h, d, theta) in &[
            (1usize, 1usize, 1usize, 2usize, 10_000.0),
            (2, 5, 3, 8, 10_000.0),
            (3, 17, 4, 64, 500_000.0),
            (2, 200, 2, 128, 10_000.0),
            (1, 3, 2, 6, 2.5),
        ] {
            let x = rng.vec(b * t * h * d, -2.0, 2.0);
            let pos: Vec<i64> = (0..t as i64)
                .map(|p| if p % 5 == 4 { 3 * p + 1000 } else { p })
                .collect();
            let want = rope_ref(&x, &pos, b, t, h, d, theta, 1.0);
            let mut y = vec![f64::NAN; x.len()];
            rotary_embedding(&x, &pos, b, t, h, d, theta, false, &mut y);
            assert_close("rope f64", &y, &want, 1e-12, 1e-12);
            let mut back = vec![f64::NAN; x.len()];
            rotary_embedding(&y, &pos, b, t, h, d, theta, true, &mut back);
            assert_close("rope inverse", &back, &x, 1e-12, 1e-12);
            let inv_want = rope_ref(&x, &pos, b, t, h, d, theta, -1.0);
            rotary_embedding(&x, &pos, b, t, h, d, theta, true, &mut back);
            assert_close("rope -angle", &back, &inv_want, 1e-12, 1e-12);

            let x32 = to_f32(&x);
            let want = rope_ref(&to_f64(&x32), &pos, b, t, h, d, theta, 1.0);
            let mut y32 = vec![f32::NAN; x.len()];
            rotary_embedding(&x32, &pos, b, t, h, d, theta, false, &mut y32);
            assert_close("rope f32", &to_f64(&y32), &want, 1e-6, 1e-6);
        }
    }

    #[test]
    #[should_panic(expected = "must be even")]
    fn odd_head_dim_panics() {
        let x = vec![0f32; 3];
        let mut y = vec![0f32; 3];
        rotary_embedding(&x, &[0], 1, 1, 1, 3, 10_000.0, false, &mut y);
    }
}

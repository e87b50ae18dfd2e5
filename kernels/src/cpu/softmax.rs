//! Softmax and log-softmax over the last dimension of a contiguous `[rows, cols]` buffer.
//!
//! Each row is independent (rows run in parallel when the buffer is large); within a row, sums
//! use the fixed lane order of the crate's vector helpers and are accumulated in `T`.

use super::fastmath::exp;
use super::vecops::{self, for_each_row};
use crate::Float;

fn check<T>(name: &str, rows: usize, cols: usize, bufs: &[(&str, &[T])]) {
    for (what, b) in bufs {
        assert_eq!(
            b.len(),
            rows * cols,
            "{name}: {what} has {} elements, expected [{rows}, {cols}]",
            b.len()
        );
    }
}

/// `y[r] = softmax(x[r])`, max-subtracted for stability.
pub fn softmax_forward<T: Float>(x: &[T], rows: usize, cols: usize, y: &mut [T]) {
    check("softmax_forward", rows, cols, &[("x", x), ("y", y)]);
    for_each_row(
        y,
        cols,
        #[inline(always)]
        |r, yr| {
            let xr = &x[r * cols..(r + 1) * cols];
            let m = vecops::max(xr);
            for (o, &v) in yr.iter_mut().zip(xr) {
                *o = exp(v - m);
            }
            let inv = T::ONE / vecops::sum(yr);
            vecops::scale(yr, inv);
        },
    );
}

/// `y[r] = log_softmax(x[r]) = x[r] - logsumexp(x[r])`.
pub fn log_softmax_forward<T: Float>(x: &[T], rows: usize, cols: usize, y: &mut [T]) {
    check("log_softmax_forward", rows, cols, &[("x", x), ("y", y)]);
    for_each_row(
        y,
        cols,
        #[inline(always)]
        |r, yr| {
            let xr = &x[r * cols..(r + 1) * cols];
            let m = vecops::max(xr);
            let s = vecops::sum_map(xr, |v| exp(v - m));
            let lse = m + s.ln();
            for (o, &v) in yr.iter_mut().zip(xr) {
                *o = v - lse;
            }
        },
    );
}

/// Given `y = softmax(x)` and `dy`: `dx = y * (dy - sum(dy * y))` row-wise.
pub fn softmax_backward<T: Float>(y: &[T], dy: &[T], rows: usize, cols: usize, dx: &mut [T]) {
    check(
        "softmax_backward",
        rows,
        cols,
        &[("y", y), ("dy", dy), ("dx", dx)],
    );
    for_each_row(
        dx,
        cols,
        #[inline(always)]
        |r, dxr| {
            let yr = &y[r * cols..(r + 1) * cols];
            let dyr = &dy[r * cols..(r + 1) * cols];
            let d = vecops::dot(yr, dyr);
            for ((o, &yv), &g) in dxr.iter_mut().zip(yr).zip(dyr) {
                *o = yv * (g - d);
            }
        },
    );
}

/// Given `y = log_softmax(x)` and `dy`: `dx = dy - exp(y) * sum(dy)` row-wise.
pub fn log_softmax_backward<T: Float>(y: &[T], dy: &[T], rows: usize, cols: usize, dx: &mut [T]) {
    check(
        "log_softmax_backward",
        rows,
        cols,
        &[("y", y), ("dy", dy), ("dx", dx)],
    );
    for_each_row(
        dx,
        cols,
        #[inline(always)]
        |r, dxr| {
            let yr = &y[r * cols..(r + 1) * cols];
            let dyr = &dy[r * cols..(r + 1) * cols];
            let s = vecops::sum(dyr);
            for ((o, &yv), &g) in dxr.iter_mut().zip(yr).zip(dyr) {
                *o = g - exp(yv) * s;
            }
        },
    );
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, dot64, to_f32, to_f64, Rng};

    /// Naive f64 softmax of one row.
    fn softmax_ref(x: &[f64]) -> Vec<f64> {
        let m = x.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|v| (v - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    fn shapes() -> Vec<(usize, usize)> {
        vec![
            (1, 1),
            (1, 7),
            (3, 16),
            (5, 33),
            (2, 1000),
            (300, 130),
            (40, 2049),
        ]
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng(1);
        for (rows, cols) in shapes() {
            let x = rng.vec(rows * cols, -8.0, 8.0);
            let mut want_sm = Vec::new();
            let mut want_ls = Vec::new();
            for r in 0..rows {
                let p = softmax_ref(&x[r * cols..(r + 1) * cols]);
                want_ls.extend(p.iter().map(|v| v.ln()));
                want_sm.extend(p);
            }
            let mut y = vec![0.0; rows * cols];
            softmax_forward(&x, rows, cols, &mut y);
            assert_close("softmax f64", &y, &want_sm, 1e-12, 1e-15);
            log_softmax_forward(&x, rows, cols, &mut y);
            assert_close("log_softmax f64", &y, &want_ls, 1e-12, 1e-12);

            let x32 = to_f32(&x);
            let x32d = to_f64(&x32);
            let mut want32 = Vec::new();
            let mut want32l = Vec::new();
            for r in 0..rows {
                let p = softmax_ref(&x32d[r * cols..(r + 1) * cols]);
                want32l.extend(p.iter().map(|v| v.ln()));
                want32.extend(p);
            }
            let mut y32 = vec![0f32; rows * cols];
            softmax_forward(&x32, rows, cols, &mut y32);
            assert_close("softmax f32", &to_f64(&y32), &want32, 1e-4, 1e-9);
            log_softmax_forward(&x32, rows, cols, &mut y32);
            assert_close("log_softmax f32", &to_f64(&y32), &want32l, 1e-4, 1e-5);
        }
    }

    #[test]
    fn forward_is_stable_for_large_logits() {
        let x = [1000.0f32, 1001.0, 999.0, -1e30];
        let mut y = [0f32; 4];
        softmax_forward(&x, 1, 4, &mut y);
        assert!(y.iter().all(|v| v.is_finite()));
        assert!((y.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        log_softmax_forward(&x, 1, 4, &mut y);
        assert!(y[..3].iter().all(|v| v.is_finite()));
    }

    #[test]
    fn backward_matches_jacobian_and_finite_differences() {
        let mut rng = Rng(2);
        for (rows, cols) in shapes() {
            let x = rng.vec(rows * cols, -3.0, 3.0);
            let dy = rng.vec(rows * cols, -1.0, 1.0);
            let mut y = vec![0.0; rows * cols];
            let mut ly = vec![0.0; rows * cols];
            softmax_forward(&x, rows, cols, &mut y);
            log_softmax_forward(&x, rows, cols, &mut ly);
            let mut dx = vec![0.0; rows * cols];
            let mut ldx = vec![0.0; rows * cols];
            softmax_backward(&y, &dy, rows, cols, &mut dx);
            log_softmax_backward(&ly, &dy, rows, cols, &mut ldx);

            // Explicit Jacobian-vector products from reference probabilities.
            let mut want = vec![0.0; rows * cols];
            let mut lwant = vec![0.0; rows * cols];
            for r in 0..rows {
                let p = softmax_ref(&x[r * cols..(r + 1) * cols]);
                let g = &dy[r * cols..(r + 1) * cols];
                for i in 0..cols {
                    // d softmax_j / d x_i = p_j (delta_ij - p_i)
                    let mut s = 0.0;
                    let mut ls = 0.0;
                    for j in 0..cols {
                        let delta = if i == j { 1.0 } else { 0.0 };
                        s += g[j] * p[j] * (delta - p[i]);
                        ls += g[j] * (delta - p[i]);
                    }
                    want[r * cols + i] = s;
                    lwant[r * cols + i] = ls;
                }
            }
            assert_close("softmax_backward", &dx, &want, 1e-10, 1e-12);
            assert_close("log_softmax_backward", &ldx, &lwant, 1e-10, 1e-12);

            // Central finite differences of L(x) = Σ dy · f(x) on a few elements (only the row
            // of the perturbed element changes, so only it enters the difference).
            if rows * cols <= 5000 {
                let h = 1e-5;
                for _ in 0..10.min(rows * cols) {
                    let i = rng.below(rows * cols);
                    let mut xp = x.clone();
                    let mut xm = x.clone();
                    xp[i] += h;
                    xm[i] -= h;
                    let (mut yp, mut ym) = (vec![0.0; rows * cols], vec![0.0; rows * cols]);
                    softmax_forward(&xp, rows, cols, &mut yp);
                    softmax_forward(&xm, rows, cols, &mut ym);
                    let row = i / cols * cols..(i / cols + 1) * cols;
                    let fd = (dot64(&dy[row.clone()], &yp[row.clone()])
                        - dot64(&dy[row.clone()], &ym[row.clone()]))
                        / (2.0 * h);
                    assert!(
                        (fd - dx[i]).abs() <= 1e-7 * (1.0 + fd.abs()),
                        "softmax fd {fd} vs {}",
                        dx[i]
                    );
                    log_softmax_forward(&xp, rows, cols, &mut yp);
                    log_softmax_forward(&xm, rows, cols, &mut ym);
                    let fd = (dot64(&dy[row.clone()], &yp[row.clone()])
                        - dot64(&dy[row.clone()], &ym[row]))
                        / (2.0 * h);
                    assert!(
                        (fd - ldx[i]).abs() <= 1e-7 * (1.0 + fd.abs()),
                        "log_softmax fd {fd} vs {}",
                        ldx[i]
                    );
                }
            }

            // f32 against the f64 results (computed from f32-rounded y).
            let (y32, ly32, dy32) = (to_f32(&y), to_f32(&ly), to_f32(&dy));
            let mut dx32 = vec![0f32; rows * cols];
            softmax_backward(&y32, &dy32, rows, cols, &mut dx32);
            let mut want32 = vec![0.0; rows * cols];
            let mut lwant32 = vec![0.0; rows * cols];
            for r in 0..rows {
                let yr = to_f64(&y32[r * cols..(r + 1) * cols]);
                let lyr = to_f64(&ly32[r * cols..(r + 1) * cols]);
                let g = to_f64(&dy32[r * cols..(r + 1) * cols]);
                let d = dot64(&yr, &g);
                let s: f64 = g.iter().sum();
                for i in 0..cols {
                    want32[r * cols + i] = yr[i] * (g[i] - d);
                    lwant32[r * cols + i] = g[i] - lyr[i].exp() * s;
                }
            }
            assert_close("softmax_backward f32", &to_f64(&dx32), &want32, 1e-4, 1e-6);
            log_softmax_backward(&ly32, &dy32, rows, cols, &mut dx32);
            assert_close(
                "log_softmax_backward f32",
                &to_f64(&dx32),
                &lwant32,
                1e-4,
                1e-5,
            );
        }
    }
}

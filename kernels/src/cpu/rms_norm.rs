//! Fused RMSNorm over the last dimension of a contiguous `[rows, cols]` buffer (Llama's norm:
//! no mean subtraction, no bias).
//!
//! `y = x · rstd · weight` with `rstd = 1 / sqrt(mean(x²) + eps)` per row. The mean of squares is
//! summed in `T` in the fixed lane order of the crate's vector helpers (independent of threads
//! and CPU). Rows run in parallel when the buffer is large. `dweight` is accumulated per column
//! over rows in increasing row order, starting from zero; large problems split the columns
//! (never the rows) across threads, so the result is the same for any thread count.

use rayon::prelude::*;

use super::strided::{rows_per_task, PAR_THRESHOLD};
use super::vecops::{self, for_each_row, simd};
use crate::Float;

/// `y = x · rstd · weight` row-wise, with `rstd = 1/sqrt(mean(x²) + eps)`; writes the per-row
/// `rstd` (length `rows`) for the backward pass. `weight` (length `cols`) is optional (absent =
/// 1). `eps` should be `>= 0` and finite (the tensor op checks it).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_forward<T: Float>(
    x: &[T],
    weight: Option<&[T]>,
    rows: usize,
    cols: usize,
    eps: f64,
    y: &mut [T],
    rstd: &mut [T],
) {
    for (what, n) in [("x", x.len()), ("y", y.len())] {
        assert_eq!(
            n,
            rows * cols,
            "rms_norm_forward: {what} has {n} elements, expected [{rows}, {cols}]"
        );
    }
    assert_eq!(
        rstd.len(),
        rows,
        "rms_norm_forward: rstd has {} elements, expected {rows}",
        rstd.len()
    );
    if let Some(w) = weight {
        assert_eq!(
            w.len(),
            cols,
            "rms_norm_forward: weight has {} elements, expected {cols}",
            w.len()
        );
    }
    let eps = T::from_f64(eps);
    if cols == 0 {
        rstd.fill(T::ONE / eps.sqrt());
        return;
    }
    let inv_n = T::ONE / T::from_f64(cols as f64);
    let row = |r: usize, yr: &mut [T], rs_out: &mut T| {
        let xr = &x[r * cols..(r + 1) * cols];
        let ms = vecops::sum_map(xr, |v| v * v) * inv_n;
        let rs = T::ONE / (ms + eps).sqrt();
        *rs_out = rs;
        match weight {
            Some(w) => {
                for ((o, &v), &w) in yr.iter_mut().zip(xr).zip(w) {
                    *o = v * rs * w;
                }
            }
            None => {
                for (o, &v) in yr.iter_mut().zip(xr) {
                    *o = v * rs;
                }
            }
        }
    };
    let chunk = |r0: usize, ys: &mut [T], rss: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                for (j, (yr, rs)) in ys.chunks_mut(cols).zip(rss.iter_mut()).enumerate() {
                    row(r0 + j, yr, rs);
                }
            },
        )
    };
    if y.len() < PAR_THRESHOLD || rows < 2 {
        chunk(0, y, rstd);
    } else {
        let per = rows_per_task(rows, cols);
        y.par_chunks_mut(per * cols)
            .zip(rstd.par_chunks_mut(per))
            .enumerate()
            .for_each(|(c, (ys, rss))| chunk(c * per, ys, rss));
    }
}

/// Backward of [`rms_norm_forward`] (with its saved `rstd`): writes (overwrites) `dx`, and
/// `dweight` (length `cols`, summed over rows in increasing row order) when given.
///
/// With `xhat = x · rstd` and `g = weight · dy`: `dx = rstd · (g - xhat · mean(g · xhat))`,
/// `dweight = Σ_rows dy · xhat`.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_backward<T: Float>(
    x: &[T],
    weight: Option<&[T]>,
    rstd: &[T],
    dy: &[T],
    rows: usize,
    cols: usize,
    dx: &mut [T],
    dweight: Option<&mut [T]>,
) {
    for (what, n) in [("x", x.len()), ("dy", dy.len()), ("dx", dx.len())] {
        assert_eq!(
            n,
            rows * cols,
            "rms_norm_backward: {what} has {n} elements, expected [{rows}, {cols}]"
        );
    }
    assert_eq!(
        rstd.len(),
        rows,
        "rms_norm_backward: rstd has {} elements, expected {rows}",
        rstd.len()
    );
    for (what, p) in [
        ("weight", weight.map(|w| w.len())),
        ("dweight", dweight.as_ref().map(|w| w.len())),
    ] {
        if let Some(n) = p {
            assert_eq!(
                n, cols,
                "rms_norm_backward: {what} has {n} elements, expected {cols}"
            );
        }
    }
    if cols > 0 {
        let inv_n = T::ONE / T::from_f64(cols as f64);
        for_each_row(
            dx,
            cols,
            #[inline(always)]
            |r, dxr| {
                let xr = &x[r * cols..(r + 1) * cols];
                let dyr = &dy[r * cols..(r + 1) * cols];
                let rs = rstd[r];
                match weight {
                    Some(w) => {
                        // dxr holds g = w * dy first.
                        for ((o, &g), &w) in dxr.iter_mut().zip(dyr).zip(w) {
                            *o = g * w;
                        }
                        let gx_mean = vecops::sum_map2(dxr, xr, |g, v| g * (v * rs)) * inv_n;
                        for (o, &v) in dxr.iter_mut().zip(xr) {
                            *o = rs * (*o - v * rs * gx_mean);
                        }
                    }
                    None => {
                        let gx_mean = vecops::sum_map2(dyr, xr, |g, v| g * (v * rs)) * inv_n;
                        for ((o, &v), &g) in dxr.iter_mut().zip(xr).zip(dyr) {
                            *o = rs * (g - v * rs * gx_mean);
                        }
                    }
                }
            },
        );
    }
    let Some(dw) = dweight else {
        return;
    };
    // Per column, over rows in increasing order.
    let accumulate = |c0: usize, dw: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                dw.fill(T::ZERO);
                let w = dw.len();
                for (r, &rs) in rstd.iter().enumerate() {
                    let base = r * cols + c0;
                    for ((a, &v), &g) in dw
                        .iter_mut()
                        .zip(&x[base..base + w])
                        .zip(&dy[base..base + w])
                    {
                        *a += g * (v * rs);
                    }
                }
            },
        )
    };
    if rows * cols < PAR_THRESHOLD || cols < 128 {
        accumulate(0, dw);
    } else {
        // Column blocks of at least 64 columns, about four per thread.
        let width = cols.div_ceil(rayon::current_num_threads() * 4).max(64);
        dw.par_chunks_mut(width)
            .enumerate()
            .for_each(|(i, dw)| accumulate(i * width, dw));
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{
        assert_close, assert_fd, central_diff, dot64, order_sensitive_inputs, to_f32, to_f64, Rng,
    };

    /// Naive f64 RMSNorm: (y, rstd).
    fn forward_ref(
        x: &[f64],
        w: Option<&[f64]>,
        rows: usize,
        cols: usize,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut y = vec![0.0; rows * cols];
        let mut rstd = vec![0.0; rows];
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let ms = row.iter().map(|v| v * v).sum::<f64>() / cols as f64;
            rstd[r] = 1.0 / (ms + eps).sqrt();
            for c in 0..cols {
                y[r * cols + c] = row[c] * rstd[r] * w.map_or(1.0, |w| w[c]);
            }
        }
        (y, rstd)
    }

    /// Naive backward through the explicit per-row Jacobian
    /// `d y_j / d x_i = w_j rstd (δ_ij - x_i x_j rstd² / n)`.
    fn backward_ref(
        x: &[f64],
        w: Option<&[f64]>,
        dy: &[f64],
        rows: usize,
        cols: usize,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>) {
        let (_, rstd) = forward_ref(x, None, rows, cols, eps);
        let n = cols as f64;
        let mut dx = vec![0.0; rows * cols];
        let mut dw = vec![0.0; cols];
        for r in 0..rows {
            let rs = rstd[r];
            for i in 0..cols {
                let mut s = 0.0;
                for j in 0..cols {
                    let delta = if i == j { 1.0 } else { 0.0 };
                    let jac = w.map_or(1.0, |w| w[j])
                        * rs
                        * (delta - x[r * cols + i] * x[r * cols + j] * rs * rs / n);
                    s += dy[r * cols + j] * jac;
                }
                dx[r * cols + i] = s;
            }
            for c in 0..cols {
                dw[c] += dy[r * cols + c] * x[r * cols + c] * rs;
            }
        }
        (dx, dw)
    }

    fn shapes() -> Vec<(usize, usize)> {
        vec![
            (1, 1),
            (1, 2),
            (3, 7),
            (5, 33),
            (17, 100),
            (300, 130),
            (64, 768),
        ]
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng(11);
        for (rows, cols) in shapes() {
            for (use_w, eps) in [(true, 1e-6), (false, 1e-5), (true, 0.0)] {
                let x = rng.vec(rows * cols, -2.0, 3.0);
                let wv = rng.vec(cols, 0.5, 1.5);
                let w = use_w.then_some(&wv[..]);
                let (yw, rw) = forward_ref(&x, w, rows, cols, eps);
                let mut y = vec![f64::NAN; rows * cols];
                let mut rs = vec![f64::NAN; rows];
                rms_norm_forward(&x, w, rows, cols, eps, &mut y, &mut rs);
                assert_close("rms y f64", &y, &yw, 1e-12, 1e-12);
                assert_close("rms rstd f64", &rs, &rw, 1e-12, 1e-12);

                let (x32, w32) = (to_f32(&x), to_f32(&wv));
                let w32o = use_w.then_some(&w32[..]);
                let w64 = to_f64(&w32);
                let (yw, rw) =
                    forward_ref(&to_f64(&x32), use_w.then_some(&w64[..]), rows, cols, eps);
                let mut y = vec![0f32; rows * cols];
                let mut rs = vec![0f32; rows];
                rms_norm_forward(&x32, w32o, rows, cols, eps, &mut y, &mut rs);
                assert_close("rms y f32", &to_f64(&y), &yw, 1e-5, 1e-6);
                assert_close("rms rstd f32", &to_f64(&rs), &rw, 1e-5, 1e-6);
            }
        }
    }

    #[test]
    fn backward_matches_reference_and_finite_differences() {
        let mut rng = Rng(21);
        let eps = 1e-6;
        for (rows, cols) in shapes() {
            for use_w in [true, false] {
                let x = rng.vec(rows * cols, -2.0, 2.0);
                let wv = rng.vec(cols, 0.5, 1.5);
                let w = use_w.then_some(&wv[..]);
                let dy = rng.vec(rows * cols, -1.0, 1.0);
                let (mut y, mut rs) = (vec![0.0; rows * cols], vec![0.0; rows]);
                rms_norm_forward(&x, w, rows, cols, eps, &mut y, &mut rs);
                let mut dx = vec![f64::NAN; rows * cols];
                let mut dw = vec![f64::NAN; cols];
                rms_norm_backward(&x, w, &rs, &dy, rows, cols, &mut dx, Some(&mut dw));
                let (dxr, dwr) = backward_ref(&x, w, &dy, rows, cols, eps);
                assert_close("rms dx", &dx, &dxr, 1e-9, 1e-10);
                assert_close("rms dw", &dw, &dwr, 1e-9, 1e-10);
                let mut dx2 = vec![f64::NAN; rows * cols];
                rms_norm_backward(&x, w, &rs, &dy, rows, cols, &mut dx2, None);
                assert_eq!(dx2, dx, "dx without dweight");

                if cols <= 200 {
                    let h = 1e-5;
                    // L = Σ dy · y as a function of x and of w.
                    let loss = |x: &[f64], w: Option<&[f64]>| {
                        let (mut y, mut rr) = (vec![0.0; rows * cols], vec![0.0; rows]);
                        rms_norm_forward(x, w, rows, cols, eps, &mut y, &mut rr);
                        dot64(&dy, &y)
                    };
                    for _ in 0..6 {
                        let i = rng.below(rows * cols);
                        let fd = central_diff(&x, i, h, |xs| loss(xs, w));
                        assert_fd("rms fd dx", fd, dx[i]);
                        if use_w {
                            let c = rng.below(cols);
                            let fd = central_diff(&wv, c, h, |ws| loss(&x, Some(ws)));
                            assert_fd("rms fd dw", fd, dw[c]);
                        }
                    }
                }

                // f32 against the f64 reference on rounded inputs.
                let (x32, dy32, w32) = (to_f32(&x), to_f32(&dy), to_f32(&wv));
                let w32o = use_w.then_some(&w32[..]);
                let (mut y32, mut r32) = (vec![0f32; rows * cols], vec![0f32; rows]);
                rms_norm_forward(&x32, w32o, rows, cols, eps, &mut y32, &mut r32);
                let mut dx32 = vec![0f32; rows * cols];
                let mut dw32 = vec![0f32; cols];
                rms_norm_backward(
                    &x32,
                    w32o,
                    &r32,
                    &dy32,
                    rows,
                    cols,
                    &mut dx32,
                    Some(&mut dw32),
                );
                let w64 = to_f64(&w32);
                let (dxr, dwr) = backward_ref(
                    &to_f64(&x32),
                    use_w.then_some(&w64[..]),
                    &to_f64(&dy32),
                    rows,
                    cols,
                    eps,
                );
                let scale = (rows as f64).sqrt();
                assert_close("rms dx f32", &to_f64(&dx32), &dxr, 1e-4, 1e-5);
                assert_close("rms dw f32", &to_f64(&dw32), &dwr, 1e-4, 1e-5 * scale);
            }
        }
    }

    #[test]
    fn weight_gradient_is_summed_in_row_order() {
        // f32 with values where summation order matters: bit-equal to the sequential row-order
        // sum, including on the column-parallel path.
        let (rows, cols) = (300, 257);
        let mut rng = Rng(31);
        let (x, dy) = order_sensitive_inputs(&mut rng, rows * cols);
        let (mut y, mut rs) = (vec![0f32; rows * cols], vec![0f32; rows]);
        rms_norm_forward(&x, None, rows, cols, 1e-6, &mut y, &mut rs);
        let mut dx = vec![0f32; rows * cols];
        let mut dw = vec![0f32; cols];
        rms_norm_backward(&x, None, &rs, &dy, rows, cols, &mut dx, Some(&mut dw));
        for c in 0..cols {
            let mut a = 0f32;
            for r in 0..rows {
                a += dy[r * cols + c] * (x[r * cols + c] * rs[r]);
            }
            assert_eq!(dw[c].to_bits(), a.to_bits(), "dw col {c}");
        }
    }
}

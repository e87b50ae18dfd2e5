//! Fused layer norm over the last dimension of a contiguous `[rows, cols]` buffer.
//!
//! Precision and order: statistics are computed in `T` by two passes over the row (mean, then
//! the mean of squared deviations), each sum in the fixed lane order of the crate's vector
//! helpers (independent of threads and CPU). Rows run in parallel when the buffer is large.
//! `dweight` / `dbias` are accumulated per column over rows in increasing row order, starting
//! from zero; large problems split the columns (never the rows) across threads, so the result
//! is the same for any thread count.

use rayon::prelude::*;

use super::strided::PAR_THRESHOLD;
use super::vecops::{self, for_each_row, simd};
use crate::Float;

/// `y = (x - mean) * rstd * weight + bias` row-wise, with `rstd = 1/sqrt(var + eps)` (biased
/// variance). Writes the per-row `mean` and `rstd` (length `rows`) for the backward pass.
/// `weight`/`bias` (length `cols`) are optional (absent = 1 and 0).
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_forward<T: Float>(
    x: &[T],
    weight: Option<&[T]>,
    bias: Option<&[T]>,
    rows: usize,
    cols: usize,
    eps: f64,
    y: &mut [T],
    mean: &mut [T],
    rstd: &mut [T],
) {
    assert_eq!(
        x.len(),
        rows * cols,
        "layer_norm_forward: x has {} elements, expected [{rows}, {cols}]",
        x.len()
    );
    assert_eq!(
        y.len(),
        rows * cols,
        "layer_norm_forward: y has {} elements, expected [{rows}, {cols}]",
        y.len()
    );
    assert!(
        mean.len() == rows && rstd.len() == rows,
        "layer_norm_forward: mean/rstd have {}/{} elements, expected {rows}",
        mean.len(),
        rstd.len()
    );
    for (what, p) in [("weight", weight), ("bias", bias)] {
        if let Some(p) = p {
            assert_eq!(
                p.len(),
                cols,
                "layer_norm_forward: {what} has {} elements, expected {cols}",
                p.len()
            );
        }
    }
    let eps = T::from_f64(eps);
    if cols == 0 {
        mean.fill(T::ZERO);
        rstd.fill(T::ONE / eps.sqrt());
        return;
    }
    let inv_n = T::ONE / T::from_f64(cols as f64);
    vecops::for_each_row_stats(
        y,
        cols,
        mean,
        rstd,
        #[inline(always)]
        |r, yr, mean_r, rstd_r| {
            let xr = &x[r * cols..(r + 1) * cols];
            let mu = vecops::sum(xr) * inv_n;
            let var = vecops::sum_map(xr, |v| (v - mu) * (v - mu)) * inv_n;
            let rs = T::ONE / (var + eps).sqrt();
            *mean_r = mu;
            *rstd_r = rs;
            match (weight, bias) {
                (Some(w), Some(b)) => {
                    for (((o, &v), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                        *o = (v - mu) * rs * w + b;
                    }
                }
                (Some(w), None) => {
                    for ((o, &v), &w) in yr.iter_mut().zip(xr).zip(w) {
                        *o = (v - mu) * rs * w;
                    }
                }
                (None, Some(b)) => {
                    for ((o, &v), &b) in yr.iter_mut().zip(xr).zip(b) {
                        *o = (v - mu) * rs + b;
                    }
                }
                (None, None) => {
                    for (o, &v) in yr.iter_mut().zip(xr) {
                        *o = (v - mu) * rs;
                    }
                }
            }
        },
    );
}

/// Backward of [`layer_norm_forward`]: writes (overwrites) `dx`, and `dweight` / `dbias`
/// (length `cols`, summed over rows in increasing row order) when given.
///
/// With `xhat = (x - mean) * rstd` and `g = weight * dy`:
/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`, `dweight = Σ_r dy * xhat`,
/// `dbias = Σ_r dy`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_backward<T: Float>(
    x: &[T],
    weight: Option<&[T]>,
    mean: &[T],
    rstd: &[T],
    dy: &[T],
    rows: usize,
    cols: usize,
    dx: &mut [T],
    dweight: Option<&mut [T]>,
    dbias: Option<&mut [T]>,
) {
    for (what, b) in [("x", x), ("dy", dy), ("dx", &*dx)] {
        assert_eq!(
            b.len(),
            rows * cols,
            "layer_norm_backward: {what} has {} elements, expected [{rows}, {cols}]",
            b.len()
        );
    }
    assert!(
        mean.len() == rows && rstd.len() == rows,
        "layer_norm_backward: mean/rstd have {}/{} elements, expected {rows}",
        mean.len(),
        rstd.len()
    );
    if let Some(w) = weight {
        assert_eq!(
            w.len(),
            cols,
            "layer_norm_backward: weight has {} elements, expected {cols}",
            w.len()
        );
    }
    for (what, p) in [("dweight", &dweight), ("dbias", &dbias)] {
        if let Some(p) = p {
            assert_eq!(
                p.len(),
                cols,
                "layer_norm_backward: {what} has {} elements, expected {cols}",
                p.len()
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
                let (mu, rs) = (mean[r], rstd[r]);
                match weight {
                    Some(w) => {
                        // Use dxr as scratch for g = w * dy.
                        for ((o, &g), &w) in dxr.iter_mut().zip(dyr).zip(w) {
                            *o = g * w;
                        }
                        let g_mean = vecops::sum(dxr) * inv_n;
                        let gx_mean = vecops::sum_map2(dxr, xr, |g, v| g * ((v - mu) * rs)) * inv_n;
                        for (o, &v) in dxr.iter_mut().zip(xr) {
                            let xhat = (v - mu) * rs;
                            *o = rs * (*o - g_mean - xhat * gx_mean);
                        }
                    }
                    None => {
                        let g_mean = vecops::sum(dyr) * inv_n;
                        let gx_mean = vecops::sum_map2(dyr, xr, |g, v| g * ((v - mu) * rs)) * inv_n;
                        for ((o, &v), &g) in dxr.iter_mut().zip(xr).zip(dyr) {
                            let xhat = (v - mu) * rs;
                            *o = rs * (g - g_mean - xhat * gx_mean);
                        }
                    }
                }
            },
        );
    }

    // Parameter gradients: per column, over rows in increasing order.
    let accumulate = |c0: usize, dw: Option<&mut [T]>, db: Option<&mut [T]>| {
        simd(
            #[inline(always)]
            || match (dw, db) {
                (Some(dw), Some(db)) => {
                    dw.fill(T::ZERO);
                    db.fill(T::ZERO);
                    let w = dw.len();
                    for r in 0..rows {
                        let base = r * cols + c0;
                        let (mu, rs) = (mean[r], rstd[r]);
                        for (((a, b), &v), &g) in dw
                            .iter_mut()
                            .zip(db.iter_mut())
                            .zip(&x[base..base + w])
                            .zip(&dy[base..base + w])
                        {
                            *a += g * ((v - mu) * rs);
                            *b += g;
                        }
                    }
                }
                (Some(dw), None) => {
                    dw.fill(T::ZERO);
                    let w = dw.len();
                    for r in 0..rows {
                        let base = r * cols + c0;
                        let (mu, rs) = (mean[r], rstd[r]);
                        for ((a, &v), &g) in dw
                            .iter_mut()
                            .zip(&x[base..base + w])
                            .zip(&dy[base..base + w])
                        {
                            *a += g * ((v - mu) * rs);
                        }
                    }
                }
                (None, Some(db)) => {
                    db.fill(T::ZERO);
                    let w = db.len();
                    for r in 0..rows {
                        let base = r * cols + c0;
                        for (b, &g) in db.iter_mut().zip(&dy[base..base + w]) {
                            *b += g;
                        }
                    }
                }
                (None, None) => {}
            },
        )
    };
    let large = rows * cols >= PAR_THRESHOLD && cols >= 128;
    if !large {
        accumulate(0, dweight, dbias);
        return;
    }
    // Column blocks of at least 64 columns, about four per thread.
    let threads = rayon::current_num_threads();
    let width = cols.div_ceil(threads * 4).max(64);
    match (dweight, dbias) {
        (Some(dw), Some(db)) => dw
            .par_chunks_mut(width)
            .zip(db.par_chunks_mut(width))
            .enumerate()
            .for_each(|(i, (dw, db))| accumulate(i * width, Some(dw), Some(db))),
        (Some(dw), None) => dw
            .par_chunks_mut(width)
            .enumerate()
            .for_each(|(i, dw)| accumulate(i * width, Some(dw), None)),
        (None, Some(db)) => db
            .par_chunks_mut(width)
            .enumerate()
            .for_each(|(i, db)| accumulate(i * width, None, Some(db))),
        (None, None) => {}
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{
        assert_close, assert_fd, central_diff, dot64, order_sensitive_inputs, to_f32, to_f64, Rng,
    };

    /// Naive f64 layer norm of a `[rows, cols]` buffer: (y, mean, rstd).
    fn forward_ref(
        x: &[f64],
        w: Option<&[f64]>,
        b: Option<&[f64]>,
        rows: usize,
        cols: usize,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let mut y = vec![0.0; rows * cols];
        let mut mean = vec![0.0; rows];
        let mut rstd = vec![0.0; rows];
        for r in 0..rows {
            let row = &x[r * cols..(r + 1) * cols];
            let mu = row.iter().sum::<f64>() / cols as f64;
            let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / cols as f64;
            let rs = 1.0 / (var + eps).sqrt();
            mean[r] = mu;
            rstd[r] = rs;
            for c in 0..cols {
                let wc = w.map_or(1.0, |w| w[c]);
                let bc = b.map_or(0.0, |b| b[c]);
                y[r * cols + c] = (row[c] - mu) * rs * wc + bc;
            }
        }
        (y, mean, rstd)
    }

    /// Naive backward: explicit per-row Jacobian (O(cols^2)), and parameter sums.
    fn backward_ref(
        x: &[f64],
        w: Option<&[f64]>,
        dy: &[f64],
        rows: usize,
        cols: usize,
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let (_, mean, rstd) = forward_ref(x, None, None, rows, cols, eps);
        let n = cols as f64;
        let mut dx = vec![0.0; rows * cols];
        let mut dw = vec![0.0; cols];
        let mut db = vec![0.0; cols];
        for r in 0..rows {
            let xhat: Vec<f64> = (0..cols)
                .map(|c| (x[r * cols + c] - mean[r]) * rstd[r])
                .collect();
            for i in 0..cols {
                // d xhat_j / d x_i = rstd (delta_ij - 1/n - xhat_i xhat_j / n)
                let mut s = 0.0;
                for j in 0..cols {
                    let delta = if i == j { 1.0 } else { 0.0 };
                    let g = dy[r * cols + j] * w.map_or(1.0, |w| w[j]);
                    s += g * rstd[r] * (delta - 1.0 / n - xhat[i] * xhat[j] / n);
                }
                dx[r * cols + i] = s;
            }
            for c in 0..cols {
                dw[c] += dy[r * cols + c] * xhat[c];
                db[c] += dy[r * cols + c];
            }
        }
        (dx, dw, db)
    }

    fn shapes() -> Vec<(usize, usize)> {
        vec![
            (1, 1),
            (1, 2),
            (3, 7),
            (4, 16),
            (5, 33),
            (17, 100),
            (300, 130),
            (64, 768),
        ]
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng(10);
        for (rows, cols) in shapes() {
            for (use_w, use_b) in [(true, true), (true, false), (false, true), (false, false)] {
                let x: Vec<f64> = rng
                    .vec(rows * cols, -2.0, 3.0)
                    .iter()
                    .map(|v| v + 5.0)
                    .collect();
                let w = rng.vec(cols, 0.5, 1.5);
                let b = rng.vec(cols, -1.0, 1.0);
                let (w, b) = (use_w.then_some(&w[..]), use_b.then_some(&b[..]));
                let eps = 1e-5;
                let (yw, mw, rw) = forward_ref(&x, w, b, rows, cols, eps);
                let mut y = vec![0.0; rows * cols];
                let (mut m, mut rs) = (vec![0.0; rows], vec![0.0; rows]);
                layer_norm_forward(&x, w, b, rows, cols, eps, &mut y, &mut m, &mut rs);
                assert_close("ln y f64", &y, &yw, 1e-9, 1e-9);
                assert_close("ln mean f64", &m, &mw, 1e-12, 1e-12);
                assert_close("ln rstd f64", &rs, &rw, 1e-9, 1e-9);

                let x32 = to_f32(&x);
                let (w32, b32) = (w.map(to_f32), b.map(to_f32));
                let (yw, mw, rw) = forward_ref(
                    &to_f64(&x32),
                    w32.as_deref().map(to_f64).as_deref(),
                    b32.as_deref().map(to_f64).as_deref(),
                    rows,
                    cols,
                    eps,
                );
                let mut y = vec![0f32; rows * cols];
                let (mut m, mut rs) = (vec![0f32; rows], vec![0f32; rows]);
                layer_norm_forward(
                    &x32,
                    w32.as_deref(),
                    b32.as_deref(),
                    rows,
                    cols,
                    eps,
                    &mut y,
                    &mut m,
                    &mut rs,
                );
                assert_close("ln y f32", &to_f64(&y), &yw, 1e-4, 2e-4);
                assert_close("ln mean f32", &to_f64(&m), &mw, 1e-5, 1e-5);
                assert_close("ln rstd f32", &to_f64(&rs), &rw, 1e-4, 1e-5);
            }
        }
    }

    #[test]
    fn backward_matches_reference_and_finite_differences() {
        let mut rng = Rng(20);
        let eps = 1e-5;
        for (rows, cols) in shapes() {
            for use_w in [true, false] {
                let x = rng.vec(rows * cols, -2.0, 2.0);
                let wv = rng.vec(cols, 0.5, 1.5);
                let w = use_w.then_some(&wv[..]);
                let dy = rng.vec(rows * cols, -1.0, 1.0);
                let (mut y, mut m, mut rs) =
                    (vec![0.0; rows * cols], vec![0.0; rows], vec![0.0; rows]);
                layer_norm_forward(&x, w, None, rows, cols, eps, &mut y, &mut m, &mut rs);
                let mut dx = vec![f64::NAN; rows * cols];
                let (mut dw, mut db) = (vec![f64::NAN; cols], vec![f64::NAN; cols]);
                layer_norm_backward(
                    &x,
                    w,
                    &m,
                    &rs,
                    &dy,
                    rows,
                    cols,
                    &mut dx,
                    Some(&mut dw),
                    Some(&mut db),
                );
                let (dxr, dwr, dbr) = backward_ref(&x, w, &dy, rows, cols, eps);
                assert_close("ln dx", &dx, &dxr, 1e-9, 1e-9);
                assert_close("ln dw", &dw, &dwr, 1e-9, 1e-9);
                assert_close("ln db", &db, &dbr, 1e-12, 1e-12);
                // Only one of the two parameter gradients.
                let mut dw2 = vec![0.0; cols];
                layer_norm_backward(
                    &x,
                    w,
                    &m,
                    &rs,
                    &dy,
                    rows,
                    cols,
                    &mut dx,
                    Some(&mut dw2),
                    None,
                );
                assert_eq!(dw2, dw);
                let mut db2 = vec![0.0; cols];
                layer_norm_backward(
                    &x,
                    w,
                    &m,
                    &rs,
                    &dy,
                    rows,
                    cols,
                    &mut dx,
                    None,
                    Some(&mut db2),
                );
                assert_eq!(db2, db);

                // Finite differences of L = Σ dy · y over one row, on a few x and w elements.
                if cols <= 200 {
                    let h = 1e-5;
                    // y for the given x and w.
                    let forward = |x: &[f64], w: Option<&[f64]>| {
                        let mut y = vec![0.0; rows * cols];
                        let (mut mm, mut rr) = (vec![0.0; rows], vec![0.0; rows]);
                        layer_norm_forward(x, w, None, rows, cols, eps, &mut y, &mut mm, &mut rr);
                        y
                    };
                    for _ in 0..6 {
                        let i = rng.below(rows * cols);
                        let row = i / cols * cols..(i / cols + 1) * cols;
                        let fd = central_diff(&x, i, h, |xs| {
                            dot64(&dy[row.clone()], &forward(xs, w)[row.clone()])
                        });
                        assert_fd("ln fd dx", fd, dx[i]);
                        if use_w {
                            let c = rng.below(cols);
                            let fd =
                                central_diff(&wv, c, h, |ws| dot64(&dy, &forward(&x, Some(ws))));
                            assert_fd("ln fd dw", fd, dw[c]);
                        }
                    }
                }

                // f32 against the f64 reference on the rounded inputs.
                let (x32, dy32, w32) = (to_f32(&x), to_f32(&dy), to_f32(&wv));
                let w32o = use_w.then_some(&w32[..]);
                let (mut y32, mut m32, mut r32) =
                    (vec![0f32; rows * cols], vec![0f32; rows], vec![0f32; rows]);
                layer_norm_forward(
                    &x32, w32o, None, rows, cols, eps, &mut y32, &mut m32, &mut r32,
                );
                let mut dx32 = vec![0f32; rows * cols];
                let (mut dw32, mut db32) = (vec![0f32; cols], vec![0f32; cols]);
                layer_norm_backward(
                    &x32,
                    w32o,
                    &m32,
                    &r32,
                    &dy32,
                    rows,
                    cols,
                    &mut dx32,
                    Some(&mut dw32),
                    Some(&mut db32),
                );
                let w64 = to_f64(&w32);
                let (dxr, dwr, dbr) = backward_ref(
                    &to_f64(&x32),
                    use_w.then_some(&w64[..]),
                    &to_f64(&dy32),
                    rows,
                    cols,
                    eps,
                );
                let scale = (rows as f64).sqrt();
                assert_close("ln dx f32", &to_f64(&dx32), &dxr, 1e-4, 1e-4);
                assert_close("ln dw f32", &to_f64(&dw32), &dwr, 1e-4, 1e-5 * scale);
                assert_close("ln db f32", &to_f64(&db32), &dbr, 1e-4, 1e-5 * scale);
            }
        }
    }

    #[test]
    fn parameter_gradients_are_summed_in_row_order() {
        // f32 with values designed so that summation order matters; the result must equal the
        // sequential row-order sum bit for bit, including on the column-parallel path.
        let (rows, cols) = (300, 257);
        let mut rng = Rng(30);
        let (x, dy) = order_sensitive_inputs(&mut rng, rows * cols);
        let (mut y, mut m, mut rs) = (vec![0f32; rows * cols], vec![0f32; rows], vec![0f32; rows]);
        layer_norm_forward(&x, None, None, rows, cols, 1e-5, &mut y, &mut m, &mut rs);
        let mut dx = vec![0f32; rows * cols];
        let (mut dw, mut db) = (vec![0f32; cols], vec![0f32; cols]);
        layer_norm_backward(
            &x,
            None,
            &m,
            &rs,
            &dy,
            rows,
            cols,
            &mut dx,
            Some(&mut dw),
            Some(&mut db),
        );
        for c in 0..cols {
            let (mut a, mut b) = (0f32, 0f32);
            for r in 0..rows {
                let xhat = (x[r * cols + c] - m[r]) * rs[r];
                a += dy[r * cols + c] * xhat;
                b += dy[r * cols + c];
            }
            assert_eq!(dw[c].to_bits(), a.to_bits(), "dw col {c}");
            assert_eq!(db[c].to_bits(), b.to_bits(), "db col {c}");
        }
    }
}

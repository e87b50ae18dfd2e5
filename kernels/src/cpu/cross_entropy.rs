//! Fused cross-entropy over logits `[rows, cols]` and integer targets, with its gradient.
//!
//! Row-wise and fused: no probability matrix is kept; the backward recomputes
//! `softmax = exp(logits - lse)` on the fly. Rows run in parallel when the problem is large; each
//! row's sums use the fixed lane order of the crate's vector helpers, in `T`.

use super::fastmath::exp;
use super::vecops::{self, for_each_index2, for_each_row};
use crate::{Float, KernelError};

/// Whether row `r`'s target is ignored.
#[inline]
fn ignored(target: i64, ignore_index: Option<i64>) -> bool {
    ignore_index == Some(target)
}

/// Per row: `loss[r] = logsumexp(logits[r]) - logits[r, targets[r]]`, and `lse[r]` is written
/// for the backward pass. Rows whose target equals `ignore_index` get loss 0. A target outside
/// `0..cols` (and not ignored) is an error naming the row and the value.
///
/// Targets are validated before anything is written. `lse` is written for ignored rows too.
pub fn cross_entropy_forward<T: Float>(
    logits: &[T],
    targets: &[i64],
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
    loss: &mut [T],
    lse: &mut [T],
) -> Result<(), KernelError> {
    assert_eq!(
        logits.len(),
        rows * cols,
        "cross_entropy_forward: logits have {} elements, expected [{rows}, {cols}]",
        logits.len()
    );
    assert!(
        targets.len() == rows && loss.len() == rows && lse.len() == rows,
        "cross_entropy_forward: targets/loss/lse have {}/{}/{} elements, expected {rows}",
        targets.len(),
        loss.len(),
        lse.len()
    );
    for (r, &t) in targets.iter().enumerate() {
        if !ignored(t, ignore_index) && (t < 0 || t as u64 >= cols as u64) {
            return Err(KernelError(format!(
                "cross_entropy: target {t} at row {r} is outside 0..{cols}"
            )));
        }
    }
    for_each_index2(
        loss,
        lse,
        cols,
        #[inline(always)]
        |r, loss_r, lse_r| {
            let row = &logits[r * cols..(r + 1) * cols];
            let m = vecops::max(row);
            let s = vecops::sum_map(row, |v| exp(v - m));
            let l = m + s.ln();
            *lse_r = l;
            let t = targets[r];
            *loss_r = if ignored(t, ignore_index) {
                T::ZERO
            } else {
                l - row[t as usize]
            };
        },
    );
    Ok(())
}

/// `dlogits[r] = dloss[r] * (softmax(logits[r]) - onehot(targets[r]))`, zero for ignored rows;
/// overwrites `dlogits`.
///
/// Targets are assumed valid (as checked by [`cross_entropy_forward`]); an out-of-range target
/// of a non-ignored row panics.
#[allow(clippy::too_many_arguments)]
pub fn cross_entropy_backward<T: Float>(
    logits: &[T],
    lse: &[T],
    targets: &[i64],
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
    dloss: &[T],
    dlogits: &mut [T],
) {
    assert!(
        logits.len() == rows * cols && dlogits.len() == rows * cols,
        "cross_entropy_backward: logits/dlogits have {}/{} elements, expected [{rows}, {cols}]",
        logits.len(),
        dlogits.len()
    );
    assert!(
        lse.len() == rows && targets.len() == rows && dloss.len() == rows,
        "cross_entropy_backward: lse/targets/dloss have {}/{}/{} elements, expected {rows}",
        lse.len(),
        targets.len(),
        dloss.len()
    );
    for_each_row(
        dlogits,
        cols,
        #[inline(always)]
        |r, out| {
            let t = targets[r];
            if ignored(t, ignore_index) {
                out.fill(T::ZERO);
                return;
            }
            assert!(
                t >= 0 && (t as u64) < cols as u64,
                "cross_entropy_backward: target {t} at row {r} is outside 0..{cols}"
            );
            let row = &logits[r * cols..(r + 1) * cols];
            let (l, g) = (lse[r], dloss[r]);
            for (o, &v) in out.iter_mut().zip(row) {
                *o = g * exp(v - l);
            }
            out[t as usize] -= g;
        },
    );
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, dot64, to_f32, to_f64, Rng};

    /// Naive f64 reference: (loss, lse) per row.
    fn forward_ref(
        logits: &[f64],
        targets: &[i64],
        cols: usize,
        ignore: Option<i64>,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut loss = Vec::new();
        let mut lse = Vec::new();
        for (r, &t) in targets.iter().enumerate() {
            let row = &logits[r * cols..(r + 1) * cols];
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            lse.push(l);
            loss.push(if Some(t) == ignore {
                0.0
            } else {
                l - row[t as usize]
            });
        }
        (loss, lse)
    }

    fn problem(
        rng: &mut Rng,
        rows: usize,
        cols: usize,
        ignore: Option<i64>,
    ) -> (Vec<f64>, Vec<i64>) {
        let logits = rng.vec(rows * cols, -6.0, 6.0);
        let targets = (0..rows)
            .map(|_| match ignore {
                Some(ii) if rng.below(4) == 0 => ii,
                _ => rng.below(cols) as i64,
            })
            .collect();
        (logits, targets)
    }

    fn shapes() -> Vec<(usize, usize)> {
        vec![
            (1, 1),
            (1, 5),
            (7, 3),
            (16, 33),
            (9, 1000),
            (128, 300),
            (3, 50_257),
        ]
    }

    #[test]
    fn forward_matches_reference() {
        let mut rng = Rng(100);
        for (rows, cols) in shapes() {
            for ignore in [None, Some(-100), Some(0)] {
                let (logits, targets) = problem(&mut rng, rows, cols, ignore);
                let (lw, sw) = forward_ref(&logits, &targets, cols, ignore);
                let (mut loss, mut lse) = (vec![f64::NAN; rows], vec![f64::NAN; rows]);
                cross_entropy_forward(&logits, &targets, rows, cols, ignore, &mut loss, &mut lse)
                    .unwrap();
                assert_close("ce loss", &loss, &lw, 1e-12, 1e-12);
                assert_close("ce lse", &lse, &sw, 1e-12, 1e-12);
                for (r, &t) in targets.iter().enumerate() {
                    if Some(t) == ignore {
                        assert_eq!(loss[r], 0.0);
                    }
                }

                let l32 = to_f32(&logits);
                let (lw, sw) = forward_ref(&to_f64(&l32), &targets, cols, ignore);
                let (mut loss, mut lse) = (vec![f32::NAN; rows], vec![f32::NAN; rows]);
                cross_entropy_forward(&l32, &targets, rows, cols, ignore, &mut loss, &mut lse)
                    .unwrap();
                assert_close("ce loss f32", &to_f64(&loss), &lw, 1e-5, 1e-5);
                assert_close("ce lse f32", &to_f64(&lse), &sw, 1e-5, 1e-5);
            }
        }
    }

    #[test]
    fn invalid_targets_are_errors() {
        let logits = [0.0f32; 6];
        let (mut loss, mut lse) = ([7.0f32; 2], [7.0f32; 2]);
        let err =
            cross_entropy_forward(&logits, &[1, 3], 2, 3, None, &mut loss, &mut lse).unwrap_err();
        assert!(err.0.contains("row 1") && err.0.contains('3'), "{err}");
        assert_eq!(loss, [7.0; 2], "nothing written on error");
        let err = cross_entropy_forward(&logits, &[-1, 0], 2, 3, Some(-100), &mut loss, &mut lse)
            .unwrap_err();
        assert!(err.0.contains("row 0") && err.0.contains("-1"), "{err}");
        cross_entropy_forward(&logits, &[-100, 2], 2, 3, Some(-100), &mut loss, &mut lse).unwrap();
        assert_eq!(loss[0], 0.0);
        assert!((loss[1] - 3f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn backward_matches_reference_and_finite_differences() {
        let mut rng = Rng(200);
        for (rows, cols) in shapes() {
            for ignore in [None, Some(-100)] {
                let (logits, targets) = problem(&mut rng, rows, cols, ignore);
                let dloss = rng.vec(rows, -2.0, 2.0);
                let (mut loss, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
                cross_entropy_forward(&logits, &targets, rows, cols, ignore, &mut loss, &mut lse)
                    .unwrap();
                let mut dl = vec![f64::NAN; rows * cols];
                cross_entropy_backward(
                    &logits, &lse, &targets, rows, cols, ignore, &dloss, &mut dl,
                );
                // Reference: explicit softmax minus one-hot.
                let mut want = vec![0.0; rows * cols];
                for r in 0..rows {
                    if Some(targets[r]) == ignore {
                        continue;
                    }
                    let row = &logits[r * cols..(r + 1) * cols];
                    let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
                    for c in 0..cols {
                        let p = (row[c] - m).exp() / s;
                        let onehot = if c as i64 == targets[r] { 1.0 } else { 0.0 };
                        want[r * cols + c] = dloss[r] * (p - onehot);
                    }
                }
                assert_close("ce dlogits", &dl, &want, 1e-10, 1e-14);

                // Finite differences of L = Σ dloss · loss on a few logits.
                if cols <= 1000 {
                    let h = 1e-5;
                    for _ in 0..8 {
                        let i = rng.below(rows * cols);
                        let (mut lp, mut lm) = (logits.clone(), logits.clone());
                        lp[i] += h;
                        lm[i] -= h;
                        let (mut a, mut b) = (vec![0.0; rows], vec![0.0; rows]);
                        cross_entropy_forward(&lp, &targets, rows, cols, ignore, &mut a, &mut b)
                            .unwrap();
                        let fp = dot64(&dloss, &a);
                        cross_entropy_forward(&lm, &targets, rows, cols, ignore, &mut a, &mut b)
                            .unwrap();
                        let fm = dot64(&dloss, &a);
                        let fd = (fp - fm) / (2.0 * h);
                        assert!(
                            (fd - dl[i]).abs() <= 1e-7 * (1.0 + fd.abs()),
                            "ce fd {fd} vs {}",
                            dl[i]
                        );
                    }
                }

                // f32.
                let (l32, d32) = (to_f32(&logits), to_f32(&dloss));
                let (mut loss32, mut lse32) = (vec![0f32; rows], vec![0f32; rows]);
                cross_entropy_forward(&l32, &targets, rows, cols, ignore, &mut loss32, &mut lse32)
                    .unwrap();
                let mut dl32 = vec![0f32; rows * cols];
                cross_entropy_backward(&l32, &lse32, &targets, rows, cols, ignore, &d32, &mut dl32);
                assert_close("ce dlogits f32", &to_f64(&dl32), &want, 1e-4, 1e-6);
            }
        }
    }
}

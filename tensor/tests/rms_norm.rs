//! RMSNorm, forward and backward, against a float64 reference written here with its own index
//! arithmetic, over random (non-contiguous) layouts in f64, f32 and bf16; and its argument
//! errors.

mod common;

use common::*;
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

/// `(y, rstd, dx, dw)` of RMSNorm over rows of `cols`, from the definition and the explicit
/// per-row Jacobian `dy_j/dx_i = w_j r (δ_ij - x_i x_j r² / n)`.
fn ref_rms(
    x: &[f64],
    w: Option<&[f64]>,
    dy: &[f64],
    cols: usize,
    eps: f64,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let rows = x.len() / cols;
    let n = cols as f64;
    let (mut y, mut rstd, mut dx, mut dw) = (
        vec![0.0; x.len()],
        vec![0.0; rows],
        vec![0.0; x.len()],
        vec![0.0; cols],
    );
    let wc = |c: usize| w.map_or(1.0, |w| w[c]);
    for r in 0..rows {
        let xr = &x[r * cols..(r + 1) * cols];
        let rs = 1.0 / (xr.iter().map(|v| v * v).sum::<f64>() / n + eps).sqrt();
        rstd[r] = rs;
        for c in 0..cols {
            y[r * cols + c] = xr[c] * rs * wc(c);
            dw[c] += dy[r * cols + c] * xr[c] * rs;
        }
        for i in 0..cols {
            dx[r * cols + i] = (0..cols)
                .map(|j| {
                    let delta = if i == j { 1.0 } else { 0.0 };
                    dy[r * cols + j] * wc(j) * rs * (delta - xr[i] * xr[j] * rs * rs / n)
                })
                .sum();
        }
    }
    (y, rstd, dx, dw)
}

fn rms_norm_matches_the_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    for case in 0..12 {
        let dims = rng.dims(1, 4, 9);
        let cols = *dims.last().unwrap();
        let x = rng.vec(numel(&dims), -2.0, 2.0);
        let w = rng.vec(cols, 0.5, 1.5);
        let dy = rng.vec(numel(&dims), -1.0, 1.0);
        let eps = [1e-6, 1e-5, 0.0][case % 3];
        let use_w = case % 4 != 3;
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let (xr, wr, dr) = (
                round_to(&x, dtype),
                round_to(&w, dtype),
                round_to(&dy, dtype),
            );
            let (y, rstd, dx, dw) = ref_rms(&xr, use_w.then_some(&wr[..]), &dr, cols, eps);
            let tx = strided_on(device, &x, &dims, &Lay::random(&mut rng, dims.len()), dtype);
            let tw = strided_on(device, &w, &[cols], &Lay::random(&mut rng, 1), dtype);
            let tdy = strided_on(
                device,
                &dy,
                &dims,
                &Lay::random(&mut rng, dims.len()),
                dtype,
            );
            let tw = use_w.then_some(&tw);
            let o = tx.rms_norm(tw, eps).unwrap();
            let (rtol, atol) = tols(dtype);
            let what = format!("rms_norm {dims:?} {dtype} weight={use_w} eps={eps}");
            check(&o.y, &dims, &y, rtol, atol, &what);
            assert_eq!(o.y.dtype(), dtype);
            let rows = numel(&dims) / cols;
            check(
                &o.rstd,
                &[rows],
                &rstd,
                rtol,
                atol,
                &format!("rstd: {what}"),
            );
            let (gx, gw) = tx.rms_norm_backward(tw, &o.rstd, &tdy, use_w).unwrap();
            let gt = if dtype == DType::F64 {
                (1e-10, 1e-12)
            } else {
                (rtol * 10.0, atol * 10.0)
            };
            check(&gx, &dims, &dx, gt.0, gt.1, &format!("dx: {what}"));
            if use_w {
                let gw = gw.unwrap();
                assert_eq!(gw.dtype(), dtype);
                check(
                    &gw,
                    &[cols],
                    &dw,
                    gt.0,
                    gt.1 * (rows as f64).sqrt(),
                    &format!("dw: {what}"),
                );
            } else {
                assert!(gw.is_none());
            }
        }
    }
    Ok(())
}
test_device!(rms_norm_matches_the_reference);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn rms_norm_errors() {
    let x = Tensor::ones((2, 3), DType::F32, Device::Cpu).unwrap();
    for eps in [-1e-6, f64::NAN, f64::INFINITY] {
        let e = x.rms_norm(None, eps).unwrap_err().to_string();
        assert!(e.contains("eps") && e.contains("[2, 3]"), "{e}");
    }
    let w = Tensor::ones(2, DType::F32, Device::Cpu).unwrap();
    let e = x.rms_norm(Some(&w), 1e-6).unwrap_err().to_string();
    assert!(e.contains("[2, 3]") && e.contains("[2]"), "{e}");
    let ids = Tensor::ones((2, 3), DType::I64, Device::Cpu).unwrap();
    assert!(ids.rms_norm(None, 1e-6).is_err());
    let o = x.rms_norm(None, 1e-6).unwrap();
    let dy = Tensor::ones((3, 2), DType::F32, Device::Cpu).unwrap();
    assert!(x.rms_norm_backward(None, &o.rstd, &dy, false).is_err());
    assert!(
        x.rms_norm_backward(None, &o.rstd, &x, true).is_err(),
        "weight grad without weight"
    );
}

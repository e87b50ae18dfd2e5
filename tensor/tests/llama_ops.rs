//! RMSNorm, rotary position embedding and SwiGLU, forward and backward, against float64
//! references written here with their own index arithmetic, over random (non-contiguous)
//! layouts in f64, f32 and bf16; and their argument errors.

mod common;

use common::*;
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

fn tols(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-6),
        _ => (2e-2, 2e-2),
    }
}

// ----- RMSNorm -----

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

// ----- rotary embedding -----

/// RoPE of `[b, t, h, d]` values from the definition (rotate-half pairs `i`, `i + d/2`; angle
/// `pos / theta^(2i/d)`, negated when `sign` is -1).
fn ref_rope(x: &[f64], dims: &[usize], pos: &[i64], theta: f64, sign: f64) -> Vec<f64> {
    let (t, h, d) = (dims[1], dims[2], dims[3]);
    let mut y = vec![0.0; x.len()];
    for (f, yv) in y.iter_mut().enumerate() {
        let idx = unravel(f, dims);
        let (ti, c) = (idx[1], idx[3]);
        let i = c % (d / 2);
        let a = sign * pos[ti] as f64 / theta.powf(2.0 * i as f64 / d as f64);
        let at = |cc: usize| x[ravel(&[idx[0], ti, idx[2], cc], &[dims[0], t, h, d])];
        *yv = if c < d / 2 {
            at(c) * a.cos() - at(c + d / 2) * a.sin()
        } else {
            at(c) * a.cos() + at(c - d / 2) * a.sin()
        };
    }
    y
}

fn rotary_embedding_matches_the_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    for &(dims, theta) in &[
        ([1usize, 1, 1, 2], 10_000.0),
        ([2, 5, 3, 8], 10_000.0),
        ([2, 7, 2, 16], 500_000.0),
        ([1, 40, 4, 64], 10_000.0),
    ] {
        let x = rng.vec(numel(&dims), -2.0, 2.0);
        let dy = rng.vec(numel(&dims), -1.0, 1.0);
        // Positions with an offset and a gap (a KV-cache continuation, packed sequences).
        let pos: Vec<i64> = (0..dims[1] as i64)
            .map(|p| if p < 3 { p + 17 } else { 2 * p })
            .collect();
        for (pdt, dtype) in [
            (DType::I64, DType::F64),
            (DType::U32, DType::F32),
            (DType::I64, DType::BF16),
        ] {
            let tp = Tensor::from_vec(pos.clone(), dims[1], device)
                .unwrap()
                .to_dtype(pdt)
                .unwrap();
            let (xr, dr) = (round_to(&x, dtype), round_to(&dy, dtype));
            let tx = strided_on(device, &x, &dims, &Lay::random(&mut rng, 4), dtype);
            let y = tx.rotary_embedding(&tp, theta).unwrap();
            let (rtol, atol) = tols(dtype);
            let what = format!("rope {dims:?} theta {theta} {dtype}");
            check(
                &y,
                &dims,
                &ref_rope(&xr, &dims, &pos, theta, 1.0),
                rtol,
                atol,
                &what,
            );
            assert_eq!(y.dtype(), dtype);
            let tdy = strided_on(device, &dy, &dims, &Lay::random(&mut rng, 4), dtype);
            let g = tdy.rotary_embedding_backward(&tp, theta).unwrap();
            check(
                &g,
                &dims,
                &ref_rope(&dr, &dims, &pos, theta, -1.0),
                rtol,
                atol,
                &format!("backward: {what}"),
            );
        }
    }
    Ok(())
}
test_device!(rotary_embedding_matches_the_reference);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn rotary_embedding_errors() {
    let x = Tensor::ones((1, 3, 2, 4), DType::F32, Device::Cpu).unwrap();
    let p = Tensor::arange(0, 3, DType::I64, Device::Cpu).unwrap();
    let e = x.rotary_embedding(&Tensor::arange(0, 4, DType::I64, Device::Cpu).unwrap(), 1e4);
    let e = e.unwrap_err().to_string();
    assert!(e.contains("[4]") && e.contains("[1, 3, 2, 4]"), "{e}");
    let odd = Tensor::ones((1, 3, 2, 5), DType::F32, Device::Cpu).unwrap();
    let e = odd.rotary_embedding(&p, 1e4).unwrap_err().to_string();
    assert!(e.contains("[1, 3, 2, 5]"), "{e}");
    let flat = Tensor::ones((3, 8), DType::F32, Device::Cpu).unwrap();
    assert!(flat.rotary_embedding(&p, 1e4).is_err());
    for theta in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(x.rotary_embedding(&p, theta).is_err(), "theta {theta}");
    }
    let pf = p.to_dtype(DType::F32).unwrap();
    assert!(x.rotary_embedding(&pf, 1e4).is_err(), "float positions");
}

// ----- SwiGLU -----

fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

fn swiglu_matches_the_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    for _ in 0..8 {
        let dims = rng.dims(1, 4, 9);
        let g = rng.vec(numel(&dims), -6.0, 6.0);
        let u = rng.vec(numel(&dims), -2.0, 2.0);
        let dy = rng.vec(numel(&dims), -1.0, 1.0);
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let (gr, ur, dr) = (
                round_to(&g, dtype),
                round_to(&u, dtype),
                round_to(&dy, dtype),
            );
            let y: Vec<f64> = gr.iter().zip(&ur).map(|(&g, &u)| silu(g) * u).collect();
            let sig = |g: f64| 1.0 / (1.0 + (-g).exp());
            let dg: Vec<f64> = (0..gr.len())
                .map(|i| dr[i] * ur[i] * (sig(gr[i]) + gr[i] * sig(gr[i]) * (1.0 - sig(gr[i]))))
                .collect();
            let du: Vec<f64> = (0..gr.len()).map(|i| dr[i] * silu(gr[i])).collect();
            let r = dims.len();
            let tg = strided_on(device, &g, &dims, &Lay::random(&mut rng, r), dtype);
            let tu = strided_on(device, &u, &dims, &Lay::random(&mut rng, r), dtype);
            let td = strided_on(device, &dy, &dims, &Lay::random(&mut rng, r), dtype);
            let (rtol, atol) = tols(dtype);
            let what = format!("swiglu {dims:?} {dtype}");
            let out = Tensor::swiglu(&tg, &tu).unwrap();
            check(&out, &dims, &y, rtol, atol, &what);
            assert_eq!(out.dtype(), dtype);
            let (a, b) = Tensor::swiglu_backward(&tg, &tu, &td).unwrap();
            let at = if dtype == DType::F32 { 1e-5 } else { atol };
            check(&a, &dims, &dg, rtol, at, &format!("dgate: {what}"));
            check(&b, &dims, &du, rtol, atol, &format!("dup: {what}"));
        }
    }
    let a = Tensor::ones((2, 3), DType::F32, device).unwrap();
    let b = Tensor::ones((3, 2), DType::F32, device).unwrap();
    let e = Tensor::swiglu(&a, &b).unwrap_err().to_string();
    assert!(e.contains("[2, 3]") && e.contains("[3, 2]"), "{e}");
    let c = a.to_dtype(DType::F64).unwrap();
    assert!(Tensor::swiglu(&a, &c).is_err(), "dtype mismatch");
    Ok(())
}
test_device!(swiglu_matches_the_reference);

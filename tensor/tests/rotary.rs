//! Rotary position embedding, both directions, against a float64 reference written here with its
//! own index arithmetic, over random (non-contiguous) layouts in f64, f32 and bf16; and its
//! argument errors.

mod common;

use common::*;
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

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

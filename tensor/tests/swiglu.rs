//! SwiGLU, forward and backward, against a float64 reference written here, over random
//! (non-contiguous) layouts in f64, f32 and bf16; and its argument errors.

mod common;

use common::*;
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

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

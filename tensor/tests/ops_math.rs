//! `sin`, `cos`, `silu`, `clamp` (with the silu/clamp backward passes) and `logsumexp` against
//! float64 references written here (plain loops, own index arithmetic), on random shapes and
//! non-contiguous layouts, in f64 (tight), f32 and the half types; plus their error cases.

mod common;

use common::*;
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

type Un = Box<dyn Fn(&Tensor) -> Result<Tensor>>;
type Case = (&'static str, Un, fn(f64) -> f64);

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f64) -> f64 {
    x * sigmoid(x)
}

/// Clamp as PyTorch defines it: NaN stays NaN.
fn clamp_ref(x: f64, lo: f64, hi: f64) -> f64 {
    if x.is_nan() {
        x
    } else if x < lo {
        lo
    } else if x > hi {
        hi
    } else {
        x
    }
}

fn ops() -> Vec<Case> {
    vec![
        ("sin", Box::new(|t| t.sin()), f64::sin),
        ("cos", Box::new(|t| t.cos()), f64::cos),
        ("silu", Box::new(|t| t.silu()), silu),
        (
            "clamp(-1, 1.5)",
            Box::new(|t| t.clamp(Some(-1.0), Some(1.5))),
            |x| clamp_ref(x, -1.0, 1.5),
        ),
        (
            "clamp(min 0.25)",
            Box::new(|t| t.clamp(Some(0.25), None)),
            |x| clamp_ref(x, 0.25, f64::INFINITY),
        ),
        (
            "clamp(max -0.5)",
            Box::new(|t| t.clamp(None, Some(-0.5))),
            |x| clamp_ref(x, f64::NEG_INFINITY, -0.5),
        ),
    ]
}

fn unary_math_matches_reference_on_strided_layouts(device: Device) -> Result<()> {
    let mut rng = Rng::new(21);
    for it in 0..8 {
        let dims = rng.dims(0, 4, 5);
        for (k, (name, op, f)) in ops().into_iter().enumerate() {
            let x = uniform_vals(7000 + 10 * it + k as u64, numel(&dims), -7.0, 7.0);
            for dtype in [DType::F64, DType::F32] {
                let lay = Lay::random(&mut rng, dims.len());
                let t = strided_on(device, &x, &dims, &lay, dtype);
                let out = op(&t).unwrap();
                assert_eq!(out.dtype(), dtype, "{name}");
                // Bounds rounded to the dtype are exact here (-1, 1.5, 0.25, -0.5).
                let exp = ref_unary(&round_to(&x, dtype), f);
                let (rtol, atol) = if dtype == DType::F64 {
                    F64_TOL
                } else {
                    F32_TOL
                };
                check(
                    &out,
                    &dims,
                    &exp,
                    rtol,
                    atol,
                    &format!("{name} {dims:?} {lay:?} {dtype}"),
                );
            }
        }
    }
    Ok(())
}
test_device!(unary_math_matches_reference_on_strided_layouts);

fn unary_math_in_half_types_computes_in_f32(device: Device) -> Result<()> {
    let x = uniform_vals(31, 40, -4.0, 4.0);
    for (dtype, ulp) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        let xr = round_to(&x, dtype);
        let (xt, _) = ref_permute(&xr, &[5, 8], &[1, 0]);
        let t = tensor_on(device, &x, &[5, 8], dtype).t().unwrap();
        for (name, op, f) in ops() {
            let out = op(&t).unwrap();
            assert_eq!(out.dtype(), dtype);
            // One rounding of the (f32-accurate) result to the half type.
            assert_close(
                &vals(&out),
                &ref_unary(&xt, f),
                ulp * 1.01,
                1e-6,
                &format!("{name} in {dtype}"),
            );
        }
    }
    Ok(())
}
test_device!(unary_math_in_half_types_computes_in_f32);

fn special_values(device: Device) -> Result<()> {
    let inf = f64::INFINITY;
    let t = tensor_on(
        device,
        &[f64::NAN, -inf, inf, -1.0, 1.0, 0.0],
        &[6],
        DType::F64,
    );
    let c = vals(&t.clamp(Some(-1.0), Some(1.0)).unwrap());
    assert!(c[0].is_nan(), "clamp keeps NaN");
    assert_eq!(&c[1..], &[-1.0, 1.0, -1.0, 1.0, 0.0]);
    // SiLU saturates without NaN in f32 (x * sigmoid(x) -> 0 on the left, x on the right).
    let s = vals(
        &tensor_on(device, &[-200.0, -90.0, 90.0, 200.0], &[4], DType::F32)
            .silu()
            .unwrap(),
    );
    assert_eq!(s, vec![0.0, 0.0, 90.0, 200.0]);
    let s = vals(
        &tensor_on(device, &[-inf, inf], &[2], DType::F64)
            .sin()
            .unwrap(),
    );
    assert!(s.iter().all(|v| v.is_nan()), "sin(±inf) is NaN");
    Ok(())
}
test_device!(special_values);

fn silu_and_clamp_backward_match_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(22);
    for it in 0..6 {
        let dims = rng.dims(1, 4, 5);
        let n = numel(&dims);
        let x = uniform_vals(7100 + it, n, -6.0, 6.0);
        let dy = uniform_vals(7200 + it, n, -2.0, 2.0);
        // silu'(x) by a central difference of the f64 reference (step 1e-5: error ~1e-10).
        let h = 1e-5;
        let silu_grad: Vec<f64> = (0..n)
            .map(|i| dy[i] * (silu(x[i] + h) - silu(x[i] - h)) / (2.0 * h))
            .collect();
        let (lo, hi) = (-1.0, 2.5);
        let clamp_grad: Vec<f64> = (0..n)
            .map(|i| if x[i] >= lo && x[i] <= hi { dy[i] } else { 0.0 })
            .collect();
        for dtype in [DType::F64, DType::F32] {
            let tx = strided_on(device, &x, &dims, &Lay::random(&mut rng, dims.len()), dtype);
            let tg = strided_on(
                device,
                &dy,
                &dims,
                &Lay::random(&mut rng, dims.len()),
                dtype,
            );
            let (rtol, atol) = if dtype == DType::F64 {
                (1e-8, 1e-9)
            } else {
                (1e-5, 1e-5)
            };
            let what = format!("silu_backward {dims:?} {dtype}");
            let g = tx.silu_backward(&tg).unwrap();
            assert_eq!(g.dtype(), dtype);
            check(&g, &dims, &silu_grad, rtol, atol, &what);
            if dtype == DType::F64 {
                let g = tx.clamp_backward(&tg, Some(lo), Some(hi)).unwrap();
                check(&g, &dims, &clamp_grad, 0.0, 0.0, "clamp_backward");
            }
        }
    }
    // The bounds themselves pass the gradient (PyTorch's convention).
    let x = tensor_on(device, &[-1.0, -0.999, 1.0, 1.001, 0.0], &[5], DType::F64);
    let g = tensor_on(device, &[1.0; 5], &[5], DType::F64);
    assert_eq!(
        vals(&x.clamp_backward(&g, Some(-1.0), Some(1.0)).unwrap()),
        vec![1.0, 1.0, 1.0, 0.0, 1.0]
    );
    assert_eq!(
        vals(&x.clamp_backward(&g, None, Some(0.0)).unwrap()),
        vec![1.0, 1.0, 0.0, 0.0, 1.0]
    );
    Ok(())
}
test_device!(silu_and_clamp_backward_match_reference);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn math_errors() {
    let x = tensor(&[1.0, 2.0, 3.0], &[3], DType::F32);
    let e = x.clamp(None, None).unwrap_err().to_string();
    assert!(e.contains("clamp") && e.contains("min and max"), "{e}");
    let e = x.clamp(Some(2.0), Some(1.0)).unwrap_err().to_string();
    assert!(e.contains("min 2") && e.contains("max 1"), "{e}");
    assert!(x.clamp(Some(f64::NAN), None).is_err(), "NaN bound");
    let i = Tensor::from_vec(vec![1i64, 2], 2, Device::Cpu).unwrap();
    for (name, r) in [
        ("sin", i.sin()),
        ("cos", i.cos()),
        ("silu", i.silu()),
        ("clamp", i.clamp(Some(0.0), None)),
        ("logsumexp", i.logsumexp(0, false)),
    ] {
        let e = r.unwrap_err().to_string();
        assert!(e.contains(name) && e.contains("I64"), "{name}: {e}");
    }
    let g = tensor(&[1.0, 2.0], &[2], DType::F32);
    let e = x.silu_backward(&g).unwrap_err().to_string();
    assert!(e.contains("[3]") && e.contains("[2]"), "{e}");
    assert!(x
        .silu_backward(&tensor(&[1.0; 3], &[3], DType::F64))
        .is_err());
    assert!(x.clamp_backward(&x, None, None).is_err());
    let e = x.logsumexp(1, false).unwrap_err().to_string();
    assert!(e.contains("logsumexp") && e.contains("[3]"), "{e}");
}

/// `ln Σ exp` over dim `d`, naively in f64 with the max shift; dims with `d` kept as 1.
fn ref_logsumexp(x: &[f64], dims: &[usize], d: usize) -> Vec<f64> {
    let mut kept = dims.to_vec();
    kept[d] = 1;
    (0..numel(&kept))
        .map(|o| {
            let mut idx = unravel(o, &kept);
            let vals: Vec<f64> = (0..dims[d])
                .map(|j| {
                    idx[d] = j;
                    x[ravel(&idx, dims)]
                })
                .collect();
            let m = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            if m.is_infinite() {
                return m;
            }
            m + vals.iter().map(|v| (v - m).exp()).sum::<f64>().ln()
        })
        .collect()
}

fn logsumexp_any_dim_and_layout(device: Device) -> Result<()> {
    let mut rng = Rng::new(23);
    for it in 0..24 {
        let dims = rng.dims(1, 4, 6);
        let rank = dims.len();
        let d = rng.below(rank);
        let named = if rng.bool() {
            d as isize
        } else {
            d as isize - rank as isize
        };
        let keepdim = rng.bool();
        // Offsets near 700: exp alone overflows f64 (and f32 much earlier).
        let offset = if it % 2 == 0 { 0.0 } else { 700.0 };
        let x = uniform_vals(7300 + it, numel(&dims), offset - 5.0, offset + 5.0);
        let mut od = dims.clone();
        if keepdim {
            od[d] = 1;
        } else {
            od.remove(d);
        }
        for dtype in [DType::F64, DType::F32] {
            let lay = Lay::random(&mut rng, rank);
            let t = strided_on(device, &x, &dims, &lay, dtype);
            let out = t.logsumexp(named, keepdim).unwrap();
            assert_eq!(out.dtype(), dtype);
            let exp = ref_logsumexp(&round_to(&x, dtype), &dims, d);
            let (rtol, atol) = if dtype == DType::F64 {
                F64_TOL
            } else {
                (1e-6, 1e-5)
            };
            check(
                &out,
                &od,
                &exp,
                rtol,
                atol,
                &format!("logsumexp {dims:?} dim {named} keepdim={keepdim} {lay:?} {dtype}"),
            );
        }
    }
    Ok(())
}
test_device!(logsumexp_any_dim_and_layout);

fn logsumexp_special_values_and_half_types(device: Device) -> Result<()> {
    let inf = f64::INFINITY;
    // Rows: all -inf, one +inf, one NaN, -inf mixed with finite values.
    let x = [
        -inf,
        -inf,
        -inf,
        1.0,
        inf,
        2.0,
        1.0,
        f64::NAN,
        2.0,
        -inf,
        0.0,
        -inf,
    ];
    let t = tensor_on(device, &x, &[4, 3], DType::F64);
    let l = vals(&t.logsumexp(1, false).unwrap());
    assert_eq!(l[0], -inf);
    assert_eq!(l[1], inf);
    assert!(l[2].is_nan());
    assert_eq!(l[3], 0.0);
    // Along dim 0 of the transpose: the same rows, read through strides.
    let l = vals(&t.t().unwrap().logsumexp(0, true).unwrap());
    assert_eq!((l[0], l[1], l[3]), (-inf, inf, 0.0));
    // An empty reduced dim gives -inf (the log of an empty sum).
    let e = Tensor::zeros((2, 0), DType::F32, device).unwrap();
    assert_eq!(vals(&e.logsumexp(-1, false).unwrap()), vec![-inf, -inf]);
    // bf16 / f16: computed in f32, one rounding.
    let v = uniform_vals(7400, 24, -3.0, 3.0);
    for (dtype, ulp) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        let out = tensor_on(device, &v, &[4, 6], dtype)
            .logsumexp(1, false)
            .unwrap();
        assert_eq!(out.dtype(), dtype);
        let exp = ref_logsumexp(&round_to(&v, dtype), &[4, 6], 1);
        assert_close(&vals(&out), &exp, ulp * 1.01, 1e-6, &format!("lse {dtype}"));
    }
    Ok(())
}
test_device!(logsumexp_special_values_and_half_types);

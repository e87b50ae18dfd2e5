//! Forward ops against float64 references written in the tests (naive loops with their own index
//! arithmetic), with broadcasting, random shapes and non-contiguous (permuted, padded, expanded)
//! inputs, in f64 (tight) and f32.

mod common;

use common::*;
use meshgrad_tensor::{
    test_device, AttentionMask, DType, Device, GeluKind, Random, Result, Tensor,
};

type Bin = fn(&Tensor, &Tensor) -> Result<Tensor>;
type BinCase = (&'static str, Bin, fn(f64, f64) -> f64);

fn binary_ops() -> Vec<BinCase> {
    vec![
        ("add", Tensor::add, |a, b| a + b),
        ("sub", Tensor::sub, |a, b| a - b),
        ("mul", Tensor::mul, |a, b| a * b),
        ("div", Tensor::div, |a, b| a / b),
        ("maximum", Tensor::maximum, f64::max),
        ("minimum", Tensor::minimum, f64::min),
    ]
}

/// A random operand shape that broadcasts to `out`: some leading dims dropped, some dims 1.
fn operand_dims(rng: &mut Rng, out: &[usize]) -> Vec<usize> {
    let drop = rng.below(out.len() + 1);
    out[drop..]
        .iter()
        .map(|&d| if rng.below(3) == 0 { 1 } else { d })
        .collect()
}

fn binary_shape_cases(rng: &mut Rng) -> Vec<(Vec<usize>, Vec<usize>)> {
    let mut cases: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![2, 1, 3], vec![4, 1]),
        (vec![], vec![3, 4]),
        (vec![3, 4], vec![]),
        (vec![5], vec![2, 5]),
        (vec![2, 5], vec![5]),
        (vec![1], vec![3, 1]),
        (vec![4, 1, 3], vec![1, 5, 1]),
        (vec![2, 3, 4], vec![2, 3, 4]),
    ];
    for _ in 0..12 {
        let out = rng.dims(0, 4, 5);
        cases.push((operand_dims(rng, &out), operand_dims(rng, &out)));
    }
    cases
}

fn binary_ops_broadcast_f64_and_f32(device: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    for (case, (ad, bd)) in binary_shape_cases(&mut rng).into_iter().enumerate() {
        let a = uniform_vals(100 + case as u64, numel(&ad), -2.0, 2.0);
        // Divisors away from zero, with both signs.
        let b: Vec<f64> = uniform_vals(200 + case as u64, numel(&bd), 0.5, 2.0)
            .into_iter()
            .enumerate()
            .map(|(i, v)| if i % 3 == 1 { -v } else { v })
            .collect();
        for dtype in [DType::F64, DType::F32] {
            let (ar, br) = (round_to(&a, dtype), round_to(&b, dtype));
            for (name, op, f) in binary_ops() {
                let (la, lb) = (
                    Lay::random(&mut rng, ad.len()),
                    Lay::random(&mut rng, bd.len()),
                );
                let (ta, tb) = (
                    strided_on(device, &a, &ad, &la, dtype),
                    strided_on(device, &b, &bd, &lb, dtype),
                );
                let out = op(&ta, &tb).unwrap();
                assert_eq!(out.dtype(), dtype);
                let (exp, od) = ref_binary(&ar, &ad, &br, &bd, f);
                let (rtol, atol) = if dtype == DType::F64 {
                    F64_TOL
                } else {
                    F32_TOL
                };
                check(
                    &out,
                    &od,
                    &exp,
                    rtol,
                    atol,
                    &format!("{name} {ad:?} ({la:?}) with {bd:?} ({lb:?}) in {dtype}"),
                );
            }
        }
    }
    Ok(())
}
test_device!(binary_ops_broadcast_f64_and_f32);

fn binary_ops_on_expanded_views(device: Device) -> Result<()> {
    // Operands that are already stride-0 views (expand) broadcast against each other.
    let a = uniform_vals(3, 3, -1.0, 1.0);
    let b = uniform_vals(4, 4, -1.0, 1.0);
    let ta = tensor_on(device, &a, &[1, 3], DType::F64)
        .expand([4, 3])
        .unwrap();
    let tb = tensor_on(device, &b, &[4, 1], DType::F64)
        .expand([2, 4, 3])
        .unwrap();
    let out = ta.mul(&tb).unwrap();
    let (exp, od) = ref_binary(&a, &[1, 3], &b, &[4, 1], |x, y| x * y);
    let (exp, _) = ref_binary(&exp, &od, &[0.0; 24], &[2, 4, 3], |x, _| x);
    check(&out, &[2, 4, 3], &exp, 0.0, 0.0, "mul of expanded views");
    Ok(())
}
test_device!(binary_ops_on_expanded_views);

type Un = Box<dyn Fn(&Tensor) -> Result<Tensor>>;
type UnCase = (&'static str, Un, Box<dyn Fn(f64) -> f64>, f64, f64);

fn unary_ops() -> Vec<UnCase> {
    vec![
        ("neg", Box::new(|t| t.neg()), Box::new(|x| -x), -3.0, 3.0),
        ("exp", Box::new(|t| t.exp()), Box::new(f64::exp), -3.0, 3.0),
        ("log", Box::new(|t| t.log()), Box::new(f64::ln), 0.05, 5.0),
        (
            "sqrt",
            Box::new(|t| t.sqrt()),
            Box::new(f64::sqrt),
            0.0,
            5.0,
        ),
        (
            "tanh",
            Box::new(|t| t.tanh()),
            Box::new(f64::tanh),
            -3.0,
            3.0,
        ),
        (
            "relu",
            Box::new(|t| t.relu()),
            Box::new(|x| if x > 0.0 { x } else { 0.0 }),
            -3.0,
            3.0,
        ),
        (
            "gelu_tanh",
            Box::new(|t| t.gelu(GeluKind::Tanh)),
            Box::new(gelu_tanh),
            -3.0,
            3.0,
        ),
        (
            "gelu_erf",
            Box::new(|t| t.gelu(GeluKind::Erf)),
            Box::new(gelu_erf),
            -3.0,
            3.0,
        ),
        ("abs", Box::new(|t| t.abs()), Box::new(f64::abs), -3.0, 3.0),
        (
            "recip",
            Box::new(|t| t.recip()),
            Box::new(|x| 1.0 / x),
            0.2,
            3.0,
        ),
        ("sqr", Box::new(|t| t.sqr()), Box::new(|x| x * x), -3.0, 3.0),
        (
            "sigmoid",
            Box::new(|t| t.sigmoid()),
            Box::new(|x| 1.0 / (1.0 + (-x).exp())),
            -6.0,
            6.0,
        ),
        (
            "powf(2.5)",
            Box::new(|t| t.powf(2.5)),
            Box::new(|x| x.powf(2.5)),
            0.1,
            3.0,
        ),
        (
            "powf(-1.5)",
            Box::new(|t| t.powf(-1.5)),
            Box::new(|x| x.powf(-1.5)),
            0.1,
            3.0,
        ),
        (
            "powf(2)",
            Box::new(|t| t.powf(2.0)),
            Box::new(|x| x * x),
            -3.0,
            3.0,
        ),
        (
            "powf(3)",
            Box::new(|t| t.powf(3.0)),
            Box::new(|x| x * x * x),
            -2.0,
            2.0,
        ),
        (
            "powf(1)",
            Box::new(|t| t.powf(1.0)),
            Box::new(|x| x),
            -2.0,
            2.0,
        ),
        (
            "powf(0.5)",
            Box::new(|t| t.powf(0.5)),
            Box::new(f64::sqrt),
            0.0,
            4.0,
        ),
        (
            "add_scalar",
            Box::new(|t| t.add_scalar(1.25)),
            Box::new(|x| x + 1.25),
            -3.0,
            3.0,
        ),
        (
            "mul_scalar",
            Box::new(|t| t.mul_scalar(-0.75)),
            Box::new(|x| x * -0.75),
            -3.0,
            3.0,
        ),
    ]
}

fn unary_ops_f64_and_f32(device: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    for it in 0..6 {
        let dims = rng.dims(0, 4, 5);
        for (k, (name, op, f, lo, hi)) in unary_ops().into_iter().enumerate() {
            let x = uniform_vals(1000 * it + k as u64, numel(&dims), lo, hi);
            for dtype in [DType::F64, DType::F32] {
                let lay = Lay::random(&mut rng, dims.len());
                let t = strided_on(device, &x, &dims, &lay, dtype);
                let out = op(&t).unwrap();
                assert_eq!(out.dtype(), dtype, "{name}");
                let exp = ref_unary(&round_to(&x, dtype), &f);
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
test_device!(unary_ops_f64_and_f32);

fn unary_special_values(device: Device) -> Result<()> {
    let t = tensor_on(device, &[0.0, -0.0, -1.0, 1e-30], &[4], DType::F64);
    assert_eq!(vals(&t.relu().unwrap()), vec![0.0, 0.0, 0.0, 1e-30]);
    assert_eq!(vals(&t.abs().unwrap()), vec![0.0, 0.0, 1.0, 1e-30]);
    let l = vals(&t.log().unwrap());
    assert_eq!(l[0], f64::NEG_INFINITY);
    assert!(l[2].is_nan());
    let s = vals(
        &tensor_on(device, &[-50.0, 50.0], &[2], DType::F32)
            .sigmoid()
            .unwrap(),
    );
    assert_close(
        &s,
        &[1.0 / (1.0 + 50f64.exp()), 1.0],
        1e-6,
        0.0,
        "sigmoid saturates without NaN",
    );
    Ok(())
}
test_device!(unary_special_values);

fn unary_on_bf16_and_f16_compute_in_f32(device: Device) -> Result<()> {
    let x = uniform_vals(5, 40, -2.0, 2.0);
    for (dtype, ulp) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        let xr = round_to(&x, dtype);
        let t = tensor_on(device, &x, &[5, 8], dtype).t().unwrap();
        let out = t.exp().unwrap();
        assert_eq!(out.dtype(), dtype);
        let (xt, _) = ref_permute(&xr, &[5, 8], &[1, 0]);
        let exp = ref_unary(&xt, f64::exp);
        assert_close(
            &vals(&out),
            &exp,
            ulp * 1.01,
            0.0,
            &format!("exp in {dtype}"),
        );
    }
    Ok(())
}
test_device!(unary_on_bf16_and_f16_compute_in_f32);

fn comparisons_and_where_with_broadcasting(device: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    type Cmp = fn(&Tensor, &Tensor) -> Result<Tensor>;
    type CmpCase = (&'static str, Cmp, fn(f64, f64) -> bool);
    let cmps: Vec<CmpCase> = vec![
        ("eq", Tensor::eq, |a, b| a == b),
        ("ne", Tensor::ne, |a, b| a != b),
        ("lt", Tensor::lt, |a, b| a < b),
        ("le", Tensor::le, |a, b| a <= b),
        ("gt", Tensor::gt, |a, b| a > b),
        ("ge", Tensor::ge, |a, b| a >= b),
    ];
    for (case, (ad, bd)) in binary_shape_cases(&mut rng).into_iter().enumerate() {
        // Quantised values so that ties are common.
        let q = |v: Vec<f64>| {
            v.into_iter()
                .map(|x| (x * 2.0).floor() / 2.0)
                .collect::<Vec<_>>()
        };
        let a = q(uniform_vals(300 + case as u64, numel(&ad), -1.5, 1.5));
        let b = q(uniform_vals(400 + case as u64, numel(&bd), -1.5, 1.5));
        for dtype in [DType::F64, DType::F32, DType::I64] {
            let (ar, br) = (round_to(&a, dtype), round_to(&b, dtype));
            for (name, op, f) in &cmps {
                let (ta, tb) = (
                    strided_on(device, &a, &ad, &Lay::random(&mut rng, ad.len()), dtype),
                    strided_on(device, &b, &bd, &Lay::random(&mut rng, bd.len()), dtype),
                );
                let out = op(&ta, &tb).unwrap();
                assert_eq!(out.dtype(), DType::U8, "{name}");
                let (exp, od) =
                    ref_binary(&ar, &ad, &br, &bd, |x, y| if f(x, y) { 1.0 } else { 0.0 });
                check(
                    &out,
                    &od,
                    &exp,
                    0.0,
                    0.0,
                    &format!("{name} {ad:?} vs {bd:?} in {dtype}"),
                );
            }
        }
        // where_cond with a third broadcast operand.
        let cd = operand_dims(&mut rng, &bcast_shape(&ad, &bd).unwrap());
        let c: Vec<f64> = (0..numel(&cd)).map(|_| rng.below(2) as f64).collect();
        let tc = strided_on(device, &c, &cd, &Lay::random(&mut rng, cd.len()), DType::U8);
        for dtype in [DType::F64, DType::F32, DType::I64] {
            let (ar, br) = (round_to(&a, dtype), round_to(&b, dtype));
            let (ta, tb) = (
                strided_on(device, &a, &ad, &Lay::random(&mut rng, ad.len()), dtype),
                strided_on(device, &b, &bd, &Lay::random(&mut rng, bd.len()), dtype),
            );
            let out = tc.where_cond(&ta, &tb).unwrap();
            assert_eq!(out.dtype(), dtype);
            let od = bcast_shape(&bcast_shape(&cd, &ad).unwrap(), &bd).unwrap();
            let exp: Vec<f64> = (0..numel(&od))
                .map(|i| {
                    let idx = unravel(i, &od);
                    if bcast_get(&c, &cd, &idx) != 0.0 {
                        bcast_get(&ar, &ad, &idx)
                    } else {
                        bcast_get(&br, &bd, &idx)
                    }
                })
                .collect();
            check(
                &out,
                &od,
                &exp,
                0.0,
                0.0,
                &format!("where_cond {cd:?} ? {ad:?} : {bd:?} in {dtype}"),
            );
        }
    }
    // The condition must be a u8 mask.
    let f = tensor_on(device, &[1.0], &[1], DType::F32);
    assert!(f.where_cond(&f, &f).is_err());
    Ok(())
}
test_device!(comparisons_and_where_with_broadcasting);

fn sum_and_mean_over_dims(device: Device) -> Result<()> {
    let mut rng = Rng::new(4);
    for it in 0..30 {
        let dims = rng.dims(1, 4, 5);
        let rank = dims.len();
        let x = uniform_vals(500 + it, numel(&dims), -1.0, 1.0);
        // A random non-empty subset of dims, each named positively or negatively.
        let mut red: Vec<usize> = (0..rank).filter(|_| rng.bool()).collect();
        if red.is_empty() {
            red.push(rng.below(rank));
        }
        let named: Vec<isize> = red
            .iter()
            .map(|&d| {
                if rng.bool() {
                    d as isize
                } else {
                    d as isize - rank as isize
                }
            })
            .collect();
        let keepdim = rng.bool();
        let n: usize = red.iter().map(|&d| dims[d]).product();
        let (s, od) = ref_sum(&x, &dims, &red, keepdim);
        let mean: Vec<f64> = s.iter().map(|v| v / n as f64).collect();
        for dtype in [DType::F64, DType::F32] {
            let lay = Lay::random(&mut rng, rank);
            let t = strided_on(device, &x, &dims, &lay, dtype);
            let (rtol, atol) = if dtype == DType::F64 {
                F64_TOL
            } else {
                (1e-5, 1e-4)
            };
            let (sr, _) = ref_sum(&round_to(&x, dtype), &dims, &red, keepdim);
            let what = format!("sum {dims:?} over {named:?} keepdim={keepdim} {lay:?} {dtype}");
            check(
                &t.sum(&named, keepdim).unwrap(),
                &od,
                &sr,
                rtol,
                atol,
                &what,
            );
            let mr: Vec<f64> = sr.iter().map(|v| v / n as f64).collect();
            check(
                &t.mean(&named, keepdim).unwrap(),
                &od,
                &mr,
                rtol,
                atol,
                &format!("mean: {what}"),
            );
            if dtype == DType::F64 {
                assert_close(&mr, &mean, 1e-12, 1e-12, "mean");
            }
        }
        // Whole-tensor reductions.
        let t = strided_on(device, &x, &dims, &Lay::random(&mut rng, rank), DType::F64);
        let total: f64 = x.iter().sum();
        check(
            &t.sum_all().unwrap(),
            &[],
            &[total],
            1e-12,
            1e-12,
            "sum_all",
        );
        check(
            &t.mean_all().unwrap(),
            &[],
            &[total / x.len() as f64],
            1e-12,
            1e-12,
            "mean_all",
        );
    }
    Ok(())
}
test_device!(sum_and_mean_over_dims);

/// Long sums over few outputs (a bias gradient: the column sum of `[rows, out]`; on CUDA the
/// column-tile kernel), partial tiles of 32 columns included, against f64 sums of the rounded
/// inputs.
fn column_sums_of_many_rows(device: Device) -> Result<()> {
    for (it, dims) in [vec![3000, 70], vec![2, 700, 33], vec![4096, 96]]
        .into_iter()
        .enumerate()
    {
        let x = uniform_vals(900 + it as u64, numel(&dims), -1.0, 1.0);
        let red = [dims.len() - 2];
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let t = tensor_on(device, &x, &dims, dtype);
            let (want, od) = ref_sum(&round_to(&x, dtype), &dims, &red, false);
            let (rtol, atol) = match dtype {
                DType::F64 => F64_TOL,
                DType::F32 => (1e-5, 1e-4),
                _ => (1e-2, 0.25), // the sum itself is rounded to bf16 once
            };
            let what = format!("sum {dims:?} over {red:?} {dtype}");
            check(
                &t.sum(&[red[0] as isize], false)?,
                &od,
                &want,
                rtol,
                atol,
                &what,
            );
        }
    }
    Ok(())
}
test_device!(column_sums_of_many_rows);

fn sum_edge_cases(device: Device) -> Result<()> {
    let t = tensor_on(device, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F64);
    // Repeated dims count once.
    check(
        &t.sum(&[1, -1], false).unwrap(),
        &[2],
        &[6.0, 15.0],
        0.0,
        0.0,
        "sum over a repeated dim",
    );
    // Out-of-range dims are errors naming the shape.
    let e = t.sum(&[2], false).unwrap_err().to_string();
    assert!(e.contains("[2, 3]"), "{e}");
    assert!(t.sum(&[-3], false).is_err());
    // No dims: unchanged.
    check(
        &t.sum(&[], false).unwrap(),
        &[2, 3],
        &vals(&t),
        0.0,
        0.0,
        "sum over no dims",
    );
    // Scalars.
    check(
        &Tensor::scalar(2.5, DType::F64, device)
            .unwrap()
            .sum_all()
            .unwrap(),
        &[],
        &[2.5],
        0.0,
        0.0,
        "sum_all of a scalar",
    );
    // Integer tensors are refused.
    assert!(tensor_on(device, &[1.0], &[1], DType::I64)
        .sum(&[0], false)
        .is_err());
    Ok(())
}
test_device!(sum_edge_cases);

fn max_and_argmax_first_index_on_ties(device: Device) -> Result<()> {
    let mut rng = Rng::new(5);
    for it in 0..30 {
        let dims = rng.dims(1, 4, 5);
        let rank = dims.len();
        let x: Vec<f64> = uniform_vals(600 + it, numel(&dims), -2.0, 2.0)
            .into_iter()
            .map(|v| v.round())
            .collect();
        let d = rng.below(rank);
        let named = if rng.bool() {
            d as isize
        } else {
            d as isize - rank as isize
        };
        let keepdim = rng.bool();
        let (mx, am) = ref_max_argmax(&x, &dims, d);
        let mut od = dims.clone();
        if keepdim {
            od[d] = 1;
        } else {
            od.remove(d);
        }
        for dtype in [DType::F64, DType::F32] {
            let lay = Lay::random(&mut rng, rank);
            let t = strided_on(device, &x, &dims, &lay, dtype);
            let what = format!("{dims:?} dim {named} keepdim={keepdim} {lay:?} {dtype}");
            check(
                &t.max(named, keepdim).unwrap(),
                &od,
                &mx,
                0.0,
                0.0,
                &format!("max {what}"),
            );
            let a = t.argmax(named, keepdim).unwrap();
            assert_eq!(a.dtype(), DType::I64);
            assert_eq!(a.dims(), &od[..]);
            assert_eq!(a.to_vec::<i64>().unwrap(), am, "argmax {what}");
        }
    }
    // All equal: index 0.
    let t = Tensor::ones((3, 4), DType::F32, device).unwrap();
    assert_eq!(
        t.argmax(1, false).unwrap().to_vec::<i64>().unwrap(),
        vec![0, 0, 0]
    );
    assert!(Tensor::zeros((3, 0), DType::F32, device)
        .unwrap()
        .max(1, false)
        .is_err());
    Ok(())
}
test_device!(max_and_argmax_first_index_on_ties);

fn matmul_cases() -> Vec<(Vec<usize>, Vec<usize>)> {
    vec![
        (vec![3, 4], vec![4, 5]),
        (vec![1, 7], vec![7, 1]),
        (vec![5, 1], vec![1, 3]),
        (vec![2, 3, 4], vec![2, 4, 5]),
        (vec![2, 3, 4, 5], vec![5, 6]),
        (vec![3, 4, 5], vec![1, 5, 2]),
        (vec![1, 4, 5], vec![3, 5, 2]),
        (vec![4, 5], vec![3, 5, 2]),
        (vec![3, 1, 5], vec![5, 2]),
        (vec![2, 1, 3, 4], vec![3, 4, 2]),
        (vec![2, 3, 1, 5], vec![5, 4]),
        (vec![17, 33], vec![33, 9]),
    ]
}

fn matmul_broadcast_batch_and_strided_operands(device: Device) -> Result<()> {
    let mut rng = Rng::new(6);
    for (case, (ad, bd)) in matmul_cases().into_iter().enumerate() {
        let a = uniform_vals(700 + case as u64, numel(&ad), -1.0, 1.0);
        let b = uniform_vals(800 + case as u64, numel(&bd), -1.0, 1.0);
        for dtype in [DType::F64, DType::F32] {
            let (ar, br) = (round_to(&a, dtype), round_to(&b, dtype));
            let (exp, od) = ref_matmul(&ar, &ad, &br, &bd);
            for _ in 0..4 {
                let (la, lb) = (
                    Lay::random(&mut rng, ad.len()),
                    Lay::random(&mut rng, bd.len()),
                );
                let out = strided_on(device, &a, &ad, &la, dtype)
                    .matmul(&strided_on(device, &b, &bd, &lb, dtype))
                    .unwrap();
                assert_eq!(out.dtype(), dtype);
                let (rtol, atol) = if dtype == DType::F64 {
                    F64_TOL
                } else {
                    (1e-5, 1e-5)
                };
                check(
                    &out,
                    &od,
                    &exp,
                    rtol,
                    atol,
                    &format!("matmul {ad:?} ({la:?}) @ {bd:?} ({lb:?}) {dtype}"),
                );
            }
        }
    }
    Ok(())
}
test_device!(matmul_broadcast_batch_and_strided_operands);

fn matmul_with_expanded_and_narrowed_batches(device: Device) -> Result<()> {
    // rhs shared through an explicit stride-0 expand; lhs a narrowed batch of a bigger tensor.
    let a = uniform_vals(11, 4 * 3 * 5, -1.0, 1.0);
    let b = uniform_vals(12, 5 * 2, -1.0, 1.0);
    let ta = tensor_on(device, &a, &[4, 3, 5], DType::F64)
        .narrow(0, 1, 2)
        .unwrap();
    let tb = tensor_on(device, &b, &[5, 2], DType::F64)
        .expand([2, 5, 2])
        .unwrap();
    let (an, ad) = ref_narrow(&a, &[4, 3, 5], 0, 1, 2);
    let (exp, od) = ref_matmul(&an, &ad, &b, &[5, 2]);
    check(
        &ta.matmul(&tb).unwrap(),
        &od,
        &exp,
        1e-12,
        1e-12,
        "narrowed @ expanded",
    );
    // Rows narrowed inside each batch (row stride != m * row stride of the batch).
    let tc = tensor_on(device, &a, &[4, 3, 5], DType::F64)
        .narrow(1, 1, 2)
        .unwrap();
    let (cn, cd) = ref_narrow(&a, &[4, 3, 5], 1, 1, 2);
    let (exp, od) = ref_matmul(&cn, &cd, &b, &[5, 2]);
    check(
        &tc.matmul(&tensor_on(device, &b, &[5, 2], DType::F64))
            .unwrap(),
        &od,
        &exp,
        1e-12,
        1e-12,
        "row-narrowed batch @ shared",
    );
    // A batch dim permuted in front of an expanded one.
    let td = tensor_on(device, &a, &[4, 3, 5], DType::F64)
        .unsqueeze(0)
        .unwrap()
        .expand([2, 4, 3, 5])
        .unwrap()
        .transpose(0, 1)
        .unwrap();
    let (dd, ddims) = {
        let (e, d) = ref_binary(
            &a,
            &[4, 3, 5],
            &[0.0; 2 * 4 * 3 * 5],
            &[2, 4, 3, 5],
            |x, _| x,
        );
        ref_permute(&e, &d, &[1, 0, 2, 3])
    };
    let (exp, od) = ref_matmul(&dd, &ddims, &b, &[5, 2]);
    check(
        &td.matmul(&tensor_on(device, &b, &[5, 2], DType::F64))
            .unwrap(),
        &od,
        &exp,
        1e-12,
        1e-12,
        "permuted expanded batch",
    );
    Ok(())
}
test_device!(matmul_with_expanded_and_narrowed_batches);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn matmul_errors() {
    let a = Tensor::zeros((2, 3), DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros((4, 5), DType::F32, Device::Cpu).unwrap();
    let e = a.matmul(&b).unwrap_err().to_string();
    assert!(
        e.contains("matmul") && e.contains("[2, 3]") && e.contains("[4, 5]"),
        "{e}"
    );
    let c = Tensor::zeros((2, 3, 4), DType::F32, Device::Cpu).unwrap();
    let d = Tensor::zeros((3, 4, 5), DType::F32, Device::Cpu).unwrap();
    let e = c.matmul(&d).unwrap_err().to_string();
    assert!(e.contains("[2, 3, 4]") && e.contains("[3, 4, 5]"), "{e}");
    assert!(Tensor::zeros(3, DType::F32, Device::Cpu)
        .unwrap()
        .matmul(&b)
        .is_err());
    assert!(a
        .matmul(&Tensor::zeros((3, 2), DType::F64, Device::Cpu).unwrap())
        .is_err());
}

fn matmul_in_bf16_and_f16(device: Device) -> Result<()> {
    let (m, k, n) = (6, 16, 5);
    let a = uniform_vals(13, m * k, -1.0, 1.0);
    let b = uniform_vals(14, k * n, -1.0, 1.0);
    for (dtype, u) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        let (ar, br) = (round_to(&a, dtype), round_to(&b, dtype));
        let (exp, od) = ref_matmul(&ar, &[m, k], &br, &[k, n]);
        let out = tensor_on(device, &a, &[m, k], dtype)
            .matmul(&tensor_on(device, &b, &[k, n], dtype))
            .unwrap();
        assert_eq!(out.dtype(), dtype);
        // f32 accumulation, one rounding to the storage type at the end.
        check(&out, &od, &exp, u, 1e-4, &format!("matmul in {dtype}"));
    }
    Ok(())
}
test_device!(matmul_in_bf16_and_f16);

fn softmax_and_log_softmax_any_dim(device: Device) -> Result<()> {
    let mut rng = Rng::new(7);
    for it in 0..20 {
        let dims = rng.dims(1, 4, 6);
        let rank = dims.len();
        let x = uniform_vals(900 + it, numel(&dims), -4.0, 4.0);
        let d = rng.below(rank);
        let named = if rng.bool() {
            d as isize
        } else {
            d as isize - rank as isize
        };
        for log in [false, true] {
            for dtype in [DType::F64, DType::F32] {
                let lay = Lay::random(&mut rng, rank);
                let t = strided_on(device, &x, &dims, &lay, dtype);
                let out = if log {
                    t.log_softmax(named)
                } else {
                    t.softmax(named)
                }
                .unwrap();
                let exp = ref_softmax(&round_to(&x, dtype), &dims, d, log);
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
                    &format!("softmax(log={log}) {dims:?} dim {named} {lay:?} {dtype}"),
                );
            }
        }
    }
    // Large logits stay finite (max-subtracted).
    let t = tensor_on(device, &[1000.0, 1001.0, -1000.0], &[3], DType::F32);
    let exp = ref_softmax(&[1000.0, 1001.0, -1000.0], &[3], 0, false);
    assert_close(
        &vals(&t.softmax(0).unwrap()),
        &exp,
        1e-6,
        1e-7,
        "softmax of large logits",
    );
    Ok(())
}
test_device!(softmax_and_log_softmax_any_dim);

fn softmax_backward_matches_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(8);
    for it in 0..8 {
        let dims = rng.dims(1, 3, 5);
        let rank = dims.len();
        let d = rng.below(rank);
        let x = uniform_vals(950 + it, numel(&dims), -2.0, 2.0);
        let dy = uniform_vals(960 + it, numel(&dims), -1.0, 1.0);
        for log in [false, true] {
            let y = ref_softmax(&x, &dims, d, log);
            // Reference: per slice along d.
            let mut exp = vec![0.0; x.len()];
            let mut kept = dims.clone();
            kept[d] = 1;
            for o in 0..numel(&kept) {
                let mut idx = unravel(o, &kept);
                let pos: Vec<usize> = (0..dims[d])
                    .map(|j| {
                        idx[d] = j;
                        ravel(&idx, &dims)
                    })
                    .collect();
                if log {
                    let s: f64 = pos.iter().map(|&p| dy[p]).sum();
                    for &p in &pos {
                        exp[p] = dy[p] - y[p].exp() * s;
                    }
                } else {
                    let s: f64 = pos.iter().map(|&p| dy[p] * y[p]).sum();
                    for &p in &pos {
                        exp[p] = y[p] * (dy[p] - s);
                    }
                }
            }
            let ty = strided_on(device, &y, &dims, &Lay::random(&mut rng, rank), DType::F64);
            let tdy = strided_on(device, &dy, &dims, &Lay::random(&mut rng, rank), DType::F64);
            let out = ty.softmax_backward(&tdy, d as isize, log).unwrap();
            check(
                &out,
                &dims,
                &exp,
                1e-11,
                1e-12,
                &format!("softmax_backward(log={log}) {dims:?} dim {d}"),
            );
        }
    }
    Ok(())
}
test_device!(softmax_backward_matches_reference);

fn gelu_backward_matches_reference_derivatives(device: Device) -> Result<()> {
    let x = uniform_vals(15, 30, -3.0, 3.0);
    let dy = uniform_vals(16, 30, -1.0, 1.0);
    let c = (2.0 / std::f64::consts::PI).sqrt();
    for kind in [GeluKind::Tanh, GeluKind::Erf] {
        let exp: Vec<f64> = x
            .iter()
            .zip(&dy)
            .map(|(&v, &g)| {
                let d = match kind {
                    GeluKind::Tanh => {
                        let t = (c * (v + 0.044715 * v * v * v)).tanh();
                        0.5 * (1.0 + t)
                            + 0.5 * v * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * v * v)
                    }
                    GeluKind::Erf => {
                        0.5 * (1.0 + erf(v / std::f64::consts::SQRT_2))
                            + v * (-0.5 * v * v).exp() / (2.0 * std::f64::consts::PI).sqrt()
                    }
                };
                g * d
            })
            .collect();
        let tx = strided_on(
            device,
            &x,
            &[5, 6],
            &Lay::Strided {
                perm: vec![1, 0],
                pad: 1,
            },
            DType::F64,
        );
        let out = tx
            .gelu_backward(&tensor_on(device, &dy, &[5, 6], DType::F64), kind)
            .unwrap();
        check(
            &out,
            &[5, 6],
            &exp,
            1e-12,
            1e-12,
            &format!("gelu_backward {kind:?}"),
        );
    }
    Ok(())
}
test_device!(gelu_backward_matches_reference_derivatives);

fn layer_norm_with_and_without_affine(device: Device) -> Result<()> {
    let mut rng = Rng::new(9);
    for it in 0..10 {
        let mut dims = rng.dims(1, 3, 4);
        dims.push(rng.range(1, 12));
        let cols = *dims.last().unwrap();
        let x = uniform_vals(1100 + it, numel(&dims), -2.0, 3.0);
        let w = uniform_vals(1200 + it, cols, 0.5, 1.5);
        let b = uniform_vals(1300 + it, cols, -0.5, 0.5);
        let eps = 1e-5;
        for affine in [false, true] {
            for dtype in [DType::F64, DType::F32] {
                let (xr, wr, br) = (
                    round_to(&x, dtype),
                    round_to(&w, dtype),
                    round_to(&b, dtype),
                );
                let (y, mean, rstd) = if affine {
                    ref_layer_norm(&xr, cols, Some(&wr), Some(&br), eps)
                } else {
                    ref_layer_norm(&xr, cols, None, None, eps)
                };
                let lay = Lay::random(&mut rng, dims.len());
                let t = strided_on(device, &x, &dims, &lay, dtype);
                let (tw, tb) = (
                    tensor_on(device, &w, &[cols], dtype),
                    tensor_on(device, &b, &[cols], dtype),
                );
                let out = if affine {
                    t.layer_norm(Some(&tw), Some(&tb), eps)
                } else {
                    t.layer_norm(None, None, eps)
                }
                .unwrap();
                let (rtol, atol) = if dtype == DType::F64 {
                    (1e-11, 1e-12)
                } else {
                    (1e-4, 1e-5)
                };
                let what = format!("layer_norm affine={affine} {dims:?} {lay:?} {dtype}");
                check(&out.y, &dims, &y, rtol, atol, &what);
                assert_eq!(out.y.dtype(), dtype);
                let rows = x.len() / cols;
                check(
                    &out.mean,
                    &[rows],
                    &mean,
                    rtol,
                    atol,
                    &format!("mean: {what}"),
                );
                check(
                    &out.rstd,
                    &[rows],
                    &rstd,
                    rtol,
                    atol,
                    &format!("rstd: {what}"),
                );
            }
        }
        // Weight only.
        let (y, _, _) = ref_layer_norm(&x, cols, Some(&w), None, eps);
        let out = tensor_on(device, &x, &dims, DType::F64)
            .layer_norm(Some(&tensor_on(device, &w, &[cols], DType::F64)), None, eps)
            .unwrap();
        check(&out.y, &dims, &y, 1e-11, 1e-12, "layer_norm weight only");
    }
    let x = Tensor::zeros((2, 4), DType::F32, device).unwrap();
    let w = Tensor::ones(3, DType::F32, device).unwrap();
    assert!(
        x.layer_norm(Some(&w), None, 1e-5).is_err(),
        "weight of the wrong size"
    );
    Ok(())
}
test_device!(layer_norm_with_and_without_affine);

fn layer_norm_backward_matches_reference(device: Device) -> Result<()> {
    let (rows, cols) = (5, 7);
    let x = uniform_vals(21, rows * cols, -2.0, 2.0);
    let w = uniform_vals(22, cols, 0.5, 1.5);
    let dy = uniform_vals(23, rows * cols, -1.0, 1.0);
    let eps = 1e-5;
    let (_, mean, rstd) = ref_layer_norm(&x, cols, None, None, eps);
    let mut dx = vec![0.0; rows * cols];
    let (mut dw, mut db) = (vec![0.0; cols], vec![0.0; cols]);
    for r in 0..rows {
        let xhat: Vec<f64> = (0..cols)
            .map(|c| (x[r * cols + c] - mean[r]) * rstd[r])
            .collect();
        let g: Vec<f64> = (0..cols).map(|c| dy[r * cols + c] * w[c]).collect();
        let mg = g.iter().sum::<f64>() / cols as f64;
        let mgx = g.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / cols as f64;
        for c in 0..cols {
            dx[r * cols + c] = rstd[r] * (g[c] - mg - xhat[c] * mgx);
            dw[c] += dy[r * cols + c] * xhat[c];
            db[c] += dy[r * cols + c];
        }
    }
    let tx = tensor_on(device, &x, &[rows, cols], DType::F64);
    let tw = tensor_on(device, &w, &[cols], DType::F64);
    let out = tx.layer_norm(Some(&tw), None, eps).unwrap();
    let tdy = strided_on(
        device,
        &dy,
        &[rows, cols],
        &Lay::Strided {
            perm: vec![1, 0],
            pad: 1,
        },
        DType::F64,
    );
    let (gx, pg) = tx
        .layer_norm_backward(Some(&tw), &out.mean, &out.rstd, &tdy)
        .unwrap();
    check(
        &gx,
        &[rows, cols],
        &dx,
        1e-10,
        1e-12,
        "layer_norm_backward dx",
    );
    let (gw, gb) = pg.expect("param grads with a weight");
    check(
        &gw,
        &[cols],
        &dw,
        1e-10,
        1e-12,
        "layer_norm_backward dweight",
    );
    check(&gb, &[cols], &db, 1e-10, 1e-12, "layer_norm_backward dbias");
    Ok(())
}
test_device!(layer_norm_backward_matches_reference);

/// `[b, h, t, d]` dims and causal flags of the attention cases.
fn attention_cases() -> Vec<(usize, usize, usize, usize, usize, bool)> {
    vec![
        (1, 1, 4, 4, 8, false),
        (1, 1, 4, 4, 8, true),
        (2, 3, 5, 5, 4, true),
        (2, 2, 3, 7, 4, false),
        (2, 2, 3, 7, 4, true),
        (1, 2, 1, 6, 3, true),
        (1, 2, 6, 2, 3, false),
        (2, 1, 33, 40, 16, true),
    ]
}

fn attention_matches_naive_softmax_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(10);
    for (case, (b, h, tq, tk, d, causal)) in attention_cases().into_iter().enumerate() {
        let s = case as u64;
        let q = uniform_vals(1400 + s, b * h * tq * d, -1.0, 1.0);
        let k = uniform_vals(1500 + s, b * h * tk * d, -1.0, 1.0);
        let v = uniform_vals(1600 + s, b * h * tk * d, -1.0, 1.0);
        let scale = 1.0 / (d as f64).sqrt();
        for dtype in [DType::F64, DType::F32] {
            let (qr, kr, vr) = (
                round_to(&q, dtype),
                round_to(&k, dtype),
                round_to(&v, dtype),
            );
            let (out, lse) = ref_attention(&qr, &kr, &vr, b * h, tq, tk, d, causal, scale);
            let (qd, kd) = (vec![b, h, tq, d], vec![b, h, tk, d]);
            let tq_ = strided_on(device, &q, &qd, &Lay::random(&mut rng, 4), dtype);
            let tk_ = strided_on(device, &k, &kd, &Lay::random(&mut rng, 4), dtype);
            let tv_ = strided_on(device, &v, &kd, &Lay::random(&mut rng, 4), dtype);
            let o = Tensor::attention(&tq_, &tk_, &tv_, &mask(causal), scale).unwrap();
            let (rtol, atol) = if dtype == DType::F64 {
                (1e-11, 1e-12)
            } else {
                (1e-4, 1e-5)
            };
            let what = format!("attention b{b} h{h} tq{tq} tk{tk} d{d} causal={causal} {dtype}");
            check(&o.out, &qd, &out, rtol, atol, &what);
            assert_eq!(o.out.dtype(), dtype);
            check(
                &o.lse,
                &[b, h, tq],
                &lse,
                rtol,
                atol,
                &format!("lse: {what}"),
            );
        }
    }
    // Causal attention needs seq_k >= seq_q.
    let q = Tensor::zeros((1, 4, 2), DType::F32, device).unwrap();
    let k = Tensor::zeros((1, 3, 2), DType::F32, device).unwrap();
    assert!(Tensor::attention(&q, &k, &k, &mask(true), 1.0).is_err());
    assert!(
        Tensor::attention(&q, &k, &q, &mask(false), 1.0).is_err(),
        "k and v shapes differ"
    );
    Ok(())
}
test_device!(attention_matches_naive_softmax_reference);

fn attention_backward_matches_reference(device: Device) -> Result<()> {
    for (case, (b, h, tq, tk, d, causal)) in attention_cases().into_iter().take(7).enumerate() {
        let s = case as u64;
        let bh = b * h;
        let q = uniform_vals(1700 + s, bh * tq * d, -1.0, 1.0);
        let k = uniform_vals(1800 + s, bh * tk * d, -1.0, 1.0);
        let v = uniform_vals(1900 + s, bh * tk * d, -1.0, 1.0);
        let dout = uniform_vals(2000 + s, bh * tq * d, -1.0, 1.0);
        let scale = 0.7;
        // Reference: P = softmax(S), dV = Pᵀ dO, dP = dO Vᵀ, dS = P ∘ (dP - rowsum(dP ∘ P)),
        // dQ = scale dS K, dK = scale dSᵀ Q.
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        for bb in 0..bh {
            for i in 0..tq {
                let allowed = |j: usize| !causal || j <= i + (tk - tq);
                let sc: Vec<f64> = (0..tk)
                    .map(|j| {
                        if !allowed(j) {
                            return f64::NEG_INFINITY;
                        }
                        (0..d)
                            .map(|c| q[(bb * tq + i) * d + c] * k[(bb * tk + j) * d + c])
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|&x| (x - m).exp()).sum();
                let p: Vec<f64> = sc.iter().map(|&x| (x - m).exp() / z).collect();
                let dp: Vec<f64> = (0..tk)
                    .map(|j| {
                        (0..d)
                            .map(|c| dout[(bb * tq + i) * d + c] * v[(bb * tk + j) * d + c])
                            .sum()
                    })
                    .collect();
                let rs: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..tk {
                    let ds = p[j] * (dp[j] - rs);
                    for c in 0..d {
                        dv[(bb * tk + j) * d + c] += p[j] * dout[(bb * tq + i) * d + c];
                        dq[(bb * tq + i) * d + c] += scale * ds * k[(bb * tk + j) * d + c];
                        dk[(bb * tk + j) * d + c] += scale * ds * q[(bb * tq + i) * d + c];
                    }
                }
            }
        }
        let (qd, kd) = (vec![b, h, tq, d], vec![b, h, tk, d]);
        let (tq_, tk_, tv_) = (
            tensor_on(device, &q, &qd, DType::F64),
            tensor_on(device, &k, &kd, DType::F64),
            tensor_on(device, &v, &kd, DType::F64),
        );
        let o = Tensor::attention(&tq_, &tk_, &tv_, &mask(causal), scale).unwrap();
        let tdo = strided_on(
            device,
            &dout,
            &qd,
            &Lay::Strided {
                perm: vec![0, 2, 1, 3],
                pad: 1,
            },
            DType::F64,
        );
        let g = Tensor::attention_backward(&tq_, &tk_, &tv_, &o, &tdo, &mask(causal), scale, false)
            .unwrap();
        let (gq, gk, gv) = (g.dq, g.dk, g.dv);
        let what = format!("attention_backward b{b} h{h} tq{tq} tk{tk} d{d} causal={causal}");
        check(&gq, &qd, &dq, 1e-10, 1e-12, &format!("dq: {what}"));
        check(&gk, &kd, &dk, 1e-10, 1e-12, &format!("dk: {what}"));
        check(&gv, &kd, &dv, 1e-10, 1e-12, &format!("dv: {what}"));
    }
    Ok(())
}
test_device!(attention_backward_matches_reference);

fn cross_entropy_rows_with_ignore_index(device: Device) -> Result<()> {
    let (n, v) = (7, 5);
    let x = uniform_vals(24, n * v, -3.0, 3.0);
    let targets: Vec<i64> = vec![0, 4, -100, 2, 2, -100, 1];
    let ignore = Some(-100);
    let mut loss = vec![0.0; n];
    let mut lse = vec![0.0; n];
    for r in 0..n {
        let row = &x[r * v..(r + 1) * v];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        lse[r] = m + row.iter().map(|a| (a - m).exp()).sum::<f64>().ln();
        if targets[r] != -100 {
            loss[r] = lse[r] - row[targets[r] as usize];
        }
    }
    let mut rng = Rng::new(11);
    for dtype in [DType::F64, DType::F32] {
        let tx = strided_on(device, &x, &[n, v], &Lay::random(&mut rng, 2), dtype);
        let tt = Tensor::from_vec(targets.clone(), n, device).unwrap();
        let (l, s) = tx.cross_entropy_rows(&tt, ignore).unwrap();
        let (rtol, atol) = if dtype == DType::F64 {
            (1e-12, 1e-12)
        } else {
            (1e-5, 1e-5)
        };
        check(
            &l,
            &[n],
            &loss,
            rtol,
            atol,
            &format!("cross_entropy loss {dtype}"),
        );
        for r in 0..n {
            if targets[r] != -100 {
                assert_close(
                    &vals(&s)[r..r + 1],
                    &lse[r..r + 1],
                    rtol,
                    atol,
                    &format!("cross_entropy lse row {r} {dtype}"),
                );
            }
        }
        // Backward: dloss * (softmax - onehot), zero on ignored rows.
        let dloss = uniform_vals(25, n, 0.5, 1.5);
        let mut exp = vec![0.0; n * v];
        for r in 0..n {
            if targets[r] == -100 {
                continue;
            }
            for c in 0..v {
                let p = (x[r * v + c] - lse[r]).exp();
                exp[r * v + c] = dloss[r] * (p - if c as i64 == targets[r] { 1.0 } else { 0.0 });
            }
        }
        let g = tx
            .cross_entropy_backward(
                &s,
                &tt,
                &tensor_on(device, &dloss, &[n], DType::F64),
                ignore,
            )
            .unwrap();
        assert_eq!(g.dtype(), dtype);
        let (rtol, atol) = if dtype == DType::F64 {
            (1e-11, 1e-12)
        } else {
            (1e-4, 1e-5)
        };
        check(
            &g,
            &[n, v],
            &exp,
            rtol,
            atol,
            &format!("cross_entropy_backward {dtype}"),
        );
    }
    // u32 targets without ignore_index.
    let t32 = Tensor::from_vec(vec![1u32, 0, 3, 4, 2, 2, 0], n, device).unwrap();
    let (l, _) = tensor_on(device, &x, &[n, v], DType::F64)
        .cross_entropy_rows(&t32, None)
        .unwrap();
    let want: Vec<f64> = (0..n)
        .map(|r| {
            let row = &x[r * v..(r + 1) * v];
            let t = [1, 0, 3, 4, 2, 2, 0][r];
            row.iter().map(|a| a.exp()).sum::<f64>().ln() - row[t]
        })
        .collect();
    check(
        &l,
        &[n],
        &want,
        1e-12,
        1e-12,
        "cross_entropy with u32 targets",
    );
    Ok(())
}
test_device!(cross_entropy_rows_with_ignore_index);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn cross_entropy_errors() {
    let x = Tensor::zeros((3, 4), DType::F32, Device::Cpu).unwrap();
    let bad = Tensor::from_vec(vec![0i64, 4, 1], 3, Device::Cpu).unwrap();
    let e = x.cross_entropy_rows(&bad, None).unwrap_err().to_string();
    assert!(
        e.contains('4'),
        "out-of-range target error should name the value: {e}"
    );
    let neg = Tensor::from_vec(vec![0i64, -1, 1], 3, Device::Cpu).unwrap();
    assert!(
        x.cross_entropy_rows(&neg, Some(-100)).is_err(),
        "negative target that is not ignored"
    );
    let ft = Tensor::zeros(3, DType::F32, Device::Cpu).unwrap();
    assert!(x.cross_entropy_rows(&ft, None).is_err(), "float targets");
    let short = Tensor::from_vec(vec![0i64, 1], 2, Device::Cpu).unwrap();
    assert!(x.cross_entropy_rows(&short, None).is_err(), "target count");
}

fn cross_entropy_over_nd_logits(device: Device) -> Result<()> {
    // Logits [B, T, V] (classes last) with targets [B, T]; the leading dims fold into rows.
    let (b, t, v) = (2, 3, 5);
    let x = uniform_vals(28, b * t * v, -4.0, 4.0);
    let targets: Vec<i64> = vec![4, -1, 0, 2, 2, -1];
    let ignore = Some(-1);
    let (mut loss, mut lse) = (vec![0.0; b * t], vec![0.0; b * t]);
    for r in 0..b * t {
        let row = &x[r * v..(r + 1) * v];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        lse[r] = m + row.iter().map(|a| (a - m).exp()).sum::<f64>().ln();
        if targets[r] != -1 {
            loss[r] = lse[r] - row[targets[r] as usize];
        }
    }
    let dloss = uniform_vals(29, b * t, 0.5, 1.5);
    let mut dlogits = vec![0.0; b * t * v];
    for r in 0..b * t {
        if targets[r] == -1 {
            continue;
        }
        for c in 0..v {
            let onehot = if c as i64 == targets[r] { 1.0 } else { 0.0 };
            dlogits[r * v + c] = dloss[r] * ((x[r * v + c] - lse[r]).exp() - onehot);
        }
    }
    let mut rng = Rng::new(14);
    let tt = Tensor::from_vec(targets.clone(), (b, t), device).unwrap();
    for dtype in [DType::F64, DType::F32] {
        let (rtol, atol) = if dtype == DType::F64 {
            (1e-12, 1e-12)
        } else {
            (1e-5, 1e-5)
        };
        for _ in 0..3 {
            let lay = Lay::random(&mut rng, 3);
            let tx = strided_on(device, &x, &[b, t, v], &lay, dtype);
            let what = format!("cross_entropy [{b}, {t}, {v}] {lay:?} {dtype}");
            let (l, s) = tx.cross_entropy_rows(&tt, ignore).unwrap();
            check(&l, &[b, t], &loss, rtol, atol, &what);
            check(&s, &[b, t], &lse, rtol, atol, &what);
            // Upstream gradient shaped like the targets, or flat.
            for dl in [
                tensor_on(device, &dloss, &[b, t], DType::F64),
                tensor_on(device, &dloss, &[b * t], DType::F64),
            ] {
                let g = tx.cross_entropy_backward(&s, &tt, &dl, ignore).unwrap();
                assert_eq!(g.dtype(), dtype);
                check(&g, &[b, t, v], &dlogits, rtol * 10.0, atol, &what);
            }
        }
    }
    // Non-contiguous targets: the transpose of a [T, B] buffer.
    let tt_t = Tensor::from_vec(vec![4i64, 2, -1, 2, 0, -1], (t, b), device)
        .unwrap()
        .t()
        .unwrap();
    let (l, _) = tensor_on(device, &x, &[b, t, v], DType::F64)
        .cross_entropy_rows(&tt_t, ignore)
        .unwrap();
    check(&l, &[b, t], &loss, 1e-12, 1e-12, "strided targets");
    // Rank 1: one position, a 0-dim target.
    let t0 = Tensor::from_vec(vec![3i64], (), device).unwrap();
    let (l, _) = tensor_on(device, &x[..v], &[v], DType::F64)
        .cross_entropy_rows(&t0, None)
        .unwrap();
    let row = &x[..v];
    let want = row.iter().map(|a| a.exp()).sum::<f64>().ln() - row[3];
    check(&l, &[], &[want], 1e-12, 1e-12, "rank-1 logits");
    Ok(())
}
test_device!(cross_entropy_over_nd_logits);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn cross_entropy_nd_errors() {
    let x = Tensor::zeros((2, 3, 5), DType::F32, Device::Cpu).unwrap();
    for dims in [vec![3usize, 2], vec![6], vec![2, 3, 5], vec![2]] {
        let t = Tensor::zeros(dims.as_slice(), DType::I64, Device::Cpu).unwrap();
        let e = x.cross_entropy_rows(&t, None).unwrap_err().to_string();
        assert!(
            e.contains("[2, 3, 5]") && e.contains(&format!("{}", t.shape())),
            "targets {dims:?}: {e}"
        );
    }
    // An out-of-range target at position [1, 0] (flat row 3) names its value.
    let t = Tensor::from_vec(vec![0i64, 1, 2, 5, 4, 3], (2, 3), Device::Cpu).unwrap();
    let e = x
        .cross_entropy_rows(&t, Some(-100))
        .unwrap_err()
        .to_string();
    assert!(e.contains("target 5") && e.contains("[2, 3]"), "{e}");
    let scalar = Tensor::zeros((), DType::F32, Device::Cpu).unwrap();
    let t0 = Tensor::zeros((), DType::I64, Device::Cpu).unwrap();
    assert!(
        scalar.cross_entropy_rows(&t0, None).is_err(),
        "0-dim logits"
    );
    // lse / dloss with the wrong number of positions.
    let t = Tensor::zeros((2, 3), DType::I64, Device::Cpu).unwrap();
    let (_, lse) = x.cross_entropy_rows(&t, None).unwrap();
    let bad = Tensor::zeros(5, DType::F32, Device::Cpu).unwrap();
    let e = x
        .cross_entropy_backward(&lse, &t, &bad, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("dloss") && e.contains("[5]"), "{e}");
    assert!(x.cross_entropy_backward(&bad, &t, &lse, None).is_err());
}

fn embedding_and_backward_with_repeated_ids(device: Device) -> Result<()> {
    let (vocab, dim) = (6, 4);
    let w = uniform_vals(26, vocab * dim, -1.0, 1.0);
    let ids: Vec<i64> = vec![3, 0, 5, 3, 3, 1];
    let id_dims = [2, 3];
    let mut rng = Rng::new(12);
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        let tw = strided_on(device, &w, &[vocab, dim], &Lay::random(&mut rng, 2), dtype);
        let wr = round_to(&w, dtype);
        let exp: Vec<f64> = ids
            .iter()
            .flat_map(|&i| wr[i as usize * dim..(i as usize + 1) * dim].to_vec())
            .collect();
        for tids in [
            Tensor::from_vec(ids.clone(), (2, 3), device).unwrap(),
            Tensor::from_vec(
                ids.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                (2, 3),
                device,
            )
            .unwrap(),
            // Non-contiguous ids.
            Tensor::from_vec(vec![3i64, 3, 0, 3, 5, 1], (3, 2), device)
                .unwrap()
                .t()
                .unwrap(),
        ] {
            let out = tw.embedding(&tids).unwrap();
            assert_eq!(out.dtype(), dtype);
            check(
                &out,
                &[2, 3, dim],
                &exp,
                0.0,
                0.0,
                &format!("embedding {dtype} ids {}", tids.dtype()),
            );
        }
    }
    // Backward: scatter-add in position order.
    let g = uniform_vals(27, ids.len() * dim, -1.0, 1.0);
    let mut exp = vec![0.0; vocab * dim];
    for (p, &i) in ids.iter().enumerate() {
        for c in 0..dim {
            exp[i as usize * dim + c] += g[p * dim + c];
        }
    }
    let tg = strided_on(
        device,
        &g,
        &[2, 3, dim],
        &Lay::Strided {
            perm: vec![2, 0, 1],
            pad: 1,
        },
        DType::F64,
    );
    let tids = Tensor::from_vec(ids.clone(), id_dims, device).unwrap();
    check(
        &tg.embedding_backward(&tids, vocab).unwrap(),
        &[vocab, dim],
        &exp,
        1e-15,
        0.0,
        "embedding_backward",
    );
    Ok(())
}
test_device!(embedding_and_backward_with_repeated_ids);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn embedding_errors() {
    let w = Tensor::zeros((4, 3), DType::F32, Device::Cpu).unwrap();
    let bad = Tensor::from_vec(vec![1i64, 4], 2, Device::Cpu).unwrap();
    let e = w.embedding(&bad).unwrap_err().to_string();
    assert!(
        e.contains('4'),
        "out-of-range id error should name the value: {e}"
    );
    let neg = Tensor::from_vec(vec![-1i64], 1, Device::Cpu).unwrap();
    assert!(w.embedding(&neg).is_err());
    let g = Tensor::zeros((2, 3), DType::F32, Device::Cpu).unwrap();
    assert!(g.embedding_backward(&bad, 4).is_err());
    assert!(
        Tensor::zeros(4, DType::F32, Device::Cpu)
            .unwrap()
            .embedding(&bad)
            .is_err(),
        "1-D table"
    );
    assert!(
        w.embedding(&Tensor::zeros(2, DType::F32, Device::Cpu).unwrap())
            .is_err(),
        "float ids"
    );
}

fn cat_stack_split_chunk(device: Device) -> Result<()> {
    let mut rng = Rng::new(13);
    for it in 0..20 {
        let dims = rng.dims(1, 4, 4);
        let rank = dims.len();
        let d = rng.below(rank);
        let named = if rng.bool() {
            d as isize
        } else {
            d as isize - rank as isize
        };
        let pieces = rng.range(1, 3);
        let mut parts: Vec<(Vec<f64>, Vec<usize>)> = Vec::new();
        for p in 0..pieces {
            let mut pd = dims.clone();
            pd[d] = rng.range(1, 3);
            parts.push((
                uniform_vals(2100 + it * 10 + p as u64, numel(&pd), -1.0, 1.0),
                pd,
            ));
        }
        let ts: Vec<Tensor> = parts
            .iter()
            .map(|(v, pd)| strided_on(device, v, pd, &Lay::random(&mut rng, rank), DType::F64))
            .collect();
        let refs: Vec<&Tensor> = ts.iter().collect();
        let out = Tensor::cat(&refs, named).unwrap();
        // Reference cat by index arithmetic.
        let mut od = dims.clone();
        od[d] = parts.iter().map(|(_, pd)| pd[d]).sum();
        let exp: Vec<f64> = (0..numel(&od))
            .map(|i| {
                let mut idx = unravel(i, &od);
                let mut p = 0;
                while idx[d] >= parts[p].1[d] {
                    idx[d] -= parts[p].1[d];
                    p += 1;
                }
                parts[p].0[ravel(&idx, &parts[p].1)]
            })
            .collect();
        check(
            &out,
            &od,
            &exp,
            0.0,
            0.0,
            &format!("cat {dims:?} dim {named}"),
        );
        // split inverts cat (views into the result).
        let sizes: Vec<usize> = parts.iter().map(|(_, pd)| pd[d]).collect();
        let back = out.split(&sizes, named).unwrap();
        for (p, t) in back.iter().enumerate() {
            assert!(t.same_storage(&out), "split gives views");
            check(
                t,
                &parts[p].1,
                &parts[p].0,
                0.0,
                0.0,
                &format!("split piece {p}"),
            );
        }
        // stack of equal shapes along a new dim (any position, negative allowed).
        let sd = rng.below(rank + 1);
        let named_sd = if rng.bool() {
            sd as isize
        } else {
            sd as isize - rank as isize - 1
        };
        let a = uniform_vals(2200 + it, numel(&dims), -1.0, 1.0);
        let b = uniform_vals(2300 + it, numel(&dims), -1.0, 1.0);
        let (ta, tb) = (
            strided_on(device, &a, &dims, &Lay::random(&mut rng, rank), DType::F32),
            strided_on(device, &b, &dims, &Lay::random(&mut rng, rank), DType::F32),
        );
        let st = Tensor::stack(&[&ta, &tb], named_sd).unwrap();
        let mut sdims = dims.clone();
        sdims.insert(sd, 2);
        let exp: Vec<f64> = (0..numel(&sdims))
            .map(|i| {
                let mut idx = unravel(i, &sdims);
                let which = idx.remove(sd);
                let src = if which == 0 { &a } else { &b };
                src[ravel(&idx, &dims)]
            })
            .collect();
        check(
            &st,
            &sdims,
            &round_to(&exp, DType::F32),
            0.0,
            0.0,
            &format!("stack {dims:?} at {named_sd}"),
        );
        // chunk into equal pieces.
        let ch = st.chunk(2, named_sd).unwrap();
        assert_eq!(ch.len(), 2);
        let mut one = sdims.clone();
        one[sd] = 1;
        check(&ch[0], &one, &round_to(&a, DType::F32), 0.0, 0.0, "chunk 0");
        check(&ch[1], &one, &round_to(&b, DType::F32), 0.0, 0.0, "chunk 1");
    }
    // Errors.
    let a = Tensor::zeros((2, 3), DType::F32, device).unwrap();
    let b = Tensor::zeros((2, 4), DType::F32, device).unwrap();
    let e = Tensor::cat(&[&a, &b], 0).unwrap_err().to_string();
    assert!(e.contains("[2, 3]") && e.contains("[2, 4]"), "{e}");
    assert!(
        Tensor::cat(
            &[
                &a,
                &b.to_dtype(DType::F64).unwrap().narrow(1, 0, 3).unwrap()
            ],
            0
        )
        .is_err(),
        "dtype mismatch"
    );
    assert!(Tensor::cat(&[], 0).is_err());
    assert!(Tensor::stack(&[&a, &b], 0).is_err());
    assert!(b.chunk(3, 1).is_err());
    assert!(b.split(&[1, 2], 1).is_err());
    Ok(())
}
test_device!(cat_stack_split_chunk);

/// `cat` writes its output into a buffer with unspecified contents (a recycled CPU buffer, the
/// caching allocator's block on CUDA): every element must come from a piece, none from what the
/// buffer held before (here NaN), for contiguous and strided pieces.
fn cat_overwrites_a_recycled_buffer(device: Device) -> Result<()> {
    let (rows, cols) = (3 << 6, 1 << 8); // 3 * 2^14 elements: large enough to be recycled
    for _ in 0..3 {
        drop(Tensor::full(f64::NAN, (rows, cols), DType::F32, device)?);
    }
    let a = Tensor::arange(0, (rows * cols / 2) as i64, DType::F32, device)?
        .reshape((rows, cols / 2))?;
    let b_t = Tensor::arange(0, (rows * cols / 2) as i64, DType::F32, device)?
        .reshape((cols / 2, rows))?;
    let b = b_t.t()?; // a strided piece
    let out = Tensor::cat(&[&a, &b], 1)?.to_vec::<f32>()?;
    assert_eq!(out.len(), rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let expect = if c < cols / 2 {
                r * cols / 2 + c
            } else {
                (c - cols / 2) * rows + r
            };
            assert_eq!(out[r * cols + c], expect as f32, "at ({r}, {c})");
        }
    }
    Ok(())
}
test_device!(cat_overwrites_a_recycled_buffer);

/// bf16 round-to-nearest-even of an f32, by bit manipulation (independent of `half`).
fn bf16_round(x: f64) -> f64 {
    let bits = (x as f32).to_bits();
    let lsb = (bits >> 16) & 1;
    let r = bits.wrapping_add(0x7FFF + lsb) & 0xFFFF_0000;
    f32::from_bits(r) as f64
}

fn casts_between_dtypes(device: Device) -> Result<()> {
    let x: Vec<f64> = uniform_vals(28, 64, -300.0, 300.0);
    let t = tensor_on(device, &x, &[8, 8], DType::F64);
    // f32: rounding to nearest.
    let f = t.to_dtype(DType::F32).unwrap();
    assert_eq!(f.dtype(), DType::F32);
    assert_eq!(
        f.to_vec::<f32>().unwrap(),
        x.iter().map(|&v| v as f32).collect::<Vec<_>>()
    );
    // bf16 from f32: RNE on the f32 bits.
    let b = f.to_dtype(DType::BF16).unwrap();
    assert_eq!(
        vals(&b),
        x.iter()
            .map(|&v| bf16_round(v as f32 as f64))
            .collect::<Vec<_>>()
    );
    // f16: within half a unit in the last place (11 significand bits) for normal values.
    let h = t.to_dtype(DType::F16).unwrap();
    for (a, e) in vals(&h).iter().zip(&x) {
        assert!(
            (a - e).abs() <= e.abs() * 2f64.powi(-11),
            "f16 of {e} is {a}"
        );
    }
    // Float to integer truncates toward zero; negatives saturate to 0 in u32.
    let i = t.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(i, x.iter().map(|&v| v.trunc() as i64).collect::<Vec<_>>());
    let u = t.to_dtype(DType::U32).unwrap().to_vec::<u32>().unwrap();
    assert_eq!(
        u,
        x.iter()
            .map(|&v| if v < 0.0 { 0 } else { v.trunc() as u32 })
            .collect::<Vec<_>>()
    );
    // Integer to float is exact; through non-contiguous views too.
    let ids: Vec<i64> = (0..24).map(|k| k * 1_000_003 - 7_000_000).collect();
    let ti = Tensor::from_vec(ids.clone(), (4, 6), device)
        .unwrap()
        .t()
        .unwrap();
    let (exp, _) = ref_permute(
        &ids.iter().map(|&v| v as f64).collect::<Vec<_>>(),
        &[4, 6],
        &[1, 0],
    );
    assert_eq!(vals(&ti.to_dtype(DType::F64).unwrap()), exp);
    let tu = Tensor::from_vec((0..6u32).collect::<Vec<_>>(), 6, device).unwrap();
    assert_eq!(
        tu.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap(),
        vec![0, 1, 2, 3, 4, 5]
    );
    assert_eq!(
        tu.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(),
        vec![0., 1., 2., 3., 4., 5.]
    );
    // Half types round-trip through f32 exactly.
    for dt in [DType::BF16, DType::F16] {
        let r = t.to_dtype(dt).unwrap();
        assert_eq!(
            vals(&r.to_dtype(DType::F32).unwrap().to_dtype(dt).unwrap()),
            vals(&r),
            "{dt} round trip"
        );
        let direct = vals(&r.to_dtype(DType::F64).unwrap());
        assert_eq!(
            direct,
            vals(&r.to_dtype(DType::F32).unwrap()),
            "{dt} widening"
        );
    }
    // Known values.
    let k = tensor_on(device, &[1.0, 0.5, 65504.0, 1.0 / 3.0], &[4], DType::F16);
    assert_eq!(vals(&k)[..3], [1.0, 0.5, 65504.0]);
    let kb = tensor_on(device, &[1.0 / 3.0], &[1], DType::BF16);
    assert_eq!(vals(&kb), vec![bf16_round(1.0 / 3.0)]);
    // Same dtype: no copy.
    assert!(t.to_dtype(DType::F64).unwrap().same_storage(&t));
    Ok(())
}
test_device!(casts_between_dtypes);

fn half_precision_binary_ops_compute_in_f32(device: Device) -> Result<()> {
    let a = uniform_vals(29, 60, -4.0, 4.0);
    let b = uniform_vals(30, 12, -4.0, 4.0);
    for (dtype, u) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        let (ar, br) = (round_to(&a, dtype), round_to(&b, dtype));
        for (name, op, f) in binary_ops() {
            if name == "div" {
                continue;
            }
            let out = op(
                &tensor_on(device, &a, &[5, 12], dtype),
                &tensor_on(device, &b, &[12], dtype),
            )
            .unwrap();
            assert_eq!(out.dtype(), dtype);
            let (exp, od) = ref_binary(&ar, &[5, 12], &br, &[12], f);
            // One rounding of the exact result: within the unit roundoff.
            check(
                &out,
                &od,
                &exp,
                u * 1.0001,
                1e-30,
                &format!("{name} in {dtype}"),
            );
        }
    }
    Ok(())
}
test_device!(half_precision_binary_ops_compute_in_f32);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn mixed_dtypes_and_integer_arithmetic_are_refused() {
    let a = Tensor::zeros(3, DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros(3, DType::F64, Device::Cpu).unwrap();
    let e = a.add(&b).unwrap_err().to_string();
    assert!(e.contains("F32") || e.contains("f32"), "{e}");
    assert!(e.contains("F64") || e.contains("f64"), "{e}");
    let i = Tensor::zeros(3, DType::I64, Device::Cpu).unwrap();
    assert!(i.add(&i).is_err());
    assert!(i.exp().is_err());
}

fn random_fills_are_layout_invariant(device: Device) -> Result<()> {
    let (n, s, len) = (1000u64, 123u64, 200usize);
    for dtype in [DType::F64, DType::F32] {
        let r = Random::new(42).device(device).dtype(dtype);
        let whole = vals(&r.uniform(n as usize, -1.0, 2.0).unwrap());
        let shard = vals(&r.offset(s).uniform(len, -1.0, 2.0).unwrap());
        assert_eq!(
            shard,
            whole[s as usize..s as usize + len],
            "uniform shard {dtype}"
        );
        let shaped = vals(&r.uniform((10, 100), -1.0, 2.0).unwrap());
        assert_eq!(shaped, whole, "uniform: the shape does not matter");
        let wn = vals(&r.normal(n as usize, 0.5, 2.0).unwrap());
        let sn = vals(&r.offset(s).normal((20, 10), 0.5, 2.0).unwrap());
        assert_eq!(sn, wn[s as usize..s as usize + len], "randn shard {dtype}");
    }
    // f32 values are the f64 ones rounded.
    let w64 = vals(
        &Random::new(9)
            .device(device)
            .dtype(DType::F64)
            .normal(100, 0.0, 1.0)
            .unwrap(),
    );
    let w32 = vals(&Random::new(9).device(device).normal(100, 0.0, 1.0).unwrap());
    assert_eq!(
        w32,
        w64.iter().map(|&v| v as f32 as f64).collect::<Vec<_>>()
    );
    // Seeds matter.
    let f64s = |seed| Random::new(seed).device(device).dtype(DType::F64);
    let other = vals(&f64s(43).uniform(1000, -1.0, 2.0).unwrap());
    let whole = vals(&f64s(42).uniform(1000, -1.0, 2.0).unwrap());
    assert!(other.iter().zip(&whole).filter(|(a, b)| a == b).count() < 5);
    Ok(())
}
test_device!(random_fills_are_layout_invariant);

fn random_fill_statistics(device: Device) -> Result<()> {
    let n = 20000;
    let f64s = |seed| Random::new(seed).device(device).dtype(DType::F64);
    let u = vals(&f64s(1).uniform(n, -1.0, 3.0).unwrap());
    assert!(u.iter().all(|&v| (-1.0..3.0).contains(&v)));
    let mean = u.iter().sum::<f64>() / n as f64;
    let var = u.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
    assert!((mean - 1.0).abs() < 0.05, "uniform mean {mean}");
    assert!((var - 16.0 / 12.0).abs() < 0.05, "uniform variance {var}");
    let g = vals(&f64s(2).normal(n, 0.5, 2.0).unwrap());
    let mean = g.iter().sum::<f64>() / n as f64;
    let var = g.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n as f64;
    assert!((mean - 0.5).abs() < 0.06, "normal mean {mean}");
    assert!((var.sqrt() - 2.0).abs() < 0.06, "normal std {}", var.sqrt());
    let within1 = g.iter().filter(|&&v| (v - 0.5).abs() < 2.0).count() as f64 / n as f64;
    assert!(
        (within1 - 0.6827).abs() < 0.02,
        "fraction within one std {within1}"
    );
    Ok(())
}
test_device!(random_fill_statistics);

fn dropout_mask_statistics_and_layout_invariance(device: Device) -> Result<()> {
    let p = 0.3;
    let shape = (64, 64);
    let m = Tensor::dropout_mask(5, 0, p, shape, DType::F32, device).unwrap();
    assert_eq!(m.dims(), &[64, 64]);
    assert_eq!(m.dtype(), DType::F32);
    let v = vals(&m);
    let keep = (1.0 / (1.0 - p)) as f32 as f64;
    assert!(
        v.iter().all(|&x| x == 0.0 || x == keep),
        "mask values are 0 or 1/(1-p)"
    );
    let dropped = v.iter().filter(|&&x| x == 0.0).count() as f64 / v.len() as f64;
    assert!((dropped - p).abs() < 0.03, "dropped fraction {dropped}");
    // The mask is the documented function of the counter-based uniforms.
    let u = vals(
        &Random::new(5)
            .device(device)
            .uniform(4096, 0.0, 1.0)
            .unwrap(),
    );
    let exp: Vec<f64> = u.iter().map(|&x| if x >= p { keep } else { 0.0 }).collect();
    assert_eq!(v, exp);
    // A shard built with its global start equals the same slice of the whole mask.
    let shard = vals(&Tensor::dropout_mask(5, 1000, p, (10, 50), DType::F32, device).unwrap());
    assert_eq!(shard, v[1000..1500]);
    // Row 3 of a [64, 64] tensor sharded along rows.
    let row = vals(&Tensor::dropout_mask(5, 3 * 64, p, 64, DType::F32, device).unwrap());
    assert_eq!(row, v[192..256]);
    // Other dtypes hold the same pattern.
    let m64 = vals(&Tensor::dropout_mask(5, 0, p, shape, DType::F64, device).unwrap());
    let k64 = 1.0 / (1.0 - p);
    assert_eq!(
        m64.iter().map(|&x| x != 0.0).collect::<Vec<_>>(),
        v.iter().map(|&x| x != 0.0).collect::<Vec<_>>()
    );
    assert!(m64.iter().all(|&x| x == 0.0 || x == k64));
    // p = 0 keeps everything; p outside [0, 1) is refused.
    assert!(
        vals(&Tensor::dropout_mask(5, 0, 0.0, 100, DType::F32, device).unwrap())
            .iter()
            .all(|&x| x == 1.0)
    );
    assert!(Tensor::dropout_mask(5, 0, 1.0, 10, DType::F32, device).is_err());
    assert!(Tensor::dropout_mask(5, 0, -0.1, 10, DType::F32, device).is_err());
    // Different seeds give different masks.
    let other = vals(&Tensor::dropout_mask(6, 0, p, shape, DType::F32, device).unwrap());
    assert_ne!(other, v);
    Ok(())
}
test_device!(dropout_mask_statistics_and_layout_invariance);

fn linear_matches_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(14);
    let cases: Vec<Vec<usize>> = vec![
        vec![5, 4],
        vec![2, 3, 4],
        vec![4],
        vec![2, 1, 3, 4],
        vec![1, 4],
        vec![33, 4],
    ];
    let (out_f, in_f) = (6, 4);
    for (case, xd) in cases.into_iter().enumerate() {
        let s = case as u64;
        let x = uniform_vals(2400 + s, numel(&xd), -1.0, 1.0);
        let w = uniform_vals(2500 + s, out_f * in_f, -1.0, 1.0);
        let b = uniform_vals(2600 + s, out_f, -1.0, 1.0);
        for dtype in [DType::F64, DType::F32] {
            let (xr, wr, br) = (
                round_to(&x, dtype),
                round_to(&w, dtype),
                round_to(&b, dtype),
            );
            let rows = xr.len() / in_f;
            for with_bias in [false, true] {
                let mut exp = vec![0.0; rows * out_f];
                for r in 0..rows {
                    for j in 0..out_f {
                        let dot: f64 = (0..in_f).map(|p| xr[r * in_f + p] * wr[j * in_f + p]).sum();
                        exp[r * out_f + j] = dot + if with_bias { br[j] } else { 0.0 };
                    }
                }
                let mut od = xd.clone();
                *od.last_mut().unwrap() = out_f;
                for _ in 0..3 {
                    let (lx, lw) = (Lay::random(&mut rng, xd.len()), Lay::random(&mut rng, 2));
                    let tx = strided_on(device, &x, &xd, &lx, dtype);
                    let tw = strided_on(device, &w, &[out_f, in_f], &lw, dtype);
                    let tb = strided_on(device, &b, &[out_f], &Lay::random(&mut rng, 1), dtype);
                    let out = tx
                        .linear(&tw, if with_bias { Some(&tb) } else { None })
                        .unwrap();
                    assert_eq!(out.dtype(), dtype);
                    let (rtol, atol) = if dtype == DType::F64 {
                        F64_TOL
                    } else {
                        (1e-5, 1e-5)
                    };
                    check(
                        &out,
                        &od,
                        &exp,
                        rtol,
                        atol,
                        &format!("linear x {xd:?} ({lx:?}) W ({lw:?}) bias={with_bias} {dtype}"),
                    );
                }
            }
        }
    }
    // An input that is an expanded (stride-0) view.
    let x = uniform_vals(2700, in_f, -1.0, 1.0);
    let w = uniform_vals(2701, out_f * in_f, -1.0, 1.0);
    let tx = tensor_on(device, &x, &[1, in_f], DType::F64)
        .expand([3, in_f])
        .unwrap();
    let out = tx
        .linear(&tensor_on(device, &w, &[out_f, in_f], DType::F64), None)
        .unwrap();
    let row: Vec<f64> = (0..out_f)
        .map(|j| (0..in_f).map(|p| x[p] * w[j * in_f + p]).sum())
        .collect();
    check(
        &out,
        &[3, out_f],
        &row.repeat(3),
        1e-12,
        1e-12,
        "linear of an expanded input",
    );
    // Errors.
    let z = |d: &[usize]| Tensor::zeros(d, DType::F32, device).unwrap();
    let e = z(&[2, 5])
        .linear(&z(&[6, 4]), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("[2, 5]") && e.contains("[6, 4]"), "{e}");
    assert!(
        z(&[2, 4]).linear(&z(&[6, 4]), Some(&z(&[4]))).is_err(),
        "bias of the wrong size"
    );
    assert!(
        z(&[2, 4]).linear(&z(&[6, 4, 1]), None).is_err(),
        "3-D weight"
    );
    Ok(())
}
test_device!(linear_matches_reference);

fn attention_qkv_matches_split_heads_reference(device: Device) -> Result<()> {
    let mut rng = Rng::new(15);
    for (case, (b, t, heads, d, causal)) in [
        (1, 4, 1, 4, true),
        (2, 5, 2, 3, false),
        (2, 5, 2, 3, true),
        (1, 17, 4, 8, true),
    ]
    .into_iter()
    .enumerate()
    {
        let c = heads * d;
        let x = uniform_vals(2800 + case as u64, b * t * 3 * c, -1.0, 1.0);
        let scale = 1.0 / (d as f64).sqrt();
        // Split q, k, v and move heads forward with our own index arithmetic.
        let part = |which: usize| -> Vec<f64> {
            let mut out = vec![0.0; b * heads * t * d];
            for bb in 0..b {
                for h in 0..heads {
                    for tt in 0..t {
                        for dd in 0..d {
                            out[((bb * heads + h) * t + tt) * d + dd] =
                                x[(bb * t + tt) * 3 * c + which * c + h * d + dd];
                        }
                    }
                }
            }
            out
        };
        for dtype in [DType::F64, DType::F32] {
            let (q, k, v) = (
                round_to(&part(0), dtype),
                round_to(&part(1), dtype),
                round_to(&part(2), dtype),
            );
            let (o, lse) = ref_attention(&q, &k, &v, b * heads, t, t, d, causal, scale);
            // Heads back to the last dim.
            let mut exp = vec![0.0; b * t * c];
            for bb in 0..b {
                for h in 0..heads {
                    for tt in 0..t {
                        for dd in 0..d {
                            exp[(bb * t + tt) * c + h * d + dd] =
                                o[((bb * heads + h) * t + tt) * d + dd];
                        }
                    }
                }
            }
            let tx = strided_on(device, &x, &[b, t, 3 * c], &Lay::random(&mut rng, 3), dtype);
            let out = tx.attention_qkv(heads, &mask(causal), scale).unwrap();
            let (rtol, atol) = if dtype == DType::F64 {
                (1e-11, 1e-12)
            } else {
                (1e-4, 1e-5)
            };
            let what = format!("attention_qkv b{b} t{t} heads{heads} d{d} causal={causal} {dtype}");
            check(&out.out, &[b, t, c], &exp, rtol, atol, &what);
            check(
                &out.lse,
                &[b, heads, t],
                &lse,
                rtol,
                atol,
                &format!("lse: {what}"),
            );
        }
        // The backward equals attention_backward on the split tensors, re-packed.
        let tx = tensor_on(device, &x, &[b, t, 3 * c], DType::F64);
        let out = tx.attention_qkv(heads, &mask(causal), scale).unwrap();
        let dout = uniform_vals(2900 + case as u64, b * t * c, -1.0, 1.0);
        let tdo = tensor_on(device, &dout, &[b, t, c], DType::F64);
        let dqkv = tx
            .attention_qkv_backward(&out, &tdo, heads, &mask(causal), scale, false)
            .unwrap()
            .0;
        let split = |v: &[f64]| tensor_on(device, v, &[b, heads, t, d], DType::F64);
        let (tq, tk, tv) = (split(&part(0)), split(&part(1)), split(&part(2)));
        let o4 = Tensor::attention(&tq, &tk, &tv, &mask(causal), scale).unwrap();
        let do4 = tdo
            .reshape([b, t, heads, d])
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let g = Tensor::attention_backward(&tq, &tk, &tv, &o4, &do4, &mask(causal), scale, false)
            .unwrap();
        let (gq, gk, gv) = (g.dq, g.dk, g.dv);
        let pack = |g: &Tensor| g.transpose(1, 2).unwrap().reshape([b, t, c]).unwrap();
        let want = Tensor::cat(&[&pack(&gq), &pack(&gk), &pack(&gv)], 2).unwrap();
        check(
            &dqkv,
            &[b, t, 3 * c],
            &vals(&want),
            1e-10,
            1e-12,
            "attention_qkv_backward",
        );
    }
    let z = Tensor::zeros((1, 4, 10), DType::F32, device).unwrap();
    assert!(
        z.attention_qkv(2, &mask(true), 1.0).is_err(),
        "3C not divisible by 3 * heads"
    );
    assert!(Tensor::zeros((4, 12), DType::F32, device)
        .unwrap()
        .attention_qkv(2, &mask(true), 1.0)
        .is_err());
    Ok(())
}
test_device!(attention_qkv_matches_split_heads_reference);

fn sqr_sum_in_f64(device: Device) -> Result<()> {
    let x = uniform_vals(3000, 50, -1.0, 1.0);
    let t = strided_on(
        device,
        &x,
        &[5, 10],
        &Lay::Strided {
            perm: vec![1, 0],
            pad: 1,
        },
        DType::F32,
    );
    let want: f64 = round_to(&x, DType::F32).iter().map(|v| v * v).sum();
    assert_close(
        &[t.sqr_sum_f64().unwrap()],
        &[want],
        1e-12,
        0.0,
        "sqr_sum_f64",
    );
    Ok(())
}
test_device!(sqr_sum_in_f64);

fn empty_tensors(device: Device) -> Result<()> {
    let z = |d: &[usize]| Tensor::zeros(d, DType::F64, device).unwrap();
    let e = z(&[0, 3]);
    assert_eq!(e.add(&z(&[3])).unwrap().dims(), &[0, 3]);
    assert_eq!(e.exp().unwrap().dims(), &[0, 3]);
    check(
        &e.sum(&[0], false).unwrap(),
        &[3],
        &[0.0; 3],
        0.0,
        0.0,
        "sum over an empty dim",
    );
    assert_eq!(e.sum(&[1], false).unwrap().dims(), &[0]);
    check(
        &z(&[2, 0]).matmul(&z(&[0, 3])).unwrap(),
        &[2, 3],
        &[0.0; 6],
        0.0,
        0.0,
        "matmul with k = 0",
    );
    assert_eq!(z(&[0, 4]).matmul(&z(&[4, 3])).unwrap().dims(), &[0, 3]);
    let a = tensor_on(device, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F64);
    let c = Tensor::cat(&[&z(&[2, 0]), &a, &a.narrow(1, 1, 0).unwrap()], 1).unwrap();
    check(&c, &[2, 3], &vals(&a), 0.0, 0.0, "cat with empty pieces");
    assert_eq!(e.softmax(-1).unwrap().dims(), &[0, 3]);
    assert_eq!(e.t().unwrap().contiguous().unwrap().dims(), &[3, 0]);
    Ok(())
}
test_device!(empty_tensors);

/// The attention mask with only the causal flag set.
fn mask(causal: bool) -> AttentionMask {
    AttentionMask {
        causal,
        ..AttentionMask::none()
    }
}

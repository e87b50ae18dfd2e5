//! Operators on `Var`: every form records the op it stands for with the same value, gradients
//! flow through them (checked against finite differences and by hand), errors are values and a
//! chain returns its first one; `reshape` with an inferred dimension is differentiable.

use crate::common;

use common::*;
use meshgrad_autograd::{gradcheck, GradcheckOptions, Var};
use meshgrad_tensor::{DType, Device, Result, Tensor};

fn leaf(seed: u64, dims: &[usize]) -> Var {
    Var::leaf(rand(seed, dims, 0.5, 1.5))
}

fn value(v: Result<Var>) -> Vec<f64> {
    vals(v.unwrap().tensor())
}

#[test]
fn var_var_forms_match_the_named_ops() {
    let (a, b) = (leaf(1, &[2, 3]), leaf(2, &[3]));
    type Op = fn(&Var, &Var) -> Result<Var>;
    let named: [(&str, Op); 4] = [
        ("add", Var::add),
        ("sub", Var::sub),
        ("mul", Var::mul),
        ("div", Var::div),
    ];
    for (name, op) in named {
        let want = value(op(&a, &b));
        let forms = match name {
            "add" => [
                &a + &b,
                a.clone() + &b,
                &a + b.clone(),
                a.clone() + b.clone(),
            ],
            "sub" => [
                &a - &b,
                a.clone() - &b,
                &a - b.clone(),
                a.clone() - b.clone(),
            ],
            "mul" => [
                &a * &b,
                a.clone() * &b,
                &a * b.clone(),
                a.clone() * b.clone(),
            ],
            _ => [
                &a / &b,
                a.clone() / &b,
                &a / b.clone(),
                a.clone() / b.clone(),
            ],
        };
        for (k, f) in forms.into_iter().enumerate() {
            let f = f.unwrap();
            assert_eq!(f.op_name(), Some(name), "form {k}");
            assert_bitwise(&vals(f.tensor()), &want, &format!("{name} form {k}"));
        }
    }
}

#[test]
fn scalar_and_neg_forms() {
    let a = leaf(3, &[4]);
    let x = vals(a.tensor());
    let map = |f: &dyn Fn(f64) -> f64| x.iter().map(|&v| f(v)).collect::<Vec<_>>();
    let cases: Vec<(&str, Result<Var>, Vec<f64>)> = vec![
        ("a + 2", &a + 2.0, map(&|v| v + 2.0)),
        ("2 + a", 2.0 + &a, map(&|v| 2.0 + v)),
        ("a - 2", a.clone() - 2.0, map(&|v| v - 2.0)),
        ("2 - a", 2.0 - a.clone(), map(&|v| 2.0 - v)),
        ("a * 3", &a * 3.0, map(&|v| v * 3.0)),
        ("3 * a", 3.0 * a.clone(), map(&|v| 3.0 * v)),
        ("a / 3", a.clone() / 3.0, map(&|v| v / 3.0)),
        ("3 / a", 3.0 / &a, map(&|v| 3.0 / v)),
        ("-a", -&a, map(&|v| -v)),
        ("-a owned", -a.clone(), map(&|v| -v)),
    ];
    for (name, got, want) in cases {
        assert_bitwise(&value(got), &want, name);
    }
}

#[test]
fn gradients_through_operators_match_finite_differences() {
    let opts = GradcheckOptions::default();
    // Every binary form and every scalar form, with broadcasting (w is a row).
    let f = |v: &[Var]| -> Result<Var> {
        let (x, w) = (&v[0], &v[1]);
        let p = (2.0 / ((x * w)? + 3.0)? - x) * (1.0 - w)?;
        let q = (-(x / 4.0)?)? * w.clone();
        ((p? + q?)? - 0.5)? / (x.clone() + 2.0)
    };
    let inputs = [rand(4, &[3, 4], 0.5, 1.5), rand(5, &[4], 0.5, 1.5)];
    gradcheck(f, &inputs, opts).unwrap();
    // The RMSNorm of the crate documentation, weight included.
    let rms = |v: &[Var]| -> Result<Var> {
        let (x, w) = (&v[0], &v[1]);
        let inv_rms = (x.sqr()?.mean(&[-1], true)? + 1e-6)?.powf(-0.5)?;
        x * inv_rms * w
    };
    let inputs = [rand(6, &[2, 3, 5], -1.0, 1.0), rand(7, &[5], 0.5, 1.5)];
    gradcheck(rms, &inputs, opts).unwrap();
}

#[test]
fn gradients_through_operators_by_hand() -> Result<()> {
    let x = Var::leaf(t64(&[1.0, 2.0, 4.0], &[3]));
    let s = Var::leaf(t64(&[3.0], &[1]));
    // y = sum(3x - 1 + x*s + 2/x); dy/dx = 3 + s - 2/x², dy/ds = sum(x)
    let y = (((3.0 * &x)? - 1.0)? + &x * &s + (2.0 / &x)?)?;
    y.sum_all().unwrap().backward().unwrap();
    assert_close(
        &grad_of(&x),
        &[3.0 + 3.0 - 2.0, 3.0 + 3.0 - 0.5, 3.0 + 3.0 - 0.125],
        1e-15,
        0.0,
        "dx",
    );
    assert_eq!(grad_of(&s), vec![7.0]);
    // A constant operand gets no gradient and passes none on.
    let c = Var::constant(t64(&[5.0], &[1]));
    let z = Var::leaf(t64(&[1.0, 2.0], &[2]));
    let y = (&c - &z).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    assert_eq!(grad_of(&z), vec![-1.0, -1.0]);
    assert!(c.grad().is_none());
    Ok(())
}

#[test]
fn errors_are_values_and_the_first_one_wins() {
    let (a, b) = (leaf(1, &[2, 3]), leaf(2, &[3]));
    let two = leaf(3, &[2]);
    let four = leaf(4, &[4]);
    let msg = |r: Result<Var>| r.unwrap_err().to_string();
    assert_eq!(msg(&a + &two), "add: shape mismatch: [2, 3] vs [2]");
    assert_eq!(
        msg(a.clone() / two.clone()),
        "div: shape mismatch: [2, 3] vs [2]"
    );
    assert_eq!(
        msg((&a + &two) * &four - &b),
        "add: shape mismatch: [2, 3] vs [2]"
    );
    assert_eq!(
        msg(((&a * &b) - &four) / &two),
        "sub: shape mismatch: [2, 3] vs [4]"
    );
    assert_eq!(msg(&b * (&a / &four)), "div: shape mismatch: [2, 3] vs [4]");
    assert_eq!(
        msg(b.clone() - (&four * &two)),
        "mul: shape mismatch: [4] vs [2]"
    );
    let f32s = Var::leaf(Tensor::ones(3, DType::F32, Device::Cpu).unwrap());
    assert_eq!(msg(&b + &f32s), "add: dtype mismatch: F64 vs F32");
    let ids = Var::constant(Tensor::arange(0, 3, DType::I64, Device::Cpu).unwrap());
    assert_eq!(msg(&ids / 2.0), "div: unsupported dtype I64");
}

#[test]
fn reshape_with_an_inferred_dimension_is_differentiable() {
    let x = leaf(8, &[2, 3, 4]);
    let (b, t) = (2usize, 3usize);
    let y = x.reshape((b * t, -1)).unwrap();
    assert_eq!(y.tensor().dims(), &[6, 4]);
    assert_eq!(y.op_name(), Some("reshape"));
    let z = y.reshape([b as isize, -1]).unwrap();
    assert_eq!(z.tensor().dims(), &[2, 12]);
    (&z * &z).unwrap().sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert_eq!(g.dims(), &[2, 3, 4]);
    assert_bitwise(
        &vals(&g),
        &vals(x.tensor()).iter().map(|v| 2.0 * v).collect::<Vec<_>>(),
        "d(sum x²)/dx through reshapes",
    );
    let e = x.reshape((5, -1)).unwrap_err().to_string();
    assert_eq!(
        e,
        "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [5, -1]: \
         24 is not a multiple of 5 (the product of the other sizes)"
    );
    gradcheck(
        |v: &[Var]| v[0].reshape((-1, 2))?.sqr(),
        &[rand(9, &[3, 4], -1.0, 1.0)],
        GradcheckOptions::default(),
    )
    .unwrap();
}

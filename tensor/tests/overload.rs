//! Operators on tensors: every form gives the bits of the named op it stands for, errors are
//! values (never panics), and a chain returns its first error.

use half::bf16;
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

const CPU: Device = Device::Cpu;

fn t32(v: &[f32], dims: &[usize], device: Device) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, device).unwrap()
}

fn f32s(t: Result<Tensor>) -> Vec<f32> {
    t.unwrap().to_vec::<f32>().unwrap()
}

fn a(device: Device) -> Tensor {
    t32(&[1.5, -2.0, 3.25, 0.1, 7.0, -0.3], &[2, 3], device)
}

fn b(device: Device) -> Tensor {
    t32(&[0.7, -1.1, 2.9], &[3], device) // broadcasts over the rows of a()
}

fn tensor_tensor_forms_match_the_named_ops(device: Device) -> Result<()> {
    let (a, b) = (a(device), b(device));
    type Op = fn(&Tensor, &Tensor) -> Result<Tensor>;
    let named: [(&str, Op); 4] = [
        ("add", Tensor::add),
        ("sub", Tensor::sub),
        ("mul", Tensor::mul),
        ("div", Tensor::div),
    ];
    for (name, op) in named {
        let want = f32s(op(&a, &b));
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
            assert_eq!(f32s(f), want, "{name} form {k}");
        }
        // Broadcasting the other way round.
        assert_eq!(
            f32s(match name {
                "add" => &b + &a,
                "sub" => &b - &a,
                "mul" => &b * &a,
                _ => &b / &a,
            }),
            f32s(op(&b, &a)),
            "{name} reversed"
        );
    }
    Ok(())
}
test_device!(tensor_tensor_forms_match_the_named_ops);

fn scalar_forms_on_either_side(device: Device) -> Result<()> {
    let a = a(device);
    let x = a.to_vec::<f32>().unwrap();
    let map = |f: &dyn Fn(f32) -> f32| x.iter().map(|&v| f(v)).collect::<Vec<_>>();
    // The scalar is applied in f32 arithmetic, as the named scalar ops do.
    assert_eq!(f32s(&a + 2.5), map(&|v| v + 2.5));
    assert_eq!(f32s(2.5 + &a), map(&|v| v + 2.5));
    assert_eq!(f32s(a.clone() + 2.5), map(&|v| v + 2.5));
    assert_eq!(f32s(2.5 + a.clone()), map(&|v| v + 2.5));
    assert_eq!(f32s(&a - 0.7), map(&|v| v - 0.7));
    assert_eq!(f32s(a.clone() - 0.7), map(&|v| v - 0.7));
    assert_eq!(f32s(1.0 - &a), map(&|v| 1.0 - v));
    assert_eq!(f32s(1.0 - a.clone()), map(&|v| 1.0 - v));
    assert_eq!(f32s(&a * 3.0), map(&|v| v * 3.0));
    assert_eq!(f32s(3.0 * &a), map(&|v| 3.0 * v));
    assert_eq!(f32s(a.clone() * 3.0), map(&|v| v * 3.0));
    assert_eq!(f32s(3.0 * a.clone()), map(&|v| 3.0 * v));
    // Division is a true division (not a multiplication by the reciprocal).
    assert_eq!(f32s(&a / 3.0), map(&|v| v / 3.0));
    assert_eq!(f32s(a.clone() / 3.0), map(&|v| v / 3.0));
    assert_eq!(f32s(3.0 / &a), map(&|v| 3.0 / v));
    assert_eq!(f32s(3.0 / a.clone()), map(&|v| 3.0 / v));
    assert_eq!(f32s(-&a), map(&|v| -v));
    assert_eq!(f32s(-a.clone()), map(&|v| -v));
    // The dtype is kept: f64 stays f64, bf16 stays bf16 (its scalar rounded to bf16 for `/`).
    let d = Tensor::from_vec(vec![1f64, 2., 4.], 3, device).unwrap();
    let q = (&d / 3.0).unwrap();
    assert_eq!(q.dtype(), DType::F64);
    assert_eq!(q.to_vec::<f64>().unwrap(), vec![1. / 3., 2. / 3., 4. / 3.]);
    let h = d.to_dtype(DType::BF16).unwrap();
    let q = (&h / 10.0).unwrap();
    assert_eq!(q.dtype(), DType::BF16);
    let want: Vec<bf16> = [1f32, 2., 4.]
        .iter()
        .map(|&v| bf16::from_f32(v / bf16::from_f32(10.0).to_f32()))
        .collect();
    assert_eq!(q.to_vec::<bf16>().unwrap(), want);
    let s = (&h * 0.5 + &h).unwrap();
    assert_eq!(s.to_vec_f64().unwrap(), vec![1.5, 3., 6.]);
    Ok(())
}
test_device!(scalar_forms_on_either_side);

fn results_chain_on_either_side(device: Device) -> Result<()> {
    let (a, b) = (a(device), b(device));
    let c = t32(&[2.0], &[1], device);
    // Left operand a Result.
    let want = f32s(a.add(&b).unwrap().mul(&c));
    assert_eq!(f32s((&a + &b) * &c), want);
    assert_eq!(f32s((&a + &b) * c.clone()), want);
    // Right operand a Result.
    let want = f32s(c.mul(&a.add(&b).unwrap()));
    assert_eq!(f32s(&c * (&a + &b)), want);
    assert_eq!(f32s(c.clone() * (&a + &b)), want);
    // A longer chain with scalars where a `?` is needed (Result op f64 cannot exist).
    let want = f32s(
        a.mul(&b)
            .unwrap()
            .mul_scalar(2.0)
            .unwrap()
            .sub(&a)
            .unwrap()
            .div(&c),
    );
    assert_eq!(f32s(((&a * &b).unwrap() * 2.0 - &a) / &c), want);
    assert_eq!(f32s((2.0 * (&a * &b).unwrap() - &a) / &c), want);
    // An RMSNorm-like expression.
    let x = a.clone();
    let y = (&x
        * (x.sqr().unwrap().mean(&[-1], true).unwrap() + 1e-6)
            .unwrap()
            .powf(-0.5)
            .unwrap())
    .unwrap();
    let ms = x.sqr().unwrap().mean(&[-1], true).unwrap();
    let want = x
        .mul(&ms.add_scalar(1e-6).unwrap().powf(-0.5).unwrap())
        .unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
    Ok(())
}
test_device!(results_chain_on_either_side);

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn errors_are_values_and_the_first_one_wins() {
    let (a, b) = (a(CPU), b(CPU));
    let two = t32(&[1.0, 2.0], &[2], CPU);
    let four = t32(&[1.0, 2.0, 3.0, 4.0], &[4], CPU);
    let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert_eq!(msg(&a + &two), "add: shape mismatch: [2, 3] vs [2]");
    assert_eq!(msg(&a - &two), "sub: shape mismatch: [2, 3] vs [2]");
    assert_eq!(
        msg(a.clone() * two.clone()),
        "mul: shape mismatch: [2, 3] vs [2]"
    );
    assert_eq!(msg(&two / &a), "div: shape mismatch: [2] vs [2, 3]");
    // The first failing step's error comes out of the chain, later steps are skipped.
    assert_eq!(
        msg((&a + &two) * &four - &b),
        "add: shape mismatch: [2, 3] vs [2]"
    );
    assert_eq!(
        msg(((&a * &b) - &four) / &two),
        "sub: shape mismatch: [2, 3] vs [4]"
    );
    // An error on the right of a chain.
    assert_eq!(msg(&b * (&a / &four)), "div: shape mismatch: [2, 3] vs [4]");
    assert_eq!(msg(&a + (&four - &two)), "sub: shape mismatch: [4] vs [2]");
    // Dtype and integer errors too.
    let d = Tensor::zeros(3, DType::F64, CPU).unwrap();
    assert_eq!(msg(&b + &d), "add: dtype mismatch: F32 vs F64");
    let ids = Tensor::arange(0, 3, DType::I64, CPU).unwrap();
    assert_eq!(msg(&ids * 2.0), "mul_scalar: unsupported dtype I64");
    assert_eq!(msg(-&ids), "neg: unsupported dtype I64");
    assert_eq!(msg(1.0 / &ids), "div: unsupported dtype I64");
    // A released operand.
    let r = t32(&[1.0, 2.0, 3.0], &[3], CPU);
    r.release_storage();
    let m = msg(&b + &r);
    assert!(
        m.starts_with("add: the tensor's storage is released"),
        "{m}"
    );
}

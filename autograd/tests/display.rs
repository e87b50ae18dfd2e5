//! `Debug` / `Display` of `Var`: the value as a tensor prints, with requires_grad and the op.

use meshgrad_autograd::{no_grad, Var};
use meshgrad_tensor::{Device, Tensor};

#[test]
fn var_prints_values_requires_grad_and_op() {
    let x = Var::leaf(Tensor::from_vec(vec![1f32, 2., 3., 4.], (2, 2), Device::Cpu).unwrap());
    assert_eq!(
        format!("{x:?}"),
        "\
Var([[1.0000, 2.0000],
     [3.0000, 4.0000]], shape=[2, 2], dtype=f32, device=cpu, requires_grad=true)"
    );
    let y = x.mul(&x).unwrap();
    assert_eq!(
        format!("{y:.1?}"),
        "\
Var([[ 1.0,  4.0],
     [ 9.0, 16.0]], shape=[2, 2], dtype=f32, device=cpu, requires_grad=true, op=mul)"
    );
    assert_eq!(format!("{y:.1}"), format!("{y:.1?}"), "Display is Debug");
    let c = Var::constant(Tensor::from_vec(vec![5i64], (), Device::Cpu).unwrap());
    assert_eq!(
        c.to_string(),
        "Var(5, shape=[], dtype=i64, device=cpu, requires_grad=false)"
    );
    let z = no_grad(|| x.sum_all()).unwrap();
    assert_eq!(
        z.to_string(),
        "Var(10.0000, shape=[], dtype=f32, device=cpu, requires_grad=false)"
    );
    x.tensor().release_storage();
    assert_eq!(
        format!("{x:?}"),
        "Var(released, shape=[2, 2], dtype=f32, device=cpu, requires_grad=true)"
    );
}

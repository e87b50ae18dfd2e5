//! Helpers of reference mode's unit tests: random tensors, bit patterns, comparison with f64
//! results, and running an op forward and backward.

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Random, Result, Tensor};

/// A standard normal f32 tensor of `dims`, keyed by `seed`.
pub(super) fn rand(seed: u64, dims: &[usize]) -> Tensor {
    Random::new(seed)
        .dtype(DType::F32)
        .normal(dims.to_vec(), 0.0, 1.0)
        .unwrap()
}

/// The bits of an f32 tensor's elements.
pub(super) fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// Asserts `a` is within 1e-4 (relative, plus 1e-4 absolute) of the f64 values `b`.
pub(super) fn close(a: &Tensor, b: &[f64], what: &str) {
    let a = a.to_vec_f64().unwrap();
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
            "{what}[{i}]: {x} vs {y}"
        );
    }
}

/// Runs `f` on leaves `x`, `w` (and `b`), back-propagates `Σ y ⊙ dy`, and returns the output
/// and the gradients of x, w and b.
pub(super) fn run(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    dy: &Tensor,
    f: impl Fn(&Var, &Var, Option<&Var>) -> Result<Var>,
) -> (Tensor, Tensor, Tensor, Option<Tensor>) {
    let (xa, wa) = (Var::leaf(x.clone()), Var::leaf(w.clone()));
    let ba = b.map(|b| Var::leaf(b.clone()));
    let y = f(&xa, &wa, ba.as_ref()).unwrap();
    let out = y.tensor().clone();
    y.mul(&Var::constant(dy.clone()))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    (
        out,
        xa.grad().unwrap(),
        wa.grad().unwrap(),
        ba.map(|b| b.grad().unwrap()),
    )
}

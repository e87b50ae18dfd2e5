//! Shared helpers of the autograd integration tests.

#![allow(dead_code)]

use meshgrad_autograd::{gradcheck, GradcheckOptions, Var};
use meshgrad_tensor::{DType, Device, Random, Result, Tensor};

/// Uniform f64 values in `[lo, hi)` from the crate's counter-based RNG, as a tensor.
pub fn rand(seed: u64, dims: &[usize], lo: f64, hi: f64) -> Tensor {
    Random::new(seed)
        .dtype(DType::F64)
        .uniform(dims, lo, hi)
        .unwrap()
}

/// A contiguous f64 tensor holding `v`.
pub fn t64(v: &[f64], dims: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), dims, Device::Cpu).unwrap()
}

pub fn vals(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

/// Values of a leaf's accumulated gradient (panics if it has none).
pub fn grad_of(v: &Var) -> Vec<f64> {
    vals(&v.grad().expect("gradient present"))
}

/// Asserts `|a - e| <= atol + rtol |e|` elementwise, naming the first mismatch.
#[track_caller]
pub fn assert_close(actual: &[f64], expected: &[f64], rtol: f64, atol: f64, what: &str) {
    assert_eq!(
        actual.len(),
        expected.len(),
        "{what}: {} values, expected {}",
        actual.len(),
        expected.len()
    );
    for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
        if (a - e).abs() > atol + rtol * e.abs() || a.is_nan() != e.is_nan() {
            panic!("{what}: first mismatch at index {i}: got {a:e}, expected {e:e}");
        }
    }
}

/// Bitwise equality of two f64 vectors, naming the first difference.
#[track_caller]
pub fn assert_bitwise(actual: &[f64], expected: &[f64], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: lengths");
    for (i, (a, e)) in actual.iter().zip(expected).enumerate() {
        assert!(
            a.to_bits() == e.to_bits(),
            "{what}: first difference at index {i}: {a:e} vs {e:e}"
        );
    }
}

/// Runs `gradcheck` with the default options and names the case on failure.
#[track_caller]
pub fn gc(what: &str, f: impl Fn(&[Var]) -> Result<Var>, inputs: &[Tensor]) {
    gc_with(what, f, inputs, GradcheckOptions::default())
}

#[track_caller]
pub fn gc_with(
    what: &str,
    f: impl Fn(&[Var]) -> Result<Var>,
    inputs: &[Tensor],
    opts: GradcheckOptions,
) {
    if let Err(e) = gradcheck(f, inputs, opts) {
        panic!("{what}: {e}");
    }
}

/// The smallest `|a - b|` over all pairs of `a` and `b` values (to keep kinks away from the
/// finite-difference step).
pub fn min_gap(a: &[f64], b: &[f64]) -> f64 {
    let mut g = f64::INFINITY;
    for x in a {
        for y in b {
            g = g.min((x - y).abs());
        }
    }
    g
}

/// The smallest gap between any two values of `a`.
pub fn min_self_gap(a: &[f64]) -> f64 {
    let mut g = f64::INFINITY;
    for i in 0..a.len() {
        for j in i + 1..a.len() {
            g = g.min((a[i] - a[j]).abs());
        }
    }
    g
}

/// The first seed from `seed` on whose values pass `ok`.
pub fn rand_where(
    seed: u64,
    dims: &[usize],
    lo: f64,
    hi: f64,
    ok: impl Fn(&[f64]) -> bool,
) -> Tensor {
    for s in seed..seed + 1000 {
        let t = rand(s, dims, lo, hi);
        if ok(&vals(&t)) {
            return t;
        }
    }
    panic!("no seed gave acceptable values");
}

//! Shared helpers of the fallback tests: run an op with and without the fused kernels and
//! compare. Tolerance: f32 within 1e-5 relative to the largest magnitude of the compared tensor
//! (plus 1e-6 absolute), f64 within 1e-12; bf16 within 1e-2 relative (one bf16 rounding of each
//! side).

use crate::{DType, Random, Tensor};

/// The cases every fallback is checked at: dtype and relative tolerance.
pub(crate) const CASES: [(DType, f64); 3] =
    [(DType::F32, 1e-5), (DType::F64, 1e-12), (DType::BF16, 1e-2)];

/// Asserts `fused` and `composed` agree within `rel` relative to the largest magnitude of
/// `fused` (at least 1), plus `rel / 10` absolute; infinities must match exactly. Returns the
/// largest error relative to that scale (what the reports quote).
pub(crate) fn close(what: &str, fused: &Tensor, composed: &Tensor, rel: f64) -> f64 {
    assert_eq!(fused.dims(), composed.dims(), "{what}: shapes");
    assert_eq!(fused.dtype(), composed.dtype(), "{what}: dtypes");
    let (a, b) = (fused.to_vec_f64().unwrap(), composed.to_vec_f64().unwrap());
    let scale = a
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, v| m.max(v.abs()))
        .max(1.0);
    let mut worst = 0f64;
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if x.is_infinite() || y.is_infinite() {
            assert_eq!(x, y, "{what}: element {i}: fused {x} vs composed {y}");
            continue;
        }
        let err = (x - y).abs();
        assert!(
            err <= rel * scale + rel / 10.0,
            "{what}: element {i}: fused {x} vs composed {y} (rel {rel})"
        );
        worst = worst.max(err / scale);
    }
    if std::env::var_os("MESHGRAD_REPORT_ERRORS").is_some() {
        eprintln!("max error {what}: {worst:.3e}");
    }
    worst
}

/// `f` with the fused kernels, then with them declined (the composed fallback).
pub(crate) fn both<T>(f: impl Fn() -> T) -> (T, T) {
    (f(), crate::backend::with_fused_declined(&f))
}

/// Normal values (mean 0, std 2) of `shape` in `dtype` from stream `seed`.
pub(crate) fn rand(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    Random::new(seed)
        .dtype(dtype)
        .normal(shape.to_vec(), 0.0, 2.0)
        .unwrap()
}

/// Every case of [`CASES`] with its inputs: normal values (as [`rand`]) of `shapes` in the
/// case's dtype, input `i` from stream `seed + i`.
pub(crate) fn cases<const N: usize>(
    seed: u64,
    shapes: [&[usize]; N],
) -> impl Iterator<Item = (DType, f64, [Tensor; N])> + '_ {
    CASES.into_iter().map(move |(dt, rel)| {
        let mut stream = seed;
        let inputs = shapes.map(|s| {
            stream += 1;
            rand(s, stream - 1, dt)
        });
        (dt, rel, inputs)
    })
}

/// `t` with the elements at flat positions `at` set to the values given (rounded to `t`'s
/// dtype): special points (zeros, bounds, infinities, NaN) among random inputs.
pub(crate) fn with_values(t: &Tensor, at: &[(usize, f64)]) -> Tensor {
    let mut v = t.to_vec_f64().unwrap();
    for &(i, x) in at {
        v[i] = x;
    }
    Tensor::from_vec(v, t.shape().clone(), t.device())
        .unwrap()
        .to_dtype(t.dtype())
        .unwrap()
}

//! Host-side combining of contributions: reductions in a fixed order, concatenation, slicing,
//! and the element ranges of an all-to-all's splits.

use half::{bf16, f16};
use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{DType, Result, WithDType};

use super::ReduceOp;

/// An element type with its accumulation rules (see the `comm` module docs).
trait Reducible: WithDType {
    /// The type sums are accumulated in.
    type Acc: Copy;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(a: Self::Acc) -> Self;
    fn add(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    /// `a / n`, or `None` for integer types.
    fn div(a: Self::Acc, n: usize) -> Option<Self::Acc>;
    fn max(a: Self, b: Self) -> Self;
}

macro_rules! float_reducible {
    ($t:ty, $acc:ty, $to:expr, $from:expr) => {
        impl Reducible for $t {
            type Acc = $acc;
            #[inline]
            fn to_acc(self) -> $acc {
                $to(self)
            }
            #[inline]
            fn from_acc(a: $acc) -> Self {
                $from(a)
            }
            #[inline]
            fn add(a: $acc, b: $acc) -> $acc {
                a + b
            }
            #[inline]
            fn div(a: $acc, n: usize) -> Option<$acc> {
                Some(a / n as $acc)
            }
            #[inline]
            fn max(a: Self, b: Self) -> Self {
                if a.is_nan() || b.is_nan() {
                    <$t>::NAN
                } else if b > a {
                    b
                } else {
                    a
                }
            }
        }
    };
}

float_reducible!(f64, f64, |x| x, |a| a);
float_reducible!(f32, f32, |x| x, |a| a);
float_reducible!(bf16, f32, bf16::to_f32, bf16::from_f32);
float_reducible!(f16, f32, f16::to_f32, f16::from_f32);

macro_rules! int_reducible {
    ($t:ty) => {
        impl Reducible for $t {
            type Acc = $t;
            #[inline]
            fn to_acc(self) -> $t {
                self
            }
            #[inline]
            fn from_acc(a: $t) -> Self {
                a
            }
            #[inline]
            fn add(a: $t, b: $t) -> $t {
                a.wrapping_add(b)
            }
            #[inline]
            fn div(_: $t, _: usize) -> Option<$t> {
                None
            }
            #[inline]
            fn max(a: Self, b: Self) -> Self {
                a.max(b)
            }
        }
    };
}

int_reducible!(u8);
int_reducible!(u32);
int_reducible!(i64);

/// Whether `op` is defined for `dtype` (avg needs a float).
pub(crate) fn supports(op: ReduceOp, dtype: DType) -> bool {
    op != ReduceOp::Avg || dtype.is_float()
}

fn slices<'a, T: WithDType>(inputs: &[&'a CpuStorage]) -> Result<Vec<&'a [T]>> {
    inputs
        .iter()
        .map(|s| {
            T::cpu_slice(s).ok_or_else(|| {
                meshgrad_tensor::Error::msg(format!(
                    "reduce: contribution of dtype {} where {} was expected",
                    s.dtype(),
                    T::DTYPE
                ))
            })
        })
        .collect()
}

fn reduce_typed<T: Reducible>(inputs: &[&[T]], op: ReduceOp) -> Result<Vec<T>> {
    let n = inputs.len();
    let len = inputs[0].len();
    if inputs.iter().any(|x| x.len() != len) {
        meshgrad_tensor::bail!("reduce: contributions have different lengths");
    }
    match op {
        ReduceOp::Max => {
            let mut out = inputs[0].to_vec();
            for x in &inputs[1..] {
                for (o, &v) in out.iter_mut().zip(x.iter()) {
                    *o = T::max(*o, v);
                }
            }
            Ok(out)
        }
        ReduceOp::Sum | ReduceOp::Avg => {
            let mut acc: Vec<T::Acc> = inputs[0].iter().map(|&v| v.to_acc()).collect();
            for x in &inputs[1..] {
                for (a, &v) in acc.iter_mut().zip(x.iter()) {
                    *a = T::add(*a, v.to_acc());
                }
            }
            if op == ReduceOp::Avg {
                for a in acc.iter_mut() {
                    *a = T::div(*a, n).ok_or_else(|| {
                        meshgrad_tensor::Error::msg(format!(
                            "reduce: avg needs a float dtype, got {}",
                            T::DTYPE
                        ))
                    })?;
                }
            }
            Ok(acc.into_iter().map(T::from_acc).collect())
        }
    }
}

fn reduce_as<T: Reducible>(inputs: &[&CpuStorage], op: ReduceOp) -> Result<CpuStorage> {
    Ok(T::into_cpu_storage(reduce_typed::<T>(
        &slices::<T>(inputs)?,
        op,
    )?))
}

/// Combines equal-length, equal-dtype buffers elementwise in the order given (rank order).
pub(crate) fn reduce(inputs: &[&CpuStorage], op: ReduceOp) -> Result<CpuStorage> {
    let first = inputs
        .first()
        .ok_or_else(|| meshgrad_tensor::Error::msg("reduce: no contributions"))?;
    match first.dtype() {
        DType::F64 => reduce_as::<f64>(inputs, op),
        DType::F32 => reduce_as::<f32>(inputs, op),
        DType::BF16 => reduce_as::<bf16>(inputs, op),
        DType::F16 => reduce_as::<f16>(inputs, op),
        DType::U8 => reduce_as::<u8>(inputs, op),
        DType::U32 => reduce_as::<u32>(inputs, op),
        DType::I64 => reduce_as::<i64>(inputs, op),
    }
}

fn concat_as<T: WithDType>(inputs: &[&CpuStorage]) -> Result<CpuStorage> {
    let parts = slices::<T>(inputs)?;
    Ok(T::into_cpu_storage(parts.concat()))
}

/// Concatenates equal-dtype buffers in the order given.
pub(crate) fn concat(inputs: &[&CpuStorage]) -> Result<CpuStorage> {
    let first = inputs
        .first()
        .ok_or_else(|| meshgrad_tensor::Error::msg("concat: no contributions"))?;
    match first.dtype() {
        DType::F64 => concat_as::<f64>(inputs),
        DType::F32 => concat_as::<f32>(inputs),
        DType::BF16 => concat_as::<bf16>(inputs),
        DType::F16 => concat_as::<f16>(inputs),
        DType::U8 => concat_as::<u8>(inputs),
        DType::U32 => concat_as::<u32>(inputs),
        DType::I64 => concat_as::<i64>(inputs),
    }
}

fn concat_ranges_as<T: WithDType>(
    parts: &[(&CpuStorage, std::ops::Range<usize>)],
) -> Result<CpuStorage> {
    let inputs: Vec<&CpuStorage> = parts.iter().map(|(s, _)| *s).collect();
    let slices = slices::<T>(&inputs)?;
    let mut out = Vec::with_capacity(parts.iter().map(|(_, r)| r.len()).sum());
    for (v, (_, r)) in slices.iter().zip(parts) {
        out.extend_from_slice(&v[r.clone()]);
    }
    Ok(T::into_cpu_storage(out))
}

/// Concatenates element ranges of buffers of `dtype`, in the order given (none: an empty
/// buffer).
pub(crate) fn concat_ranges(
    dtype: DType,
    parts: &[(&CpuStorage, std::ops::Range<usize>)],
) -> Result<CpuStorage> {
    match dtype {
        DType::F64 => concat_ranges_as::<f64>(parts),
        DType::F32 => concat_ranges_as::<f32>(parts),
        DType::BF16 => concat_ranges_as::<bf16>(parts),
        DType::F16 => concat_ranges_as::<f16>(parts),
        DType::U8 => concat_ranges_as::<u8>(parts),
        DType::U32 => concat_ranges_as::<u32>(parts),
        DType::I64 => concat_ranges_as::<i64>(parts),
    }
}

/// The element ranges of consecutive blocks of `splits[i]` rows of `row` elements each: block
/// `i` is `[row * (splits[0] + ... + splits[i - 1]), row * (splits[0] + ... + splits[i]))`.
pub(crate) fn split_ranges(splits: &[usize], row: usize) -> Vec<std::ops::Range<usize>> {
    let mut at = 0;
    splits
        .iter()
        .map(|&n| {
            let r = at..at + n * row;
            at = r.end;
            r
        })
        .collect()
}

/// A copy of elements `start..start + len` of `s`.
pub(crate) fn slice(s: &CpuStorage, start: usize, len: usize) -> CpuStorage {
    meshgrad_tensor::cpu_map!(s, v => WithDType::into_cpu_storage(v[start..start + len].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_ranges_and_concat_ranges() {
        assert_eq!(split_ranges(&[2, 0, 1], 3), vec![0..6, 6..6, 6..9]);
        assert!(split_ranges(&[], 3).is_empty());
        let a = CpuStorage::I64((0..6).collect());
        let b = CpuStorage::I64((10..14).collect());
        let got = concat_ranges(DType::I64, &[(&b, 2..4), (&a, 0..0), (&a, 1..3)]).unwrap();
        assert_eq!(
            got.as_bytes(),
            CpuStorage::I64(vec![12, 13, 1, 2]).as_bytes()
        );
        let none = concat_ranges(DType::BF16, &[]).unwrap();
        assert_eq!((none.dtype(), none.len()), (DType::BF16, 0));
        assert!(concat_ranges(DType::F32, &[(&a, 0..1)]).is_err(), "dtype");
    }

    #[test]
    fn sum_order_and_rounding() {
        // 1e8 + 1 - 1e8 in f32: ((1e8 + 1) + -1e8) = 0 when summed left to right.
        let a = CpuStorage::F32(vec![1e8, 1.0]);
        let b = CpuStorage::F32(vec![1.0, 2.0]);
        let c = CpuStorage::F32(vec![-1e8, 3.0]);
        let r = reduce(&[&a, &b, &c], ReduceOp::Sum).unwrap();
        match r {
            CpuStorage::F32(v) => assert_eq!(v, vec![0.0, 6.0]),
            _ => panic!("dtype"),
        }
        // bf16 accumulates in f32 and rounds once: 256 + 1 + 1 = 258 (representable), while
        // rounding after each add would give 256.
        let x = CpuStorage::BF16(vec![bf16::from_f32(256.0)]);
        let y = CpuStorage::BF16(vec![bf16::from_f32(1.0)]);
        let r = reduce(&[&x, &y, &y], ReduceOp::Sum).unwrap();
        match r {
            CpuStorage::BF16(v) => assert_eq!(v[0].to_f32(), 258.0),
            _ => panic!("dtype"),
        }
    }

    #[test]
    fn max_avg_ints() {
        let a = CpuStorage::F64(vec![1.0, f64::NAN]);
        let b = CpuStorage::F64(vec![2.0, 0.0]);
        match reduce(&[&a, &b], ReduceOp::Max).unwrap() {
            CpuStorage::F64(v) => assert!(v[0] == 2.0 && v[1].is_nan()),
            _ => panic!("dtype"),
        }
        let i = CpuStorage::I64(vec![3]);
        assert!(reduce(&[&i, &i], ReduceOp::Avg).is_err());
        let u = CpuStorage::U8(vec![200]);
        match reduce(&[&u, &u], ReduceOp::Sum).unwrap() {
            CpuStorage::U8(v) => assert_eq!(v, vec![144]),
            _ => panic!("dtype"),
        }
    }
}

//! Element types.

use half::{bf16, f16};

use crate::{Error, Result};

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// 64-bit float (reference precision, gradcheck).
    F64,
    /// 32-bit float.
    F32,
    /// bfloat16 (computed in f32 on CPU).
    BF16,
    /// IEEE half (computed in f32 on CPU).
    F16,
    /// Bytes; comparison results and masks (0 or 1).
    U8,
    /// 32-bit unsigned ids.
    U32,
    /// 64-bit signed ids.
    I64,
}

impl DType {
    /// `self`, or [`Error::DTypeMismatch`] naming `op` (`self` as the left operand) when
    /// `other` is another dtype: the one dtype check of two operands.
    pub(crate) fn matching(self, op: &'static str, other: DType) -> Result<DType> {
        if self != other {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self,
                rhs: other,
            });
        }
        Ok(self)
    }

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::U32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether this is a floating-point type.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F64 | DType::F32 | DType::BF16 | DType::F16)
    }

    /// Whether this is an integer type (ids or masks).
    pub fn is_int(self) -> bool {
        !self.is_float()
    }

    /// The lowercase name used in files and messages (`f32`, `bf16`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F64 => "f64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
            DType::U32 => "u32",
            DType::I64 => "i64",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        Ok(match s {
            "f64" => DType::F64,
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            "f16" => DType::F16,
            "u8" => DType::U8,
            "u32" => DType::U32,
            "i64" => DType::I64,
            _ => crate::bail!("unknown dtype '{s}' (expected f64, f32, bf16, f16, u8, u32 or i64)"),
        })
    }
}

/// A Rust element type that a tensor can hold.
pub trait WithDType: Copy + Send + Sync + std::fmt::Debug + 'static + bytemuck::Pod {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Converts from f64 (saturating/rounding as `as` does for ints).
    fn from_f64(v: f64) -> Self;
    /// Converts to f64.
    fn to_f64(self) -> f64;
    /// Wraps a vector into CPU storage.
    fn into_cpu_storage(v: Vec<Self>) -> crate::storage::CpuStorage;
    /// Borrows the slice out of CPU storage of the matching dtype.
    fn cpu_slice(s: &crate::storage::CpuStorage) -> Option<&[Self]>;
    /// Takes the vector out of CPU storage of the matching dtype.
    fn from_cpu_storage(s: crate::storage::CpuStorage) -> Option<Vec<Self>>;
}

macro_rules! with_dtype {
    ($ty:ty, $dt:ident, $from:expr, $to:expr) => {
        impl WithDType for $ty {
            const DTYPE: DType = DType::$dt;
            #[inline]
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            #[inline]
            fn to_f64(self) -> f64 {
                $to(self)
            }
            fn into_cpu_storage(v: Vec<Self>) -> crate::storage::CpuStorage {
                crate::storage::CpuStorage::$dt(v)
            }
            fn cpu_slice(s: &crate::storage::CpuStorage) -> Option<&[Self]> {
                match s {
                    crate::storage::CpuStorage::$dt(v) => Some(v),
                    _ => None,
                }
            }
            fn from_cpu_storage(s: crate::storage::CpuStorage) -> Option<Vec<Self>> {
                match s {
                    crate::storage::CpuStorage::$dt(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}

with_dtype!(f64, F64, |v| v, |x| x);
with_dtype!(f32, F32, |v| v as f32, |x: f32| x as f64);
with_dtype!(bf16, BF16, bf16::from_f64, |x: bf16| x.to_f64());
with_dtype!(f16, F16, f16::from_f64, |x: f16| x.to_f64());
with_dtype!(u8, U8, |v| v as u8, |x: u8| x as f64);
with_dtype!(u32, U32, |v| v as u32, |x: u32| x as f64);
with_dtype!(i64, I64, |v| v as i64, |x: i64| x as f64);

//! Copies and dtype conversions on the CPU.

use half::{bf16, f16};
use meshgrad_kernels::cpu::strided;

use crate::backend::api::In;
use crate::storage::CpuStorage;
use crate::{DType, Layout, Result};

/// A contiguous copy of the view `l` of `s`.
pub(crate) fn copy_contiguous(s: &CpuStorage, l: &Layout) -> Result<CpuStorage> {
    let n = l.shape().elem_count();
    Ok(crate::cpu_map!(s, v => {
        let out = if let Some(r) = l.contiguous_range() {
            v[r].to_vec()
        } else {
            let mut out = vec![Default::default(); n];
            strided::copy_strided(v, l.offset(), l.dims(), l.strides(), &mut out);
            out
        };
        crate::WithDType::into_cpu_storage(out)
    }))
}

/// Writes the view `sl` of `src` into the view `dl` of `dst` (same shape and dtype).
pub(crate) fn copy_into(
    dst: &mut CpuStorage,
    dl: &Layout,
    (src, sl): In<'_, CpuStorage>,
) -> Result<()> {
    dst.dtype().matching("copy_into", src.dtype())?;
    let contiguous_src = copy_contiguous(src, sl)?;
    macro_rules! go {
        ($($v:ident),*) => {
            match (dst, &contiguous_src) {
                $( (CpuStorage::$v(d), CpuStorage::$v(s)) => {
                    if let Some(r) = dl.contiguous_range() {
                        d[r].copy_from_slice(s);
                    } else {
                        strided::copy_into_strided(s, d, dl.offset(), dl.dims(), dl.strides());
                    }
                } )*
                _ => unreachable!("dtypes checked equal"),
            }
        };
    }
    go!(F64, F32, BF16, F16, U8, U32, I64);
    Ok(())
}

fn convert<T: Copy, U>(v: &[T], f: impl Fn(T) -> U) -> Vec<U> {
    v.iter().map(|&x| f(x)).collect()
}

/// A contiguous copy of the view `l` of `s` converted to `dtype` (float to int truncates toward
/// zero, as `as` does; float narrowing rounds to nearest).
pub(crate) fn cast(s: &CpuStorage, l: &Layout, dtype: DType) -> Result<CpuStorage> {
    let c = copy_contiguous(s, l)?;
    use CpuStorage as S;
    Ok(match (&c, dtype) {
        (_, d) if d == c.dtype() => c,
        (S::F32(v), DType::BF16) => S::BF16(convert(v, bf16::from_f32)),
        (S::F32(v), DType::F16) => S::F16(convert(v, f16::from_f32)),
        (S::F32(v), DType::F64) => S::F64(convert(v, |x| x as f64)),
        (S::BF16(v), DType::F32) => S::F32(convert(v, bf16::to_f32)),
        (S::F16(v), DType::F32) => S::F32(convert(v, f16::to_f32)),
        (S::F64(v), DType::F32) => S::F32(convert(v, |x| x as f32)),
        _ => {
            // General path through f64 (exact for every supported type except i64 beyond 2^53).
            let wide: Vec<f64> =
                crate::cpu_map!(&c, v => v.iter().map(|&x| crate::WithDType::to_f64(x)).collect());
            match dtype {
                DType::F64 => S::F64(wide),
                DType::F32 => S::F32(convert(&wide, |x| x as f32)),
                DType::BF16 => S::BF16(convert(&wide, bf16::from_f64)),
                DType::F16 => S::F16(convert(&wide, f16::from_f64)),
                DType::U8 => S::U8(convert(&wide, |x| x as u8)),
                DType::U32 => S::U32(convert(&wide, |x| x as u32)),
                DType::I64 => match &c {
                    S::U32(v) => S::I64(convert(v, |x| x as i64)),
                    S::U8(v) => S::I64(convert(v, |x| x as i64)),
                    _ => S::I64(convert(&wide, |x| x as i64)),
                },
            }
        }
    })
}

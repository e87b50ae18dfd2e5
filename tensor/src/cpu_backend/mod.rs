//! The CPU backend: resolves dtypes and layouts, then calls `meshgrad_kernels::cpu`.
//! The precision float ops compute in is not decided here: [`floats`] realises the tensor
//! layer's rule, [`crate::compute_dtype`] (f32 and f64 natively; bf16 and f16 widened to f32,
//! computed, and narrowed back by [`IntoStorage`]).

mod backend_impl;
mod cast;
pub(crate) mod in_place;
pub(crate) mod indexing;
mod memory;

use std::borrow::Cow;
use std::ops::Range;

use half::{bf16, f16};
use meshgrad_kernels::cpu::{self, elementwise::View};
use meshgrad_kernels::ops::{MatrixLayout, ReduceOp};

pub(crate) use cast::{cast, copy_contiguous, copy_into};
pub(crate) use indexing::{gather, gather_backward, index_select, index_select_backward};
pub(crate) use memory::{arange, from_host, full, output, random, read_elements, to_host, zeros};

use crate::backend::api::{In, ReduceDims};
use crate::backend::Product;
use crate::storage::CpuStorage;
use crate::{DType, Error, Layout, Result};

/// A float buffer in its compute precision.
pub(crate) enum Floats<'a> {
    F32(Cow<'a, [f32]>),
    F64(&'a [f64]),
}

/// Borrows (or widens) `range` of a float buffer to the precision [`crate::compute_dtype`]
/// names for its dtype; a storage/precision pair the CPU kernels do not cover is
/// [`Error::UnsupportedDType`].
pub(crate) fn floats<'a>(
    s: &'a CpuStorage,
    range: Range<usize>,
    op: &'static str,
) -> Result<Floats<'a>> {
    Ok(match (s, crate::compute_dtype(s.dtype())) {
        (CpuStorage::F32(v), DType::F32) => Floats::F32(Cow::Borrowed(&v[range])),
        (CpuStorage::F64(v), DType::F64) => Floats::F64(&v[range]),
        (CpuStorage::BF16(v), DType::F32) => {
            Floats::F32(Cow::Owned(v[range].iter().map(|x| x.to_f32()).collect()))
        }
        (CpuStorage::F16(v), DType::F32) => {
            Floats::F32(Cow::Owned(v[range].iter().map(|x| x.to_f32()).collect()))
        }
        _ => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: s.dtype(),
            })
        }
    })
}

/// Selects the slice of `f` with the same element type as `_like`.
pub(crate) fn pick<'a, T: 'static>(f: &'a Floats<'_>, _like: &[T]) -> Result<&'a [T]> {
    pick_slice(f)
}

fn pick_slice<'a, T: 'static>(f: &'a Floats<'_>) -> Result<&'a [T]> {
    use std::any::TypeId;
    match f {
        Floats::F32(c) if TypeId::of::<T>() == TypeId::of::<f32>() => {
            let s: &[f32] = c;
            // SAFETY: T is f32 (checked by TypeId just above), so the slice types are identical.
            Ok(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const T, s.len()) })
        }
        Floats::F64(c) if TypeId::of::<T>() == TypeId::of::<f64>() => {
            let s: &[f64] = c;
            // SAFETY: T is f64 (checked by TypeId just above), so the slice types are identical.
            Ok(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const T, s.len()) })
        }
        _ => Err(Error::msg(
            "a weight or bias dtype differs from the input's",
        )),
    }
}

/// Narrows an f32 result back to the storage dtype it was computed for.
pub(crate) fn from_f32(dtype: DType, v: Vec<f32>) -> CpuStorage {
    match dtype {
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

/// A result vector in compute precision, narrowed to the storage dtype.
pub(crate) trait IntoStorage {
    fn into_storage(self, dtype: DType) -> CpuStorage;
}
impl IntoStorage for Vec<f32> {
    fn into_storage(self, dtype: DType) -> CpuStorage {
        from_f32(dtype, self)
    }
}
impl IntoStorage for Vec<f64> {
    fn into_storage(self, _dtype: DType) -> CpuStorage {
        CpuStorage::F64(self)
    }
}

/// Runs `$body` with `$x` bound to a compute-precision slice of one float input. The body is
/// duplicated per precision, so it may call generic kernels.
macro_rules! with_floats {
    ($op:expr, $( ($s:expr, $r:expr) => $x:ident ),+ ; $body:block) => {{
        match ($( floats($s, $r, $op)?, )+) {
            ($( Floats::F32($x), )+) => {
                $( let $x: &[f32] = &$x; )+
                $body
            }
            ($( Floats::F64($x), )+) => {
                $body
            }
            #[allow(unreachable_patterns)]
            _ => return Err(crate::Error::msg(format!("{}: operands have different dtypes", $op))),
        }
    }};
}
pub(crate) use with_floats;

/// The whole buffer as a range.
pub(crate) fn entire(s: &CpuStorage) -> Range<usize> {
    0..s.len()
}

pub(crate) fn range(l: &Layout) -> Range<usize> {
    l.contiguous_range()
        .expect("the tensor layer passes contiguous layouts here")
}

fn view<'a, T>(data: &'a [T], l: &'a Layout) -> View<'a, T> {
    View {
        data,
        offset: l.offset(),
        strides: l.strides(),
    }
}

pub(crate) fn unary(
    (s, l): In<'_, CpuStorage>,
    op: meshgrad_kernels::ops::UnaryOp,
) -> Result<CpuStorage> {
    let dt = s.dtype();
    let n = l.shape().elem_count();
    if l.is_contiguous() {
        return Ok(with_floats!("unary", (s, range(l)) => x; {
            let mut out = crate::pool::output(n);
            cpu::elementwise::unary(op, x, &mut out);
            out.into_storage(dt)
        }));
    }
    let c = copy_contiguous(s, l)?;
    unary((&c, &Layout::contiguous(l.shape().clone())), op)
}

/// `dst += src` in place for contiguous float buffers of one dtype and equal element count;
/// `Ok(false)` (nothing done) when the dtypes are not f32 or f64.
pub(crate) fn add_assign_contiguous(
    dst: &mut CpuStorage,
    dl: &Layout,
    (src, sl): In<'_, CpuStorage>,
) -> Result<bool> {
    let (dr, sr) = (range(dl), range(sl));
    match (dst, src) {
        (CpuStorage::F32(d), CpuStorage::F32(s)) => {
            cpu::elementwise::add_assign(&mut d[dr], &s[sr]);
            Ok(true)
        }
        (CpuStorage::F64(d), CpuStorage::F64(s)) => {
            cpu::elementwise::add_assign(&mut d[dr], &s[sr]);
            Ok(true)
        }
        _ => Ok(false),
    }
}

pub(crate) fn binary(
    op: meshgrad_kernels::ops::BinaryOp,
    (a, al): In<'_, CpuStorage>,
    (b, bl): In<'_, CpuStorage>,
) -> Result<CpuStorage> {
    let dt = a.dtype();
    let shape = al.dims();
    let n = al.shape().elem_count();
    Ok(
        with_floats!("binary", (a, entire(a)) => x, (b, entire(b)) => y; {
            let mut out = crate::pool::output(n);
            cpu::elementwise::binary(op, shape, view(x, al), view(y, bl), &mut out);
            out.into_storage(dt)
        }),
    )
}

pub(crate) fn compare(
    op: meshgrad_kernels::ops::CmpOp,
    (a, al): In<'_, CpuStorage>,
    (b, bl): In<'_, CpuStorage>,
) -> Result<CpuStorage> {
    let shape = al.dims();
    let n = al.shape().elem_count();
    let mut out = vec![0u8; n];
    with_floats!("compare", (a, entire(a)) => x, (b, entire(b)) => y; {
        cpu::elementwise::compare(op, shape, view(x, al), view(y, bl), &mut out);
    });
    Ok(CpuStorage::U8(out))
}

pub(crate) fn where_cond(
    (c, cl): In<'_, CpuStorage>,
    (t, tl): In<'_, CpuStorage>,
    (f, fl): In<'_, CpuStorage>,
) -> Result<CpuStorage> {
    let CpuStorage::U8(cond) = c else {
        return Err(Error::UnsupportedDType {
            op: "where_cond (condition)",
            dtype: c.dtype(),
        });
    };
    let shape = cl.dims();
    let n = cl.shape().elem_count();
    macro_rules! go {
        ($($v:ident),*) => {
            match (t, f) {
                $( (CpuStorage::$v(tv), CpuStorage::$v(fv)) => {
                    let mut out = vec![Default::default(); n];
                    cpu::elementwise::where_cond(shape, view(cond, cl), view(tv, tl), view(fv, fl), &mut out);
                    CpuStorage::$v(out)
                } )*
                _ => return Err(Error::DTypeMismatch { op: "where_cond", lhs: t.dtype(), rhs: f.dtype() }),
            }
        };
    }
    Ok(go!(F64, F32, BF16, F16, U8, U32, I64))
}

pub(crate) fn reduce(
    op: ReduceOp,
    (s, l): In<'_, CpuStorage>,
    ReduceDims { outer, red, inner }: ReduceDims,
) -> Result<CpuStorage> {
    let dt = s.dtype();
    let mut idx = vec![
        0i64;
        if op == ReduceOp::ArgMax {
            outer * inner
        } else {
            0
        }
    ];
    let out = with_floats!("reduce", (s, range(l)) => x; {
        let mut out = crate::pool::output(outer * inner);
        match op {
            ReduceOp::Sum => cpu::reduce::sum(x, outer, red, inner, &mut out),
            ReduceOp::Max => cpu::reduce::max(x, outer, red, inner, &mut out),
            ReduceOp::ArgMax => cpu::reduce::argmax(x, outer, red, inner, &mut idx),
        }
        out.into_storage(dt)
    });
    Ok(if op == ReduceOp::ArgMax {
        CpuStorage::I64(idx)
    } else {
        out
    })
}

/// See `BackendStorage::matmul`.
pub(crate) fn matmul(a: &CpuStorage, b: &CpuStorage, p: &Product) -> Result<CpuStorage> {
    let &Product {
        al,
        bl,
        batch,
        m,
        n,
        k,
    } = p;
    let dt = a.dtype();
    let cl = MatrixLayout {
        offset: 0,
        batch_stride: m * n,
        row_stride: n,
        col_stride: 1,
    };
    Ok(
        with_floats!("matmul", (a, entire(a)) => x, (b, entire(b)) => y; {
            let mut out = crate::pool::output(batch * m * n);
            cpu::matmul::matmul(batch, m, n, k, x, al, y, bl, &mut out, cl, false);
            out.into_storage(dt)
        }),
    )
}

/// Borrows (or widens) ids as i64.
pub(crate) fn ids<'a>(s: &'a CpuStorage, l: &Layout, op: &'static str) -> Result<Cow<'a, [i64]>> {
    let r = range(l);
    Ok(match s {
        CpuStorage::I64(v) => Cow::Borrowed(&v[r]),
        CpuStorage::U32(v) => Cow::Owned(v[r].iter().map(|&x| x as i64).collect()),
        CpuStorage::U8(v) => Cow::Owned(v[r].iter().map(|&x| x as i64).collect()),
        _ => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: s.dtype(),
            })
        }
    })
}

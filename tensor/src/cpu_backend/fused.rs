//! Fused kernels on the CPU: layer norm, cross-entropy, optimizer steps (attention is in
//! `attention.rs`).

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::{floats, full, ids, range, with_floats, Floats, IntoStorage};
use crate::storage::CpuStorage;
use crate::{Error, Layout, Result};

type In<'a> = (&'a CpuStorage, &'a Layout);

/// Returns `(y, mean, rstd)`.
pub(crate) fn layer_norm(
    x: In<'_>,
    w: Option<In<'_>>,
    b: Option<In<'_>>,
    rows: usize,
    cols: usize,
    eps: f64,
) -> Result<(CpuStorage, CpuStorage, CpuStorage)> {
    let dt = x.0.dtype();
    // Weight and bias are computed in the input's precision.
    let wv = w
        .map(|(s, l)| floats(s, range(l), "layer_norm (weight)"))
        .transpose()?;
    let bv = b
        .map(|(s, l)| floats(s, range(l), "layer_norm (bias)"))
        .transpose()?;
    Ok(match floats(x.0, range(x.1), "layer_norm")? {
        Floats::F32(xv) => {
            let wf = as_f32(&wv)?;
            let bf = as_f32(&bv)?;
            let mut y: Vec<f32> = crate::pool::output(rows * cols);
            let (mut m, mut r) = (vec![0f32; rows], vec![0f32; rows]);
            cpu::layer_norm::layer_norm_forward(
                &xv, wf, bf, rows, cols, eps, &mut y, &mut m, &mut r,
            );
            (y.into_storage(dt), CpuStorage::F32(m), CpuStorage::F32(r))
        }
        Floats::F64(xv) => {
            let wf = as_f64(&wv)?;
            let bf = as_f64(&bv)?;
            let mut y = vec![0f64; rows * cols];
            let (mut m, mut r) = (vec![0f64; rows], vec![0f64; rows]);
            cpu::layer_norm::layer_norm_forward(
                xv, wf, bf, rows, cols, eps, &mut y, &mut m, &mut r,
            );
            (CpuStorage::F64(y), CpuStorage::F64(m), CpuStorage::F64(r))
        }
    })
}

fn as_f32<'a>(v: &'a Option<Floats<'_>>) -> Result<Option<&'a [f32]>> {
    match v {
        None => Ok(None),
        Some(Floats::F32(c)) => Ok(Some(c)),
        Some(Floats::F64(_)) => Err(Error::msg(
            "layer_norm: weight/bias dtype differs from the input's",
        )),
    }
}

fn as_f64<'a>(v: &'a Option<Floats<'_>>) -> Result<Option<&'a [f64]>> {
    match v {
        None => Ok(None),
        Some(Floats::F64(c)) => Ok(Some(c)),
        Some(Floats::F32(_)) => Err(Error::msg(
            "layer_norm: weight/bias dtype differs from the input's",
        )),
    }
}

/// Returns `(dx, dweight, dbias)`; the last two when the weight was given (bias grads are
/// computed together with weight grads since they come from the same pass).
#[allow(clippy::too_many_arguments)]
pub(crate) fn layer_norm_backward(
    x: In<'_>,
    w: Option<In<'_>>,
    mean: In<'_>,
    rstd: In<'_>,
    dy: In<'_>,
    rows: usize,
    cols: usize,
    param_grads: bool,
) -> Result<(CpuStorage, Option<CpuStorage>, Option<CpuStorage>)> {
    let dt = x.0.dtype();
    let wv = w
        .map(|(s, l)| floats(s, range(l), "layer_norm_backward (weight)"))
        .transpose()?;
    let wdt = w.map(|(s, _)| s.dtype()).unwrap_or(dt);
    Ok(
        with_floats!("layer_norm_backward", (x.0, range(x.1)) => xv, (mean.0, range(mean.1)) => mv, (rstd.0, range(rstd.1)) => rv, (dy.0, range(dy.1)) => gv; {
            let mut dx = crate::pool::output(rows * cols);
            let mut dwv = vec![Float::ZERO; if param_grads { cols } else { 0 }];
            let mut dbv = vec![Float::ZERO; if param_grads { cols } else { 0 }];
            let wslice = match &wv {
                None => None,
                Some(f) => Some(pick(f, xv)?),
            };
            cpu::layer_norm::layer_norm_backward(
                xv,
                wslice,
                mv,
                rv,
                gv,
                rows,
                cols,
                &mut dx,
                param_grads.then_some(&mut dwv[..]),
                param_grads.then_some(&mut dbv[..]),
            );
            let dw = param_grads.then(|| dwv.into_storage(wdt));
            let db = param_grads.then(|| dbv.into_storage(wdt));
            (dx.into_storage(dt), dw, db)
        }),
    )
}

/// `x Wᵀ (+ bias)` as one gemm: `x` is `m × k` (layout `xl`), `W` is read as the `k × n`
/// matrix `wl` (the transposed view of a `[n, k]` weight), the bias (`[n]`, contiguous) is
/// written into every output row first and the product accumulates onto it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear(
    x: &CpuStorage,
    xl: meshgrad_kernels::ops::MatrixLayout,
    w: &CpuStorage,
    wl: meshgrad_kernels::ops::MatrixLayout,
    bias: Option<In<'_>>,
    m: usize,
    n: usize,
    k: usize,
) -> Result<CpuStorage> {
    let dt = x.dtype();
    let bv = bias
        .map(|(s, l)| floats(s, range(l), "linear (bias)"))
        .transpose()?;
    let cl = meshgrad_kernels::ops::MatrixLayout {
        offset: 0,
        batch_stride: 0,
        row_stride: n,
        col_stride: 1,
    };
    Ok(
        with_floats!("linear", (x, full(x)) => a, (w, full(w)) => b; {
            let mut out = crate::pool::output(m * n);
            let accumulate = match &bv {
                None => false,
                Some(f) => {
                    let bs = pick(f, a)?;
                    for row in out.chunks_exact_mut(n) {
                        row.copy_from_slice(bs);
                    }
                    true
                }
            };
            cpu::matmul::matmul(1, m, n, k, a, xl, b, wl, &mut out, cl, accumulate);
            out.into_storage(dt)
        }),
    )
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

/// Returns `(per-row loss, lse)`, both in compute precision.
pub(crate) fn cross_entropy(
    logits: In<'_>,
    targets: In<'_>,
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
) -> Result<(CpuStorage, CpuStorage)> {
    let t = ids(targets.0, targets.1, "cross_entropy (targets)")?;
    let err;
    let r = with_floats!("cross_entropy", (logits.0, range(logits.1)) => x; {
        let mut loss = vec![Float::ZERO; rows];
        let mut lse = vec![Float::ZERO; rows];
        err = cpu::cross_entropy::cross_entropy_forward(x, &t, rows, cols, ignore_index, &mut loss, &mut lse);
        (loss.into_storage(crate::DType::F32), lse.into_storage(crate::DType::F32))
    });
    err?;
    Ok(r)
}

/// Returns `dlogits` in the logits' dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn cross_entropy_backward(
    logits: In<'_>,
    lse: In<'_>,
    targets: In<'_>,
    dloss: In<'_>,
    rows: usize,
    cols: usize,
    ignore_index: Option<i64>,
) -> Result<CpuStorage> {
    let dt = logits.0.dtype();
    let t = ids(targets.0, targets.1, "cross_entropy_backward (targets)")?;
    Ok(
        with_floats!("cross_entropy_backward", (logits.0, range(logits.1)) => x, (lse.0, range(lse.1)) => l, (dloss.0, range(dloss.1)) => g; {
            let mut dx = crate::pool::output(rows * cols);
            cpu::cross_entropy::cross_entropy_backward(x, l, &t, rows, cols, ignore_index, g, &mut dx);
            dx.into_storage(dt)
        }),
    )
}

/// Runs `f` on mutable and shared f32/f64 slices of matching type; half types are refused.
macro_rules! float_mut {
    ($op:expr, $s:expr, $r:expr, |$x:ident| $body:expr) => {
        match $s {
            CpuStorage::F32(v) => {
                let $x = &mut v[$r];
                $body
            }
            CpuStorage::F64(v) => {
                let $x = &mut v[$r];
                $body
            }
            other => {
                return Err(Error::UnsupportedDType {
                    op: $op,
                    dtype: other.dtype(),
                })
            }
        }
    };
}

fn same<'a, T: 'static>(s: &'a CpuStorage, l: &Layout, op: &'static str) -> Result<&'a [T]> {
    let r = range(l);
    let any: &dyn std::any::Any = match s {
        CpuStorage::F32(v) => v,
        CpuStorage::F64(v) => v,
        other => {
            return Err(Error::UnsupportedDType {
                op,
                dtype: other.dtype(),
            })
        }
    };
    any.downcast_ref::<Vec<T>>().map(|v| &v[r]).ok_or_else(|| {
        Error::msg(format!(
            "{op}: operands must all have the parameter's dtype"
        ))
    })
}

fn same_mut<'a, T: 'static>(
    s: &'a mut CpuStorage,
    l: &Layout,
    op: &'static str,
) -> Result<&'a mut [T]> {
    let r = range(l);
    let dt = s.dtype();
    let any: &mut dyn std::any::Any = match s {
        CpuStorage::F32(v) => v,
        CpuStorage::F64(v) => v,
        _ => return Err(Error::UnsupportedDType { op, dtype: dt }),
    };
    any.downcast_mut::<Vec<T>>()
        .map(|v| &mut v[r])
        .ok_or_else(|| {
            Error::msg(format!(
                "{op}: operands must all have the parameter's dtype"
            ))
        })
}

/// One AdamW step in place on `param`, `m`, `v` (all of the parameter's dtype, contiguous).
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    param: &mut CpuStorage,
    pl: &Layout,
    grad: In<'_>,
    m: &mut CpuStorage,
    ml: &Layout,
    v: &mut CpuStorage,
    vl: &Layout,
    hp: &meshgrad_kernels::ops::AdamWStep,
) -> Result<()> {
    const OP: &str = "adamw_step";
    float_mut!(OP, param, range(pl), |p| {
        let g = same(grad.0, grad.1, OP)?;
        let mm = same_mut(m, ml, OP)?;
        let vv = same_mut(v, vl, OP)?;
        cpu::adamw::adamw_step(hp, p, g, mm, vv);
    });
    Ok(())
}

/// One SGD-with-momentum step in place on `param` and `buf`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd(
    param: &mut CpuStorage,
    pl: &Layout,
    grad: In<'_>,
    buf: &mut CpuStorage,
    bl: &Layout,
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    first_step: bool,
) -> Result<()> {
    const OP: &str = "sgd_step";
    float_mut!(OP, param, range(pl), |p| {
        let g = same(grad.0, grad.1, OP)?;
        let b = same_mut(buf, bl, OP)?;
        cpu::adamw::sgd_step(lr, momentum, weight_decay, first_step, p, g, b);
    });
    Ok(())
}

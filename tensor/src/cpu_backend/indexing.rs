//! CPU side of `gather` and `index_select` and their backward passes. Inputs arrive contiguous;
//! indices may be any integer dtype (widened to i64).

use meshgrad_kernels::cpu;
use meshgrad_kernels::Float;

use super::{floats, ids, range, with_floats, Floats, IntoStorage};
use crate::backend::api::{In, Select};
use crate::storage::CpuStorage;
use crate::Result;

/// `torch.gather` of `x` (dims `xl.dims()`) along `dim` by `index` (dims `il.dims()`); any dtype.
pub(crate) fn gather(
    (x, xl): In<'_, CpuStorage>,
    (index, il): In<'_, CpuStorage>,
    dim: usize,
) -> Result<CpuStorage> {
    let idx = ids(index, il, "gather (index)")?;
    let r = range(xl);
    let err;
    let out = crate::cpu_map!(x, v => {
        let mut out = vec![Default::default(); idx.len()];
        err = cpu::gather::gather(&v[r], xl.dims(), dim, &idx, il.dims(), &mut out);
        crate::WithDType::into_cpu_storage(out)
    });
    err?;
    Ok(out)
}

/// Scatter-adds `dout` (dims `il.dims()`) into zeros of `x_dims` along `dim` by `index`.
pub(crate) fn gather_backward(
    (dout, dl): In<'_, CpuStorage>,
    (index, il): In<'_, CpuStorage>,
    x_dims: &[usize],
    dim: usize,
) -> Result<CpuStorage> {
    let idx = ids(index, il, "gather_backward (index)")?;
    let dt = dout.dtype();
    let n: usize = x_dims.iter().product();
    let err;
    let out = with_floats!("gather_backward", (dout, range(dl)) => g; {
        let mut dx = vec![Float::ZERO; n];
        err = cpu::gather::gather_backward(g, x_dims, dim, &idx, il.dims(), &mut dx);
        dx.into_storage(dt)
    });
    err?;
    Ok(out)
}

/// `index_select` of `x` viewed as `[outer, x_n, inner]` by the 1-D `ids`; any dtype.
pub(crate) fn index_select(
    (x, xl): In<'_, CpuStorage>,
    (ids_s, il): In<'_, CpuStorage>,
    Select {
        outer,
        x_n,
        inner,
        dim,
    }: Select,
) -> Result<CpuStorage> {
    let idx = ids(ids_s, il, "index_select (ids)")?;
    let r = range(xl);
    let err;
    let out = crate::cpu_map!(x, v => {
        let mut out = vec![Default::default(); outer * idx.len() * inner];
        err = cpu::gather::index_select(&v[r], outer, x_n, inner, &idx, dim, &mut out);
        crate::WithDType::into_cpu_storage(out)
    });
    err?;
    Ok(out)
}

/// Index-adds `dout` (`[outer, ids.len(), inner]`) into zeros of `[outer, x_n, inner]`.
pub(crate) fn index_select_backward(
    (dout, dl): In<'_, CpuStorage>,
    (ids_s, il): In<'_, CpuStorage>,
    Select {
        outer,
        x_n,
        inner,
        dim,
    }: Select,
) -> Result<CpuStorage> {
    let idx = ids(ids_s, il, "index_select_backward (ids)")?;
    let dt = dout.dtype();
    let err;
    let out = with_floats!("index_select_backward", (dout, range(dl)) => g; {
        let mut dx = vec![Float::ZERO; outer * x_n * inner];
        err = cpu::gather::index_select_backward(g, outer, x_n, inner, &idx, dim, &mut dx);
        dx.into_storage(dt)
    });
    err?;
    Ok(out)
}

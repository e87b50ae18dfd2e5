//! The CPU backend's implementation of [`BackendStorage`]: every method hands its operands to the
//! CPU adapters of this module (which resolve dtypes and layouts and call
//! `meshgrad_kernels::cpu`).

use half::{bf16, f16};
use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};
use meshgrad_kernels::rng;

use super::indexing;
use crate::backend::api::{BackendStorage, Distribution, In, Product};
use crate::storage::CpuStorage;
use crate::{DType, Device, Layout, Result};

/// The buffer as a contiguous `[len]` view.
fn whole(s: &CpuStorage) -> Layout {
    Layout::contiguous(s.len())
}

impl BackendStorage for CpuStorage {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn dtype(&self) -> DType {
        CpuStorage::dtype(self)
    }

    fn len(&self) -> usize {
        CpuStorage::len(self)
    }

    fn zeros(_device: Device, dtype: DType, len: usize) -> Result<Self> {
        Ok(CpuStorage::zeros(dtype, len))
    }

    fn output(_device: Device, dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => CpuStorage::F32(crate::pool::output(len)),
            _ => CpuStorage::zeros(dtype, len),
        })
    }

    fn full(_device: Device, value: f64, dtype: DType, n: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F64 => CpuStorage::F64(vec![value; n]),
            DType::F32 => CpuStorage::F32(vec![value as f32; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::from_f64(value); n]),
            DType::F16 => CpuStorage::F16(vec![f16::from_f64(value); n]),
            DType::U8 => CpuStorage::U8(vec![value as u8; n]),
            DType::U32 => CpuStorage::U32(vec![value as u32; n]),
            DType::I64 => CpuStorage::I64(vec![value as i64; n]),
        })
    }

    fn from_host(_device: Device, host: CpuStorage) -> Result<Self> {
        Ok(host)
    }

    fn to_host(&self, l: &Layout) -> Result<CpuStorage> {
        match l.contiguous_range() {
            Some(r) if r.start == 0 && r.end == self.len() => Ok(self.clone()),
            Some(r) => {
                Ok(crate::cpu_map!(self, v => crate::WithDType::into_cpu_storage(v[r].to_vec())))
            }
            None => super::copy_contiguous(self, l),
        }
    }

    fn read_elements(&self, indices: &[usize]) -> Result<CpuStorage> {
        Ok(
            crate::cpu_map!(self, v => crate::WithDType::into_cpu_storage(
                indices.iter().map(|&i| v[i]).collect()
            )),
        )
    }

    fn random(
        _device: Device,
        dtype: DType,
        n: usize,
        seed: u64,
        offset: u64,
        dist: Distribution,
    ) -> Result<Self> {
        // f32 fills directly (the f64 -> f32 rounding inside the fill equals filling f64 and
        // casting); every other dtype fills f64 (i64 for integers) and casts.
        let wide = match dist {
            Distribution::Normal { mean, std } => {
                if dtype == DType::F32 {
                    let mut v = vec![0f32; n];
                    rng::fill_normal(seed, offset, mean, std, &mut v);
                    return Ok(CpuStorage::F32(v));
                }
                let mut v = vec![0f64; n];
                rng::fill_normal(seed, offset, mean, std, &mut v);
                CpuStorage::F64(v)
            }
            Distribution::Uniform { low, high } => {
                if dtype == DType::F32 {
                    let mut v = vec![0f32; n];
                    rng::fill_uniform(seed, offset, low, high, &mut v);
                    return Ok(CpuStorage::F32(v));
                }
                let mut v = vec![0f64; n];
                rng::fill_uniform(seed, offset, low, high, &mut v);
                CpuStorage::F64(v)
            }
            Distribution::RandInt { low, high } => {
                let mut v = vec![0i64; n];
                rng::fill_randint(seed, offset, low, high, &mut v);
                CpuStorage::I64(v)
            }
        };
        if wide.dtype() == dtype {
            return Ok(wide);
        }
        super::cast(&wide, &whole(&wide), dtype)
    }

    fn arange(_device: Device, start: i64, len: usize, dtype: DType) -> Result<Self> {
        let v: Vec<f64> = (0..len as i64).map(|i| (start + i) as f64).collect();
        let s = CpuStorage::F64(v);
        if dtype == DType::F64 {
            return Ok(s);
        }
        super::cast(&s, &whole(&s), dtype)
    }

    fn release(&mut self) {
        // Large f32 buffers go back to the recycling pool (see `crate::pool`).
        if let CpuStorage::F32(v) = self {
            crate::pool::give(std::mem::take(v));
        }
    }

    fn cast(&self, l: &Layout, dtype: DType) -> Result<Self> {
        super::cast(self, l, dtype)
    }

    fn copy_contiguous(&self, l: &Layout) -> Result<Self> {
        super::copy_contiguous(self, l)
    }

    fn copy_into(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<()> {
        super::copy_into(self, dl, src.0, src.1)
    }

    fn add_assign_contiguous(&mut self, dl: &Layout, src: In<'_, Self>) -> Result<bool> {
        super::add_assign_contiguous(self, dl, src.0, src.1)
    }

    fn unary(x: In<'_, Self>, op: UnaryOp) -> Result<Self> {
        super::unary(x.0, x.1, op)
    }

    fn binary(op: BinaryOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self> {
        super::binary(op, a.0, a.1, b.0, b.1)
    }

    fn compare(op: CmpOp, a: In<'_, Self>, b: In<'_, Self>) -> Result<Self> {
        super::compare(op, a.0, a.1, b.0, b.1)
    }

    fn where_cond(cond: In<'_, Self>, t: In<'_, Self>, f: In<'_, Self>) -> Result<Self> {
        super::where_cond(cond.0, cond.1, t.0, t.1, f.0, f.1)
    }

    fn reduce(
        op: ReduceOp,
        x: In<'_, Self>,
        outer: usize,
        red: usize,
        inner: usize,
    ) -> Result<Self> {
        super::reduce(op, x.0, x.1, outer, red, inner)
    }

    fn matmul(a: &Self, b: &Self, p: &Product) -> Result<Self> {
        super::matmul(a, b, p)
    }

    fn gather(x: In<'_, Self>, index: In<'_, Self>, dim: usize) -> Result<Self> {
        indexing::gather(x.0, x.1, index.0, index.1, dim)
    }

    fn gather_backward(
        dout: In<'_, Self>,
        index: In<'_, Self>,
        x_dims: &[usize],
        dim: usize,
    ) -> Result<Self> {
        indexing::gather_backward(dout.0, dout.1, index.0, index.1, x_dims, dim)
    }

    fn index_select(
        x: In<'_, Self>,
        ids: In<'_, Self>,
        outer: usize,
        x_n: usize,
        inner: usize,
        dim: usize,
    ) -> Result<Self> {
        indexing::index_select(x, ids, outer, x_n, inner, dim)
    }

    fn index_select_backward(
        dout: In<'_, Self>,
        ids: In<'_, Self>,
        outer: usize,
        x_n: usize,
        inner: usize,
        dim: usize,
    ) -> Result<Self> {
        indexing::index_select_backward(dout, ids, outer, x_n, inner, dim)
    }
}

//! Reductions over dimensions.

use crate::backend::api::ReduceDims;
use crate::ops::float_only;
use crate::storage::Storage;
use crate::{DType, Result, Shape, Tensor};
use meshgrad_kernels::ops::ReduceOp;

impl Tensor {
    fn reduce_dim(&self, dim: usize, op: ReduceOp, name: &'static str) -> Result<Tensor> {
        float_only(name, self)?;
        let dims = self.dims();
        if matches!(op, ReduceOp::Max | ReduceOp::ArgMax) && dims[dim] == 0 {
            crate::bail!(
                "{name}: cannot reduce the empty dim {dim} of shape {}",
                self.shape()
            );
        }
        let outer: usize = dims[..dim].iter().product();
        let inner: usize = dims[dim + 1..].iter().product();
        let x = self.contiguous()?;
        let g = x.read_storage(name)?;
        let d = ReduceDims {
            outer,
            red: dims[dim],
            inner,
        };
        let s = Storage::reduce(op, (&g, x.layout()), d)?;
        let mut out = dims.to_vec();
        out[dim] = 1;
        Ok(Tensor::from_storage(s, out))
    }

    fn finish(t: Tensor, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        if keepdim {
            return Ok(t);
        }
        let shape: Vec<usize> = t
            .dims()
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(i))
            .map(|(_, &d)| d)
            .collect();
        t.reshape(shape)
    }

    fn resolve_dims(&self, op: &'static str, dims: &[isize]) -> Result<Vec<usize>> {
        let mut v = dims
            .iter()
            .map(|&d| self.dim(op, d))
            .collect::<Result<Vec<_>>>()?;
        v.sort_unstable();
        v.dedup();
        Ok(v)
    }

    /// Sums over `dims` (negative counts from the end), in increasing index order along each.
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let _prof = crate::profile::scope("sum");
        let ds = self.resolve_dims("sum", dims)?;
        let mut t = self.clone();
        for &d in &ds {
            t = t.reduce_dim(d, ReduceOp::Sum, "sum")?;
        }
        Tensor::finish(t, &ds, keepdim)
    }

    /// Sum of all elements as a 0-dim tensor.
    pub fn sum_all(&self) -> Result<Tensor> {
        self.reshape(self.elem_count())?.sum(&[0], false)
    }

    /// Mean over `dims`.
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Tensor> {
        let ds = self.resolve_dims("mean", dims)?;
        let n: usize = ds.iter().map(|&d| self.dims()[d]).product();
        self.sum(dims, keepdim)?.mul_scalar(1.0 / n as f64)
    }

    /// Mean of all elements as a 0-dim tensor.
    pub fn mean_all(&self) -> Result<Tensor> {
        self.sum_all()?.mul_scalar(1.0 / self.elem_count() as f64)
    }

    /// Maximum over one dim.
    pub fn max(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let _prof = crate::profile::scope("max");
        let d = self.dim("max", dim)?;
        Tensor::finish(self.reduce_dim(d, ReduceOp::Max, "max")?, &[d], keepdim)
    }

    /// Index (i64) of the first maximum over one dim.
    pub fn argmax(&self, dim: isize, keepdim: bool) -> Result<Tensor> {
        let d = self.dim("argmax", dim)?;
        Tensor::finish(
            self.reduce_dim(d, ReduceOp::ArgMax, "argmax")?,
            &[d],
            keepdim,
        )
    }

    /// Sums this tensor down to `shape` (the inverse of broadcasting `shape` up to `self`'s shape):
    /// the reduction a broadcast operand's gradient needs.
    pub fn sum_to_shape(&self, shape: &Shape) -> Result<Tensor> {
        let _prof = crate::profile::scope("sum_to_shape");
        if self.shape() == shape {
            return Ok(self.clone());
        }
        // Validates that `shape` broadcasts to ours.
        let b = Shape::broadcast("sum_to_shape", shape, self.shape())?;
        if &b != self.shape() {
            return Err(crate::Error::ShapeMismatch {
                op: "sum_to_shape",
                lhs: self.shape().clone(),
                rhs: shape.clone(),
            });
        }
        let lead = self.rank() - shape.rank();
        let mut dims: Vec<isize> = (0..lead as isize).collect();
        for (i, &d) in shape.dims().iter().enumerate() {
            if d == 1 && self.dims()[lead + i] != 1 {
                dims.push((lead + i) as isize);
            }
        }
        let s = self.sum(&dims, true)?;
        s.reshape(shape.clone())
    }

    /// Sum of squares of all elements, in f64, as a host value (for norms).
    pub fn sqr_sum_f64(&self) -> Result<f64> {
        let x = self.to_dtype(DType::F64)?;
        x.sqr()?.sum_all()?.item()
    }
}

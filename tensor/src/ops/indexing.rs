//! Index-driven reads: `gather` (torch.gather semantics) and `index_select`, with their
//! deterministic scatter-add / index-add backward passes.

use super::same_device;
use crate::backend::api::Select;
use crate::storage::Storage;
use crate::{Error, Result, Shape, Tensor};

/// Refuses a non-integer index tensor.
fn integer_index(op: &'static str, index: &Tensor) -> Result<()> {
    if !index.dtype().is_int() {
        return Err(Error::UnsupportedDType {
            op,
            dtype: index.dtype(),
        });
    }
    Ok(())
}

/// Checks a gather's index against the input dims (same rank, no larger than the input in any
/// dim but `d`).
fn check_gather(op: &'static str, x_shape: &Shape, index: &Tensor, d: usize) -> Result<()> {
    integer_index(op, index)?;
    if index.rank() != x_shape.rank() {
        crate::bail!(
            "{op}: index {} must have the rank of the input {}",
            index.shape(),
            x_shape
        );
    }
    for (k, (&n, &m)) in index.dims().iter().zip(x_shape.dims()).enumerate() {
        if k != d && n > m {
            crate::bail!(
                "{op}: index {} is larger than the input {} in dim {k} (only dim {d}, the gathered one, may be)",
                index.shape(),
                x_shape
            );
        }
    }
    Ok(())
}

/// `dims` viewed as `[outer, dims[d], inner]` around dim `d`, for an `index_select` along it.
fn select_at(dims: &[usize], d: usize) -> Select {
    Select {
        outer: dims[..d].iter().product(),
        x_n: dims[d],
        inner: dims[d + 1..].iter().product(),
        dim: d,
    }
}

impl Tensor {
    /// `torch.gather`: picks, for every position `p` of the integer `index`, the element of
    /// `self` at `p` with its coordinate along `dim` replaced by `index[p]`. For rank 2,
    /// `out[i][j] = self[index[i][j]][j]` (`dim = 0`) or `self[i][index[i][j]]` (`dim = 1`).
    ///
    /// `index` (i64, u32 or u8) has the rank of `self` and is no larger than it in any dim but
    /// `dim`; the result has `index`'s shape and `self`'s dtype (any dtype). An index outside
    /// `0..self.size(dim)` is an error naming the index, its position, the dim and its size.
    pub fn gather(&self, dim: isize, index: &Tensor) -> Result<Tensor> {
        let _prof = crate::profile::scope("gather");
        same_device("gather", self, index)?;
        let d = self.dim("gather", dim)?;
        check_gather("gather", self.shape(), index, d)?;
        let (x, i) = (self.contiguous()?, index.contiguous()?);
        let (gx, gi) = (x.read_storage("gather")?, i.read_storage("gather")?);
        let s = Storage::gather((&gx, x.layout()), (&gi, i.layout()), d)?;
        Ok(Tensor::from_storage(s, index.shape()))
    }

    /// The backward of [`Tensor::gather`] (`self` is the output gradient, shaped like `index`):
    /// scatter-adds it into zeros of `input_shape` along `dim`. Each element receives its
    /// contributions in increasing position order, so the result does not depend on the thread
    /// count. Float dtypes (half types accumulated in f32).
    pub fn gather_backward(
        &self,
        dim: isize,
        index: &Tensor,
        input_shape: impl Into<Shape>,
    ) -> Result<Tensor> {
        let _prof = crate::profile::scope("gather_backward");
        let op = "gather_backward";
        let input_shape = input_shape.into();
        same_device(op, self, index)?;
        let d = input_shape.dim(op, dim)?;
        check_gather(op, &input_shape, index, d)?;
        if self.shape() != index.shape() {
            return Err(crate::Error::shape_mismatch(
                "gather_backward (gradient vs index)",
                self.shape(),
                index.shape(),
            ));
        }
        let (g, i) = (self.contiguous()?, index.contiguous()?);
        let (gg, gi) = (g.read_storage(op)?, i.read_storage(op)?);
        let s =
            Storage::gather_backward((&gg, g.layout()), (&gi, i.layout()), input_shape.dims(), d)?;
        Ok(Tensor::from_storage(s, input_shape))
    }

    /// The slices of `self` along `dim` picked by the 1-D integer `ids` (i64, u32 or u8), in
    /// order and possibly repeated: the result is `self`'s shape with `dim` of size `ids.len()`,
    /// in `self`'s dtype (any dtype). An id outside `0..self.size(dim)` is an error naming the
    /// id, its position, the dim and its size.
    pub fn index_select(&self, dim: isize, ids: &Tensor) -> Result<Tensor> {
        let _prof = crate::profile::scope("index_select");
        same_device("index_select", self, ids)?;
        let d = self.dim("index_select", dim)?;
        integer_index("index_select", ids)?;
        if ids.rank() != 1 {
            crate::bail!(
                "index_select: ids must be 1-D, got shape {} (input {})",
                ids.shape(),
                self.shape()
            );
        }
        let sel = select_at(self.dims(), d);
        let (x, i) = (self.contiguous()?, ids.contiguous()?);
        let (gx, gi) = (
            x.read_storage("index_select")?,
            i.read_storage("index_select")?,
        );
        let s = Storage::index_select((&gx, x.layout()), (&gi, i.layout()), sel)?;
        let mut out = self.dims().to_vec();
        out[d] = ids.elem_count();
        Ok(Tensor::from_storage(s, out))
    }

    /// The backward of [`Tensor::index_select`] (`self` is the output gradient): index-adds it
    /// into zeros of `input_shape` along `dim`, in increasing id position for every element
    /// (deterministic for any thread count). Float dtypes (half types accumulated in f32).
    pub fn index_select_backward(
        &self,
        dim: isize,
        ids: &Tensor,
        input_shape: impl Into<Shape>,
    ) -> Result<Tensor> {
        let _prof = crate::profile::scope("index_select_backward");
        let op = "index_select_backward";
        let input_shape = input_shape.into();
        same_device(op, self, ids)?;
        let d = input_shape.dim(op, dim)?;
        integer_index(op, ids)?;
        let mut want = input_shape.dims().to_vec();
        want[d] = ids.elem_count();
        if ids.rank() != 1 || self.dims() != want.as_slice() {
            crate::bail!(
                "{op}: gradient {} and ids {} do not fit input {} along dim {d}",
                self.shape(),
                ids.shape(),
                input_shape
            );
        }
        let sel = select_at(input_shape.dims(), d);
        let (g, i) = (self.contiguous()?, ids.contiguous()?);
        let (gg, gi) = (g.read_storage(op)?, i.read_storage(op)?);
        let s = Storage::index_select_backward((&gg, g.layout()), (&gi, i.layout()), sel)?;
        Ok(Tensor::from_storage(s, input_shape))
    }
}

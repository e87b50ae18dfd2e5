//! Joining tensors: cat and stack.

use super::same_kind;
use crate::storage::Storage;
use crate::{Error, Result, Shape, Tensor};

impl Tensor {
    /// Concatenates along `dim`; all other dims must agree.
    pub fn cat(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let _prof = crate::profile::scope("cat");
        let first = *tensors
            .first()
            .ok_or_else(|| Error::msg("cat: no tensors given"))?;
        let d = first.dim("cat", dim)?;
        let mut total = 0;
        for t in tensors {
            same_kind("cat", first, t)?;
            let ok = t.rank() == first.rank()
                && t.dims()
                    .iter()
                    .zip(first.dims())
                    .enumerate()
                    .all(|(i, (a, b))| i == d || a == b);
            if !ok {
                return Err(crate::Error::shape_mismatch(
                    "cat",
                    first.shape(),
                    t.shape(),
                ));
            }
            total += t.dims()[d];
        }
        let mut dims = first.dims().to_vec();
        dims[d] = total;
        let shape = Shape::new(dims);
        // The pieces cover every element of the output.
        let out = Tensor::from_storage(
            Storage::output(first.device(), first.dtype(), shape.elem_count())?,
            shape,
        );
        let mut start = 0;
        for t in tensors {
            let len = t.dims()[d];
            let dst = out.layout().narrow(d, start, len)?;
            let src = t.read_storage("cat")?;
            let mut g = out.write_storage("cat")?;
            Storage::copy_into(&mut g, &dst, (&src, t.layout()))?;
            start += len;
        }
        Ok(out)
    }

    /// Stacks equal-shaped tensors along a new dim `dim`.
    pub fn stack(tensors: &[&Tensor], dim: isize) -> Result<Tensor> {
        let v = tensors
            .iter()
            .map(|t| t.unsqueeze(dim))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = v.iter().collect();
        Tensor::cat(&refs, dim)
    }
}

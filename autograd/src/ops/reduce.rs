//! Reductions.

use meshgrad_tensor::{DType, Result, Tensor};

use crate::Var;

/// The input shape with the reduced dims kept as size 1.
fn kept_shape(dims: &[usize], reduced: &[usize]) -> Vec<usize> {
    dims.iter()
        .enumerate()
        .map(|(i, &d)| if reduced.contains(&i) { 1 } else { d })
        .collect()
}

/// The reduced dims, resolved, sorted and deduplicated (as the tensor reductions treat them: a
/// dim named twice is reduced once).
fn resolve(t: &Tensor, op: &'static str, dims: &[isize]) -> Result<Vec<usize>> {
    let mut v = dims
        .iter()
        .map(|&d| t.dim(op, d))
        .collect::<Result<Vec<_>>>()?;
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

impl Var {
    /// Sum over `dims`.
    pub fn sum(&self, dims: &[isize], keepdim: bool) -> Result<Var> {
        let x = self.tensor();
        let v = x.sum(dims, keepdim)?;
        let kept = kept_shape(x.dims(), &resolve(x, "sum", dims)?);
        let shape = x.shape().clone();
        Ok(Var::from_op(
            "sum",
            v,
            &[self],
            Box::new(move |g, _| {
                Ok(vec![Some(
                    g.reshape(kept.clone())?
                        .expand(shape.clone())?
                        .contiguous()?,
                )])
            }),
        ))
    }

    /// Sum of all elements (0-dim).
    pub fn sum_all(&self) -> Result<Var> {
        let dims: Vec<isize> = (0..self.tensor().rank() as isize).collect();
        if dims.is_empty() {
            return Ok(self.clone());
        }
        self.sum(&dims, false)
    }

    /// Mean over `dims`.
    pub fn mean(&self, dims: &[isize], keepdim: bool) -> Result<Var> {
        let x = self.tensor();
        let n: usize = resolve(x, "mean", dims)?
            .iter()
            .map(|&d| x.dims()[d])
            .product();
        self.sum(dims, keepdim)?.mul_scalar(1.0 / n as f64)
    }

    /// Mean of all elements (0-dim).
    pub fn mean_all(&self) -> Result<Var> {
        let n = self.tensor().elem_count();
        self.sum_all()?.mul_scalar(1.0 / n as f64)
    }

    /// Maximum over `dim`; the gradient goes to the first maximal element.
    pub fn max(&self, dim: isize, keepdim: bool) -> Result<Var> {
        let x = self.tensor().clone();
        let d = x.dim("max", dim)?;
        let v = x.max(dim, keepdim)?;
        let idx = x.argmax(dim, true)?;
        Ok(Var::from_op(
            "max",
            v,
            &[self],
            Box::new(move |g, _| {
                let mut ar = vec![1; x.rank()];
                ar[d] = x.dims()[d];
                let positions =
                    Tensor::arange(0, x.dims()[d] as i64, DType::F64, x.device())?.reshape(ar)?;
                let onehot = positions.eq(&idx.to_dtype(DType::F64)?)?;
                let kept = kept_shape(x.dims(), &[d]);
                let gk = g.reshape(kept)?;
                let z = Tensor::zeros((), g.dtype(), g.device())?;
                Ok(vec![Some(onehot.where_cond(&gk, &z)?)])
            }),
        ))
    }
}

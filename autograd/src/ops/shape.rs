//! Views and joins: reshape, permute, transpose, narrow, expand, (un)squeeze, cat, split, stack.

use meshgrad_tensor::{IntoShapeSpec, Result, Shape, Tensor};

use crate::Var;

impl Var {
    /// Reshape (a view when possible); the target is any [`IntoShapeSpec`], so one size may be
    /// `-1` (inferred), as in [`Tensor::reshape`].
    ///
    /// ```
    /// use meshgrad_autograd::Var;
    /// use meshgrad_tensor::{DType, Device, Tensor};
    /// let x = Var::leaf(Tensor::zeros((2, 3, 4), DType::F32, Device::Cpu)?);
    /// let (b, t) = (2usize, 3usize);
    /// assert_eq!(x.reshape((b * t, -1))?.tensor().dims(), &[6, 4]);
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn reshape(&self, spec: impl IntoShapeSpec) -> Result<Var> {
        let from = self.tensor().shape().clone();
        let v = self.tensor().reshape(spec)?;
        Ok(Var::from_op(
            "reshape",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.reshape(from.clone())?)])),
        ))
    }

    /// Reorders dims.
    pub fn permute(&self, perm: &[usize]) -> Result<Var> {
        let v = self.tensor().permute(perm)?;
        let mut inv = vec![0; perm.len()];
        for (i, &p) in perm.iter().enumerate() {
            inv[p] = i;
        }
        Ok(Var::from_op(
            "permute",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.permute(&inv)?)])),
        ))
    }

    /// Swaps two dims.
    pub fn transpose(&self, d0: isize, d1: isize) -> Result<Var> {
        let v = self.tensor().transpose(d0, d1)?;
        Ok(Var::from_op(
            "transpose",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.transpose(d0, d1)?)])),
        ))
    }

    /// Elements `start..start+len` of `dim` (a view).
    pub fn narrow(&self, dim: isize, start: usize, len: usize) -> Result<Var> {
        let x = self.tensor();
        let v = x.narrow(dim, start, len)?;
        let (shape, dtype, device) = (x.shape().clone(), x.dtype(), x.device());
        Ok(Var::from_op(
            "narrow",
            v,
            &[self],
            Box::new(move |g, _| {
                let full = Tensor::zeros(shape.clone(), dtype, device)?;
                full.narrow(dim, start, len)?.copy_from(g)?;
                Ok(vec![Some(full)])
            }),
        ))
    }

    /// Broadcasts to `shape` (a view); the gradient is summed back.
    pub fn expand(&self, shape: impl Into<Shape>) -> Result<Var> {
        let from = self.tensor().shape().clone();
        let v = self.tensor().expand(shape)?;
        Ok(Var::from_op(
            "expand",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.sum_to_shape(&from)?)])),
        ))
    }

    /// Inserts a size-1 dim.
    pub fn unsqueeze(&self, dim: isize) -> Result<Var> {
        let from = self.tensor().shape().clone();
        let v = self.tensor().unsqueeze(dim)?;
        Ok(Var::from_op(
            "unsqueeze",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.reshape(from.clone())?)])),
        ))
    }

    /// Removes a size-1 dim.
    pub fn squeeze(&self, dim: isize) -> Result<Var> {
        let from = self.tensor().shape().clone();
        let v = self.tensor().squeeze(dim)?;
        Ok(Var::from_op(
            "squeeze",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.reshape(from.clone())?)])),
        ))
    }

    /// A contiguous copy (identity for gradients).
    pub fn contiguous(&self) -> Result<Var> {
        if self.tensor().is_contiguous() {
            return Ok(self.clone());
        }
        let v = self.tensor().contiguous()?;
        Ok(Var::from_op(
            "contiguous",
            v,
            &[self],
            Box::new(|g, _| Ok(vec![Some(g.clone())])),
        ))
    }

    /// Splits `dim` into pieces of the given sizes.
    pub fn split(&self, sizes: &[usize], dim: isize) -> Result<Vec<Var>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(sizes.len());
        let total: usize = sizes.iter().sum();
        let d = self.tensor().dim("split", dim)?;
        if total != self.tensor().dims()[d] {
            meshgrad_tensor::bail!(
                "split: sizes {sizes:?} sum to {total}, but dim {d} of shape {} has size {}",
                self.tensor().shape(),
                self.tensor().dims()[d]
            );
        }
        for &len in sizes {
            out.push(self.narrow(dim, start, len)?);
            start += len;
        }
        Ok(out)
    }

    /// Splits `dim` into `n` equal pieces.
    pub fn chunk(&self, n: usize, dim: isize) -> Result<Vec<Var>> {
        let d = self.tensor().dim("chunk", dim)?;
        let size = self.tensor().dims()[d];
        if n == 0 || !size.is_multiple_of(n) {
            meshgrad_tensor::bail!(
                "chunk: dim {d} of shape {} does not split into {n} equal chunks",
                self.tensor().shape()
            );
        }
        self.split(&vec![size / n; n], dim)
    }

    /// Concatenates along `dim`.
    pub fn cat(vars: &[&Var], dim: isize) -> Result<Var> {
        let ts: Vec<&Tensor> = vars.iter().map(|v| v.tensor()).collect();
        let v = Tensor::cat(&ts, dim)?;
        let sizes: Vec<usize> = ts
            .iter()
            .map(|t| t.dims()[t.dim("cat", dim).unwrap_or(0)])
            .collect();
        Ok(Var::from_op(
            "cat",
            v,
            vars,
            Box::new(move |g, _| {
                g.split(&sizes, dim)?
                    .into_iter()
                    .map(|t| t.contiguous().map(Some))
                    .collect::<Result<Vec<_>>>()
            }),
        ))
    }

    /// Stacks along a new dim.
    pub fn stack(vars: &[&Var], dim: isize) -> Result<Var> {
        let v = vars
            .iter()
            .map(|v| v.unsqueeze(dim))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Var> = v.iter().collect();
        Var::cat(&refs, dim)
    }
}

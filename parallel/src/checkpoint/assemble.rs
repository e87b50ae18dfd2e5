//! Assembling tensors from pieces: a whole global tensor, or the part a rank of the *current*
//! layout needs (a tensor-parallel split and/or a flat range of it).
//!
//! When the requested split cuts the tensor the way the saved pieces do (same dimension,
//! chunks and degree, or both unsplit), only the pieces of that part that overlap the requested
//! range are read: resuming under the same tensor-parallel degree, whatever the data-parallel
//! sharding, never materialises a whole tensor. Otherwise the global tensor is assembled first
//! (one tensor at a time) and the part cut from it.

use std::ops::Range;

use meshgrad_tensor::{Device, Result, Tensor};

use super::format::{PieceEntry, Split, TensorEntry};
use super::open::Checkpoint;

fn same_scheme(a: Option<&Split>, b: Option<&Split>) -> bool {
    a.map(Split::scheme) == b.map(Split::scheme)
}

impl Checkpoint {
    /// The elements of `p` (flat), read from its rank file.
    fn piece_data(&self, t: &TensorEntry, p: &PieceEntry, local_numel: usize) -> Result<Tensor> {
        let n = p.range.map_or(local_numel, |[a, b]| b - a);
        self.rank_file(&p.file)?
            .read(&p.key, t.dtype()?, n)?
            .reshape(n)
    }

    /// Elements `want` of the flattened local tensor of the saved part `part` (a split with
    /// the saved scheme, or `None` when the tensor was saved unsplit), as a flat tensor.
    fn saved_part(
        &self,
        t: &TensorEntry,
        part: Option<&Split>,
        want: Range<usize>,
    ) -> Result<Tensor> {
        let local_numel: usize = match part {
            Some(s) => s.local_dims(&t.shape).iter().product(),
            None => t.numel(),
        };
        let out = Tensor::zeros(want.len(), t.dtype()?, Device::Cpu)?;
        let index = part.map(|s| s.index);
        for p in &t.pieces {
            if p.split.as_ref().map(|s| s.index) != index {
                continue;
            }
            let [a, b] = p.range.unwrap_or([0, local_numel]);
            let (lo, hi) = (a.max(want.start), b.min(want.end));
            if lo >= hi {
                continue;
            }
            let data = self.piece_data(t, p, local_numel)?;
            out.narrow(0, lo - want.start, hi - lo)?
                .copy_from(&data.narrow(0, lo - a, hi - lo)?)?;
        }
        Ok(out)
    }

    /// The whole global tensor `name`, in its saved dtype, assembled from its pieces.
    pub fn read_full(&self, name: &str) -> Result<Tensor> {
        let t = self.entry(name)?;
        self.full_of(t)
            .map_err(|e| self.err(format!("tensor {name}: {e}")))
    }

    fn full_of(&self, t: &TensorEntry) -> Result<Tensor> {
        match t.split_scheme() {
            None => self
                .saved_part(t, None, 0..t.numel())?
                .reshape(t.shape.clone()),
            Some(s) => {
                let full = Tensor::zeros(t.shape.clone(), t.dtype()?, Device::Cpu)?;
                let local_dims = s.local_dims(&t.shape);
                let n: usize = local_dims.iter().product();
                for i in 0..s.degree {
                    let part = s.with_index(i);
                    let local = self
                        .saved_part(t, Some(&part), 0..n)?
                        .reshape(local_dims.clone())?;
                    part.place(&full, &local)?;
                }
                Ok(full)
            }
        }
    }

    /// The part of tensor `name` a rank of the current layout holds, in its saved dtype: the
    /// local tensor of `split` (the whole tensor for `None`), in its local shape, or with a
    /// `range`, those elements of the flattened local tensor as a 1-D tensor. Errors name the
    /// tensor and the checkpoint.
    pub fn read_local(
        &self,
        name: &str,
        split: Option<&Split>,
        range: Option<Range<usize>>,
    ) -> Result<Tensor> {
        let t = self.entry(name)?;
        self.local_of(t, split, range)
            .map_err(|e| self.err(format!("tensor {name}: {e}")))
    }

    fn local_of(
        &self,
        t: &TensorEntry,
        split: Option<&Split>,
        range: Option<Range<usize>>,
    ) -> Result<Tensor> {
        let local_dims = match split {
            Some(s) => {
                s.check(&t.shape).map_err(meshgrad_tensor::Error::msg)?;
                s.local_dims(&t.shape)
            }
            None => t.shape.clone(),
        };
        let n: usize = local_dims.iter().product();
        let want = range.clone().unwrap_or(0..n);
        if want.start > want.end || want.end > n {
            meshgrad_tensor::bail!(
                "element range {}..{} is not within its local tensor of {n} elements",
                want.start,
                want.end
            );
        }
        let flat = if same_scheme(t.split_scheme(), split) {
            self.saved_part(t, split, want.clone())?
        } else {
            let full = self.full_of(t)?;
            let local = match split {
                Some(s) => s.extract(&full)?,
                None => full,
            };
            local
                .reshape(n)?
                .narrow(0, want.start, want.len())?
                .contiguous()?
        };
        match range {
            Some(_) => Ok(flat),
            None => flat.reshape(local_dims),
        }
    }
}

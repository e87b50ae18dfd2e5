//! In-place updates: copies into views, accumulation, and the checks of the optimizer steps
//! (`fused/adamw`, `fused/sgd`). They write through the storage shared by every view of it.

use super::same_kind;
use crate::storage::Storage;
use crate::{Error, Result, Tensor};

impl Tensor {
    /// Copies `src`'s values into this tensor's elements (shapes must match; dtypes too).
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        let _prof = crate::profile::scope("copy_from");
        same_kind("copy_from", self, src)?;
        if self.shape() != src.shape() {
            return Err(Error::shape_mismatch(
                "copy_from",
                self.shape(),
                src.shape(),
            ));
        }
        // A source sharing our storage is copied first so the read and the write never overlap.
        let src = if self.same_storage(src) {
            src.deep_clone()?
        } else {
            src.clone()
        };
        let gs = src.read_storage("copy_from")?;
        let mut gd = self.write_storage("copy_from")?;
        Storage::copy_into(&mut gd, self.layout(), (&gs, src.layout()))
    }

    /// Sets every element to `value`.
    pub fn fill_(&self, value: f64) -> Result<()> {
        let v = Tensor::full(value, self.shape(), self.dtype(), self.device())?;
        self.copy_from(&v)
    }

    /// `self += other` in place (shapes must match). Contiguous float operands of one shape
    /// and dtype that do not share storage are added straight into `self`'s buffer (the same
    /// values, bit for bit, as `self.add(other)`); anything else goes through a temporary sum.
    pub fn add_assign(&self, other: &Tensor) -> Result<()> {
        let _prof = crate::profile::scope("add_assign");
        if self.shape() == other.shape()
            && self.dtype() == other.dtype()
            && self.device() == other.device()
            && self.dtype().is_float()
            && self.is_contiguous()
            && other.is_contiguous()
            && !self.same_storage(other)
        {
            let gs = other.read_storage("add_assign")?;
            let mut gd = self.write_storage("add_assign")?;
            if Storage::add_assign_contiguous(&mut gd, self.layout(), (&gs, other.layout()))? {
                return Ok(());
            }
        }
        let sum = self.add(other)?;
        if sum.shape() != self.shape() {
            return Err(Error::shape_mismatch(
                "add_assign",
                self.shape(),
                other.shape(),
            ));
        }
        self.copy_from(&sum)
    }

    /// Checks the operands of an in-place optimizer step (`self` the parameter): contiguous,
    /// of one kind and shape, sharing no storage.
    pub(crate) fn check_flat(&self, others: &[&Tensor], op: &'static str) -> Result<()> {
        if !self.is_contiguous() {
            crate::bail!(
                "{op}: the parameter (shape {}) must be contiguous",
                self.shape()
            );
        }
        for o in others {
            same_kind(op, self, o)?;
            if o.shape() != self.shape() || !o.is_contiguous() {
                return Err(Error::shape_mismatch(op, self.shape(), o.shape()));
            }
        }
        // The step holds a read lock on the gradient and write locks on the others: operands
        // sharing one storage would deadlock on its lock, so they are refused.
        let all: Vec<&Tensor> = std::iter::once(self)
            .chain(others.iter().copied())
            .collect();
        for (i, a) in all.iter().enumerate() {
            if all[i + 1..].iter().any(|b| a.same_storage(b)) {
                crate::bail!(
                    "{op}: the parameter, gradient and state buffers must not share storage"
                );
            }
        }
        Ok(())
    }
}

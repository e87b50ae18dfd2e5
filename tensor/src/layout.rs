//! Strided layouts: a shape, strides and an offset over a flat storage. Views (permute, narrow,
//! expand, reshape of contiguous data) only change the layout.

use crate::{Error, Result, Shape};

/// How a tensor's elements map into its storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    shape: Shape,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout {
    /// A row-major contiguous layout at offset 0.
    pub fn contiguous(shape: impl Into<Shape>) -> Self {
        let shape = shape.into();
        let strides = shape.contiguous_strides();
        Layout {
            shape,
            strides,
            offset: 0,
        }
    }

    /// A layout from its parts.
    pub fn new(shape: Shape, strides: Vec<usize>, offset: usize) -> Self {
        debug_assert_eq!(shape.rank(), strides.len());
        Layout {
            shape,
            strides,
            offset,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// Strides in elements.
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// Offset of the first element in the storage.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Whether elements are row-major with no gaps (dims of size 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for (&d, &s) in self.shape.dims().iter().zip(&self.strides).rev() {
            if d != 1 && s != acc {
                return false;
            }
            acc *= d;
        }
        true
    }

    /// The contiguous range of storage this layout covers, if it is contiguous.
    pub fn contiguous_range(&self) -> Option<std::ops::Range<usize>> {
        self.is_contiguous()
            .then(|| self.offset..self.offset + self.shape.elem_count())
    }

    /// One past the largest storage index the layout touches (0 for an empty tensor).
    pub fn storage_extent(&self) -> usize {
        if self.shape.elem_count() == 0 {
            return 0;
        }
        self.offset
            + self
                .shape
                .dims()
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }

    /// Reorders dimensions: dimension `i` of the result is dimension `perm[i]` of `self`.
    pub fn permute(&self, perm: &[usize]) -> Result<Layout> {
        let rank = self.shape.rank();
        let mut seen = vec![false; rank];
        if perm.len() != rank
            || perm
                .iter()
                .any(|&p| p >= rank || std::mem::replace(&mut seen[p], true))
        {
            crate::bail!(
                "permute: {perm:?} is not a permutation of the {rank} dims of a tensor of shape {}",
                self.shape
            );
        }
        let dims = perm
            .iter()
            .map(|&p| self.shape.dims()[p])
            .collect::<Vec<_>>();
        let strides = perm.iter().map(|&p| self.strides[p]).collect();
        Ok(Layout {
            shape: Shape::new(dims),
            strides,
            offset: self.offset,
        })
    }

    /// The sub-range `start..start+len` of dimension `dim`.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        let size = self.shape.dims()[dim];
        if start + len > size {
            crate::bail!(
                "narrow: range {start}..{} out of bounds for dim {dim} of size {size} (shape {})",
                start + len,
                self.shape
            );
        }
        let mut dims = self.shape.dims().to_vec();
        dims[dim] = len;
        Ok(Layout {
            shape: Shape::new(dims),
            strides: self.strides.clone(),
            offset: self.offset + start * self.strides[dim],
        })
    }

    /// Broadcasts to `shape` (trailing alignment; size-1 and new leading dims get stride 0).
    pub fn broadcast_as(&self, shape: &Shape) -> Result<Layout> {
        let rank = shape.rank();
        let own = self.shape.rank();
        if own > rank {
            return Err(Error::ShapeMismatch {
                op: "broadcast_as",
                lhs: self.shape.clone(),
                rhs: shape.clone(),
            });
        }
        let mut strides = vec![0; rank];
        for i in 0..own {
            let (d, target) = (self.shape.dims()[i], shape.dims()[rank - own + i]);
            if d == target {
                strides[rank - own + i] = self.strides[i];
            } else if d != 1 {
                return Err(Error::ShapeMismatch {
                    op: "broadcast_as",
                    lhs: self.shape.clone(),
                    rhs: shape.clone(),
                });
            }
        }
        Ok(Layout {
            shape: shape.clone(),
            strides,
            offset: self.offset,
        })
    }

    /// A view with a new shape of the same element count, if one exists without copying
    /// (always for contiguous layouts; otherwise when the merged/split dims are compatible).
    pub fn reshape_view(&self, shape: &Shape) -> Option<Layout> {
        if shape.elem_count() != self.shape.elem_count() {
            return None;
        }
        if self.is_contiguous() {
            return Some(Layout {
                shape: shape.clone(),
                strides: shape.contiguous_strides(),
                offset: self.offset,
            });
        }
        // General case: group old dims into chunks that are each contiguous among themselves
        // and map the new dims onto the chunks.
        let old: Vec<(usize, usize)> = self
            .shape
            .dims()
            .iter()
            .zip(&self.strides)
            .filter(|(&d, _)| d != 1)
            .map(|(&d, &s)| (d, s))
            .collect();
        let mut new_strides = vec![0; shape.rank()];
        let mut oi = 0;
        let mut ni = 0;
        let new_dims = shape.dims();
        while ni < new_dims.len() {
            if new_dims[ni] == 1 {
                new_strides[ni] = 1;
                ni += 1;
                continue;
            }
            if oi >= old.len() {
                return None;
            }
            // Collect a chunk of old dims and a chunk of new dims with equal products.
            let (mut old_prod, mut new_prod) = (old[oi].0, new_dims[ni]);
            let chunk_start_old = oi;
            let chunk_start_new = ni;
            while old_prod != new_prod {
                if old_prod < new_prod {
                    oi += 1;
                    if oi >= old.len() {
                        return None;
                    }
                    // Must be contiguous with the previous old dim.
                    if old[oi - 1].1 != old[oi].0 * old[oi].1 {
                        return None;
                    }
                    old_prod *= old[oi].0;
                } else {
                    ni += 1;
                    if ni >= new_dims.len() {
                        return None;
                    }
                    new_prod *= new_dims[ni];
                }
            }
            let _ = chunk_start_old;
            // Strides for the new dims of this chunk: innermost stride of the chunk.
            let mut stride = old[oi].1;
            for j in (chunk_start_new..=ni).rev() {
                new_strides[j] = stride;
                stride *= new_dims[j];
            }
            oi += 1;
            ni += 1;
        }
        if oi != old.len() {
            return None;
        }
        Some(Layout {
            shape: shape.clone(),
            strides: new_strides,
            offset: self.offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguity_and_views() {
        let l = Layout::contiguous([2, 3, 4]);
        assert!(l.is_contiguous());
        let p = l.permute(&[0, 2, 1]).unwrap();
        assert_eq!(p.dims(), &[2, 4, 3]);
        assert_eq!(p.strides(), &[12, 1, 4]);
        assert!(!p.is_contiguous());
        let n = l.narrow(1, 1, 2).unwrap();
        assert_eq!(n.offset(), 4);
        assert!(!n.is_contiguous());
        assert!(l.narrow(1, 2, 2).is_err());
        let b = Layout::contiguous([3, 1])
            .broadcast_as(&Shape::from([2, 3, 5]))
            .unwrap();
        assert_eq!(b.strides(), &[0, 1, 0]);
        assert!(l.permute(&[0, 0, 1]).is_err());
    }

    #[test]
    fn reshape_views() {
        let l = Layout::contiguous([2, 3, 4]);
        assert_eq!(
            l.reshape_view(&Shape::from([6, 4])).unwrap().strides(),
            &[4, 1]
        );
        // A transposed matrix cannot be flattened without a copy.
        let t = Layout::contiguous([3, 4]).permute(&[1, 0]).unwrap();
        assert!(t.reshape_view(&Shape::from([12])).is_none());
        // Splitting the leading dim of a narrowed (row-strided) view is fine.
        let n = Layout::contiguous([4, 8]).narrow(1, 0, 4).unwrap();
        let r = n.reshape_view(&Shape::from([2, 2, 4])).unwrap();
        assert_eq!(r.strides(), &[16, 8, 1]);
        // Merging dims that are not contiguous with each other is refused.
        assert!(n.reshape_view(&Shape::from([16])).is_none());
    }
}

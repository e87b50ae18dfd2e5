//! Shapes, dimension resolution and broadcasting.

use crate::{Error, Result};

/// The dimensions of a tensor (row-major).
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape from its dimensions.
    pub fn new(dims: Vec<usize>) -> Self {
        Shape(dims)
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar).
    pub fn elem_count(&self) -> usize {
        self.0.iter().product()
    }

    /// Row-major contiguous strides (in elements).
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut strides = vec![0; self.0.len()];
        let mut acc = 1;
        for (s, &d) in strides.iter_mut().zip(&self.0).rev() {
            *s = acc;
            acc *= d;
        }
        strides
    }

    /// Resolves a possibly negative dimension index (`-1` is the last) against this rank.
    pub fn dim(&self, op: &'static str, dim: isize) -> Result<usize> {
        let rank = self.rank() as isize;
        let d = if dim < 0 { dim + rank } else { dim };
        if d < 0 || d >= rank {
            return Err(Error::DimOutOfRange {
                op,
                dim,
                shape: self.clone(),
            });
        }
        Ok(d as usize)
    }

    /// The shape both operands broadcast to (NumPy rules: align trailing dims; 1 stretches).
    pub fn broadcast(op: &'static str, lhs: &Shape, rhs: &Shape) -> Result<Shape> {
        let rank = lhs.rank().max(rhs.rank());
        let mut dims = vec![0; rank];
        for (i, out) in dims.iter_mut().enumerate() {
            let l = if i < rank - lhs.rank() {
                1
            } else {
                lhs.0[i - (rank - lhs.rank())]
            };
            let r = if i < rank - rhs.rank() {
                1
            } else {
                rhs.0[i - (rank - rhs.rank())]
            };
            *out = if l == r || r == 1 {
                l
            } else if l == 1 {
                r
            } else {
                return Err(Error::ShapeMismatch {
                    op,
                    lhs: lhs.clone(),
                    rhs: rhs.clone(),
                });
            };
        }
        Ok(Shape(dims))
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}

impl From<()> for Shape {
    fn from(_: ()) -> Self {
        Shape(vec![])
    }
}

impl From<usize> for Shape {
    fn from(d: usize) -> Self {
        Shape(vec![d])
    }
}

impl From<(usize, usize)> for Shape {
    fn from(d: (usize, usize)) -> Self {
        Shape(vec![d.0, d.1])
    }
}

impl From<(usize, usize, usize)> for Shape {
    fn from(d: (usize, usize, usize)) -> Self {
        Shape(vec![d.0, d.1, d.2])
    }
}

impl From<(usize, usize, usize, usize)> for Shape {
    fn from(d: (usize, usize, usize, usize)) -> Self {
        Shape(vec![d.0, d.1, d.2, d.3])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_rules() {
        let s = |v: &[usize]| Shape::from(v);
        assert_eq!(
            Shape::broadcast("t", &s(&[2, 1, 3]), &s(&[4, 1])).unwrap(),
            s(&[2, 4, 3])
        );
        assert_eq!(Shape::broadcast("t", &s(&[]), &s(&[5])).unwrap(), s(&[5]));
        let err = Shape::broadcast("add", &s(&[2, 3]), &s(&[4]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("[2, 3]") && err.contains("[4]"), "{err}");
    }

    #[test]
    fn dims_and_strides() {
        let s = Shape::from([2, 3, 4]);
        assert_eq!(s.contiguous_strides(), vec![12, 4, 1]);
        assert_eq!(s.dim("t", -1).unwrap(), 2);
        assert!(s.dim("t", 3).is_err());
        assert!(s.dim("t", -4).is_err());
    }
}

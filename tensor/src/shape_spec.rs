//! Reshape targets: a shape in which at most one size is `-1`, inferred from the element count.

use crate::{Result, Shape};

/// A reshape target: one size per dimension, at most one of them `-1` (inferred so that the
/// element count is unchanged). Built from anything [`IntoShapeSpec`]: the shapes accepted
/// elsewhere (`Shape`, `usize`, `[usize; N]`, `&[usize]`, `Vec<usize>`, tuples) and their signed
/// forms (`(b, t, -1)`, `&[n as isize, -1]`, `-1` to flatten).
///
/// ```
/// use meshgrad_tensor::{Device, ShapeSpec, Tensor};
/// let x = Tensor::zeros((2, 3, 4), meshgrad_tensor::DType::F32, Device::Cpu)?;
/// let (b, t) = (2usize, 3usize);
/// assert_eq!(x.reshape((b, t, -1))?.dims(), &[2, 3, 4]);
/// assert_eq!(x.reshape(&[b as isize, -1])?.dims(), &[2, 12]);
/// assert_eq!(x.reshape(-1)?.dims(), &[24]);
/// assert_eq!(x.reshape((4, 6))?.dims(), &[4, 6]);
/// let spec = ShapeSpec::new(vec![-1, 4]);
/// assert_eq!(spec.to_string(), "[-1, 4]");
/// assert_eq!(spec.resolve("reshape", x.shape())?.dims(), &[6, 4]);
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct ShapeSpec(Vec<isize>);

impl ShapeSpec {
    /// A spec from its sizes (`-1` for the inferred one; other negative sizes are rejected by
    /// [`ShapeSpec::resolve`]).
    pub fn new(dims: Vec<isize>) -> Self {
        ShapeSpec(dims)
    }

    /// The sizes, `-1` where inferred.
    pub fn dims(&self) -> &[isize] {
        &self.0
    }

    /// The shape this spec gives a tensor of shape `from`: the `-1` (if any) becomes
    /// `elements / product(other sizes)`. Errors, naming `op`, the tensor's shape and element
    /// count and the spec: more than one `-1`, another negative size, an element count that the
    /// known sizes do not divide, or (without `-1`) a different element count.
    pub fn resolve(&self, op: &'static str, from: &Shape) -> Result<Shape> {
        let n = from.elem_count();
        let fail = |why: String| -> Result<Shape> {
            crate::bail!(
                "{op}: cannot reshape a tensor of shape {from} ({n} elements) into {self}: {why}"
            )
        };
        let inferred: Vec<usize> = (0..self.0.len()).filter(|&i| self.0[i] == -1).collect();
        if inferred.len() > 1 {
            return fail(format!(
                "only one dimension can be -1 (inferred), found {}",
                inferred.len()
            ));
        }
        if let Some(&bad) = self.0.iter().find(|&&d| d < -1) {
            return fail(format!(
                "size {bad} is negative (only -1, inferred, is allowed)"
            ));
        }
        let mut known: usize = 1;
        for &d in self.0.iter().filter(|&&d| d >= 0) {
            known = match known.checked_mul(d as usize) {
                Some(k) => k,
                None => return fail("the sizes overflow".into()),
            };
        }
        let mut dims: Vec<usize> = self.0.iter().map(|&d| d.max(0) as usize).collect();
        match inferred.first() {
            Some(&i) => {
                if known == 0 {
                    return fail("the other sizes multiply to 0, so -1 is undetermined".into());
                }
                if !n.is_multiple_of(known) {
                    return fail(format!(
                        "{n} is not a multiple of {known} (the product of the other sizes)"
                    ));
                }
                dims[i] = n / known;
            }
            None => {
                if known != n {
                    return fail(format!("{known} elements, not {n}"));
                }
            }
        }
        Ok(Shape::new(dims))
    }
}

impl std::fmt::Display for ShapeSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// Anything a reshape accepts as its target: see [`ShapeSpec`].
pub trait IntoShapeSpec {
    /// The spec.
    fn into_shape_spec(self) -> ShapeSpec;
}

/// One size of a [`ShapeSpec`]: unsigned sizes, or signed ones where `-1` means inferred.
/// Implemented for `usize`, `u32`, `u64`, `isize`, `i32` and `i64` (so integer literals and
/// `-1` work as they are).
pub trait SpecDim: Copy {
    /// The size as an `isize` (`-1` inferred; values beyond the range of `isize` saturate to
    /// `isize::MAX`, which no tensor can match).
    fn spec_dim(self) -> isize;
}

macro_rules! spec_dim {
    ($($t:ty),*) => {$(
        impl SpecDim for $t {
            #[inline]
            fn spec_dim(self) -> isize {
                isize::try_from(self).unwrap_or(isize::MAX)
            }
        }
        impl IntoShapeSpec for $t {
            fn into_shape_spec(self) -> ShapeSpec {
                ShapeSpec(vec![self.spec_dim()])
            }
        }
    )*};
}
spec_dim!(usize, u32, u64, isize, i32, i64);

impl IntoShapeSpec for ShapeSpec {
    fn into_shape_spec(self) -> ShapeSpec {
        self
    }
}

impl IntoShapeSpec for &ShapeSpec {
    fn into_shape_spec(self) -> ShapeSpec {
        self.clone()
    }
}

impl IntoShapeSpec for Shape {
    fn into_shape_spec(self) -> ShapeSpec {
        (&self).into_shape_spec()
    }
}

impl IntoShapeSpec for &Shape {
    fn into_shape_spec(self) -> ShapeSpec {
        self.dims().into_shape_spec()
    }
}

impl IntoShapeSpec for () {
    fn into_shape_spec(self) -> ShapeSpec {
        ShapeSpec(vec![])
    }
}

impl<D: SpecDim> IntoShapeSpec for &[D] {
    fn into_shape_spec(self) -> ShapeSpec {
        ShapeSpec(self.iter().map(|d| d.spec_dim()).collect())
    }
}

impl<D: SpecDim, const N: usize> IntoShapeSpec for [D; N] {
    fn into_shape_spec(self) -> ShapeSpec {
        self.as_slice().into_shape_spec()
    }
}

impl<D: SpecDim, const N: usize> IntoShapeSpec for &[D; N] {
    fn into_shape_spec(self) -> ShapeSpec {
        self.as_slice().into_shape_spec()
    }
}

impl<D: SpecDim> IntoShapeSpec for Vec<D> {
    fn into_shape_spec(self) -> ShapeSpec {
        self.as_slice().into_shape_spec()
    }
}

impl<D: SpecDim> IntoShapeSpec for &Vec<D> {
    fn into_shape_spec(self) -> ShapeSpec {
        self.as_slice().into_shape_spec()
    }
}

macro_rules! spec_tuple {
    ($($name:ident),+) => {
        impl<$($name: SpecDim),+> IntoShapeSpec for ($($name,)+) {
            #[allow(non_snake_case)]
            fn into_shape_spec(self) -> ShapeSpec {
                let ($($name,)+) = self;
                ShapeSpec(vec![$($name.spec_dim()),+])
            }
        }
    };
}
spec_tuple!(A);
spec_tuple!(A, B);
spec_tuple!(A, B, C);
spec_tuple!(A, B, C, D);
spec_tuple!(A, B, C, D, E);
spec_tuple!(A, B, C, D, E, F);

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve(spec: impl IntoShapeSpec, from: &[usize]) -> Result<Vec<usize>> {
        Ok(spec
            .into_shape_spec()
            .resolve("reshape", &Shape::from(from))?
            .dims()
            .to_vec())
    }

    #[test]
    #[allow(clippy::needless_borrows_for_generic_args)] // the borrowed forms are under test
    fn every_form_resolves() {
        let from = [2usize, 3, 4];
        let (b, t) = (2usize, 3usize);
        assert_eq!(resolve((b, t, -1), &from).unwrap(), [2, 3, 4]);
        assert_eq!(resolve((-1, 4), &from).unwrap(), [6, 4]);
        assert_eq!(resolve((2, 3), &[6]).unwrap(), [2, 3]);
        assert_eq!(resolve(24, &from).unwrap(), [24]);
        assert_eq!(resolve(-1, &from).unwrap(), [24]);
        assert_eq!(resolve(b * t * 4, &from).unwrap(), [24]);
        assert_eq!(resolve([4usize, 6], &from).unwrap(), [4, 6]);
        assert_eq!(resolve([4, -1], &from).unwrap(), [4, 6]);
        assert_eq!(resolve(&[b as isize, -1], &from).unwrap(), [2, 12]);
        assert_eq!(resolve(&from[..], &from).unwrap(), [2, 3, 4]);
        assert_eq!(resolve(vec![1usize, 24], &from).unwrap(), [1, 24]);
        assert_eq!(resolve(&vec![-1i64, 1, 1], &from).unwrap(), [24, 1, 1]);
        assert_eq!(resolve(Shape::from([12, 2]), &from).unwrap(), [12, 2]);
        assert_eq!(resolve(&Shape::from([12, 2]), &from).unwrap(), [12, 2]);
        assert_eq!(resolve((), &[1]).unwrap(), Vec::<usize>::new());
        assert_eq!(resolve((-1,), &[]).unwrap(), [1]);
        assert_eq!(
            resolve((1, 2, 1, 3, 1, -1), &from).unwrap(),
            [1, 2, 1, 3, 1, 4]
        );
        // Empty tensors: -1 is determined when the other sizes are not 0.
        assert_eq!(resolve((-1, 3), &[0, 3]).unwrap(), [0, 3]);
        assert_eq!(resolve((0, 5), &[0, 3]).unwrap(), [0, 5]);
    }

    #[test]
    fn errors_name_shape_spec_and_count() {
        let from = [2usize, 3, 4];
        let e = |spec: ShapeSpec, from: &[usize]| resolve(spec, from).unwrap_err().to_string();
        assert_eq!(
            e(ShapeSpec::new(vec![-1, -1]), &from),
            "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [-1, -1]: \
             only one dimension can be -1 (inferred), found 2"
        );
        assert_eq!(
            e(ShapeSpec::new(vec![5, -1]), &from),
            "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [5, -1]: \
             24 is not a multiple of 5 (the product of the other sizes)"
        );
        assert_eq!(
            e(ShapeSpec::new(vec![5, 5]), &from),
            "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [5, 5]: \
             25 elements, not 24"
        );
        assert_eq!(
            e(ShapeSpec::new(vec![2, -3, 4]), &from),
            "reshape: cannot reshape a tensor of shape [2, 3, 4] (24 elements) into [2, -3, 4]: \
             size -3 is negative (only -1, inferred, is allowed)"
        );
        assert_eq!(
            e(ShapeSpec::new(vec![0, -1]), &[0, 3]),
            "reshape: cannot reshape a tensor of shape [0, 3] (0 elements) into [0, -1]: \
             the other sizes multiply to 0, so -1 is undetermined"
        );
        let huge = usize::MAX.into_shape_spec();
        assert_eq!(huge.dims(), &[isize::MAX]);
        assert!(resolve((usize::MAX, 2usize), &from).is_err());
    }
}

//! The rotary position embedding composed of basic ops (both directions), and the test that it
//! agrees with the fused paths.

use super::Rotary;
use crate::ops::fallback::widen;
use crate::{DType, Result, Tensor};

/// See [`Rotary`]. As in the fused kernels, the angles and their cosines and sines are computed
/// in f64 and rounded once to the compute precision.
pub(super) fn rotary(a: &Rotary<&Tensor>) -> Result<Tensor> {
    let (x, positions, dims, theta, inverse) = (a.x, a.positions, a.dims, a.theta, a.inverse);
    let [_, t, _, d] = dims;
    let half = d / 2;
    if x.elem_count() == 0 {
        return x.zeros_like();
    }
    let xc = widen(x)?;
    let dev = x.device();
    // The inverse frequencies depend on D and theta only: the kernels' own table.
    let inv = meshgrad_kernels::cpu::rotary::inv_frequencies(d, theta);
    let inv = Tensor::from_vec(inv, (1, half), dev)?;
    let angle = positions.to_dtype(DType::F64)?.reshape((t, 1))?.mul(&inv)?;
    let sign = if inverse { -1.0 } else { 1.0 };
    let table = |a: Tensor| a.to_dtype(xc.dtype())?.reshape((1, t, 1, half));
    let (cos, sin) = (table(angle.cos()?)?, table(angle.sin()?.mul_scalar(sign)?)?);
    let (x1, x2) = (xc.narrow(3, 0, half)?, xc.narrow(3, half, half)?);
    let y1 = x1.mul(&cos)?.sub(&x2.mul(&sin)?)?;
    let y2 = x2.mul(&cos)?.add(&x1.mul(&sin)?)?;
    Tensor::cat(&[&y1, &y2], 3)?.to_dtype(x.dtype())
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close};
    use crate::{Device, Tensor};

    #[test]
    fn rotary_embedding_matches_its_composition() {
        for (dt, rel, [x]) in cases(31, [&[2, 5, 3, 8]]) {
            // Unordered, repeated and negative positions, and a large one.
            let p = Tensor::from_vec(vec![0i64, 7, 3, -2, 4096], 5, Device::Cpu).unwrap();
            for theta in [10_000.0, 500_000.0] {
                let (a, c) = both(|| x.rotary_embedding(&p, theta).unwrap());
                close(&format!("rotary_embedding {dt} theta={theta}"), &a, &c, rel);
                let (a, c) = both(|| x.rotary_embedding_backward(&p, theta).unwrap());
                close(
                    &format!("rotary_embedding_backward {dt} theta={theta}"),
                    &a,
                    &c,
                    rel,
                );
            }
        }
    }
}

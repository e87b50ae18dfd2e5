//! Log-sum-exp composed of basic ops, and the test that it agrees with the fused paths.

use super::Logsumexp;
use crate::ops::fallback::{replace, widen};
use crate::{Result, Tensor};

/// See [`Logsumexp`]: shifted by the maximum, or by 0 where the maximum is infinite (so a slice
/// of all `-inf`, or an empty one, gives `-inf` and one holding `+inf` gives `+inf`); NaN
/// propagates.
pub(super) fn forward(a: &Logsumexp<&Tensor>) -> Result<Tensor> {
    let (x, outer, red, inner) = (a.x, a.outer, a.red, a.inner);
    let xc = widen(x)?.reshape((outer, red, inner))?;
    if red == 0 || outer * inner == 0 {
        return Tensor::full(f64::NEG_INFINITY, a.out.clone(), x.dtype(), x.device());
    }
    let m = xc.max(1, true)?;
    let shift = replace(&replace(&m, f64::INFINITY, 0.0)?, f64::NEG_INFINITY, 0.0)?;
    let s = xc.sub(&shift)?.exp()?.sum(&[1], true)?.log()?;
    shift
        .add(&s)?
        .reshape((outer, inner))?
        .to_dtype(x.dtype())?
        .reshape(a.out.clone())
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, cases, close, with_values};
    use crate::{Device, Tensor};

    #[test]
    fn logsumexp_matches_its_composition() {
        for (dt, rel, [x]) in cases(42, [&[4, 6, 5]]) {
            // One slice (dim 1, fixed [0, *, 0]) all -inf, one holding +inf.
            let mut special: Vec<_> = (0..6).map(|r| (r * 5, f64::NEG_INFINITY)).collect();
            special.push((30 + 7, f64::INFINITY));
            let x = with_values(&x, &special);
            for (dim, keep) in [(0, false), (1, true), (2, false), (-1, true)] {
                let (a, c) = both(|| x.logsumexp(dim, keep).unwrap());
                close(&format!("logsumexp {dt} dim={dim}"), &a, &c, rel);
            }
            let empty = Tensor::zeros((3, 0), dt, Device::Cpu).unwrap();
            let (a, c) = both(|| empty.logsumexp(1, false).unwrap());
            close(&format!("logsumexp {dt} empty"), &a, &c, rel);
        }
    }
}

//! The SGD-with-momentum update over flat buffers.

use rayon::prelude::*;

use crate::cpu::adamw::CHUNK;
use crate::cpu::vecops::simd;
use crate::Float;

/// SGD with momentum as in PyTorch (dampening 0, not Nesterov): `g += wd * p`;
/// `buf = g` on the first step, else `buf = momentum * buf + g`; `p -= lr * buf`.
///
/// `buf` is always written (also with `momentum == 0`, where it equals the decayed gradient).
pub fn sgd_step<T: Float>(
    lr: f64,
    momentum: f64,
    weight_decay: f64,
    first_step: bool,
    param: &mut [T],
    grad: &[T],
    buf: &mut [T],
) {
    let n = param.len();
    assert!(
        grad.len() == n && buf.len() == n,
        "sgd_step: param/grad/buf have {}/{}/{} elements",
        n,
        grad.len(),
        buf.len()
    );
    let (lr, mom, wd) = (
        T::from_f64(lr),
        T::from_f64(momentum),
        T::from_f64(weight_decay),
    );
    let run = |p: &mut [T], g: &[T], b: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                for ((p, &g), b) in p.iter_mut().zip(g).zip(b.iter_mut()) {
                    let g = g + wd * *p;
                    let nb = if first_step { g } else { mom * *b + g };
                    *b = nb;
                    *p -= lr * nb;
                }
            },
        )
    };
    if n < 2 * CHUNK {
        run(param, grad, buf);
    } else {
        param
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK).zip(buf.par_chunks_mut(CHUNK)))
            .for_each(|(p, (g, b))| run(p, g, b));
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, Rng};

    #[test]
    fn sgd_matches_formula() {
        let mut rng = Rng(10);
        for &n in &[1usize, 7, 40_000] {
            for (mom, wd) in [(0.0, 0.0), (0.9, 0.0), (0.9, 0.01)] {
                let p0 = rng.vec(n, -1.0, 1.0);
                let (mut p, mut b) = (p0.clone(), vec![0.0; n]);
                let (mut pr, mut br) = (p0.clone(), vec![0.0; n]);
                for step in 0..4 {
                    let g = rng.vec(n, -1.0, 1.0);
                    sgd_step(0.1, mom, wd, step == 0, &mut p, &g, &mut b);
                    for i in 0..n {
                        let gi = g[i] + wd * pr[i];
                        br[i] = if step == 0 { gi } else { mom * br[i] + gi };
                        pr[i] -= 0.1 * br[i];
                    }
                }
                assert_close("sgd p", &p, &pr, 1e-13, 1e-14);
                assert_close("sgd buf", &b, &br, 1e-13, 1e-14);
            }
        }
    }
}

//! The AdamW update over flat buffers (SGD's is `sgd.rs`).

use rayon::prelude::*;

use crate::cpu::vecops::simd;
use crate::ops::AdamWStep;
use crate::Float;

/// Elements per parallel task of the optimizer loops.
pub(crate) const CHUNK: usize = 16 * 1024;

/// AdamW as in Loshchilov & Hutter / PyTorch: `p -= lr*wd*p`; `m = b1 m + (1-b1) g`;
/// `v = b2 v + (1-b2) g²`; `p -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)`.
///
/// Arithmetic follows PyTorch's single-tensor implementation: the hyper-parameter constants
/// (`1 - lr*wd`, `lr / (1-b1^t)`, `sqrt(1-b2^t)`, ...) are computed in f64 and rounded to `T`;
/// per element, in `T`: `p *= 1 - lr*wd`, `m = b1 m + (1-b1) g`, `v = b2 v + (1-b2) g g`,
/// `p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)`. Elementwise, so chunking over threads
/// does not change results.
pub fn adamw_step<T: Float>(hp: &AdamWStep, param: &mut [T], grad: &[T], m: &mut [T], v: &mut [T]) {
    let n = param.len();
    assert!(
        grad.len() == n && m.len() == n && v.len() == n,
        "adamw_step: param/grad/m/v have {}/{}/{}/{} elements",
        n,
        grad.len(),
        m.len(),
        v.len()
    );
    assert!(hp.step >= 1, "adamw_step: step counts from 1");
    let t = hp.step.min(i32::MAX as u64) as i32;
    let bc1 = 1.0 - hp.beta1.powi(t);
    let bc2 = 1.0 - hp.beta2.powi(t);
    let decay = T::from_f64(1.0 - hp.lr * hp.weight_decay);
    let b1 = T::from_f64(hp.beta1);
    let b2 = T::from_f64(hp.beta2);
    let one_minus_b1 = T::from_f64(1.0 - hp.beta1);
    let one_minus_b2 = T::from_f64(1.0 - hp.beta2);
    let step_size = T::from_f64(hp.lr / bc1);
    let bc2_sqrt = T::from_f64(bc2.sqrt());
    let eps = T::from_f64(hp.eps);
    let apply_decay = hp.weight_decay != 0.0;
    let run = |p: &mut [T], g: &[T], m: &mut [T], v: &mut [T]| {
        simd(
            #[inline(always)]
            || {
                for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
                    let mut pv = *p;
                    if apply_decay {
                        pv *= decay;
                    }
                    let mv = b1 * *m + one_minus_b1 * g;
                    let vv = b2 * *v + one_minus_b2 * g * g;
                    *m = mv;
                    *v = vv;
                    *p = pv - step_size * mv / (vv.sqrt() / bc2_sqrt + eps);
                }
            },
        )
    };
    if n < 2 * CHUNK {
        run(param, grad, m, v);
    } else {
        param
            .par_chunks_mut(CHUNK)
            .zip(grad.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
            .for_each(|((p, g), (m, v))| run(p, g, m, v));
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;
    use crate::cpu::testutil::{assert_close, to_f32, to_f64, Rng};

    /// The documented formula, literally, in f64.
    fn adamw_ref(hp: &AdamWStep, p: &mut [f64], g: &[f64], m: &mut [f64], v: &mut [f64]) {
        let t = hp.step as i32;
        for i in 0..p.len() {
            p[i] -= hp.lr * hp.weight_decay * p[i];
            m[i] = hp.beta1 * m[i] + (1.0 - hp.beta1) * g[i];
            v[i] = hp.beta2 * v[i] + (1.0 - hp.beta2) * g[i] * g[i];
            let mhat = m[i] / (1.0 - hp.beta1.powi(t));
            let vhat = v[i] / (1.0 - hp.beta2.powi(t));
            p[i] -= hp.lr * mhat / (vhat.sqrt() + hp.eps);
        }
    }

    #[test]
    fn adamw_matches_formula_over_several_steps() {
        let mut rng = Rng(9);
        for &n in &[1usize, 5, 100, 70_001] {
            for wd in [0.0, 0.1] {
                let p0 = rng.vec(n, -1.0, 1.0);
                let (mut p, mut m, mut v) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
                let (mut pr, mut mr, mut vr) = (p0.clone(), vec![0.0; n], vec![0.0; n]);
                let (mut p32, mut m32, mut v32) = (to_f32(&p0), vec![0f32; n], vec![0f32; n]);
                let (mut pr32, mut mr32, mut vr32) = (to_f64(&p32), vec![0.0; n], vec![0.0; n]);
                for step in 1..=5u64 {
                    let hp = AdamWStep {
                        lr: 1e-2,
                        beta1: 0.9,
                        beta2: 0.999,
                        eps: 1e-8,
                        weight_decay: wd,
                        step,
                    };
                    let g = rng.vec(n, -1.0, 1.0);
                    adamw_step(&hp, &mut p, &g, &mut m, &mut v);
                    adamw_ref(&hp, &mut pr, &g, &mut mr, &mut vr);
                    let g32 = to_f32(&g);
                    adamw_step(&hp, &mut p32, &g32, &mut m32, &mut v32);
                    adamw_ref(&hp, &mut pr32, &to_f64(&g32), &mut mr32, &mut vr32);
                }
                assert_close("adamw p", &p, &pr, 1e-12, 1e-13);
                assert_close("adamw m", &m, &mr, 1e-12, 1e-14);
                assert_close("adamw v", &v, &vr, 1e-12, 1e-14);
                assert_close("adamw p f32", &to_f64(&p32), &pr32, 1e-5, 1e-6);
                assert_close("adamw m f32", &to_f64(&m32), &mr32, 1e-5, 1e-6);
                assert_close("adamw v f32", &to_f64(&v32), &vr32, 1e-5, 1e-7);
            }
        }
    }
}

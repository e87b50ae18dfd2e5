//! AdamW composed of basic ops, and the tests that it agrees with the fused paths: the new
//! parameter and state values are computed with basic ops and copied into the buffers. The
//! arithmetic is the CPU kernel's (`meshgrad_kernels::cpu::adamw`), operation by operation in
//! the parameter's dtype (f32 or f64) with the same hyper-parameter constants rounded from f64,
//! so the results agree with it to the last bit wherever the basic ops round as the kernel does.

use super::AdamW;
use crate::ops::fallback::{optimizer_dtype, scalar_like};
use crate::{Result, Tensor};

/// See [`AdamW`]: `p *= 1 - lr wd` (when `wd != 0`), `m = b1 m + (1 - b1) g`,
/// `v = b2 v + (1 - b2) g g`, `p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)` with
/// `bc = 1 - beta^step`.
pub(super) fn step(a: &AdamW<&Tensor, &Tensor>) -> Result<()> {
    let AdamW {
        grad,
        param,
        m,
        v,
        hp,
    } = a;
    optimizer_dtype("adamw_step", param)?;
    if hp.step < 1 {
        crate::bail!("adamw_step: step counts from 1");
    }
    let t = hp.step.min(i32::MAX as u64) as i32;
    let bc1 = 1.0 - hp.beta1.powi(t);
    let bc2 = 1.0 - hp.beta2.powi(t);
    let mut p = (*param).clone();
    if hp.weight_decay != 0.0 {
        p = p.mul_scalar(1.0 - hp.lr * hp.weight_decay)?;
    }
    let mn = m
        .mul_scalar(hp.beta1)?
        .add(&grad.mul_scalar(1.0 - hp.beta1)?)?;
    let vn = v
        .mul_scalar(hp.beta2)?
        .add(&grad.mul_scalar(1.0 - hp.beta2)?.mul(grad)?)?;
    let denom = vn
        .sqrt()?
        .div(&scalar_like(bc2.sqrt(), param)?)?
        .add_scalar(hp.eps)?;
    let pn = p.sub(&mn.mul_scalar(hp.lr / bc1)?.div(&denom)?)?;
    param.copy_from(&pn)?;
    m.copy_from(&mn)?;
    v.copy_from(&vn)
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, close, rand};
    use crate::{AdamWStep, DType, Tensor};

    /// Fresh parameter, gradients of 3 steps and zero state of `dt`.
    pub(crate) fn setup(dt: DType, seed: u64) -> (Tensor, Vec<Tensor>) {
        let p = rand(&[7, 13], seed, dt);
        let grads = (0..3).map(|i| rand(&[7, 13], seed + 1 + i, dt)).collect();
        (p, grads)
    }

    #[test]
    fn adamw_matches_its_composition() {
        for (dt, rel) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            for wd in [0.0, 0.1] {
                let run = || {
                    let (p, grads) = setup(dt, 50);
                    let (m, v) = (p.zeros_like().unwrap(), p.zeros_like().unwrap());
                    for (i, g) in grads.iter().enumerate() {
                        let hp = AdamWStep {
                            lr: 1e-2,
                            beta1: 0.9,
                            beta2: 0.95,
                            eps: 1e-8,
                            weight_decay: wd,
                            step: i as u64 + 1,
                        };
                        p.adamw_step_(g, &m, &v, &hp).unwrap();
                    }
                    (p, m, v)
                };
                let (a, c) = both(run);
                let what = format!("adamw {dt} wd={wd}");
                close(&format!("{what} param"), &a.0, &c.0, rel);
                close(&format!("{what} m"), &a.1, &c.1, rel);
                close(&format!("{what} v"), &a.2, &c.2, rel);
            }
        }
    }

    #[test]
    fn half_types_are_refused_as_by_the_kernel() {
        let p = rand(&[4], 70, DType::BF16);
        let (g, m, v) = (p.clone(), p.zeros_like().unwrap(), p.zeros_like().unwrap());
        let g = g.deep_clone().unwrap();
        let hp = AdamWStep {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            step: 1,
        };
        let (a, c) = both(|| p.adamw_step_(&g, &m, &v, &hp).is_err());
        assert!(a && c);
    }
}

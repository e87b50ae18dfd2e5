//! SGD with momentum composed of basic ops, and the test that it agrees with the fused paths
//! (the arithmetic of `meshgrad_kernels::cpu::sgd::sgd_step`, as for AdamW's composition).

use super::Sgd;
use crate::ops::fallback::optimizer_dtype;
use crate::{Result, Tensor};

/// See [`Sgd`]: `g' = g + wd p`; `buf = g'` on the first step, else `momentum buf + g'`;
/// `p -= lr buf`.
pub(super) fn step(a: &Sgd<&Tensor, &Tensor>) -> Result<()> {
    let (param, buf) = (a.param, a.buf);
    optimizer_dtype("sgd_step", param)?;
    let g = a.grad.add(&param.mul_scalar(a.weight_decay)?)?;
    let nb = if a.first_step {
        g
    } else {
        buf.mul_scalar(a.momentum)?.add(&g)?
    };
    let pn = param.sub(&nb.mul_scalar(a.lr)?)?;
    param.copy_from(&pn)?;
    buf.copy_from(&nb)
}

#[cfg(test)]
mod tests {
    use crate::ops::fallback::testutil::{both, close, rand};
    use crate::DType;

    #[test]
    fn sgd_matches_its_composition() {
        for (dt, rel) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            for (momentum, wd) in [(0.0, 0.0), (0.9, 0.0), (0.9, 0.01)] {
                let run = || {
                    let p = rand(&[7, 13], 60, dt);
                    let buf = p.zeros_like().unwrap();
                    for i in 0..3 {
                        let g = rand(&[7, 13], 61 + i, dt);
                        p.sgd_step_(&g, &buf, 0.05, momentum, wd, i == 0).unwrap();
                    }
                    (p, buf)
                };
                let (a, c) = both(run);
                let what = format!("sgd {dt} momentum={momentum} wd={wd}");
                close(&format!("{what} param"), &a.0, &c.0, rel);
                close(&format!("{what} buf"), &a.1, &c.1, rel);
            }
        }
    }
}

//! Gradient checking against central finite differences in f64.

use meshgrad_tensor::{DType, Random, Result, Tensor};

use crate::{engine, Var};

/// Tolerances and step of a gradient check.
#[derive(Clone, Copy, Debug)]
pub struct GradcheckOptions {
    /// Finite-difference step.
    pub eps: f64,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
    /// Seed of the random output projection.
    pub seed: u64,
}

impl Default for GradcheckOptions {
    fn default() -> Self {
        GradcheckOptions {
            eps: 1e-6,
            atol: 1e-7,
            rtol: 1e-5,
            seed: 7,
        }
    }
}

/// Checks the analytic gradients of `f` at `inputs` against central finite differences.
///
/// Inputs are converted to f64 and made leaves. The output is projected to a scalar with fixed
/// random weights `w` (so every output element matters): `L = sum(f(x) * w)`. For every element
/// of every input, `dL/dx` from backward must match `(L(x+eps) - L(x-eps)) / 2eps` within
/// `atol + rtol * |numeric|`. Errors name the input, element and both values.
pub fn gradcheck(
    f: impl Fn(&[Var]) -> Result<Var>,
    inputs: &[Tensor],
    opts: GradcheckOptions,
) -> Result<()> {
    let xs: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<Result<_>>()?;
    let leaves: Vec<Var> = xs.iter().map(|t| Var::leaf(t.clone())).collect();
    let out = f(&leaves)?;
    let w = Random::new(opts.seed)
        .dtype(DType::F64)
        .device(out.tensor().device())
        .uniform(out.tensor().shape(), -1.0, 1.0)?;
    let loss_of =
        |o: &Tensor| -> Result<f64> { o.to_dtype(DType::F64)?.mul(&w)?.sum_all()?.item() };
    if !out.requires_grad() {
        meshgrad_tensor::bail!("gradcheck: the output does not depend on any input");
    }
    let grads = engine::grad(&[(out.clone(), w.to_dtype(out.tensor().dtype())?)], &leaves)?;

    for (i, x) in xs.iter().enumerate() {
        let analytic = match &grads[i] {
            Some(g) => g.to_vec_f64()?,
            None => vec![0.0; x.elem_count()],
        };
        let base = x.to_vec_f64()?;
        for e in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[e] += delta;
                let perturbed: Vec<Var> = xs
                    .iter()
                    .enumerate()
                    .map(|(j, t)| {
                        if j == i {
                            Tensor::from_vec(v.clone(), t.shape(), t.device()).map(Var::constant)
                        } else {
                            Ok(Var::constant(t.clone()))
                        }
                    })
                    .collect::<Result<_>>()?;
                loss_of(f(&perturbed)?.tensor())
            };
            let numeric = (eval(opts.eps)? - eval(-opts.eps)?) / (2.0 * opts.eps);
            let a = analytic[e];
            if (a - numeric).abs() > opts.atol + opts.rtol * numeric.abs() {
                meshgrad_tensor::bail!(
                    "gradcheck: input {i} (shape {}), element {e}: analytic {a:.10e} vs numeric {numeric:.10e}",
                    x.shape()
                );
            }
        }
    }
    Ok(())
}

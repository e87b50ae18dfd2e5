//! The fully connected layer (`x Wᵀ + bias`) and its GELU-fused form, with their backward
//! rules.

use meshgrad_tensor::{GeluKind, Result};

use crate::Var;

impl Var {
    /// The fully connected layer `x Wᵀ + bias` (`x [..., in]`, `weight [out, in]`, `bias [out]`)
    /// as one fused op (see [`Tensor::linear`](meshgrad_tensor::Tensor::linear)). The backward
    /// is three products over all rows: `dx = dy W`, `dW = dyᵀ x` (computed straight into the
    /// weight's `[out, in]` layout) and `dbias = Σ_rows dy`, each only when wanted (see
    /// [`BackwardFn`](crate::BackwardFn)): the split backward's input pass computes `dx` alone,
    /// its weight pass `dW` and `dbias`.
    pub fn linear(x: &Var, weight: &Var, bias: Option<&Var>) -> Result<Var> {
        let (xt, wt) = (x.tensor().clone(), weight.tensor().clone());
        let v = xt.linear(&wt, bias.map(|b| b.tensor()))?;
        let mut inputs: Vec<&Var> = vec![x, weight];
        inputs.extend(bias);
        let has_bias = bias.is_some();
        Ok(Var::from_op(
            "linear",
            v,
            &inputs,
            Box::new(move |g, wanted| {
                let want_bias = has_bias && wanted[2];
                let (gx, gw, gb) = xt.linear_backward(&wt, g, (wanted[0], wanted[1], want_bias))?;
                let mut grads = vec![gx, gw];
                if has_bias {
                    grads.push(gb);
                }
                Ok(grads)
            }),
        ))
    }

    /// `gelu(x Wᵀ + bias)` (shapes as for [`Var::linear`]) as one fused op (see
    /// [`Tensor::linear_gelu`](meshgrad_tensor::Tensor::linear_gelu)): the same values and gradients as `Var::linear` followed by
    /// [`Var::gelu`], bit for bit where the backend composes them (the CPU), with one GEMM and
    /// no separate GELU pass where it fuses them (cuBLASLt's GELU epilogue). The node keeps the
    /// pre-activation (as the unfused `gelu` node would); its backward computes
    /// `dpre = gelu_backward(pre, dy)`, then the linear backward from `dpre` (each of `dx`,
    /// `dW`, `dbias` only when wanted). In a split backward both passes compute `dpre` (one
    /// elementwise pass each).
    pub fn linear_gelu(x: &Var, weight: &Var, bias: Option<&Var>, kind: GeluKind) -> Result<Var> {
        let (xt, wt) = (x.tensor().clone(), weight.tensor().clone());
        let (y, pre) = xt.linear_gelu(&wt, bias.map(|b| b.tensor()), kind)?;
        let mut inputs: Vec<&Var> = vec![x, weight];
        inputs.extend(bias);
        let has_bias = bias.is_some();
        Ok(Var::from_op(
            "linear_gelu",
            y,
            &inputs,
            Box::new(move |g, wanted| {
                let want_bias = has_bias && wanted[2];
                let dpre = pre.gelu_backward(g, kind)?;
                let (gx, gw, gb) =
                    xt.linear_backward(&wt, &dpre, (wanted[0], wanted[1], want_bias))?;
                let mut grads = vec![gx, gw];
                if has_bias {
                    grads.push(gb);
                }
                Ok(grads)
            }),
        ))
    }
}

#[cfg(test)]
mod tests {
    use meshgrad_tensor::{DType, Random, Tensor};

    use crate::{gradcheck, GradcheckOptions, Var};

    #[test]
    fn linear_matches_matmul_plus_bias_and_finite_differences() {
        let f64s = |seed| Random::new(seed).dtype(DType::F64);
        let x = f64s(1).normal((2, 3, 4), 0.0, 1.0).unwrap();
        let w = f64s(2).normal((5, 4), 0.0, 1.0).unwrap();
        let b = f64s(3).normal(5, 0.0, 1.0).unwrap();
        let fused = |xs: &[Var]| Var::linear(&xs[0], &xs[1], Some(&xs[2]));
        let plain = |xs: &[Var]| xs[0].matmul(&xs[1].transpose(0, 1)?)?.add(&xs[2]);
        let no_bias = |xs: &[Var]| Var::linear(&xs[0], &xs[1], None);
        let inputs = [x.clone(), w.clone(), b.clone()];
        gradcheck(fused, &inputs, GradcheckOptions::default()).unwrap();
        gradcheck(no_bias, &inputs[..2], GradcheckOptions::default()).unwrap();
        // A strided (transposed) weight view is read through its strides.
        let wt = w.t().unwrap().contiguous().unwrap();
        let through_view = |xs: &[Var]| Var::linear(&xs[0], &xs[1].transpose(0, 1)?, Some(&xs[2]));
        gradcheck(
            through_view,
            &[x.clone(), wt, b.clone()],
            GradcheckOptions::default(),
        )
        .unwrap();

        let va: Vec<Var> = inputs.iter().map(|t| Var::leaf(t.clone())).collect();
        let vb: Vec<Var> = inputs.iter().map(|t| Var::leaf(t.clone())).collect();
        let (ya, yb) = (fused(&va).unwrap(), plain(&vb).unwrap());
        let close = |p: &Tensor, q: &Tensor| {
            let (p, q) = (p.to_vec_f64().unwrap(), q.to_vec_f64().unwrap());
            assert_eq!(p.len(), q.len());
            for (a, b) in p.iter().zip(&q) {
                assert!((a - b).abs() < 1e-12, "{a} vs {b}");
            }
        };
        close(ya.tensor(), yb.tensor());
        ya.sum_all().unwrap().backward().unwrap();
        yb.sum_all().unwrap().backward().unwrap();
        for (a, b) in va.iter().zip(&vb) {
            close(&a.grad().unwrap(), &b.grad().unwrap());
            assert!(a.grad().unwrap().is_contiguous());
        }
    }
}

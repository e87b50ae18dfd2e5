//! Matmul and the fused neural-network ops, with their backward rules.

use meshgrad_tensor::{GeluKind, Result, Tensor};

use crate::Var;

/// Parameters of one dropout application. The mask of element `i` (row-major) is the
/// counter-based draw `(seed, start + i)`: it does not depend on sharding, and re-running the
/// same spec (as activation checkpointing does) reproduces the same mask.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutSpec {
    /// Drop probability in `[0, 1)`.
    pub p: f64,
    /// Stream seed (derive it from the run seed, the step and the layer).
    pub seed: u64,
    /// Global index of this tensor's first element.
    pub start: u64,
}

impl Var {
    /// `self @ rhs` with broadcast batch dims. The backward computes only the wanted inputs'
    /// gradients (see [`BackwardFn`](crate::BackwardFn)).
    pub fn matmul(&self, rhs: &Var) -> Result<Var> {
        let (a, b) = (self.tensor().clone(), rhs.tensor().clone());
        let v = a.matmul(&b)?;
        Ok(Var::from_op(
            "matmul",
            v,
            &[self, rhs],
            Box::new(move |g, wanted| {
                let (ra, rb) = (wanted[0], wanted[1]);
                let ga = if ra {
                    Some(g.matmul(&b.t()?)?.sum_to_shape(a.shape())?)
                } else {
                    None
                };
                let gb = if rb {
                    let (k, n) = (b.dims()[b.rank() - 2], b.dims()[b.rank() - 1]);
                    if b.rank() == 2 && a.rank() > 2 {
                        // Fold the batch into rows: one [K, rows] @ [rows, N] product.
                        let a2 = a.reshape((a.elem_count() / k, k))?;
                        let g2 = g.reshape((g.elem_count() / n, n))?;
                        Some(a2.t()?.matmul(&g2)?)
                    } else {
                        Some(a.t()?.matmul(g)?.sum_to_shape(b.shape())?)
                    }
                } else {
                    None
                };
                Ok(vec![ga, gb])
            }),
        ))
    }

    /// The fully connected layer `x Wᵀ + bias` (`x [..., in]`, `weight [out, in]`, `bias [out]`)
    /// as one fused op (see [`Tensor::linear`]). The backward is three products over all rows:
    /// `dx = dy W`, `dW = dyᵀ x` (computed straight into the weight's `[out, in]` layout) and
    /// `dbias = Σ_rows dy`, each only when wanted (see [`BackwardFn`](crate::BackwardFn)): the
    /// split backward's input pass computes `dx` alone, its weight pass `dW` and `dbias`.
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
    /// [`Tensor::linear_gelu`]): the same values and gradients as `Var::linear` followed by
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

    /// Softmax along `dim`.
    pub fn softmax(&self, dim: isize) -> Result<Var> {
        let v = self.tensor().softmax(dim)?;
        let y = v.clone();
        Ok(Var::from_op(
            "softmax",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(y.softmax_backward(g, dim, false)?)])),
        ))
    }

    /// Log-softmax along `dim`.
    pub fn log_softmax(&self, dim: isize) -> Result<Var> {
        let v = self.tensor().log_softmax(dim)?;
        let y = v.clone();
        Ok(Var::from_op(
            "log_softmax",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(y.softmax_backward(g, dim, true)?)])),
        ))
    }

    /// Layer norm over the last dim with optional affine weight and bias (fused forward and
    /// backward). A bias without a weight is refused.
    pub fn layer_norm(&self, weight: Option<&Var>, bias: Option<&Var>, eps: f64) -> Result<Var> {
        if bias.is_some() && weight.is_none() {
            meshgrad_tensor::bail!("layer_norm: a bias needs a weight");
        }
        let x = self.tensor().clone();
        let w = weight.map(|w| w.tensor().clone());
        let out = x.layer_norm(w.as_ref(), bias.map(|b| b.tensor()), eps)?;
        let (mean, rstd) = (out.mean, out.rstd);
        let mut inputs: Vec<&Var> = vec![self];
        inputs.extend(weight);
        inputs.extend(bias);
        let has_bias = bias.is_some();
        Ok(Var::from_op(
            "layer_norm",
            out.y,
            &inputs,
            Box::new(move |g, _| {
                let (dx, pg) = x.layer_norm_backward(w.as_ref(), &mean, &rstd, g)?;
                let mut grads = vec![Some(dx)];
                if let Some((dw, db)) = pg {
                    grads.push(Some(dw));
                    if has_bias {
                        grads.push(Some(db));
                    }
                }
                Ok(grads)
            }),
        ))
    }

    /// Mean cross-entropy of `self` (logits `[..., V]`, classes in the last dim, for example
    /// `[B, T, V]` or `[N, V]`) against integer `targets` shaped like the leading dims (`[B, T]`
    /// or `[N]`), over the positions whose target is not `ignore_index` (0 when every position
    /// is ignored). Fused: the leading dims are folded into rows of one kernel, and the gradient
    /// is computed from the saved per-position log-sum-exp, never from stored probabilities.
    ///
    /// Errors: a targets shape other than the logits' leading dims (naming both shapes),
    /// non-integer targets, or a target outside `0..V` that is not `ignore_index`.
    pub fn cross_entropy(&self, targets: &Tensor, ignore_index: Option<i64>) -> Result<Var> {
        let logits = self.tensor().clone();
        let (rows, lse) = logits.cross_entropy_rows(targets, ignore_index)?;
        let count = match ignore_index {
            None => targets.elem_count(),
            Some(ix) => targets
                .to_vec_f64()?
                .iter()
                .filter(|&&t| t as i64 != ix)
                .count(),
        };
        let scale = 1.0 / count.max(1) as f64;
        let v = rows.sum_all()?.mul_scalar(scale)?;
        let targets = targets.clone();
        Ok(Var::from_op(
            "cross_entropy",
            v,
            &[self],
            Box::new(move |g, _| {
                let dloss = g
                    .to_dtype(lse.dtype())?
                    .mul_scalar(scale)?
                    .expand(lse.shape().clone())?
                    .contiguous()?;
                Ok(vec![Some(logits.cross_entropy_backward(
                    &lse,
                    &targets,
                    &dloss,
                    ignore_index,
                )?)])
            }),
        ))
    }

    /// Rows of `table` (`[vocab, dim]`) picked by integer `ids`; the gradient scatter-adds back.
    pub fn embedding(table: &Var, ids: &Tensor) -> Result<Var> {
        let v = table.tensor().embedding(ids)?;
        let ids = ids.clone();
        let vocab = table.tensor().dims()[0];
        let dtype = table.tensor().dtype();
        Ok(Var::from_op(
            "embedding",
            v,
            &[table],
            Box::new(move |g, _| {
                Ok(vec![Some(
                    g.embedding_backward(&ids, vocab)?.to_dtype(dtype)?,
                )])
            }),
        ))
    }

    /// Dropout with a counter-based mask (see [`DropoutSpec`]); identity when `p == 0`.
    pub fn dropout(&self, spec: DropoutSpec) -> Result<Var> {
        if spec.p == 0.0 {
            return Ok(self.clone());
        }
        let x = self.tensor();
        let mask = Tensor::dropout_mask(
            spec.seed,
            spec.start,
            spec.p,
            x.shape(),
            x.dtype(),
            x.device(),
        )?;
        let v = x.mul(&mask)?;
        Ok(Var::from_op(
            "dropout",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.mul(&mask)?)])),
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

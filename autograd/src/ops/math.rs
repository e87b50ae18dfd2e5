//! `sin`, `cos`, `silu`, `clamp` and `logsumexp` on [`Var`], with their backward rules.

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `sin x`; the gradient is `g cos x`.
    pub fn sin(&self) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.sin()?;
        Ok(Var::from_op(
            "sin",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.mul(&x.cos()?)?)])),
        ))
    }

    /// `cos x`; the gradient is `-g sin x`.
    pub fn cos(&self) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.cos()?;
        Ok(Var::from_op(
            "cos",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.mul(&x.sin()?)?.neg()?)])),
        ))
    }

    /// SiLU `x * sigmoid(x)` as one fused op, with the exact fused backward
    /// `g s (1 + x (1 - s))`, `s = sigmoid(x)` (see [`Tensor::silu_backward`]).
    pub fn silu(&self) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.silu()?;
        Ok(Var::from_op(
            "silu",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(x.silu_backward(g)?)])),
        ))
    }

    /// Clamps to `[min, max]` (`None`: unbounded on that side; see [`Tensor::clamp`]). The
    /// gradient passes where `min <= x <= max`, bounds included (PyTorch's convention), and is
    /// 0 elsewhere. An error if both bounds are `None` or `min > max`.
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Var> {
        let x = self.tensor().clone();
        let v = x.clamp(min, max)?;
        Ok(Var::from_op(
            "clamp",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(x.clamp_backward(g, min, max)?)])),
        ))
    }

    /// Stable `ln Σ exp(x)` along `dim` (see [`Tensor::logsumexp`]). The gradient is
    /// `softmax(x)` along `dim` times the upstream gradient broadcast over `dim`, computed as
    /// `exp(x - lse) * g` from the saved result.
    pub fn logsumexp(&self, dim: isize, keepdim: bool) -> Result<Var> {
        let x = self.tensor().clone();
        let d = x.dim("logsumexp", dim)?;
        let v = x.logsumexp(dim, keepdim)?;
        let mut kept = x.dims().to_vec();
        kept[d] = 1;
        let lse: Tensor = v.reshape(kept.clone())?;
        Ok(Var::from_op(
            "logsumexp",
            v,
            &[self],
            Box::new(move |g, _| {
                let p = x.sub(&lse)?.exp()?;
                Ok(vec![Some(p.mul(&g.reshape(kept.clone())?)?)])
            }),
        ))
    }
}

//! The fused ops of Llama-style models with their backward rules: RMSNorm, rotary position
//! embedding, SwiGLU.

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// RMSNorm over the last dim, `x / sqrt(mean(x²) + eps) * weight` with an optional weight
    /// `[C]` (see [`Tensor::rms_norm`]; `eps` must be `>= 0` and finite). Fused forward and
    /// backward; the weight's gradient is computed only when it requires one.
    pub fn rms_norm(&self, weight: Option<&Var>, eps: f64) -> Result<Var> {
        let x = self.tensor().clone();
        let w = weight.map(|w| w.tensor().clone());
        let out = x.rms_norm(w.as_ref(), eps)?;
        let rstd = out.rstd;
        let mut inputs: Vec<&Var> = vec![self];
        inputs.extend(weight);
        let weight_grad = weight.is_some_and(|w| w.requires_grad());
        let has_weight = weight.is_some();
        Ok(Var::from_op(
            "rms_norm",
            out.y,
            &inputs,
            Box::new(move |g, _| {
                let (dx, dw) = x.rms_norm_backward(w.as_ref(), &rstd, g, weight_grad)?;
                let mut grads = vec![Some(dx)];
                if has_weight {
                    grads.push(dw);
                }
                Ok(grads)
            }),
        ))
    }

    /// Rotary position embedding of `self` (`[B, T, H, D]`) at integer `positions [T]` with base
    /// `theta`, in Hugging Face Llama's "rotate half" convention (see
    /// [`Tensor::rotary_embedding`]). The backward rotates the gradient by the negative angles.
    pub fn rotary_embedding(&self, positions: &Tensor, theta: f64) -> Result<Var> {
        let v = self.tensor().rotary_embedding(positions, theta)?;
        let positions = positions.clone();
        Ok(Var::from_op(
            "rotary_embedding",
            v,
            &[self],
            Box::new(move |g, _| Ok(vec![Some(g.rotary_embedding_backward(&positions, theta)?)])),
        ))
    }

    /// SwiGLU, `silu(gate) * up` with `silu(x) = x * sigmoid(x)` (Llama's MLP gate), fused
    /// forward and backward (see [`Tensor::swiglu`]); `gate` and `up` have one shape.
    pub fn swiglu(gate: &Var, up: &Var) -> Result<Var> {
        let (gt, ut) = (gate.tensor().clone(), up.tensor().clone());
        let v = Tensor::swiglu(&gt, &ut)?;
        let (rg, ru) = (gate.requires_grad(), up.requires_grad());
        Ok(Var::from_op(
            "swiglu",
            v,
            &[gate, up],
            Box::new(move |g, _| {
                let (dg, du) = Tensor::swiglu_backward(&gt, &ut, g)?;
                Ok(vec![rg.then_some(dg), ru.then_some(du)])
            }),
        ))
    }
}

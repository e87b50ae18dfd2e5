//! RMSNorm over the last dim with its backward rule (Llama's norm).

use meshgrad_tensor::Result;

use crate::Var;

impl Var {
    /// RMSNorm over the last dim, `x / sqrt(mean(x²) + eps) * weight` with an optional weight
    /// `[C]` (see [`Tensor::rms_norm`](meshgrad_tensor::Tensor::rms_norm); `eps` must be `>= 0` and finite). Fused forward and
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
}

//! Layer norm over the last dim (fused forward and backward).

use meshgrad_tensor::Result;

use crate::Var;

impl Var {
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
}

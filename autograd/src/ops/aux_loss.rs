//! An auxiliary loss that reaches the backward without being added to the model's output: the
//! identity on `x` whose backward also sends a fixed gradient to a scalar `aux` (Megatron-LM's
//! `MoEAuxLossAutoScaler`). A layer deep inside a pipeline stage can so add `weight * aux` to
//! the training objective although only the last stage computes the loss.

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
    /// `self` unchanged; in the backward, `self` passes its gradient through and the scalar
    /// `aux` receives the gradient `weight`, whatever `self`'s gradient is: the gradients are
    /// those of `L + weight * aux` for the loss `L` the backward starts from. The backward runs
    /// only when `self` receives a gradient, so `self` must lie on the path to the loss (a
    /// layer's output). Errors: `aux` not a single element.
    pub fn attach_aux_loss(&self, aux: &Var, weight: f64) -> Result<Var> {
        let at = aux.tensor();
        if at.elem_count() != 1 {
            meshgrad_tensor::bail!(
                "attach_aux_loss: the auxiliary loss must be one element, got shape {}",
                at.shape()
            );
        }
        let (shape, dtype, device) = (at.shape().clone(), at.dtype(), at.device());
        let (rx, ra) = (self.requires_grad(), aux.requires_grad());
        Ok(Var::from_op(
            "attach_aux_loss",
            self.tensor().clone(),
            &[self, aux],
            // The mask is ignored: both gradients are cheap, and the split backward's input
            // pass needs `aux`'s (it reaches the activations through the router).
            Box::new(move |g, _| {
                let ga = if ra {
                    Some(Tensor::full(weight, shape.clone(), dtype, device)?)
                } else {
                    None
                };
                Ok(vec![rx.then(|| g.clone()), ga])
            }),
        ))
    }
}

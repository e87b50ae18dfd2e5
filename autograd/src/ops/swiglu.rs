//! SwiGLU, `silu(gate) * up`, with its backward rule (Llama's MLP gate).

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
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

//! Rotary position embedding with its backward rule (Llama's positions).

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

impl Var {
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
}

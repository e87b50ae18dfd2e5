//! Custom autograd functions: a forward and its backward defined together.

use std::sync::Arc;

use meshgrad_tensor::{Result, Tensor};

use crate::Var;

/// An op defined outside the crate, with its forward and backward side by side. Communication
/// ops (all-reduce in forward, identity in backward, and so on) are written this way.
pub trait Function: Send + Sync + 'static {
    /// A short name for errors and graph dumps.
    fn name(&self) -> &'static str;
    /// Computes the output from the input values.
    fn forward(&self, inputs: &[Tensor]) -> Result<Tensor>;
    /// From the output gradient (and the saved inputs and output), the gradient of each input.
    fn backward(
        &self,
        inputs: &[Tensor],
        output: &Tensor,
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>>;
}

/// Applies a custom function to variables, recording it in the graph.
pub fn apply(f: Arc<dyn Function>, inputs: &[&Var]) -> Result<Var> {
    let xs: Vec<Tensor> = inputs.iter().map(|v| v.tensor().clone()).collect();
    let out = f.forward(&xs)?;
    let saved = out.clone();
    let name = f.name();
    Ok(Var::from_op(
        name,
        out,
        inputs,
        Box::new(move |g, _| f.backward(&xs, &saved, g)),
    ))
}

//! Dropout with a counter-based mask, reproducible under sharding and recomputation.

use meshgrad_tensor::{Result, Tensor};

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

//! The GPT-2 feed-forward block.

use meshgrad_autograd::Var;
use meshgrad_tensor::{GeluKind, Result};

use super::{Dropout, Linear, LinearConfig};
use crate::module::Forward;
use crate::param_builder::ParamBuilder;

/// `dropout(c_proj(gelu(c_fc(x))))` with a 4x hidden width.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct Mlp {
    /// Up-projection `[4C, C]`.
    pub c_fc: Linear,
    /// Down-projection `[C, 4C]`.
    pub c_proj: Linear,
    /// Dropout after the down-projection.
    pub dropout: Dropout,
    /// The GELU variant (GPT-2 uses the tanh approximation).
    pub gelu: GeluKind,
}

impl Mlp {
    /// Width `n_embd`; `proj_std` is the down-projection's init std.
    pub fn new(
        p: &ParamBuilder,
        n_embd: usize,
        bias: bool,
        dropout: f64,
        proj_std: f64,
    ) -> Result<Self> {
        Ok(Mlp {
            c_fc: LinearConfig::new(n_embd, 4 * n_embd).bias(bias).build(p)?,
            c_proj: LinearConfig::new(4 * n_embd, n_embd)
                .bias(bias)
                .std(proj_std)
                .build(p)?,
            dropout: Dropout::on_sequence(dropout, p)?,
            gelu: GeluKind::Tanh,
        })
    }
}

impl Forward for Mlp {
    fn forward(&self, x: &Var) -> Result<Var> {
        // The GELU fused into c_fc's product (cuBLASLt's epilogue on CUDA; the same ops and
        // bits as `c_fc.forward(x)?.gelu(..)` on the CPU).
        let h = self.c_fc.forward_gelu(x, self.gelu)?;
        self.dropout.forward(&self.c_proj.forward(&h)?)
    }
}

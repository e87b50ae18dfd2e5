//! The transformer MLP: Linear(C, 4C), GELU (tanh form), Linear(4C, C), dropout.

use meshgrad_autograd::Var;
use meshgrad_tensor::{GeluKind, Result};

use super::{Dropout, ForwardCtx, Linear};
use crate::module::{join, Module, ParamFactory};

/// GPT-2's feed-forward block.
pub struct Mlp {
    /// `[4C, C]`
    pub c_fc: Linear,
    /// `[C, 4C]`
    pub c_proj: Linear,
    /// Output dropout.
    pub dropout: Dropout,
    /// GELU form.
    pub gelu: GeluKind,
}

impl Mlp {
    /// A new MLP named `name`.
    pub fn new(
        f: &ParamFactory,
        name: &str,
        n_embd: usize,
        bias: bool,
        dropout: f64,
        proj_std: f64,
    ) -> Result<Self> {
        Ok(Mlp {
            c_fc: Linear::new(f, &join(name, "c_fc"), n_embd, 4 * n_embd, bias, 0.02)?,
            c_proj: Linear::new(f, &join(name, "c_proj"), 4 * n_embd, n_embd, bias, proj_std)?,
            dropout: Dropout::new(f.seed, &join(name, "dropout"), dropout),
            gelu: GeluKind::Tanh,
        })
    }

    /// `x [..., C]` -> `[..., C]`.
    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let h = self.c_fc.forward(x)?.gelu(self.gelu)?;
        self.dropout.forward(&self.c_proj.forward(&h)?, ctx)
    }
}

impl Module for Mlp {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var)) {
        self.c_fc.visit_params(&join(prefix, "c_fc"), f);
        self.c_proj.visit_params(&join(prefix, "c_proj"), f);
    }
    fn set_training(&self, training: bool) {
        self.dropout.set_training(training);
    }
}

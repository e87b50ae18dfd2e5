//! The pre-LayerNorm transformer block.

use std::sync::Arc;

use meshgrad_autograd::{checkpoint, Var};
use meshgrad_tensor::Result;

use super::{CausalSelfAttention, ForwardCtx, LayerNorm, Mlp};
use crate::module::{join, Module, ParamFactory};

/// `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
pub struct Block {
    /// Norm before attention.
    pub ln_1: LayerNorm,
    /// Self-attention.
    pub attn: CausalSelfAttention,
    /// Norm before the MLP.
    pub ln_2: LayerNorm,
    /// Feed-forward.
    pub mlp: Mlp,
}

/// The block's hyper-parameters.
#[derive(Clone, Copy, Debug)]
pub struct BlockConfig {
    /// Model width.
    pub n_embd: usize,
    /// Heads.
    pub n_head: usize,
    /// Linear and norm biases.
    pub bias: bool,
    /// Dropout probability.
    pub dropout: f64,
    /// Init std of the residual projections.
    pub proj_std: f64,
    /// Layer-norm epsilon.
    pub eps: f64,
}

impl Block {
    /// A new block named `name`.
    pub fn new(f: &ParamFactory, name: &str, c: BlockConfig) -> Result<Self> {
        Ok(Block {
            ln_1: LayerNorm::new(f, &join(name, "ln_1"), c.n_embd, c.bias, c.eps)?,
            attn: CausalSelfAttention::new(
                f,
                &join(name, "attn"),
                c.n_embd,
                c.n_head,
                c.bias,
                c.dropout,
                c.proj_std,
            )?,
            ln_2: LayerNorm::new(f, &join(name, "ln_2"), c.n_embd, c.bias, c.eps)?,
            mlp: Mlp::new(
                f,
                &join(name, "mlp"),
                c.n_embd,
                c.bias,
                c.dropout,
                c.proj_std,
            )?,
        })
    }

    /// `x [B, T, C]` -> `[B, T, C]`.
    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let x = x.add(&self.attn.forward(&self.ln_1.forward(x)?, ctx)?)?;
        x.add(&self.mlp.forward(&self.ln_2.forward(&x)?, ctx)?)
    }

    /// As [`Block::forward`], but keeps only the block's input and recomputes its activations
    /// during backward (activation checkpointing).
    pub fn forward_checkpointed(self: &Arc<Self>, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let me = self.clone();
        let ctx = *ctx;
        checkpoint(
            Arc::new(move |xs: &[Var]| me.forward(&xs[0], &ctx)),
            std::slice::from_ref(x),
        )
    }
}

impl Module for Block {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var)) {
        self.ln_1.visit_params(&join(prefix, "ln_1"), f);
        self.attn.visit_params(&join(prefix, "attn"), f);
        self.ln_2.visit_params(&join(prefix, "ln_2"), f);
        self.mlp.visit_params(&join(prefix, "mlp"), f);
    }
    fn set_training(&self, training: bool) {
        self.attn.set_training(training);
        self.mlp.set_training(training);
    }
}

//! The pre-LayerNorm transformer block.

use std::sync::Arc;

use meshgrad_autograd::{checkpoint, Var};
use meshgrad_tensor::Result;

use super::{CausalSelfAttention, LayerNorm, Mlp};
use crate::module::Forward;
use crate::param_builder::ParamBuilder;

/// `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(crate::Module)]
#[module(crate = crate)]
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
    /// A new block.
    pub fn new(p: &ParamBuilder, c: BlockConfig) -> Result<Self> {
        Ok(Block {
            ln_1: LayerNorm::new(p, c.n_embd, c.bias, c.eps)?,
            attn: CausalSelfAttention::new(p, c.n_embd, c.n_head, c.bias, c.dropout, c.proj_std)?,
            ln_2: LayerNorm::new(p, c.n_embd, c.bias, c.eps)?,
            mlp: Mlp::new(p, c.n_embd, c.bias, c.dropout, c.proj_std)?,
        })
    }

    /// As [`Forward::forward`], but keeps only the block's input and recomputes its activations
    /// during backward (activation checkpointing).
    pub fn forward_checkpointed(self: &Arc<Self>, x: &Var) -> Result<Var> {
        let me = self.clone();
        checkpoint(
            Arc::new(move |xs: &[Var]| me.forward(&xs[0])),
            std::slice::from_ref(x),
        )
    }
}

impl Forward for Block {
    /// `x [B, T, C]` -> `[B, T, C]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        let x = x.add(&self.attn.forward(&self.ln_1.forward(x)?)?)?;
        x.add(&self.mlp.forward(&self.ln_2.forward(&x)?)?)
    }
}

//! Causal multi-head self-attention (GPT-2 layout: one fused qkv projection).

use meshgrad_autograd::Var;
use meshgrad_tensor::{AttentionMask, Result};

use super::{Dropout, ForwardCtx, Linear};
use crate::module::{join, Module, ParamFactory};

/// Causal multi-head self-attention with a fused `c_attn` (qkv) projection and an output
/// projection `c_proj`; attention itself is the fused flash-style kernel.
pub struct CausalSelfAttention {
    /// `[3C, C]` qkv projection.
    pub c_attn: Linear,
    /// `[C, C]` output projection.
    pub c_proj: Linear,
    /// Residual dropout.
    pub resid_dropout: Dropout,
    /// Number of heads.
    pub n_head: usize,
}

impl CausalSelfAttention {
    /// A new attention layer named `name`; `proj_std` initialises `c_proj` (GPT-2 scales it by
    /// `1/sqrt(2 n_layer)`).
    pub fn new(
        f: &ParamFactory,
        name: &str,
        n_embd: usize,
        n_head: usize,
        bias: bool,
        dropout: f64,
        proj_std: f64,
    ) -> Result<Self> {
        if n_head == 0 || !n_embd.is_multiple_of(n_head) {
            meshgrad_tensor::bail!(
                "attention: n_embd {n_embd} is not divisible by n_head {n_head}"
            );
        }
        Ok(CausalSelfAttention {
            c_attn: Linear::new(f, &join(name, "c_attn"), n_embd, 3 * n_embd, bias, 0.02)?,
            c_proj: Linear::new(f, &join(name, "c_proj"), n_embd, n_embd, bias, proj_std)?,
            resid_dropout: Dropout::new(f.seed, &join(name, "resid_dropout"), dropout),
            n_head,
        })
    }

    /// `x [B, T, C]` -> `[B, T, C]`.
    pub fn forward(&self, x: &Var, ctx: &ForwardCtx) -> Result<Var> {
        let dims = x.tensor().dims().to_vec();
        if dims.len() != 3 {
            meshgrad_tensor::bail!(
                "attention: expected input [B, T, C], got {}",
                x.tensor().shape()
            );
        }
        let (h, d) = (self.n_head, dims[2] / self.n_head);
        let qkv = self.c_attn.forward(x)?;
        // q, k and v are read straight out of the fused projection and the heads come back side
        // by side as [B, T, C]: no split, transpose or copy.
        let y = Var::attention_qkv(&qkv, h, &AttentionMask::causal(), 1.0 / (d as f64).sqrt())?;
        self.resid_dropout.forward(&self.c_proj.forward(&y)?, ctx)
    }
}

impl Module for CausalSelfAttention {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var)) {
        self.c_attn.visit_params(&join(prefix, "c_attn"), f);
        self.c_proj.visit_params(&join(prefix, "c_proj"), f);
    }
    fn set_training(&self, training: bool) {
        self.resid_dropout.set_training(training);
    }
}

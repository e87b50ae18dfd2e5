//! Causal multi-head self-attention (GPT-2 style, fused qkv projection); ring attention over a
//! context-parallel group when the model is built for one ([`crate::cp`]).

use meshgrad_autograd::Var;
use meshgrad_tensor::{AttentionMask, Result};

use super::{Dropout, Linear, LinearConfig};
use crate::cp::ContextParallel;
use crate::module::Forward;
use crate::param_builder::ParamBuilder;

/// `c_proj(attention(split_heads(c_attn(x))))` with a causal mask, then residual dropout.
/// `c_attn` maps `C -> 3C` (`[q | k | v]`, heads contiguous within each).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct CausalSelfAttention {
    /// Fused q/k/v projection `[3C, C]`.
    pub c_attn: Linear,
    /// Output projection `[C, C]`.
    pub c_proj: Linear,
    /// Dropout after the output projection.
    pub resid_dropout: Dropout,
    /// Number of heads.
    pub n_head: usize,
    /// The context-parallel group the sequence is split over (from the builder), if any.
    pub cp: Option<ContextParallel>,
}

impl CausalSelfAttention {
    /// Width `n_embd` split into `n_head` heads; `proj_std` is the output projection's init std.
    pub fn new(
        p: &ParamBuilder,
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
            c_attn: LinearConfig::new(n_embd, 3 * n_embd).bias(bias).build(p)?,
            c_proj: LinearConfig::new(n_embd, n_embd)
                .bias(bias)
                .std(proj_std)
                .build(p)?,
            resid_dropout: Dropout::on_sequence(dropout, p)?,
            n_head,
            cp: p.context_parallel_group().cloned(),
        })
    }
}

impl Forward for CausalSelfAttention {
    /// `x [B, T, C]` -> `[B, T, C]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        let dims = x.tensor().dims().to_vec();
        if dims.len() != 3 {
            meshgrad_tensor::bail!(
                "attention {}: expected input [B, T, C], got {}",
                self.c_attn.path().trim_end_matches(".c_attn"),
                x.tensor().shape()
            );
        }
        // Under tensor parallelism c_attn holds this rank's heads of q, k and v.
        let d = dims[2] / self.n_head;
        let h = self.c_attn.weight.tensor().dims()[0] / (3 * d);
        let qkv = self.c_attn.forward(x)?;
        // q, k and v are read straight out of the fused projection and the heads come back side
        // by side as [B, T, C]: no split, transpose or copy.
        let scale = 1.0 / (d as f64).sqrt();
        let y = match self.cp.as_ref().filter(|cp| cp.is_active()) {
            // Context parallelism (or reference mode's folded position order): this rank's
            // heads of q, k, v as [B, h, T, d], ring (or folded) attention, heads back side by
            // side.
            Some(cp) => {
                // The projection's rows: under sequence parallelism the gathered sequence.
                let (b, t) = (dims[0], qkv.tensor().dims()[1]);
                let parts = qkv.split(&[h * d, h * d, h * d], -1)?;
                let heads = |v: &Var| v.reshape((b, t, h, d))?.transpose(1, 2);
                cp.causal_attention(
                    &heads(&parts[0])?,
                    &heads(&parts[1])?,
                    &heads(&parts[2])?,
                    scale,
                )?
                .transpose(1, 2)?
                .reshape((b, t, h * d))?
            }
            None => Var::attention_qkv(&qkv, h, &AttentionMask::causal(), scale)?,
        };
        self.resid_dropout.forward(&self.c_proj.forward(&y)?)
    }
}

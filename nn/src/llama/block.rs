//! The Llama decoder layer: grouped-query attention with rotary embeddings, the SwiGLU MLP, and
//! the pre-RMSNorm residual block around them (Hugging Face `LlamaDecoderLayer`).

use std::sync::Arc;

use meshgrad_autograd::{checkpoint, Var};
use meshgrad_tensor::{AttentionMask, Result};

use super::rope::{self, RopeAngles};
use super::LlamaConfig;
use crate::cp::ContextParallel;
use crate::layers::{Linear, LinearConfig, RmsNorm};
use crate::module::Forward;
use crate::moe::SparseMoe;
use crate::param_builder::ParamBuilder;

/// A bias-free linear with Hugging Face Llama's initialisation, N(0, 0.02) (Mixtral's experts
/// and router too).
pub(crate) fn proj(p: &ParamBuilder, in_features: usize, out_features: usize) -> Result<Linear> {
    LinearConfig::new(in_features, out_features)
        .bias(false)
        .std(0.02)
        .build(p)
}

/// Causal self-attention with rotary embeddings on q and k and grouped-query attention (`self_attn`).
///
/// Under tensor parallelism q/k/v are column-parallel and `o_proj` row-parallel: each rank holds
/// `n_head / tp` query heads and the `n_kv_head / tp` kv heads they read (Megatron-LM's split),
/// and infers both counts from its local weights.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct LlamaAttention {
    /// Query projection `[n_head * head_dim, n_embd]`.
    pub q_proj: Linear,
    /// Key projection `[n_kv_head * head_dim, n_embd]`.
    pub k_proj: Linear,
    /// Value projection `[n_kv_head * head_dim, n_embd]`.
    pub v_proj: Linear,
    /// Output projection `[n_embd, n_head * head_dim]`.
    pub o_proj: Linear,
    /// The width of one head.
    pub head_dim: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// How the rotation's angles are computed.
    pub rope_angles: RopeAngles,
    /// transformers' tables, kept between calls ([`RopeAngles::Transformers`]).
    rope_tables: rope::TableCache,
    /// The context-parallel group the sequence is split over (from the builder), if any: ring
    /// attention, and rotations at global positions.
    pub cp: Option<ContextParallel>,
}

impl LlamaAttention {
    /// The attention of a layer of `c`.
    pub fn new(p: &ParamBuilder, c: &LlamaConfig) -> Result<Self> {
        let (d, e) = (c.head_dim(), c.n_embd);
        Ok(LlamaAttention {
            q_proj: proj(p, e, c.n_head * d)?,
            k_proj: proj(p, e, c.n_kv_head * d)?,
            v_proj: proj(p, e, c.n_kv_head * d)?,
            o_proj: proj(p, c.n_head * d, e)?,
            head_dim: d,
            rope_theta: c.rope_theta,
            rope_angles: c.rope_angles,
            rope_tables: rope::TableCache::default(),
            cp: p
                .context_parallel_group()
                .filter(|cp| cp.is_active())
                .cloned(),
        })
    }
}

impl Forward for LlamaAttention {
    /// `x [B, T, C]` -> `[B, T, C]` (under sequence parallelism `[B, T / tp, C]` both ways: the
    /// projections gather the sequence, `o_proj` scatters it back). Positions are `0..T` of the
    /// whole sequence; under context parallelism `x` is this rank's two chunks, rotated at their
    /// global positions, and attention is ring attention over the group (the kv heads are
    /// repeated before the ring, so the ring carries the query heads' keys and values).
    fn forward(&self, x: &Var) -> Result<Var> {
        if x.tensor().rank() != 3 {
            meshgrad_tensor::bail!(
                "llama attention {}: expected input [B, T, C], got {}",
                self.q_proj.path().trim_end_matches(".q_proj"),
                x.tensor().shape()
            );
        }
        let d = self.head_dim;
        let q = self.q_proj.forward(x)?;
        let (b, t) = (q.tensor().dims()[0], q.tensor().dims()[1]);
        // [B, T, h d] -> [B, T, h, d], rotated, then heads first: [B, h, T, d].
        let heads = |v: Var, rotate: bool| -> Result<Var> {
            let v = v.reshape((b, t, -1, d))?;
            let v = if rotate {
                rope::rotate(
                    &v,
                    self.rope_theta,
                    self.rope_angles,
                    &self.rope_tables,
                    self.cp.as_ref(),
                )?
            } else {
                v
            };
            v.transpose(1, 2)
        };
        let q = heads(q, true)?;
        let k = heads(self.k_proj.forward(x)?, true)?;
        let v = heads(self.v_proj.forward(x)?, false)?;
        let (h, kv) = (q.tensor().dims()[1], k.tensor().dims()[1]);
        if kv == 0 || !h.is_multiple_of(kv) {
            meshgrad_tensor::bail!(
                "llama attention: {h} query heads cannot share {kv} kv heads (this rank's q_proj \
                 {} and k_proj {})",
                self.q_proj.weight.tensor().shape(),
                self.k_proj.weight.tensor().shape()
            );
        }
        let (k, v) = (repeat_kv(&k, h / kv)?, repeat_kv(&v, h / kv)?);
        let scale = 1.0 / (d as f64).sqrt();
        let y = match &self.cp {
            Some(cp) => cp.causal_attention(&q, &k, &v, scale)?,
            None => Var::attention(&q, &k, &v, &AttentionMask::causal(), scale)?,
        };
        self.o_proj
            .forward(&y.transpose(1, 2)?.reshape((b, t, h * d))?)
    }
}

/// Grouped-query attention's key/value heads for the query heads: `[B, kv, T, d]` ->
/// `[B, kv * rep, T, d]`, kv head `j` serving query heads `j rep .. (j + 1) rep` (Hugging Face's
/// `repeat_kv`). A broadcast view reshaped, so the backward sums each group's gradients.
fn repeat_kv(x: &Var, rep: usize) -> Result<Var> {
    if rep == 1 {
        return Ok(x.clone());
    }
    let d = x.tensor().dims().to_vec();
    x.unsqueeze(2)?
        .expand(vec![d[0], d[1], rep, d[2], d[3]])?
        .reshape((d[0], d[1] * rep, d[2], d[3]))
}

/// The SwiGLU feed-forward, `down_proj(silu(gate_proj(x)) * up_proj(x))` (`mlp`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct LlamaMlp {
    /// Gate projection `[intermediate_size, n_embd]`.
    pub gate_proj: Linear,
    /// Up projection `[intermediate_size, n_embd]`.
    pub up_proj: Linear,
    /// Down projection `[n_embd, intermediate_size]`.
    pub down_proj: Linear,
}

impl LlamaMlp {
    /// The MLP of a layer of `c`.
    pub fn new(p: &ParamBuilder, c: &LlamaConfig) -> Result<Self> {
        Ok(LlamaMlp {
            gate_proj: proj(p, c.n_embd, c.intermediate_size)?,
            up_proj: proj(p, c.n_embd, c.intermediate_size)?,
            down_proj: proj(p, c.intermediate_size, c.n_embd)?,
        })
    }
}

impl Forward for LlamaMlp {
    fn forward(&self, x: &Var) -> Result<Var> {
        let gated = Var::swiglu(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?;
        self.down_proj.forward(&gated)
    }
}

/// One decoder layer: `x + self_attn(input_layernorm(x))`, then
/// `x + ffn(post_attention_layernorm(x))`, the feed-forward being the dense `mlp` (a Llama) or
/// the mixture of experts `block_sparse_moe` (a Mixtral, Hugging Face `MixtralDecoderLayer`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct LlamaDecoderLayer {
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: LlamaAttention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// The dense feed-forward (a Llama).
    pub mlp: Option<LlamaMlp>,
    /// The mixture of experts (a Mixtral).
    pub block_sparse_moe: Option<SparseMoe>,
}

impl LlamaDecoderLayer {
    /// Layer `index` (global) of `c`.
    pub fn new(p: &ParamBuilder, c: &LlamaConfig, index: usize) -> Result<Self> {
        let input_layernorm = RmsNorm::new(p, c.n_embd, c.norm_eps)?;
        let self_attn = LlamaAttention::new(p, c)?;
        let post_attention_layernorm = RmsNorm::new(p, c.n_embd, c.norm_eps)?;
        let (mlp, block_sparse_moe) = match c.moe {
            None => (Some(LlamaMlp::new(p, c)?), None),
            Some(moe) => {
                let aux_weight = moe.router_aux_loss_coef / c.n_layer as f64;
                let sizes = (c.n_embd, c.intermediate_size);
                let layer = SparseMoe::new(p, sizes, moe, (index, aux_weight))?;
                (None, Some(layer))
            }
        };
        Ok(LlamaDecoderLayer {
            input_layernorm,
            self_attn,
            post_attention_layernorm,
            mlp,
            block_sparse_moe,
        })
    }

    /// The feed-forward of `x`: the dense MLP or the mixture of experts.
    fn ffn(&self, x: &Var) -> Result<Var> {
        match (&self.mlp, &self.block_sparse_moe) {
            (Some(mlp), _) => mlp.forward(x),
            (None, Some(moe)) => moe.forward(x),
            (None, None) => meshgrad_tensor::bail!("llama layer: has no feed-forward"),
        }
    }

    /// As [`Forward::forward`], but keeps only the layer's input and recomputes its activations
    /// during backward (activation checkpointing).
    pub fn forward_checkpointed(self: &Arc<Self>, x: &Var) -> Result<Var> {
        let me = self.clone();
        checkpoint(
            Arc::new(move |xs: &[Var]| me.forward(&xs[0])),
            std::slice::from_ref(x),
        )
    }
}

impl Forward for LlamaDecoderLayer {
    /// `x [B, T, C]` -> `[B, T, C]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        let x = x.add(&self.self_attn.forward(&self.input_layernorm.forward(x)?)?)?;
        x.add(&self.ffn(&self.post_attention_layernorm.forward(&x)?)?)
    }
}

//! The encoder (`bert.encoder`): [`BertEncoder`], its post-LayerNorm [`BertLayer`]s and their
//! parts (self-attention with the padding mask, the residual branches, the feed-forward layer).

use std::ops::Range;
use std::sync::Arc;

use meshgrad_autograd::{checkpoint, Var};
use meshgrad_tensor::{AttentionMask, DType, Device, GeluKind, Result, Tensor};

use super::BertConfig;
use crate::cp::ContextParallel;
use crate::layers::{Dropout, LayerNorm, Linear, LinearConfig};
use crate::module::Forward;
use crate::param_builder::ParamBuilder;
use crate::stage::BlockRange;

/// Multi-head self-attention: `query`, `key`, `value` projections and dropout on the
/// probabilities (Hugging Face's `attention.self`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertSelfAttention {
    /// `[hidden, hidden]`.
    pub query: Linear,
    /// `[hidden, hidden]`.
    pub key: Linear,
    /// `[hidden, hidden]`.
    pub value: Linear,
    /// Dropout on the attention probabilities.
    pub dropout: Dropout,
    /// Heads.
    pub num_heads: usize,
    /// The context-parallel group the sequence is split over (from the builder), if any.
    pub cp: Option<ContextParallel>,
}

impl BertSelfAttention {
    /// `x [B, T, C]` and the additive mask `[B, 1, 1, T]` -> the heads' context `[B, T, C]`.
    ///
    /// Under tensor parallelism `query`, `key` and `value` hold this rank's heads (the local head
    /// count comes from the local `query` weight, `[C / tp, C]`), the context is `[B, T, C / tp]`
    /// and the probability dropout draws the masks of the global heads.
    pub fn forward(&self, x: &Var, mask: Option<&Tensor>) -> Result<Var> {
        let w = self.query.weight.tensor().dims().to_vec();
        let d = w[1] / self.num_heads;
        let local = w[0] / d;
        let first = self
            .query
            .weight
            .placement()
            .map_or(0, |p| p.index() * local);
        let q = self.query.forward(x)?;
        let k = self.key.forward(x)?;
        let v = self.value.forward(x)?;
        let heads = HeadSlice {
            local,
            first,
            total: self.num_heads,
        };
        match self.cp.as_ref().filter(|cp| cp.is_active()) {
            Some(_) if self.dropout.is_training() && self.dropout.p > 0.0 => {
                meshgrad_tensor::bail!(
                    "BERT attention: probability dropout (p = {}) does not run under context \
                     parallelism (ring and all-gather attention never form the probabilities)",
                    self.dropout.p
                )
            }
            Some(cp) => ring_attention(cp, &q, &k, &v, mask, local),
            None => masked_attention(&q, &k, &v, mask, heads, &self.dropout),
        }
    }
}

/// Which heads of the layer a rank computes: `local` heads starting at global head `first` of
/// `total` (all of them on one device).
#[derive(Clone, Copy)]
struct HeadSlice {
    local: usize,
    first: usize,
    total: usize,
}

/// Scaled dot-product attention of `q`, `k`, `v` (each `[B, T, C]`, heads contiguous in `C`)
/// with an optional additive key mask `[B, 1, 1, T]` (0 to attend, a large negative number for
/// padding), softmax over the keys and dropout on the probabilities; returns `[B, T, C]`.
///
/// This is the one place where BERT's attention is computed. Without attention-probability
/// dropout (eval mode, or `attention_probs_dropout_prob` 0) it is the fused flash-style op
/// ([`Var::attention`] with the additive mask as a score bias, so a fully padded row behaves as
/// in Hugging Face's implementation); with dropout on the probabilities it is composed from
/// `Var` ops (per-head `q kᵀ`, scale, mask, softmax, dropout, product with `v`), since the fused
/// op has no dropout. Both compute the same function. `q`, `k`, `v` hold the heads `heads`
/// describes (this rank's, under tensor parallelism); the dropout masks are those of the global
/// heads ([`Dropout::forward_heads`]).
fn masked_attention(
    q: &Var,
    k: &Var,
    v: &Var,
    mask: Option<&Tensor>,
    slice: HeadSlice,
    dropout: &Dropout,
) -> Result<Var> {
    let dims = q.tensor().dims().to_vec();
    let (b, t, c) = (dims[0], dims[1], dims[2]);
    let heads = slice.local;
    let d = c / heads;
    let scale = 1.0 / (d as f64).sqrt();
    // [B, T, C] -> [B, H, T, D] (views).
    let split = |x: &Var| x.reshape((b, t, heads, d))?.permute(&[0, 2, 1, 3]);
    let (q, v) = (split(q)?, split(v)?);
    let probs_dropout = dropout.is_training() && dropout.p > 0.0;
    let out = if probs_dropout {
        let kt = k.reshape((b, t, heads, d))?.permute(&[0, 2, 3, 1])?; // [B, H, D, T]
        let mut scores = q.matmul(&kt)?.mul_scalar(scale)?;
        if let Some(m) = mask {
            scores = scores.add(&Var::constant(m.clone()))?;
        }
        dropout
            .forward_heads(&scores.softmax(-1)?, slice.total, slice.first)?
            .matmul(&v)?
    } else {
        let mut am = AttentionMask::none();
        if let Some(m) = mask {
            am = am.with_bias(Var::constant(m.clone()));
        }
        Var::attention(&q, &split(k)?, &v, &am, scale)?
    };
    out.permute(&[0, 2, 1, 3])?.contiguous()?.reshape((b, t, c))
}

/// Context parallelism: non-causal ring attention over `cp` of this rank's `q`, `k`, `v` (each
/// `[B, 2L, C]`, `heads` heads contiguous in `C`) with the key padding of the additive mask
/// `[B, 1, 1, 2L]` (0 = attend) if any; returns `[B, 2L, C]`. No probability dropout (refused
/// with cp).
fn ring_attention(
    cp: &ContextParallel,
    q: &Var,
    k: &Var,
    v: &Var,
    mask: Option<&Tensor>,
    heads: usize,
) -> Result<Var> {
    let dims = q.tensor().dims().to_vec();
    let (b, t, c) = (dims[0], dims[1], dims[2]);
    let d = c / heads;
    let split = |x: &Var| x.reshape((b, t, heads, d))?.transpose(1, 2);
    let padding = match mask {
        Some(m) => {
            let attend: Vec<u32> = m
                .to_vec_f64()?
                .into_iter()
                .map(|x| u32::from(x == 0.0))
                .collect();
            Some(Tensor::from_vec(attend, (b, t), Device::Cpu)?.to_device(m.device())?)
        }
        None => None,
    };
    let scale = 1.0 / (d as f64).sqrt();
    cp.attention(
        &split(q)?,
        &split(k)?,
        &split(v)?,
        padding.as_ref(),
        false,
        scale,
    )?
    .transpose(1, 2)?
    .reshape((b, t, c))
}

/// `LayerNorm(input + dropout(dense(x)))`: the residual branch after attention
/// (`attention.output`) or after the feed-forward layer (`output`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertResidualOutput {
    /// The projection.
    pub dense: Linear,
    /// The post-residual norm.
    #[module(rename = "LayerNorm")]
    pub layer_norm: LayerNorm,
    /// Dropout on the projection.
    pub dropout: Dropout,
}

impl BertResidualOutput {
    fn new(p: &ParamBuilder, c: &BertConfig, from: usize) -> Result<Self> {
        Ok(BertResidualOutput {
            dense: LinearConfig::new(from, c.hidden_size)
                .std(c.initializer_range)
                .build(p)?,
            layer_norm: LayerNorm::new(p, c.hidden_size, true, c.layer_norm_eps)?,
            dropout: Dropout::on_sequence(c.hidden_dropout_prob, p)?,
        })
    }

    /// `LayerNorm(input + dropout(dense(x)))`.
    pub fn forward(&self, x: &Var, input: &Var) -> Result<Var> {
        let h = self.dropout.forward(&self.dense.forward(x)?)?;
        self.layer_norm.forward(&h.add(input)?)
    }
}

/// Self-attention and its output projection (Hugging Face's `attention`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertAttention {
    /// `attention.self`.
    #[module(rename = "self")]
    pub self_attention: BertSelfAttention,
    /// `attention.output`.
    pub output: BertResidualOutput,
}

/// The feed-forward up-projection with exact GELU (`intermediate`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertIntermediate {
    /// `[intermediate, hidden]`.
    pub dense: Linear,
}

/// One post-LayerNorm encoder layer (`encoder.layer.N`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertLayer {
    /// Attention block.
    pub attention: BertAttention,
    /// Feed-forward up-projection.
    pub intermediate: BertIntermediate,
    /// Feed-forward down-projection, residual and norm.
    pub output: BertResidualOutput,
}

impl BertLayer {
    fn new(p: &ParamBuilder, c: &BertConfig) -> Result<Self> {
        let lin = |i, o| LinearConfig::new(i, o).std(c.initializer_range).build(p);
        let h = c.hidden_size;
        Ok(BertLayer {
            attention: BertAttention {
                self_attention: BertSelfAttention {
                    query: lin(h, h)?,
                    key: lin(h, h)?,
                    value: lin(h, h)?,
                    dropout: Dropout::new(c.attention_probs_dropout_prob)?,
                    num_heads: c.num_attention_heads,
                    cp: p.context_parallel_group().cloned(),
                },
                output: BertResidualOutput::new(p, c, h)?,
            },
            intermediate: BertIntermediate {
                dense: lin(h, c.intermediate_size)?,
            },
            output: BertResidualOutput::new(p, c, c.intermediate_size)?,
        })
    }

    /// `x [B, T, C]` with the additive mask `[B, 1, 1, T]` -> `[B, T, C]`.
    pub fn forward(&self, x: &Var, mask: Option<&Tensor>) -> Result<Var> {
        let a = self.attention.self_attention.forward(x, mask)?;
        let a = self.attention.output.forward(&a, x)?;
        let h = self.intermediate.forward(&a)?;
        self.output.forward(&h, &a)
    }

    /// As [`BertLayer::forward`], keeping only the layer's input and recomputing its activations
    /// during backward (activation checkpointing).
    pub fn forward_checkpointed(self: &Arc<Self>, x: &Var, mask: Option<&Tensor>) -> Result<Var> {
        let me = self.clone();
        let mask = mask.cloned();
        checkpoint(
            Arc::new(move |xs: &[Var]| me.forward(&xs[0], mask.as_ref())),
            std::slice::from_ref(x),
        )
    }
}

impl Forward for BertIntermediate {
    /// `gelu_erf(dense(x))`.
    fn forward(&self, x: &Var) -> Result<Var> {
        self.dense.forward(x)?.gelu(GeluKind::Erf)
    }
}

/// The encoder layers (`bert.encoder`): all of them in the whole model, a stage's range in a
/// stage, each named by its global index.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertEncoder {
    /// `bert.encoder.layer.N` (`layer[N]` is layer `N`).
    pub layer: BlockRange<BertLayer>,
}

impl BertEncoder {
    /// Encoder layers `range` of config `c` (global indices; only their names, given by the
    /// model tree, depend on them).
    pub(super) fn new(p: &ParamBuilder, c: &BertConfig, range: Range<usize>) -> Result<Self> {
        let start = range.start;
        let layers = range
            .map(|_| BertLayer::new(p, c).map(Arc::new))
            .collect::<Result<Vec<_>>>()?;
        Ok(BertEncoder {
            layer: BlockRange::new(start, layers),
        })
    }

    /// The hidden states `x` `[B, T, hidden]` through every layer, with the additive mask `[B, 1, 1, T]`; each
    /// layer keeps only its input and recomputes its activations in backward when
    /// `checkpointed` (activation checkpointing).
    pub fn forward(&self, mut x: Var, mask: Option<&Tensor>, checkpointed: bool) -> Result<Var> {
        for layer in self.layer.blocks() {
            x = if checkpointed {
                layer.forward_checkpointed(&x, mask)?
            } else {
                layer.forward(&x, mask)?
            };
        }
        Ok(x)
    }
}

/// The additive attention mask `[B, 1, 1, T]` of `attention_mask [B, T]` (1 = attend,
/// 0 = padding), as Hugging Face builds it: `(1 - mask) * min`, with `min` the most negative
/// finite value of the parameters' dtype; in the dtype and on the device of `like` (a
/// parameter).
pub(super) fn additive_mask(mask: &Tensor, like: &Tensor) -> Result<Tensor> {
    let min = match like.dtype() {
        DType::F64 => f64::MIN,
        DType::F32 => f32::MIN as f64,
        DType::BF16 => half::bf16::MIN.to_f64(),
        DType::F16 => half::f16::MIN.to_f64(),
        other => meshgrad_tensor::bail!("bert: parameters of dtype {other} are not supported"),
    };
    let (b, t) = (mask.dims()[0], mask.dims()[1]);
    let v: Vec<f64> = mask
        .to_vec_f64()?
        .into_iter()
        .map(|m| (1.0 - m) * min)
        .collect();
    Tensor::from_vec(v, (b, 1, 1, t), Device::Cpu)?
        .to_dtype(like.dtype())?
        .to_device(like.device())
}

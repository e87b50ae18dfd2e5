//! BERT for masked language modelling, with Hugging Face's `BertForMaskedLM` architecture and
//! parameter names.
//!
//! The module tree mirrors Hugging Face's, so every parameter name equals the name in a
//! `BertForMaskedLM` checkpoint (`bert.embeddings.word_embeddings.weight`,
//! `bert.encoder.layer.0.attention.self.query.weight`, ...,
//! `cls.predictions.transform.LayerNorm.bias`, `cls.predictions.bias`):
//!
//! * embeddings: word + position (absolute, `0..T`) + token type (type 0 when none are given),
//!   then `LayerNorm` and dropout;
//! * `num_hidden_layers` post-LayerNorm encoder layers: self-attention (`query`, `key`, `value`,
//!   softmax with the padding mask, dropout on the probabilities), `attention.output.dense`,
//!   dropout, `LayerNorm(x + attention)`; `intermediate.dense` with exact (erf) GELU;
//!   `output.dense`, dropout, `LayerNorm(x + mlp)`;
//! * the MLM head: `cls.predictions.transform.dense`, exact GELU, `transform.LayerNorm`, and the
//!   decoder, whose weight is the word-embedding table (tied, not a parameter of its own) and
//!   whose bias is `cls.predictions.bias`.
//!
//! See [`crate::state::hf_bert`] for checkpoints and [`crate::mlm`] for the masking of inputs.
//!
//! # Stages
//!
//! [`BertStage`] is a contiguous range of the encoder layers, with or without the embeddings and
//! the MLM head, under the full model's parameter names (`bert.encoder.layer.{i}` keeps its
//! global `i`; see [`crate::stage`]). A later stage with the head holds its own copy of the
//! word-embedding table for the tied decoder ([`ModelStage::tied_parameters`]). [`BertBatch`]
//! is a microbatch as the stages read it; [`BertStage::tp_plan`] is the part of
//! [`BertForMaskedLM::tp_plan`] that a stage's modules take.
//!
//! # Tensor and sequence parallelism
//!
//! [`BertForMaskedLM::build`] with a [`ParamBuilder::tensor_parallel`] builder and
//! [`BertForMaskedLM::tp_plan`] builds this rank's part of the model (see [`crate::tp`]); every
//! split parameter holds exactly its slice of the single-device one. Over `tp` ranks:
//!
//! | parameters                                           | split                                   |
//! |------------------------------------------------------|-----------------------------------------|
//! | `attention.self.{query,key,value}.{weight,bias}`     | rows (Colwise): rank `r` holds heads `[r H/tp, (r+1) H/tp)` |
//! | `attention.output.dense.weight`                      | columns (Rowwise); its bias replicated, added after the sum |
//! | `intermediate.dense.{weight,bias}`                   | rows (Colwise)                          |
//! | `output.dense.weight`                                | columns (Rowwise); bias replicated      |
//! | `embeddings.word_embeddings.weight`                  | vocabulary rows (VocabEmbedding); the tied decoder reads the same split table |
//! | `cls.predictions.bias`                               | vocabulary (VocabHead), like the table  |
//! | position / token-type embeddings, every `LayerNorm`, `cls.predictions.transform.dense` | replicated |
//!
//! Attention infers its local head count from the local `query` weight and computes its heads
//! over the whole sequence (padding mask included); the probability dropout draws the masks of
//! its global heads ([`Dropout::forward_heads`]), so every layout drops what one device drops.
//! The MLM logits stay split by vocabulary (`[B, T, vocab / tp]`) and the loss is the
//! loss-parallel cross-entropy: the full logits are never gathered.
//!
//! BERT normalises after each residual, so with sequence parallelism the region split along the
//! sequence (`[B, T / tp, C]` per rank) starts at `embeddings.LayerNorm` (which cuts the
//! replicated embedding sum to this rank's positions) and holds the embedding dropout, each
//! residual dropout, the residual additions and each residual `LayerNorm`. Query/key/value and
//! `intermediate.dense` all-gather the sequence on entry; both output projections
//! reduce-scatter into the region. The MLM head's transform (dense, GELU, `LayerNorm`) runs on
//! this rank's positions (its replicated parameters' gradients summed over the ranks); the
//! decoder gathers the positions and produces its vocabulary slice for all of them.

use std::sync::Arc;

use meshgrad_autograd::{checkpoint, Var};
use meshgrad_tensor::{AttentionMask, DType, Device, GeluKind, Result, Tensor};

use crate::layers::{Dropout, Embedding, LayerNorm, Linear, LinearConfig, LmHead};
use crate::module::{Child, Forward, Module};
use crate::param_builder::{Init, ParamBuilder};
use crate::stage::{BlockRange, ModelStage, StageInput, StageSpec};
use crate::tp::{ParallelStyle, TensorParallel, TpPlan};

/// The label of tokens that take no part in the loss (PyTorch's `CrossEntropyLoss` default).
pub const IGNORE_INDEX: i64 = -100;

/// BERT hyper-parameters, with Hugging Face's `BertConfig` field names. [`Default`] is
/// Hugging Face's default (the `bert-base` shape).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BertConfig {
    /// Token ids `0..vocab_size`.
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Encoder layers.
    pub num_hidden_layers: usize,
    /// Attention heads; must divide `hidden_size`.
    pub num_attention_heads: usize,
    /// Width of the feed-forward layer.
    pub intermediate_size: usize,
    /// The longest sequence (rows of the position table).
    pub max_position_embeddings: usize,
    /// Token types (segments).
    pub type_vocab_size: usize,
    /// Layer-norm epsilon.
    pub layer_norm_eps: f64,
    /// Dropout after the embeddings and after each residual branch.
    pub hidden_dropout_prob: f64,
    /// Dropout on the attention probabilities.
    pub attention_probs_dropout_prob: f64,
    /// The padding token (its word-embedding row starts at zero, as Hugging Face initialises it).
    pub pad_token_id: usize,
    /// Standard deviation of the initial weights.
    pub initializer_range: f64,
}

impl Default for BertConfig {
    fn default() -> Self {
        BertConfig {
            vocab_size: 30522,
            hidden_size: 768,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            intermediate_size: 3072,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            hidden_dropout_prob: 0.1,
            attention_probs_dropout_prob: 0.1,
            pad_token_id: 0,
            initializer_range: 0.02,
        }
    }
}

impl BertConfig {
    /// Its sizes for memory and cost estimates: learned positions and token types, a norm after
    /// the embedding, biases everywhere, no final norm, the masked-LM head's transform and bias,
    /// the decoder tied to the token table.
    pub fn shape(&self) -> crate::ModelShape {
        crate::ModelShape {
            vocab_size: self.vocab_size,
            positions: self.max_position_embeddings,
            n_layer: self.num_hidden_layers,
            n_head: self.num_attention_heads,
            n_kv_head: self.num_attention_heads,
            n_embd: self.hidden_size,
            ffn: self.intermediate_size,
            bias: true,
            learned_positions: true,
            type_vocab_size: self.type_vocab_size,
            embedding_norm: true,
            gated_mlp: false,
            final_norm: false,
            head_transform: true,
            tied: true,
        }
    }

    /// Checks the values, with one-line errors naming the field.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        for (k, v) in [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("intermediate_size", c.intermediate_size),
            ("max_position_embeddings", c.max_position_embeddings),
            ("type_vocab_size", c.type_vocab_size),
        ] {
            if v == 0 {
                meshgrad_tensor::bail!("bert config: {k} must be at least 1, got 0");
            }
        }
        if !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            meshgrad_tensor::bail!(
                "bert config: hidden_size {} is not divisible by num_attention_heads {}",
                c.hidden_size,
                c.num_attention_heads
            );
        }
        for (k, p) in [
            ("hidden_dropout_prob", c.hidden_dropout_prob),
            (
                "attention_probs_dropout_prob",
                c.attention_probs_dropout_prob,
            ),
        ] {
            if !(0.0..1.0).contains(&p) {
                meshgrad_tensor::bail!("bert config: {k} must be in [0, 1), got {p}");
            }
        }
        if !(c.layer_norm_eps.is_finite() && c.layer_norm_eps > 0.0) {
            meshgrad_tensor::bail!(
                "bert config: layer_norm_eps must be positive and finite, got {}",
                c.layer_norm_eps
            );
        }
        if !(c.initializer_range.is_finite() && c.initializer_range >= 0.0) {
            meshgrad_tensor::bail!(
                "bert config: initializer_range must be a finite number >= 0, got {}",
                c.initializer_range
            );
        }
        if c.pad_token_id >= c.vocab_size {
            meshgrad_tensor::bail!(
                "bert config: pad_token_id {} is outside the vocabulary (vocab_size {})",
                c.pad_token_id,
                c.vocab_size
            );
        }
        Ok(())
    }

    /// Number of parameters of the [`BertForMaskedLM`] this config builds (the tied decoder
    /// counted once, as part of the word embeddings).
    pub fn num_parameters(&self) -> usize {
        let (v, h, i) = (self.vocab_size, self.hidden_size, self.intermediate_size);
        let ln = 2 * h;
        let embeddings = (v + self.max_position_embeddings + self.type_vocab_size) * h + ln;
        let layer = 4 * (h * h + h) + ln + (h * i + i) + (i * h + h) + ln;
        let head = (h * h + h) + ln + v;
        embeddings + self.num_hidden_layers * layer + head
    }
}

/// Word, position and token-type embeddings, summed, then `LayerNorm` and dropout.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertEmbeddings {
    /// `[vocab_size, hidden]`; also the MLM decoder's weight.
    pub word_embeddings: Embedding,
    /// `[max_position_embeddings, hidden]`.
    pub position_embeddings: Embedding,
    /// `[type_vocab_size, hidden]`.
    pub token_type_embeddings: Embedding,
    /// Norm of the sum.
    #[module(rename = "LayerNorm")]
    pub layer_norm: LayerNorm,
    /// Dropout after the norm.
    pub dropout: Dropout,
}

impl BertEmbeddings {
    fn new(p: &ParamBuilder, c: &BertConfig) -> Result<Self> {
        let std = c.initializer_range;
        Ok(BertEmbeddings {
            word_embeddings: Embedding::new(p, c.vocab_size, c.hidden_size, std)?,
            position_embeddings: Embedding::new(p, c.max_position_embeddings, c.hidden_size, std)?,
            token_type_embeddings: Embedding::new(p, c.type_vocab_size, c.hidden_size, std)?,
            layer_norm: LayerNorm::new(p, c.hidden_size, true, c.layer_norm_eps)?,
            dropout: Dropout::new(c.hidden_dropout_prob)?,
        })
    }

    /// `ids [B, T]`, `token_type_ids [B, T]` (type 0 when `None`) -> `[B, T, hidden]`.
    pub fn forward(&self, ids: &Tensor, token_type_ids: Option<&Tensor>) -> Result<Var> {
        embed(
            EmbeddingParts {
                word: &self.word_embeddings,
                position: &self.position_embeddings,
                token_type: &self.token_type_embeddings,
                layer_norm: &self.layer_norm,
                dropout: &self.dropout,
            },
            ids,
            token_type_ids,
        )
    }
}

/// The parts of the embeddings, borrowed from a [`BertEmbeddings`] or a [`BertStageEmbeddings`].
struct EmbeddingParts<'a> {
    word: &'a Embedding,
    position: &'a Embedding,
    token_type: &'a Embedding,
    layer_norm: &'a LayerNorm,
    dropout: &'a Dropout,
}

/// Word + token-type + position embeddings of `ids [B, T]` (type 0 when `token_type_ids` is
/// `None`), then `LayerNorm` and dropout: the one embedding forward of the model and its stages.
fn embed(e: EmbeddingParts<'_>, ids: &Tensor, token_type_ids: Option<&Tensor>) -> Result<Var> {
    let t = ids.dims()[1];
    let pos = Tensor::arange(0, t as i64, DType::I64, ids.device())?;
    let zeros;
    let types = match token_type_ids {
        Some(tt) => tt,
        None => {
            zeros = Tensor::zeros(ids.shape().clone(), DType::U32, ids.device())?;
            &zeros
        }
    };
    let x = e
        .word
        .forward(ids)?
        .add(&e.token_type.forward(types)?)?
        .add(&e.position.forward(&pos)?)?;
    e.dropout.forward(&e.layer_norm.forward(&x)?)
}

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
        masked_attention(&q, &k, &v, mask, heads, &self.dropout)
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
            dropout: Dropout::new(c.hidden_dropout_prob)?,
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

/// Encoder layers `range` (global indices; only their names, given by the model tree, depend on
/// them).
fn new_layers(
    p: &ParamBuilder,
    c: &BertConfig,
    range: std::ops::Range<usize>,
) -> Result<Vec<Arc<BertLayer>>> {
    range.map(|_| BertLayer::new(p, c).map(Arc::new)).collect()
}

/// One encoder layer, recomputed in backward with activation checkpointing.
fn run_layer(
    layer: &Arc<BertLayer>,
    x: &Var,
    mask: Option<&Tensor>,
    checkpointed: bool,
) -> Result<Var> {
    if checkpointed {
        layer.forward_checkpointed(x, mask)
    } else {
        layer.forward(x, mask)
    }
}

/// The stack of encoder layers (`encoder`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertEncoder {
    /// `encoder.layer.N`.
    pub layer: Vec<Arc<BertLayer>>,
}

/// The encoder without a head (Hugging Face's `BertModel` without the pooler).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertModel {
    /// Embeddings.
    pub embeddings: BertEmbeddings,
    /// Encoder layers.
    pub encoder: BertEncoder,
}

/// `dense`, exact GELU, `LayerNorm` (`cls.predictions.transform`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertPredictionHeadTransform {
    /// `[hidden, hidden]`.
    pub dense: Linear,
    /// Norm after the activation.
    #[module(rename = "LayerNorm")]
    pub layer_norm: LayerNorm,
}

/// The transform and the output bias of the MLM head (`cls.predictions`); the decoder weight
/// is the word-embedding table.
///
/// Its tensor-parallel style is [`ParallelStyle::VocabHead`]: `bias` is split by vocabulary like
/// the (tied) table and the logits and loss stay split (the `decoder` carries the style).
pub struct BertLMPredictionHead {
    /// `cls.predictions.transform`.
    pub transform: BertPredictionHeadTransform,
    /// `[vocab_size]`: the decoder's bias (this rank's `[vocab_size / tp]` under tensor
    /// parallelism).
    pub bias: Var,
    /// The decoder over the word-embedding table (owns no parameters; not a named child).
    pub decoder: LmHead,
}

impl Module for BertLMPredictionHead {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        f("transform", Child::Module(&self.transform));
        f("bias", Child::Param(&self.bias));
    }
    fn module_type(&self) -> &'static str {
        "BertLMPredictionHead"
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        self.decoder.parallelize(path, style, tp)
    }
}

/// The MLM head (`cls`).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertOnlyMLMHead {
    /// `cls.predictions`.
    pub predictions: BertLMPredictionHead,
}

impl BertOnlyMLMHead {
    fn new(p: &ParamBuilder, c: &BertConfig) -> Result<Self> {
        Ok(BertOnlyMLMHead {
            predictions: BertLMPredictionHead {
                transform: BertPredictionHeadTransform {
                    dense: LinearConfig::new(c.hidden_size, c.hidden_size)
                        .std(c.initializer_range)
                        .build(p)?,
                    layer_norm: LayerNorm::new(p, c.hidden_size, true, c.layer_norm_eps)?,
                },
                bias: p.param(c.vocab_size, Init::Zeros)?,
                decoder: LmHead::new(),
            },
        })
    }

    /// MLM logits of the final hidden states `x`: the transform (dense, exact GELU,
    /// `LayerNorm`), then the decoder over the word-embedding table `table` with
    /// `cls.predictions.bias` (under tensor parallelism, this rank's vocabulary slice).
    fn logits(&self, x: &Var, table: &Var) -> Result<Var> {
        let p = &self.predictions;
        let h = p.transform.dense.forward(x)?.gelu(GeluKind::Erf)?;
        let h = p.transform.layer_norm.forward(&h)?;
        p.decoder.forward_with_bias(&h, table, Some(&p.bias))
    }

    /// The summed cross-entropy of `logits` over the labelled tokens of `labels` (`n` of them,
    /// [`count_labels`]) divided by `denominator` (see [`BertForMaskedLM::loss_over`]).
    fn loss(&self, logits: &Var, labels: &Tensor, n: usize, denominator: f64) -> Result<Var> {
        if !(denominator.is_finite() && denominator > 0.0) {
            meshgrad_tensor::bail!(
                "bert: the loss denominator must be positive, got {denominator}"
            );
        }
        let labels = labels.to_dtype(DType::I64)?;
        // Under tensor parallelism the logits are this rank's vocabulary slice and the loss is
        // loss-parallel (the full logits are never gathered).
        let mean = self
            .predictions
            .decoder
            .loss(logits, &labels, Some(IGNORE_INDEX))?;
        // The op's mean is over the n labelled rows (0 when there are none).
        mean.mul_scalar(n as f64 / denominator)
    }
}

/// BERT with the masked-language-modelling head (Hugging Face's `BertForMaskedLM`).
///
/// ```
/// use meshgrad_nn::bert::{BertConfig, BertForMaskedLM};
/// use meshgrad_tensor::{DType, Device, Tensor};
/// let config = BertConfig {
///     vocab_size: 50, hidden_size: 16, num_hidden_layers: 1, num_attention_heads: 2,
///     intermediate_size: 32, max_position_embeddings: 8, ..BertConfig::default()
/// };
/// let model = BertForMaskedLM::new(config, 0, DType::F32, Device::Cpu)?;
/// let ids = Tensor::from_vec(vec![1u32, 2, 3, 0], (1, 4), Device::Cpu)?;
/// let mask = Tensor::from_vec(vec![1u32, 1, 1, 0], (1, 4), Device::Cpu)?;
/// let logits = model.forward(&ids, Some(&mask), None)?;
/// assert_eq!(logits.tensor().dims(), &[1, 4, 50]);
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertForMaskedLM {
    /// Hyper-parameters.
    pub config: BertConfig,
    /// The encoder (`bert.`).
    pub bert: BertModel,
    /// The MLM head (`cls.`).
    pub cls: BertOnlyMLMHead,
    /// Recompute each layer's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
}

impl BertForMaskedLM {
    /// A new model with Hugging Face's initialisation: N(0, initializer_range) weights and
    /// embeddings (the padding token's word-embedding row zero), zero biases, unit norm weights.
    /// Each parameter's values depend only on `seed` and its name.
    pub fn new(config: BertConfig, seed: u64, dtype: DType, device: Device) -> Result<Self> {
        BertForMaskedLM::build(config, ParamBuilder::new(seed).dtype(dtype).device(device))
    }

    /// A new model whose parameters `builder` creates (its seed, dtype and device; with
    /// [`ParamBuilder::tensor_parallel`] and [`BertForMaskedLM::tp_plan`], this rank's part of a
    /// tensor-parallel model, every value equal to the single-device one). Sizes that do not
    /// split over the tensor-parallel ranks are refused first ([`check_tp_sizes`]).
    pub fn build(config: BertConfig, builder: ParamBuilder) -> Result<Self> {
        config.validate()?;
        if let Some(tp) = builder.tensor_parallel_group() {
            check_tp_sizes(&config, tp.degree(), None)?;
        }
        let c = config;
        let model = builder.build(|p| {
            Ok(BertForMaskedLM {
                config,
                bert: BertModel {
                    embeddings: BertEmbeddings::new(p, &c)?,
                    encoder: BertEncoder {
                        layer: new_layers(p, &c, 0..c.num_hidden_layers)?,
                    },
                },
                cls: BertOnlyMLMHead::new(p, &c)?,
                activation_checkpointing: false,
            })
        })?;
        zero_padding_row(&model.bert.embeddings.word_embeddings.weight, &c)?;
        Ok(model)
    }

    /// The tensor-parallel plan of BERT (see the [module docs](self)): query/key/value and the
    /// feed-forward up-projection column-parallel (split by heads / by features), both output
    /// projections row-parallel, the word embeddings and the tied MLM decoder with its bias split
    /// by vocabulary (loss-parallel cross-entropy), and the post-residual norms and dropouts
    /// sequence-parallel, the region starting at `embeddings.LayerNorm` and running through the
    /// MLM-head transform.
    pub fn tp_plan() -> TpPlan {
        let layer = |s: &str| format!("bert.encoder.layer.*.{s}");
        TpPlan::new()
            .with(
                "bert.embeddings.word_embeddings",
                ParallelStyle::VocabEmbedding,
            )
            .with("bert.embeddings.LayerNorm", ParallelStyle::SequenceSplit)
            .with("bert.embeddings.dropout", ParallelStyle::SequenceParallel)
            .with(
                layer("attention.self.query"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(
                layer("attention.self.key"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(
                layer("attention.self.value"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(layer("attention.output.dense"), ParallelStyle::Rowwise)
            .with(
                layer("attention.output.dropout"),
                ParallelStyle::SequenceParallel,
            )
            .with(
                layer("attention.output.LayerNorm"),
                ParallelStyle::SequenceParallel,
            )
            .with(
                layer("intermediate.dense"),
                ParallelStyle::Colwise { chunks: 1 },
            )
            .with(layer("output.dense"), ParallelStyle::Rowwise)
            .with(layer("output.dropout"), ParallelStyle::SequenceParallel)
            .with(layer("output.LayerNorm"), ParallelStyle::SequenceParallel)
            .with(
                "cls.predictions.transform.dense",
                ParallelStyle::SequenceParallel,
            )
            .with(
                "cls.predictions.transform.LayerNorm",
                ParallelStyle::SequenceParallel,
            )
            .with("cls.predictions", ParallelStyle::VocabHead)
    }

    /// Checks that the sizes split over `tp` ranks, with one line naming them; `sequence` is the
    /// training sequence length when sequence parallelism is on.
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
    }

    /// The word-embedding table `[vocab_size, hidden]` (the decoder's weight).
    pub fn word_embeddings(&self) -> &Var {
        &self.bert.embeddings.word_embeddings.weight
    }

    /// The final hidden states `[B, T, hidden]` (the encoder's output; under sequence
    /// parallelism this rank's positions `[B, T / tp, hidden]`).
    pub fn hidden_states(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Var> {
        self.run(input_ids, attention_mask, token_type_ids, false)
    }

    /// MLM logits `[B, T, vocab_size]` for `input_ids [B, T]` (integers), with an optional
    /// `attention_mask [B, T]` (1 = attend, 0 = padding; any dtype) and `token_type_ids [B, T]`
    /// (type 0 when `None`). Dropout masks follow the current
    /// [`ForwardCtx`](meshgrad_autograd::ForwardCtx). Under tensor parallelism the logits are
    /// this rank's vocabulary slice `[B, T, vocab_size / tp]`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Var> {
        self.run(input_ids, attention_mask, token_type_ids, true)
    }

    /// The forward: embeddings, the encoder layers (each checkpointed when
    /// `activation_checkpointing`), then with `logits` the head (transform, tied decoder).
    fn run(
        &self,
        ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
        logits: bool,
    ) -> Result<Var> {
        check_inputs(&self.config, ids, attention_mask, token_type_ids)?;
        let mask = attention_mask
            .map(|m| additive_mask(m, self.word_embeddings().tensor()))
            .transpose()?;
        let mut x = self.bert.embeddings.forward(ids, token_type_ids)?;
        for layer in &self.bert.encoder.layer {
            x = run_layer(layer, &x, mask.as_ref(), self.activation_checkpointing)?;
        }
        if !logits {
            return Ok(x);
        }
        self.cls.logits(&x, self.word_embeddings())
    }

    /// Checks labels `[B, T]`: integers, each [`IGNORE_INDEX`] or a token id. Returns how many
    /// are not ignored.
    pub fn count_labels(&self, labels: &Tensor) -> Result<usize> {
        count_labels(&self.config, labels)
    }

    /// The MLM loss as Hugging Face's `BertForMaskedLM` computes it: the mean cross-entropy of
    /// the logits over the tokens whose label is not -100 ([`IGNORE_INDEX`]). `labels [B, T]`
    /// must be `i64`. When every label is -100 the loss is 0 (Hugging Face returns NaN).
    pub fn loss(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
        labels: &Tensor,
    ) -> Result<Var> {
        let n = self.count_labels(labels)?;
        self.loss_over(
            input_ids,
            attention_mask,
            token_type_ids,
            labels,
            n.max(1) as f64,
        )
    }

    /// The summed cross-entropy over the labelled tokens divided by `denominator`: the share of
    /// these rows in the mean over a larger batch that has `denominator` labelled tokens in all
    /// (split across micro-batches or ranks). With `denominator` equal to this batch's count it
    /// is [`BertForMaskedLM::loss`].
    pub fn loss_over(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
        labels: &Tensor,
        denominator: f64,
    ) -> Result<Var> {
        if labels.dims() != input_ids.dims() {
            meshgrad_tensor::bail!(
                "bert: labels {} must match input_ids {}",
                labels.shape(),
                input_ids.shape()
            );
        }
        if !(denominator.is_finite() && denominator > 0.0) {
            meshgrad_tensor::bail!(
                "bert: the loss denominator must be positive, got {denominator}"
            );
        }
        let n = self.count_labels(labels)?;
        let logits = self.forward(input_ids, attention_mask, token_type_ids)?;
        self.cls.loss(&logits, labels, n, denominator)
    }
}

/// Checks the shapes and dtypes of the inputs against `c`; returns `(B, T)`.
fn check_inputs(
    c: &BertConfig,
    ids: &Tensor,
    attention_mask: Option<&Tensor>,
    token_type_ids: Option<&Tensor>,
) -> Result<(usize, usize)> {
    if ids.rank() != 2 || !ids.dtype().is_int() {
        meshgrad_tensor::bail!(
            "bert: input_ids must be an integer tensor [B, T], got {} of {}",
            ids.shape(),
            ids.dtype()
        );
    }
    let (b, t) = (ids.dims()[0], ids.dims()[1]);
    if t == 0 || t > c.max_position_embeddings {
        meshgrad_tensor::bail!(
            "bert: sequence length {t} must be in 1..={} (max_position_embeddings)",
            c.max_position_embeddings
        );
    }
    for (name, x) in [
        ("attention_mask", attention_mask),
        ("token_type_ids", token_type_ids),
    ] {
        if let Some(x) = x {
            if x.dims() != ids.dims() {
                meshgrad_tensor::bail!(
                    "bert: {name} has shape {} but input_ids has {}",
                    x.shape(),
                    ids.shape()
                );
            }
        }
    }
    if let Some(tt) = token_type_ids {
        if !tt.dtype().is_int() {
            meshgrad_tensor::bail!("bert: token_type_ids must be integers, got {}", tt.dtype());
        }
    }
    Ok((b, t))
}

/// The additive attention mask `[B, 1, 1, T]` of `attention_mask [B, T]` (1 = attend,
/// 0 = padding), as Hugging Face builds it: `(1 - mask) * min`, with `min` the most negative
/// finite value of the parameters' dtype; in the dtype and on the device of `like` (a
/// parameter).
fn additive_mask(mask: &Tensor, like: &Tensor) -> Result<Tensor> {
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

/// Checks labels `[B, T]` against `c` (integers, each [`IGNORE_INDEX`] or a token id); returns
/// how many are not ignored.
fn count_labels(c: &BertConfig, labels: &Tensor) -> Result<usize> {
    if !labels.dtype().is_int() || labels.rank() != 2 {
        meshgrad_tensor::bail!(
            "bert: labels must be an integer tensor [B, T], got {} of {}",
            labels.shape(),
            labels.dtype()
        );
    }
    let v = c.vocab_size as i64;
    let mut n = 0;
    for (i, &l) in labels
        .to_dtype(DType::I64)?
        .to_vec::<i64>()?
        .iter()
        .enumerate()
    {
        if l == IGNORE_INDEX {
            continue;
        }
        if !(0..v).contains(&l) {
            let t = labels.dims()[1];
            meshgrad_tensor::bail!(
                "bert: label {l} at row {}, position {} is neither {IGNORE_INDEX} nor a token id below vocab_size {v}",
                i / t,
                i % t
            );
        }
        n += 1;
    }
    Ok(n)
}

/// Zeroes the padding token's row of the word-embedding table `table` (on the rank whose
/// vocabulary slice holds it), as Hugging Face initialises it.
fn zero_padding_row(table: &Var, c: &BertConfig) -> Result<()> {
    let w = table.tensor();
    let rows = match table.placement() {
        Some(p) => p.ranges(c.vocab_size, p.index())[0].clone(),
        None => 0..c.vocab_size,
    };
    if rows.contains(&c.pad_token_id) {
        let zeros = Tensor::zeros((1, c.hidden_size), w.dtype(), w.device())?;
        w.narrow(0, c.pad_token_id - rows.start, 1)?
            .copy_from(&zeros)?;
    }
    Ok(())
}

/// The tensor-parallel size checks of [`BertForMaskedLM::check_tensor_parallel`]: the heads,
/// the hidden and intermediate widths and the vocabulary must split over `tp` ranks (and the
/// sequence length, with sequence parallelism); the error is one line naming the size.
pub fn check_tp_sizes(c: &BertConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
    crate::tp::check_split_sizes(
        "bert",
        tp,
        &[
            ("num_attention_heads", c.num_attention_heads),
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("vocab_size", c.vocab_size),
        ],
        sequence,
    )
}

/// Reference mode's chunk count `K` for a BERT of config `c` trained on sequences of
/// `sequence` positions (see [`crate::tp::reference`]): the largest power of two dividing the
/// heads, the intermediate width, the vocabulary and the sequence length (so also the hidden
/// width). It depends only on the model and the sequence length, never on the layout.
pub fn reference_chunks(c: &BertConfig, sequence: usize) -> usize {
    crate::tp::largest_common_power_of_two(&[
        c.num_attention_heads,
        c.intermediate_size,
        c.vocab_size,
        sequence,
    ])
}

impl Forward for BertIntermediate {
    /// `gelu_erf(dense(x))`.
    fn forward(&self, x: &Var) -> Result<Var> {
        self.dense.forward(x)?.gelu(GeluKind::Erf)
    }
}

/// One microbatch as every [`BertStage`] reads it: the stage with the embeddings its ids and
/// token types, every stage the attention mask, the stage with the MLM head the labels.
#[derive(Clone, Debug)]
pub struct BertBatch {
    /// Token ids `[B, T]` (integers; read by the stage with the embeddings, and checked against
    /// the other tensors by every stage).
    pub ids: Tensor,
    /// `[B, T]`, 1 = attend, 0 = padding (any dtype); `None` attends everywhere.
    pub attention_mask: Option<Tensor>,
    /// `[B, T]` integer token types; `None` is type 0 everywhere.
    pub token_type_ids: Option<Tensor>,
    /// MLM labels `[B, T]`: a token id, or [`IGNORE_INDEX`] for tokens outside the loss.
    pub labels: Tensor,
    /// What the summed cross-entropy is divided by: `None` for this microbatch's own count of
    /// labelled tokens (its mean, [`BertForMaskedLM::loss`]); `Some(n)` for the labelled-token
    /// count of the larger batch it is part of ([`BertForMaskedLM::loss_over`]), so that the
    /// microbatches' losses and gradients sum to the larger batch's mean.
    pub denominator: Option<f64>,
}

/// The word-embedding part of a [`BertStage`] (`bert.embeddings`): everything on the stage with
/// the embeddings, only `word_embeddings` (the tied decoder's copy) on a later stage with the
/// MLM head.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertStageEmbeddings {
    /// `[vocab_size, hidden]`: the lookup table and the decoder's weight.
    pub word_embeddings: Embedding,
    /// `[max_position_embeddings, hidden]` (with the embeddings).
    pub position_embeddings: Option<Embedding>,
    /// `[type_vocab_size, hidden]` (with the embeddings).
    pub token_type_embeddings: Option<Embedding>,
    /// Norm of the sum (with the embeddings).
    #[module(rename = "LayerNorm")]
    pub layer_norm: Option<LayerNorm>,
    /// Dropout after the norm (with the embeddings).
    pub dropout: Option<Dropout>,
}

impl BertStageEmbeddings {
    fn parts(&self) -> Option<EmbeddingParts<'_>> {
        Some(EmbeddingParts {
            word: &self.word_embeddings,
            position: self.position_embeddings.as_ref()?,
            token_type: self.token_type_embeddings.as_ref()?,
            layer_norm: self.layer_norm.as_ref()?,
            dropout: self.dropout.as_ref()?,
        })
    }
}

/// A stage's encoder layers (`bert.encoder`), named by global index.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertStageEncoder {
    /// `bert.encoder.layer.N` for the stage's `N`.
    pub layer: BlockRange<BertLayer>,
}

/// A stage's part of `bert.`: the embeddings (or only the tied table) and its layers.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertStageModel {
    /// With the embeddings or the MLM head.
    pub embeddings: Option<BertStageEmbeddings>,
    /// The stage's layers.
    pub encoder: BertStageEncoder,
}

/// A stage of a [`BertForMaskedLM`]: encoder layers `spec.blocks` (global indices), with the
/// embeddings (`bert.embeddings`) when `spec.embedding` and the MLM head (`cls`) when
/// `spec.head`. See [`crate::stage`]; it follows the stages of [`Gpt`](crate::gpt::Gpt).
///
/// It creates only its own parameters, under the full model's (Hugging Face's) names
/// (`bert.encoder.layer.2.attention.self.query.weight` in whatever stage holds layer 2), in the
/// full model's order, with the full model's values: initialisation is keyed by name (and, under
/// tensor parallelism, by global element index), and the padding row of the word embeddings
/// starts at zero in every copy. Dropout paths are the full model's too, so a stage run in the
/// [`ForwardCtx`](meshgrad_autograd::ForwardCtx) of the full model's forward draws its masks.
/// Every stage reads the attention mask of the microbatch ([`BertBatch`]).
///
/// **The tied decoder.** The MLM decoder's weight is the word-embedding table
/// `bert.embeddings.word_embeddings.weight`. A stage with the head that is not also the stage
/// with the embeddings holds its own copy under that name, initialised to the same values
/// (only the decoder reads it). The two copies are one parameter of the model: its gradient is
/// the sum of the copies' gradients, both copies must take that summed gradient and the same
/// update, and a checkpoint stores it once. [`ModelStage::tied_parameters`] names it. A single
/// stage holding the whole model has one table, as [`BertForMaskedLM`].
///
/// Built from the same parts ([`BertLayer`], [`BertOnlyMLMHead`]) by the same functions as
/// [`BertForMaskedLM`], and run through the same embedding, layer, head and loss functions, so
/// chained stages compute the full model's loss and gradients bit for bit.
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertStage {
    /// Hyper-parameters of the full model.
    pub config: BertConfig,
    /// The part of the model this stage holds.
    pub spec: StageSpec,
    /// `bert.`: the embeddings (or the tied table) and the stage's layers.
    pub bert: BertStageModel,
    /// `cls.`: the MLM head (with the head).
    pub cls: Option<BertOnlyMLMHead>,
    /// Recompute each layer's activations during backward instead of storing them.
    pub activation_checkpointing: bool,
}

impl BertStage {
    /// A new stage with Hugging Face's initialisation: every parameter equal to the same-named
    /// parameter of [`BertForMaskedLM::new`] with the same arguments.
    pub fn new(
        config: BertConfig,
        spec: StageSpec,
        seed: u64,
        dtype: DType,
        device: Device,
    ) -> Result<Self> {
        BertStage::build(
            config,
            spec,
            ParamBuilder::new(seed).dtype(dtype).device(device),
        )
    }

    /// A new stage whose parameters `builder` creates (with [`ParamBuilder::tensor_parallel`]
    /// and [`BertStage::tp_plan`], this rank's part of the stage's tensor-parallel split; with
    /// [`ParamBuilder::delayed_init`], allocated on first use). One-line errors for a spec that
    /// does not fit the config and for sizes that do not split over the tensor-parallel ranks.
    pub fn build(config: BertConfig, spec: StageSpec, builder: ParamBuilder) -> Result<Self> {
        config.validate()?;
        spec.validate(config.num_hidden_layers)
            .map_err(|e| meshgrad_tensor::Error::msg(format!("bert {e}")))?;
        if let Some(tp) = builder.tensor_parallel_group() {
            check_tp_sizes(&config, tp.degree(), None)?;
        }
        let c = config;
        let stage = builder.build(|p| {
            let (first, last) = (spec.embedding, spec.head);
            let embeddings = if first || last {
                let std = c.initializer_range;
                let opt = |on: bool, rows: usize| -> Result<Option<Embedding>> {
                    on.then(|| Embedding::new(p, rows, c.hidden_size, std))
                        .transpose()
                };
                Some(BertStageEmbeddings {
                    word_embeddings: Embedding::new(p, c.vocab_size, c.hidden_size, std)?,
                    position_embeddings: opt(first, c.max_position_embeddings)?,
                    token_type_embeddings: opt(first, c.type_vocab_size)?,
                    layer_norm: first
                        .then(|| LayerNorm::new(p, c.hidden_size, true, c.layer_norm_eps))
                        .transpose()?,
                    dropout: first
                        .then(|| Dropout::new(c.hidden_dropout_prob))
                        .transpose()?,
                })
            } else {
                None
            };
            Ok(BertStage {
                config,
                spec: spec.clone(),
                bert: BertStageModel {
                    embeddings,
                    encoder: BertStageEncoder {
                        layer: BlockRange::new(
                            spec.blocks.start,
                            new_layers(p, &c, spec.blocks.clone())?,
                        ),
                    },
                },
                cls: last.then(|| BertOnlyMLMHead::new(p, &c)).transpose()?,
                activation_checkpointing: false,
            })
        })?;
        if let Some(table) = stage.word_embeddings() {
            zero_padding_row(table, &c)?;
        }
        Ok(stage)
    }

    /// The part of [`BertForMaskedLM::tp_plan`] that applies to the modules of a stage `spec`:
    /// the word embeddings on the stages with the embeddings or the head, the rest of
    /// `bert.embeddings` on the stage with the embeddings, `cls` on the stage with the head,
    /// the layer entries everywhere.
    pub fn tp_plan(spec: &StageSpec) -> TpPlan {
        let holds = |pattern: &str| {
            if pattern == "bert.embeddings.word_embeddings" {
                spec.embedding || spec.head
            } else if pattern.starts_with("bert.embeddings") {
                spec.embedding
            } else if pattern.starts_with("cls") {
                spec.head
            } else {
                true
            }
        };
        BertForMaskedLM::tp_plan()
            .entries()
            .iter()
            .filter(|(p, _)| holds(p))
            .fold(TpPlan::new(), |plan, (p, s)| plan.with(p.clone(), *s))
    }

    /// As [`BertForMaskedLM::check_tensor_parallel`].
    pub fn check_tensor_parallel(&self, tp: usize, sequence: Option<usize>) -> Result<()> {
        check_tp_sizes(&self.config, tp, sequence)
    }

    /// The word-embedding table `[vocab_size, hidden]` on the stages with the embeddings or the
    /// head (on a later stage with the head, its copy of the tied table).
    pub fn word_embeddings(&self) -> Option<&Var> {
        self.bert
            .embeddings
            .as_ref()
            .map(|e| &e.word_embeddings.weight)
    }

    /// A parameter of the stage's layers (every stage holds at least one layer).
    fn layer_param(&self) -> &Var {
        &self.bert.encoder.layer.blocks()[0]
            .attention
            .self_attention
            .query
            .weight
    }

    /// The hidden states after the stage's last layer for `input`, with the padding mask
    /// `attention_mask [B, T]` (every stage) and `token_type_ids [B, T]` (read by the stage with
    /// the embeddings): `[B, T, hidden]`, under sequence parallelism this rank's positions
    /// `[B, T / tp, hidden]`, which is also what a later stage takes. On the stage with the head
    /// this is [`BertForMaskedLM::hidden_states`] (the MLM head's transform is not applied).
    pub fn hidden_states(
        &self,
        input: StageInput<'_>,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Var> {
        let mut x = match input {
            StageInput::Ids(ids) => {
                let Some(parts) = self
                    .bert
                    .embeddings
                    .as_ref()
                    .and_then(BertStageEmbeddings::parts)
                else {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): takes the previous stage's hidden states [B, T, {}], not token ids (it has no embeddings)",
                        self.spec,
                        self.config.hidden_size
                    );
                };
                check_inputs(&self.config, ids, attention_mask, token_type_ids)?;
                embed(parts, ids, token_type_ids)?
            }
            StageInput::Hidden(h) => {
                if self.spec.embedding {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): holds the embeddings and takes token ids [B, T], not hidden states",
                        self.spec
                    );
                }
                let d = h.tensor().dims();
                if d.len() != 3 || d[2] != self.config.hidden_size || d[1] == 0 {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): hidden states must be [B, T, {}], got {}",
                        self.spec,
                        self.config.hidden_size,
                        h.tensor().shape()
                    );
                }
                if let Some(m) = attention_mask {
                    if m.rank() != 2 || m.dims()[0] != d[0] {
                        meshgrad_tensor::bail!(
                            "bert stage ({}): attention_mask {} does not match the hidden states {} (need [B, T] with B = {})",
                            self.spec,
                            m.shape(),
                            h.tensor().shape(),
                            d[0]
                        );
                    }
                }
                h.clone()
            }
        };
        let mask = attention_mask
            .map(|m| additive_mask(m, self.layer_param().tensor()))
            .transpose()?;
        for layer in self.bert.encoder.layer.blocks() {
            x = run_layer(layer, &x, mask.as_ref(), self.activation_checkpointing)?;
        }
        Ok(x)
    }

    fn head(&self) -> Result<(&BertOnlyMLMHead, &Var)> {
        match (&self.cls, self.word_embeddings()) {
            (Some(cls), Some(table)) => Ok((cls, table)),
            _ => meshgrad_tensor::bail!(
                "bert stage ({}): has no MLM head (only the last stage computes logits and the loss)",
                self.spec
            ),
        }
    }

    /// MLM logits `[B, T, vocab_size]` (as [`BertForMaskedLM::forward`]; under tensor
    /// parallelism this rank's vocabulary slice) on the stage with the head.
    pub fn logits(
        &self,
        input: StageInput<'_>,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
    ) -> Result<Var> {
        let (cls, table) = self.head()?;
        cls.logits(
            &self.hidden_states(input, attention_mask, token_type_ids)?,
            table,
        )
    }

    /// The MLM loss of `labels [B, T]` on the stage with the head: the summed cross-entropy
    /// over the labelled tokens divided by `denominator`, or by their count when `None` (as
    /// [`BertForMaskedLM::loss_over`] and [`BertForMaskedLM::loss`]).
    pub fn loss(
        &self,
        input: StageInput<'_>,
        attention_mask: Option<&Tensor>,
        token_type_ids: Option<&Tensor>,
        labels: &Tensor,
        denominator: Option<f64>,
    ) -> Result<Var> {
        let (cls, _) = self.head()?;
        let n = count_labels(&self.config, labels)?;
        let denominator = denominator.unwrap_or(n.max(1) as f64);
        if !(denominator.is_finite() && denominator > 0.0) {
            meshgrad_tensor::bail!(
                "bert: the loss denominator must be positive, got {denominator}"
            );
        }
        let logits = self.logits(input, attention_mask, token_type_ids)?;
        let d = logits.tensor().dims();
        if labels.dims() != &d[..2] {
            meshgrad_tensor::bail!(
                "bert stage ({}): labels {} do not match the input's [B, T] = [{}, {}]",
                self.spec,
                labels.shape(),
                d[0],
                d[1]
            );
        }
        cls.loss(&logits, labels, n, denominator)
    }
}

impl ModelStage for BertStage {
    type Batch = BertBatch;

    fn spec(&self) -> &StageSpec {
        &self.spec
    }

    fn tied_table(&self) -> Option<&'static str> {
        Some("bert.embeddings.word_embeddings.weight")
    }

    /// Hidden states, or the MLM loss of `batch.labels` on the stage with the head. Every stage
    /// checks `batch`'s ids, mask and token types against each other (and a later stage its
    /// hidden states' batch against them).
    fn forward_stage(&self, batch: &BertBatch, hidden: Option<&Var>) -> Result<Var> {
        let (mask, types) = (batch.attention_mask.as_ref(), batch.token_type_ids.as_ref());
        let (b, _) = check_inputs(&self.config, &batch.ids, mask, types)?;
        let input = match hidden {
            Some(h) => {
                if h.tensor().rank() == 3 && h.tensor().dims()[0] != b {
                    meshgrad_tensor::bail!(
                        "bert stage ({}): hidden states {} do not match the batch's input_ids {}",
                        self.spec,
                        h.tensor().shape(),
                        batch.ids.shape()
                    );
                }
                StageInput::Hidden(h)
            }
            None => StageInput::Ids(&batch.ids),
        };
        if self.spec.head {
            if batch.labels.dims() != batch.ids.dims() {
                meshgrad_tensor::bail!(
                    "bert: labels {} must match input_ids {}",
                    batch.labels.shape(),
                    batch.ids.shape()
                );
            }
            self.loss(input, mask, types, &batch.labels, batch.denominator)
        } else {
            self.hidden_states(input, mask, types)
        }
    }
}

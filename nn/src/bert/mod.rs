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
//! * [`BertConfig`]: the hyper-parameters and their checks.
//! * [`BertForMaskedLM`]: the model, or a stage of it; one type, the whole model being the stage
//!   of every encoder layer with the embeddings and the head ([`crate::StageSpec::full`]). It
//!   implements [`crate::ModelStage`] with the microbatch [`BertBatch`].
//! * Its parts, under Hugging Face's names: [`BertModel`] (`bert.`: [`BertEmbeddings`] and the
//!   [`BertEncoder`] of [`BertLayer`]s) and the MLM head [`BertOnlyMLMHead`] (`cls.`); the loss
//!   skips the labels [`IGNORE_INDEX`].
//! * [`BertForMaskedLM::tp_plan`], [`BertForMaskedLM::stage_tp_plan`], [`check_tp_sizes`],
//!   [`reference_chunks`]: tensor parallelism.
//! * Hugging Face BERT checkpoint folders: [`crate::state::hf_bert`]; the masking of inputs:
//!   [`crate::mlm`].
//!
//! # Stages
//!
//! A stage ([`BertForMaskedLM::new_stage`]) is a contiguous range of the encoder layers, with or
//! without the embeddings and the MLM head, under the whole model's parameter names
//! (`bert.encoder.layer.{i}` keeps its global `i`; see [`crate::stage`]). A later stage with the
//! head holds its own copy of the word-embedding table for the tied decoder
//! ([`crate::ModelStage::tied_parameters`]). [`BertBatch`] is a microbatch as the stages read
//! it; [`BertForMaskedLM::stage_tp_plan`] is the part of [`BertForMaskedLM::tp_plan`] that a
//! stage's modules take.
//!
//! # Tensor and sequence parallelism
//!
//! [`BertForMaskedLM::build`] with a
//! [`ParamBuilder::tensor_parallel`](crate::ParamBuilder::tensor_parallel) builder and
//! [`BertForMaskedLM::tp_plan`] builds this rank's part of the model (see [`crate::tp`]); every
//! split parameter holds exactly its slice of the single-device one (a stage likewise, with
//! [`BertForMaskedLM::build_stage`] and [`BertForMaskedLM::stage_tp_plan`]). Over `tp` ranks:
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
//! its global heads ([`Dropout::forward_heads`](crate::layers::Dropout::forward_heads)), so every
//! layout drops what one device drops. The MLM logits stay split by vocabulary
//! (`[B, T, vocab / tp]`) and the loss is the loss-parallel cross-entropy: the full logits are
//! never gathered.
//!
//! BERT normalises after each residual, so with sequence parallelism the region split along the
//! sequence (`[B, T / tp, C]` per rank) starts at `embeddings.LayerNorm` (which cuts the
//! replicated embedding sum to this rank's positions) and holds the embedding dropout, each
//! residual dropout, the residual additions and each residual `LayerNorm`. Query/key/value and
//! `intermediate.dense` all-gather the sequence on entry; both output projections
//! reduce-scatter into the region. The MLM head's transform (dense, GELU, `LayerNorm`) runs on
//! this rank's positions (its replicated parameters' gradients summed over the ranks); the
//! decoder gathers the positions and produces its vocabulary slice for all of them.

mod config;
mod embeddings;
mod head;
mod layer;
mod model;
mod tp;

pub use config::BertConfig;
pub use embeddings::BertEmbeddings;
pub use head::{BertLMPredictionHead, BertOnlyMLMHead, BertPredictionHeadTransform, IGNORE_INDEX};
pub use layer::{
    BertAttention, BertEncoder, BertIntermediate, BertLayer, BertResidualOutput, BertSelfAttention,
};
pub use model::{BertBatch, BertForMaskedLM, BertModel};
pub use tp::{check_tp_sizes, reference_chunks};

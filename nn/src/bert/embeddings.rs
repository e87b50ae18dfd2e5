//! [`BertEmbeddings`] (`bert.embeddings`): word, position and token-type embeddings, summed,
//! then `LayerNorm` and dropout.

use meshgrad_autograd::Var;
use meshgrad_tensor::{DType, Result, Tensor};

use super::BertConfig;
use crate::cp::ContextParallel;
use crate::layers::{Dropout, Embedding, LayerNorm};
use crate::module::Forward;
use crate::param_builder::ParamBuilder;

/// Word, position and token-type embeddings, summed, then `LayerNorm` and dropout
/// (`bert.embeddings`).
///
/// The whole model, and the stage with the embeddings, hold all of it. A later stage with the
/// MLM head holds only `word_embeddings`: its copy of the table the tied decoder reads (see
/// [`BertForMaskedLM`](crate::bert::BertForMaskedLM)).
#[derive(crate::Module)]
#[module(crate = crate)]
pub struct BertEmbeddings {
    /// `[vocab_size, hidden]`: the lookup table and the MLM decoder's weight.
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
    /// The context-parallel group the sequence is split over (from the builder), if any: the
    /// position embeddings read the global positions of the local tokens.
    pub cp: Option<ContextParallel>,
}

impl BertEmbeddings {
    /// The embeddings of config `c`: all of them with `lookup`, else only the word-embedding
    /// table (for the tied decoder of a later stage with the head).
    pub(super) fn new(p: &ParamBuilder, c: &BertConfig, lookup: bool) -> Result<Self> {
        let std = c.initializer_range;
        let table = |rows: usize| -> Result<Option<Embedding>> {
            lookup
                .then(|| Embedding::new(p, rows, c.hidden_size, std))
                .transpose()
        };
        Ok(BertEmbeddings {
            word_embeddings: Embedding::new(p, c.vocab_size, c.hidden_size, std)?,
            position_embeddings: table(c.max_position_embeddings)?,
            token_type_embeddings: table(c.type_vocab_size)?,
            layer_norm: lookup
                .then(|| LayerNorm::new(p, c.hidden_size, true, c.layer_norm_eps))
                .transpose()?,
            dropout: lookup
                .then(|| Dropout::on_sequence(c.hidden_dropout_prob, p))
                .transpose()?,
            cp: p.context_parallel_group().cloned(),
        })
    }

    /// `ids [B, T]`, `token_type_ids [B, T]` (type 0 when `None`) -> `[B, T, hidden]`: word +
    /// token-type + position (`0..T`, or the global positions of this rank's tokens under context
    /// parallelism) embeddings, then `LayerNorm` and dropout. An error when
    /// this holds only the word-embedding table.
    pub fn forward(&self, ids: &Tensor, token_type_ids: Option<&Tensor>) -> Result<Var> {
        let (Some(position), Some(token_type), Some(layer_norm), Some(dropout)) = (
            &self.position_embeddings,
            &self.token_type_embeddings,
            &self.layer_norm,
            &self.dropout,
        ) else {
            meshgrad_tensor::bail!(
                "bert embeddings: only the word-embedding table is held here (the tied decoder's \
                 copy on a later stage with the head); token ids cannot be embedded"
            );
        };
        let t = ids.dims()[1];
        let pos = match &self.cp {
            Some(cp) => cp.positions(t, ids.device())?,
            None => Tensor::arange(0, t as i64, DType::I64, ids.device())?,
        };
        let zeros;
        let types = match token_type_ids {
            Some(tt) => tt,
            None => {
                zeros = Tensor::zeros(ids.shape().clone(), DType::U32, ids.device())?;
                &zeros
            }
        };
        let x = self
            .word_embeddings
            .forward(ids)?
            .add(&token_type.forward(types)?)?
            .add(&position.forward(&pos)?)?;
        dropout.forward(&layer_norm.forward(&x)?)
    }
}

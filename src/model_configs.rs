//! The models a training config describes, for every part of the CLI that builds or sizes one
//! (the recipes, reference mode's chunk counts, the memory preflight, checkpoints): the one
//! place where `[model]` keys become a GPT, Llama, Mixtral or BERT config.

use meshgrad_nn::bert::BertConfig;
use meshgrad_nn::llama::LlamaConfig;
use meshgrad_nn::mlm::{MlmConfig, SpecialTokens};
use meshgrad_nn::moe::MoeSettings;
use meshgrad_nn::GptConfig;

use crate::config::{ModelKind, TrainConfig};

/// The GPT a training config describes.
pub fn gpt_config(cfg: &TrainConfig) -> GptConfig {
    let m = &cfg.model;
    GptConfig {
        vocab_size: m.padded_vocab(m.vocab_size),
        block_size: m.block_size,
        n_layer: m.n_layer,
        n_head: m.n_head,
        n_embd: m.n_embd,
        dropout: m.dropout,
        bias: m.bias,
        layer_norm_eps: 1e-5,
    }
}

/// The Llama a training config describes: `n_embd` wide, `n_layer` layers of `n_head` query
/// heads and `model.n_kv_head` key/value heads, the MLP `model.intermediate_size` wide,
/// `model.rope_theta`, `model.norm_eps`, the head tied to the token table by
/// `model.tie_embeddings` (untied by default), context `block_size`, the vocabulary padded by
/// `model.vocab_multiple`.
pub fn llama_config(cfg: &TrainConfig) -> LlamaConfig {
    let m = &cfg.model;
    let mut c = LlamaConfig::new(
        m.padded_vocab(m.vocab_size),
        m.block_size,
        m.n_embd,
        m.n_layer,
        m.n_head,
    );
    c.n_kv_head = m.kv_heads();
    c.intermediate_size = m.ffn_hidden();
    c.rope_theta = m.rope_theta;
    c.norm_eps = m.norm_eps;
    c.tie_embeddings = m.tied();
    c
}

/// The Mixtral a training config describes: the Llama of [`llama_config`] whose feed-forwards
/// are mixtures of `model.n_experts` experts (each `intermediate_size` wide), routing each token
/// to `model.experts_per_token`, with `model.router_aux_loss_coef` and
/// `model.expert_capacity_factor`.
pub fn mixtral_config(cfg: &TrainConfig) -> LlamaConfig {
    let m = &cfg.model;
    let mut c = llama_config(cfg);
    c.moe = Some(MoeSettings {
        n_experts: m.n_experts,
        experts_per_token: m.experts_per_token,
        router_aux_loss_coef: m.router_aux_loss_coef,
        capacity_factor: m.expert_capacity_factor,
    });
    c
}

/// The sizes of the model a training config describes (for memory and cost estimates).
pub fn model_shape(cfg: &TrainConfig) -> meshgrad_nn::ModelShape {
    match cfg.model.kind {
        ModelKind::Gpt => gpt_config(cfg).shape(),
        ModelKind::Llama => llama_config(cfg).shape(),
        ModelKind::Mixtral => mixtral_config(cfg).shape(),
        ModelKind::Bert => bert_config(cfg).shape(),
    }
}

/// The special tokens of a run: appended after `model.vocab_size` ordinary ids.
pub fn special_tokens(cfg: &TrainConfig) -> SpecialTokens {
    SpecialTokens::after(cfg.model.vocab_size as u32)
}

/// The BERT a training config describes: `n_embd` wide, `n_layer` layers of `n_head` heads, a
/// 4x feed-forward, `block_size` positions, two token types, `model.dropout` on the hidden states
/// and the attention probabilities, the vocabulary of [`special_tokens`] (padded to a multiple of
/// `model.vocab_multiple`).
pub fn bert_config(cfg: &TrainConfig) -> BertConfig {
    let m = &cfg.model;
    let sp = special_tokens(cfg);
    BertConfig {
        vocab_size: m.padded_vocab(sp.mask as usize + 1),
        hidden_size: m.n_embd,
        num_hidden_layers: m.n_layer,
        num_attention_heads: m.n_head,
        intermediate_size: 4 * m.n_embd,
        max_position_embeddings: m.block_size,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: m.dropout,
        attention_probs_dropout_prob: m.dropout,
        pad_token_id: sp.pad as usize,
        initializer_range: 0.02,
    }
}

/// The masking of a run: BERT's proportions, random replacements among the ordinary ids.
pub fn mlm_config(cfg: &TrainConfig) -> MlmConfig {
    MlmConfig::bert(cfg.model.vocab_size as u32, special_tokens(cfg))
}

//! meshgrad layers and models: the [`Module`] trait, linear/embedding/norm/dropout/attention/MLP
//! layers, the GPT, BERT (masked-LM) and Llama models (each whole, or as stages: a range of blocks
//! with or without the embedding and the head, under the whole model's parameter names), MLM
//! masking, optimizers, learning-rate schedules, state dicts (safetensors and Hugging Face GPT-2,
//! BERT and Llama checkpoints), token datasets (in memory, JSONL, memory-mapped llm.c shards),
//! tokenizers (Hugging Face `tokenizers`: byte-level BPE and WordPiece), evaluation losses
//! ([`eval`]), the kernel self-check ([`selftest`]: every op on a device against the CPU in
//! f64) and the GPT training-step benchmark ([`bench`](mod@bench)).

pub mod bench;
pub mod bert;
pub mod causal_lm;
pub mod cp;
pub mod data;
pub mod eval;
pub mod family;
mod generation;
pub mod gpt;
mod input_checks;
pub mod layers;
pub mod llama;
pub mod mixtral;
pub mod mlm;
pub mod module;
pub mod moe;
pub mod optim;
pub mod param_builder;
pub mod selftest;
pub mod shape;
pub mod stage;
pub mod state;
pub mod tokenizer;
pub mod tp;

pub use bert::{BertBatch, BertConfig, BertForMaskedLM};
pub use causal_lm::CausalLm;
pub use family::CausalFamily;
pub use gpt::{Gpt, GptBatch, GptConfig};
pub use layers::{
    Activation, Block, BlockConfig, CausalSelfAttention, Dropout, Embedding, LayerNorm, Linear,
    LinearConfig, Mlp, RmsNorm, SequenceEntry, Sequential,
};
pub use llama::{Llama, LlamaBatch, LlamaConfig};
pub use meshgrad_autograd::ForwardCtx;
/// Derives [`Module`] from a struct's fields (see [`module`] and the `meshgrad-derive` crate).
pub use meshgrad_derive::Module;
pub use mixtral::Mixtral;
pub use module::{Forward, Module};
pub use param_builder::{Init, InitialValues, ParamBuilder};
pub use shape::ModelShape;
pub use stage::{run_chained, BlockRange, ModelStage, StageInput, StageSpec};

impl From<data::DataError> for meshgrad_tensor::Error {
    /// Data errors join the framework's one error type, so `?` works across both.
    fn from(e: data::DataError) -> Self {
        meshgrad_tensor::Error::msg(e.to_string())
    }
}

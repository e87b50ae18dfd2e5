//! meshgrad layers and models: the [`Module`] trait, linear/embedding/norm/dropout/attention/MLP
//! layers, the GPT model, optimizers, learning-rate schedules, state dicts (safetensors and
//! Hugging Face GPT-2 checkpoints) and token datasets.

pub mod bert;
pub mod data;
pub mod gpt;
pub mod hooks;
pub mod layers;
pub mod mlm;
pub mod module;
pub mod optim;
pub mod state;

pub use bert::{BertConfig, BertForMaskedLM};
pub use gpt::{Gpt, GptConfig};
pub use hooks::{ForwardHooks, HookSlot, Stage, Staged};
pub use layers::{
    Activation, Block, BlockConfig, CausalSelfAttention, Dropout, Embedding, LayerNorm, Linear,
    LinearConfig, Mlp, Sequential,
};
pub use meshgrad_autograd::ForwardCtx;
/// Derives [`Module`] from a struct's fields (see [`module`] and the `meshgrad-derive` crate).
pub use meshgrad_derive::Module;
pub use module::{Forward, Init, Module, ParamBuilder};

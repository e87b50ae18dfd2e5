//! meshgrad layers and models: the [`Module`] trait, linear/embedding/norm/dropout/attention/MLP
//! layers, the GPT model, optimizers, learning-rate schedules, state dicts (safetensors and
//! Hugging Face GPT-2 checkpoints), token datasets (in memory, JSONL, memory-mapped llm.c shards)
//! and tokenizers (Hugging Face `tokenizers`: byte-level BPE and WordPiece).

pub mod data;
pub mod gpt;
pub mod hooks;
pub mod layers;
pub mod module;
pub mod optim;
pub mod state;
pub mod tokenizer;

pub use gpt::{Gpt, GptConfig};
pub use hooks::{ForwardHooks, HookSlot, Stage, Staged};
pub use module::{Init, Module, ParamFactory};

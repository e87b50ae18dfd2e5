//! Llama (Hugging Face `LlamaForCausalLM`): RMSNorm, rotary position embeddings, grouped-query
//! attention, a SwiGLU MLP, an untied or tied head.
//!
//! * [`LlamaConfig`]: the hyper-parameters and their checks; [`RopeAngles`]: how the rotary
//!   embedding rounds its angles (exactly, or as transformers does).
//! * [`Llama`]: the model, or a stage of it; one type, the whole model being the stage of every
//!   layer with the embedding and the head ([`crate::StageSpec::full`]). It implements
//!   [`crate::ModelStage`] with the microbatch [`LlamaBatch`].
//! * [`Llama::tp_plan`], [`check_tp_sizes`], [`reference_chunks`]: tensor parallelism.
//! * Hugging Face checkpoint folders: [`crate::state::hf_llama`].

pub(crate) mod block;
mod config;
mod family;
mod model;
mod rope;

pub use block::{LlamaAttention, LlamaDecoderLayer, LlamaMlp};
pub use config::LlamaConfig;
pub use model::{check_tp_sizes, reference_chunks, Llama, LlamaBatch, LlamaBody, LlamaHead};
pub use rope::RopeAngles;

//! GPT (the GPT-2 architecture): learned positions, pre-LayerNorm blocks, tied output head.
//!
//! * [`GptConfig`]: the hyper-parameters and their checks.
//! * [`Gpt`]: the model, or a stage of it; one type, the whole model being the stage of every
//!   block with the embedding and the head ([`crate::StageSpec::full`]). It implements
//!   [`crate::ModelStage`] with the microbatch [`GptBatch`].
//! * [`Gpt::tp_plan`], [`Gpt::stage_tp_plan`], [`check_tp_sizes`], [`reference_chunks`]: tensor
//!   parallelism.
//! * Hugging Face GPT-2 checkpoint folders: [`crate::state::hf_gpt2`].

mod config;
mod family;
mod model;

pub use config::GptConfig;
pub use model::{check_tp_sizes, reference_chunks, Gpt, GptBatch};

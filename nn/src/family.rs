//! [`CausalFamily`]: what is needed to build, split and size a next-token model family without
//! naming it. The trainer (`meshgrad train`'s recipe for next-token models), the memory report
//! (`meshgrad_parallel::memory_report`) and estimates take a family as a type parameter; each
//! family implements it once, beside its model ([`crate::Gpt`], [`crate::Llama`]).

use std::path::Path;

use meshgrad_tensor::Result;

use crate::gpt::GptBatch;
use crate::tp::TpPlan;
use crate::{CausalLm, ModelShape, ModelStage, Module, ParamBuilder, StageSpec};

/// A next-token model family: its config, its stages (the whole model being the full stage), how
/// tensor parallelism splits them, and its whole model for checkpoints and generation.
pub trait CausalFamily: Sync + Sized + 'static {
    /// The model's hyper-parameters.
    type Config: Copy + Send + Sync + std::fmt::Debug;
    /// A stage of the model (the whole model being the full stage).
    type Stage: ModelStage<Batch = GptBatch> + Send + Sync;
    /// The whole model, for the checkpoint and the sample.
    type Whole: CausalLm + Module;
    /// The family's name in messages.
    const NAME: &'static str;
    /// Checks the config's sizes and values, with one-line errors.
    fn validate(config: &Self::Config) -> Result<()>;
    /// The config with its vocabulary padded to a multiple of `tp` (for the size checks that
    /// come before the vocabulary's own, which names the key that pads it).
    fn padded(config: Self::Config, tp: usize) -> Self::Config;
    /// The vocabulary of `config`.
    fn vocab(config: &Self::Config) -> usize;
    /// One-line errors for sizes that do not split over `tp` ranks (`sequence`: the sequence
    /// length under sequence parallelism).
    fn check_tp(config: &Self::Config, tp: usize, sequence: Option<usize>) -> Result<()>;
    /// Blocks (layers) of the model.
    fn n_layer(config: &Self::Config) -> usize;
    /// Parameters of the whole model.
    fn num_parameters(config: &Self::Config) -> usize;
    /// The model's sizes for memory and cost estimates.
    fn shape(config: &Self::Config) -> ModelShape;
    /// What a header says of the model before its parameter count (empty for the GPT).
    fn describe(config: &Self::Config) -> String;
    /// The tensor-parallel plan of stage `spec`.
    fn tp_plan(config: &Self::Config, spec: &StageSpec) -> TpPlan;
    /// Builds stage `spec` through `builder`, recomputing its blocks in the backward when
    /// `checkpointing`.
    fn build_stage(
        config: Self::Config,
        spec: StageSpec,
        builder: ParamBuilder,
        checkpointing: bool,
    ) -> Result<Self::Stage>;
    /// Builds the whole model through `builder`, sampling only among the first `vocab_in_use`
    /// ids.
    fn build_whole(
        config: Self::Config,
        builder: ParamBuilder,
        vocab_in_use: usize,
    ) -> Result<Self::Whole>;
    /// Saves the whole model as the family's Hugging Face folder `dir`.
    fn save(model: &Self::Whole, dir: &Path) -> Result<()>;
    /// The mixture-of-experts settings of a family whose feed-forwards are experts (the trainer
    /// reports their load and adds their load-balancing loss to the reported loss); `None`, the
    /// default, for a dense model.
    fn moe(_config: &Self::Config) -> Option<crate::moe::MoeSettings> {
        None
    }
}

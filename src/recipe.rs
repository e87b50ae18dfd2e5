//! What the trainer needs from a model family: a [`Recipe`]. The trainer ([`crate::rank_train`])
//! knows recipes, never a model by name; [`crate::train::train`] maps the config's model kind to
//! its recipe (the registry: one `match`). A family is one recipe, or one family of a recipe:
//! the next-token models (GPT, Llama) in [`crate::recipe_causal`], BERT in
//! [`crate::recipe_bert`].
//!
//! The model is built as stages ([`ModelStage`]); the whole model is the one stage
//! [`StageSpec::full`], so one device, data and tensor parallelism run the same code as a
//! pipeline, with one stage.

use std::ops::Range;
use std::sync::Arc;

use anyhow::Result;
use meshgrad_autograd::distributed::ChunkOrder;
use meshgrad_nn::cp::ContextParallel;
use meshgrad_nn::moe::ExpertParallel;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{InitialValues, ModelStage, ParamBuilder, StageSpec};
use meshgrad_parallel::pipeline::Microbatch;
use meshgrad_parallel::{Communicator, ParallelLayout};
use meshgrad_tensor::Tensor;

use crate::config::TrainConfig;
use crate::run_setup::{RunData, TrainOptions, TrainSummary, Verbosity};
use crate::step_loop::{LoopResult, Reporter};

/// What stage to build and how: its own parameters only, split by `tp` when given, taking its
/// chunks of each sequence over `cp` when given, holding its block of the experts over `ep` when
/// given, lazily
/// initialised when `delayed`, recomputing its blocks' activations in the backward when
/// `checkpointing`, starting from `init` (`--init-from`) instead of the run seed's values.
pub(crate) struct StageBuild {
    pub(crate) spec: StageSpec,
    pub(crate) tp: Option<TensorParallel>,
    pub(crate) cp: Option<ContextParallel>,
    pub(crate) ep: Option<ExpertParallel>,
    pub(crate) delayed: bool,
    pub(crate) checkpointing: bool,
    pub(crate) init: Option<Arc<InitialValues>>,
}

impl StageBuild {
    /// The whole model on one device, from the run seed, nothing recomputed (profiling).
    pub(crate) fn plain(spec: StageSpec) -> StageBuild {
        StageBuild {
            spec,
            tp: None,
            cp: None,
            ep: None,
            delayed: false,
            checkpointing: false,
            init: None,
        }
    }

    /// `builder` with this build's delayed initialisation, initial values and context
    /// parallelism.
    pub(crate) fn prepare(&self, mut builder: ParamBuilder) -> ParamBuilder {
        if let Some(cp) = &self.cp {
            builder = builder.context_parallel(cp.clone());
        }
        if let Some(ep) = &self.ep {
            builder = builder.expert_parallel(ep.clone());
        }
        if self.delayed {
            builder = builder.delayed_init();
        }
        if let Some(values) = &self.init {
            builder = builder.initial_values(values.clone());
        }
        builder
    }
}

/// A model family's training recipe (see the [module docs](self)).
pub(crate) trait Recipe: Sync + Sized {
    /// The model's stage (the whole model being the full stage).
    type Stage: ModelStage + Send + Sync;
    /// The family's name in messages (`GPT`, `BERT`).
    const NAME: &'static str;
    /// One-line refusals of `cfg` (resolved) under `layout` (`None`: one device) before any
    /// data is read: sizes that do not split over tensor parallelism, options the family does
    /// not support.
    fn check(cfg: &TrainConfig, layout: Option<&ParallelLayout>, opts: &TrainOptions)
        -> Result<()>;
    /// The recipe of the run `cfg` (resolved and checked) on `data`.
    fn new(cfg: TrainConfig, data: RunData) -> Result<Self>;
    /// The training config.
    fn cfg(&self) -> &TrainConfig;
    /// Number of blocks (layers) to split.
    fn n_blocks(&self) -> usize;
    /// Builds a stage on the run's device and in its precision as `b` says.
    fn build_stage(&self, b: StageBuild) -> Result<Self::Stage>;
    /// The microbatches of training step `step` for `rows` (this data-parallel rank's), split
    /// `microbatches` ways, on the run's device; `dp` is the number of ranks the loss is averaged
    /// over (data-parallel times context-parallel). The executor scales the last stage's output
    /// by `1 / microbatches` for the backward and averages it for the step's loss, which,
    /// averaged over those ranks, must be the step's global loss.
    fn train_microbatches(
        &self,
        step: u64,
        rows: Range<u64>,
        microbatches: usize,
        dp: usize,
    ) -> Result<Vec<Microbatch<<Self::Stage as ModelStage>::Batch>>>;
    /// Context parallelism: this rank's chunks (`order`) of every sequence of `batch`. Each
    /// rank's loss must then be its tokens' share of the global mean times the group size (for
    /// equal token counts, the mean over its own tokens), as gradients and losses are averaged
    /// over the context-parallel ranks with the data-parallel ones. Default: a one-line refusal.
    fn context_chunks(
        &self,
        _batch: <Self::Stage as ModelStage>::Batch,
        _order: &ChunkOrder,
    ) -> Result<<Self::Stage as ModelStage>::Batch> {
        anyhow::bail!(
            "context parallelism (cp) is not supported for {} yet",
            Self::NAME
        )
    }
    /// The validation batches of `rows` (this data-parallel rank's), on the run's device.
    fn val_batches(&self, rows: Range<u64>) -> Result<Vec<<Self::Stage as ModelStage>::Batch>>;
    /// The validation loss from the sum of the last stage's outputs over the validation batches
    /// (the same on every rank of a data-parallel group; `dp` averages over it).
    fn val_loss(&self, local_sum: f64, n_batches: usize, dp: &dyn Communicator) -> Result<f64>;
    /// Reference mode: the factor each row group's loss is multiplied by before its backward,
    /// and the step's tree sum of row-group losses after it (`total` row groups in the global
    /// batch). Default (a mean over tokens): `1 / total`.
    fn reference_loss_scale(&self, total: usize) -> f64 {
        1.0 / total as f64
    }
    /// Reference mode: validation batch `batch`'s loss from the tree sum of its row groups'
    /// losses over the whole global batch (`total` row groups). Default: the sum divided by
    /// `total`.
    fn reference_val_loss(&self, sum: f64, _batch: u64, total: usize) -> Result<f64> {
        Ok(sum / total as f64)
    }
    /// A mixture of experts' load-balancing coefficient (the trainer then collects the experts'
    /// load each step, reports it and adds `coefficient * aux_loss` to the reported loss);
    /// `None`, the default, for a dense model.
    fn aux_loss_coef(&self) -> Option<f64> {
        None
    }
    /// The run's first log line; `layout` describes the layout (empty on one device).
    fn header(&self, layout: &str) -> String;
    /// A training microbatch of `rows` rows to profile the layers with.
    fn profile_batch(&self, rows: usize) -> Result<<Self::Stage as ModelStage>::Batch>;
    /// The leader's end of the run, from the full single-device state dict: the checkpoint,
    /// the config, a sample, the summary line.
    fn finish(
        &self,
        tensors: &[(String, Tensor)],
        rep: Reporter,
        result: LoopResult,
        verbosity: Verbosity,
    ) -> Result<TrainSummary>;
}

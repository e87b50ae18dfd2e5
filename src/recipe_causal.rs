//! The next-token model families' [`Recipe`]: one recipe, [`CausalRecipe`], for every decoder
//! trained on next-token prediction of the same data (its microbatches, validation, profile
//! batch, header and end of run), and per family a [`CausalFamily`]: how its config is read
//! from the training config, how a stage is built and split by tensor parallelism, and how the
//! whole model is saved. Two families: the GPT-2-style [`Gpt`] (Hugging Face GPT-2 folders) and
//! the [`Llama`] (RMSNorm, RoPE, grouped-query attention, SwiGLU; Hugging Face
//! `LlamaForCausalLM` folders).

use std::ops::Range;
use std::path::Path;

use anyhow::Result;
use meshgrad_nn::data::TokenSource;
use meshgrad_nn::gpt::GptBatch;
use meshgrad_nn::llama::LlamaConfig;
use meshgrad_nn::state::{hf_gpt2, hf_llama, load_state_dict};
use meshgrad_nn::tp::TpPlan;
use meshgrad_nn::{CausalLm, Gpt, GptConfig, Llama, ModelStage, Module, ParamBuilder, StageSpec};
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::pipeline::Microbatch;
use meshgrad_parallel::{micro_rows, Communicator, ParallelLayout, ReduceOp};
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::model_configs::{gpt_config, llama_config};
use crate::recipe::{Recipe, StageBuild};
use crate::run_finish::{finish_run, Finish};
use crate::run_setup::{
    batch_tensors, precision_dtype, train_device, RunData, TrainOptions, TrainSummary, Verbosity,
    VAL_STREAM,
};
use crate::step_loop::{LoopResult, Reporter};

/// What differs between next-token model families (see the [module docs](self)).
pub(crate) trait CausalFamily: Sync + Sized {
    /// The model's hyper-parameters.
    type Config: Copy + Send + Sync;
    /// A stage of the model (the whole model being the full stage).
    type Stage: ModelStage<Batch = GptBatch> + Send + Sync;
    /// The whole model, for the checkpoint and the sample.
    type Whole: CausalLm + Module;
    /// The family's name in messages.
    const NAME: &'static str;
    /// The model a training config describes (its vocabulary padded by `model.vocab_multiple`).
    fn config(cfg: &TrainConfig) -> Self::Config;
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
    /// What the header says of the model before its parameter count (empty for the GPT).
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
    ) -> meshgrad_tensor::Result<Self::Stage>;
    /// Builds the whole model through `builder`, sampling only among the first `vocab_in_use`
    /// ids.
    fn build_whole(
        config: Self::Config,
        builder: ParamBuilder,
        vocab_in_use: usize,
    ) -> meshgrad_tensor::Result<Self::Whole>;
    /// Saves the whole model as the family's Hugging Face folder `dir`.
    fn save(model: &Self::Whole, dir: &Path) -> meshgrad_tensor::Result<()>;
}

impl CausalFamily for Gpt {
    type Config = GptConfig;
    type Stage = Gpt;
    type Whole = Gpt;
    const NAME: &'static str = "GPT";

    fn config(cfg: &TrainConfig) -> GptConfig {
        gpt_config(cfg)
    }
    fn padded(mut config: GptConfig, tp: usize) -> GptConfig {
        config.vocab_size = config.vocab_size.next_multiple_of(tp);
        config
    }
    fn vocab(config: &GptConfig) -> usize {
        config.vocab_size
    }
    fn check_tp(config: &GptConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
        Ok(meshgrad_nn::gpt::check_tp_sizes(config, tp, sequence)?)
    }
    fn n_layer(config: &GptConfig) -> usize {
        config.n_layer
    }
    fn num_parameters(config: &GptConfig) -> usize {
        config.num_parameters()
    }
    fn describe(_config: &GptConfig) -> String {
        String::new()
    }
    fn tp_plan(_config: &GptConfig, spec: &StageSpec) -> TpPlan {
        Gpt::stage_tp_plan(spec)
    }
    fn build_stage(
        config: GptConfig,
        spec: StageSpec,
        builder: ParamBuilder,
        checkpointing: bool,
    ) -> meshgrad_tensor::Result<Gpt> {
        let mut stage = Gpt::build_stage(config, spec, builder)?;
        stage.activation_checkpointing = checkpointing;
        Ok(stage)
    }
    fn build_whole(
        config: GptConfig,
        builder: ParamBuilder,
        vocab_in_use: usize,
    ) -> meshgrad_tensor::Result<Gpt> {
        let mut model = Gpt::build(config, builder)?;
        model.vocab_in_use = Some(vocab_in_use);
        Ok(model)
    }
    fn save(model: &Gpt, dir: &Path) -> meshgrad_tensor::Result<()> {
        hf_gpt2::save_gpt2(model, dir)
    }
}

impl CausalFamily for Llama {
    type Config = LlamaConfig;
    type Stage = Llama;
    type Whole = Llama;
    const NAME: &'static str = "Llama";

    fn config(cfg: &TrainConfig) -> LlamaConfig {
        llama_config(cfg)
    }
    fn padded(mut config: LlamaConfig, tp: usize) -> LlamaConfig {
        config.vocab_size = config.vocab_size.next_multiple_of(tp);
        config
    }
    fn vocab(config: &LlamaConfig) -> usize {
        config.vocab_size
    }
    fn check_tp(config: &LlamaConfig, tp: usize, sequence: Option<usize>) -> Result<()> {
        Ok(meshgrad_nn::llama::check_tp_sizes(config, tp, sequence)?)
    }
    fn n_layer(config: &LlamaConfig) -> usize {
        config.n_layer
    }
    fn num_parameters(config: &LlamaConfig) -> usize {
        config.num_parameters()
    }
    fn describe(c: &LlamaConfig) -> String {
        format!(
            "Llama ({} kv heads of {}, MLP {}, rope_theta {}, {}), ",
            c.n_kv_head,
            c.n_head,
            c.intermediate_size,
            c.rope_theta,
            if c.tie_embeddings { "tied" } else { "untied" }
        )
    }
    fn tp_plan(config: &LlamaConfig, spec: &StageSpec) -> TpPlan {
        Llama::tp_plan(config, spec)
    }
    fn build_stage(
        config: LlamaConfig,
        spec: StageSpec,
        builder: ParamBuilder,
        checkpointing: bool,
    ) -> meshgrad_tensor::Result<Llama> {
        let mut stage = Llama::build_stage(config, spec, builder)?;
        stage.activation_checkpointing = checkpointing;
        Ok(stage)
    }
    fn build_whole(
        config: LlamaConfig,
        builder: ParamBuilder,
        vocab_in_use: usize,
    ) -> meshgrad_tensor::Result<Llama> {
        let mut model = Llama::build(config, builder)?;
        model.vocab_in_use = Some(vocab_in_use);
        Ok(model)
    }
    fn save(model: &Llama, dir: &Path) -> meshgrad_tensor::Result<()> {
        hf_llama::save_llama(model, dir)
    }
}

/// A next-token run's recipe for family `F`.
pub(crate) struct CausalRecipe<F: CausalFamily> {
    cfg: TrainConfig,
    data: RunData,
    config: F::Config,
    /// The run's device (`train.device`).
    device: Device,
}

impl<F: CausalFamily> CausalRecipe<F> {
    /// Parameters from the run seed, in the run's precision, on its device.
    fn builder(&self) -> Result<ParamBuilder> {
        Ok(ParamBuilder::new(self.cfg.train.seed)
            .dtype(precision_dtype(&self.cfg)?)
            .device(self.device))
    }

    /// Rows `rows` of batch `step` of the training (or validation) split, on the run's device.
    fn batch(&self, seed: u64, step: u64, rows: Range<u64>, val: bool) -> Result<GptBatch> {
        let ds = if val {
            &self.data.val
        } else {
            &self.data.train
        };
        let (ids, targets) = batch_tensors(ds, seed, step, rows, self.cfg.model.block_size)?;
        Ok(GptBatch {
            ids: ids.to_device(self.device)?,
            targets: targets.to_device(self.device)?,
            ignore_index: None,
        })
    }
}

impl<F: CausalFamily> Recipe for CausalRecipe<F> {
    type Stage = F::Stage;
    const NAME: &'static str = F::NAME;

    fn check(
        cfg: &TrainConfig,
        layout: Option<&ParallelLayout>,
        opts: &TrainOptions,
    ) -> Result<()> {
        let Some(layout) = layout else {
            return Ok(());
        };
        // The other sizes first; then the vocabulary, whose error names the key that pads it.
        let config = F::config(cfg);
        F::check_tp(
            &F::padded(config, layout.tp()),
            layout.tp(),
            opts.sequence_parallel.then_some(cfg.model.block_size),
        )?;
        crate::ranks::check_vocab_splits(cfg, F::vocab(&config), layout)
    }

    fn new(cfg: TrainConfig, data: RunData) -> Result<Self> {
        Ok(CausalRecipe {
            config: F::config(&cfg),
            device: train_device(&cfg)?,
            cfg,
            data,
        })
    }

    fn cfg(&self) -> &TrainConfig {
        &self.cfg
    }

    fn n_blocks(&self) -> usize {
        F::n_layer(&self.config)
    }

    fn build_stage(&self, b: StageBuild) -> Result<F::Stage> {
        let builder = b.prepare(self.builder()?);
        // Reference mode: the sums tensor parallelism splits are trees over the model's chunk
        // count on every stage, on one device as on tp ranks.
        let plan = F::tp_plan(&self.config, &b.spec);
        crate::reference_tp::build_with_plan(&self.cfg, builder, b.tp, plan, |pb| {
            F::build_stage(self.config, b.spec.clone(), pb, b.checkpointing)
        })
    }

    fn train_microbatches(
        &self,
        step: u64,
        rows: Range<u64>,
        microbatches: usize,
        _dp: usize,
    ) -> Result<Vec<Microbatch<GptBatch>>> {
        micro_rows(rows, microbatches)?
            .into_iter()
            .map(|r| {
                Ok(Microbatch {
                    first_row: r.start,
                    batch: self.batch(self.cfg.train.seed, step, r, false)?,
                })
            })
            .collect()
    }

    fn val_batches(&self, rows: Range<u64>) -> Result<Vec<GptBatch>> {
        (0..self.cfg.train.eval_batches.max(1) as u64)
            .map(|i| self.batch(self.cfg.train.seed ^ VAL_STREAM, i, rows.clone(), true))
            .collect()
    }

    fn val_loss(&self, local_sum: f64, n_batches: usize, dp: &dyn Communicator) -> Result<f64> {
        let mean = local_sum / n_batches.max(1) as f64;
        Ok(all_reduce_scalar(dp, mean, ReduceOp::Avg)?)
    }

    fn header(&self, layout: &str) -> String {
        let (cfg, data) = (&self.cfg, &self.data);
        let tokens = match &data.tokenizer {
            Some(t) => format!("tokenizer {} (vocab {})", t.name(), t.vocab_size()),
            None => "byte-level text".to_string(),
        };
        format!(
            "meshgrad train: {}{} parameters, {} train / {} val tokens from {} (validation: {}; \
             {tokens}), {} steps of {} x {} tokens{layout}",
            F::describe(&self.config),
            F::num_parameters(&self.config),
            data.train.len(),
            data.val.len(),
            data.source,
            data.validation,
            cfg.train.steps,
            cfg.train.batch_size,
            cfg.model.block_size
        )
    }

    fn profile_batch(&self, rows: usize) -> Result<GptBatch> {
        self.batch(self.cfg.train.seed, 0, 0..rows as u64, false)
    }

    fn finish(
        &self,
        tensors: &[(String, Tensor)],
        rep: Reporter,
        result: LoopResult,
        verbosity: Verbosity,
    ) -> Result<TrainSummary> {
        let model = F::build_whole(self.config, self.builder()?, self.cfg.model.vocab_size)?;
        load_state_dict(&model, tensors, true)?;
        let finish = Finish {
            cfg: &self.cfg,
            tokenizer: self.data.tokenizer.as_ref(),
            rep,
            result,
            verbosity,
            sampler: Some(&model),
            note: String::new(),
        };
        finish_run(finish, |out| Ok(F::save(&model, out)?))
    }
}

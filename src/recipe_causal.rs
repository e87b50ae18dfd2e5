//! The next-token model families' [`Recipe`]: one recipe, [`CausalRecipe`], for every decoder
//! trained on next-token prediction of the same data (its microbatches, validation, profile
//! batch, header and end of run), over a family's [`CausalFamily`] (nn: how a stage is built
//! and split by tensor parallelism, how the whole model is saved) and its [`TrainFamily`] (how
//! its config is read from the training config). Three families: the GPT-2-style [`Gpt`] (Hugging Face GPT-2 folders) and
//! the [`Llama`] (RMSNorm, RoPE, grouped-query attention, SwiGLU; Hugging Face
//! `LlamaForCausalLM` folders) and the [`Mixtral`] (a Llama with mixture-of-experts
//! feed-forwards; `MixtralForCausalLM` folders).

use std::ops::Range;

use anyhow::Result;
use meshgrad_autograd::distributed::ChunkOrder;
use meshgrad_nn::data::TokenSource;
use meshgrad_nn::gpt::GptBatch;
use meshgrad_nn::llama::LlamaConfig;
use meshgrad_nn::state::load_state_dict;
use meshgrad_nn::{CausalFamily, Gpt, GptConfig, Llama, Mixtral, ParamBuilder};
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::pipeline::Microbatch;
use meshgrad_parallel::{micro_rows, Communicator, ParallelLayout, ReduceOp};
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::model_configs::{gpt_config, llama_config, mixtral_config};
use crate::recipe::{Recipe, StageBuild};
use crate::run_finish::{finish_run, Finish};
use crate::run_setup::{
    batch_tensors, precision_dtype, train_device, RunData, TrainOptions, TrainSummary, Verbosity,
    VAL_STREAM,
};
use crate::step_loop::{LoopResult, Reporter};

/// A next-token family as a training config describes it: the family ([`CausalFamily`]) and
/// how its config is read from `[model]`.
pub(crate) trait TrainFamily: CausalFamily {
    /// The model a training config describes (its vocabulary padded by `model.vocab_multiple`).
    fn config(cfg: &TrainConfig) -> Self::Config;
}

impl TrainFamily for Gpt {
    fn config(cfg: &TrainConfig) -> GptConfig {
        gpt_config(cfg)
    }
}

impl TrainFamily for Llama {
    fn config(cfg: &TrainConfig) -> LlamaConfig {
        llama_config(cfg)
    }
}

impl TrainFamily for Mixtral {
    fn config(cfg: &TrainConfig) -> LlamaConfig {
        mixtral_config(cfg)
    }
}

/// A next-token run's recipe for family `F`.
pub(crate) struct CausalRecipe<F: TrainFamily> {
    cfg: TrainConfig,
    data: RunData,
    config: F::Config,
    /// The run's device (`train.device`).
    device: Device,
}

impl<F: TrainFamily> CausalRecipe<F> {
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

impl<F: TrainFamily> Recipe for CausalRecipe<F> {
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
        crate::ranks::check_context_parallel(cfg, layout)?;
        // The other sizes first; then the vocabulary, whose error names the key that pads it.
        let config = F::config(cfg);
        if layout.ep() > 1 {
            let Some(moe) = F::moe(&config) else {
                anyhow::bail!(
                    "layout {layout}: expert parallelism (ep) needs a model with experts; {} has \
                     none (use --model mixtral)",
                    F::NAME
                );
            };
            meshgrad_nn::moe::ExpertParallel::check_divides(layout.ep(), moe.n_experts)
                .map_err(|e| anyhow::anyhow!("layout {layout}: {e} (model.n_experts)"))?;
        }
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

    /// The ids and targets cut to this rank's chunks: every target is counted (no ignore
    /// index) and every rank holds the same number, so each rank's mean is its share of the
    /// global mean times the group size.
    fn context_chunks(&self, batch: GptBatch, order: &ChunkOrder) -> Result<GptBatch> {
        Ok(GptBatch {
            ids: order.local_of(&batch.ids, 1)?,
            targets: order.local_of(&batch.targets, 1)?,
            ignore_index: batch.ignore_index,
        })
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

    fn aux_loss_coef(&self) -> Option<f64> {
        F::moe(&self.config).map(|m| m.router_aux_loss_coef)
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

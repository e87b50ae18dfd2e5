//! The GPT under pipeline parallelism: its [`PipelineTask`] (stages, microbatches, validation,
//! profile and checkpoint), driven by [`crate::train_pipeline`].

use std::ops::Range;

use anyhow::Result;
use meshgrad_nn::gpt::{GptBatch, GptStage};
use meshgrad_nn::state::load_state_dict;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{Gpt, GptConfig, ParamBuilder, StageSpec};
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::pipeline::Microbatch;
use meshgrad_parallel::{micro_rows, Communicator, ReduceOp};
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::train::{
    batch_tensors, finish_run, gpt_config, header, LoopResult, Reporter, RunData, TrainSummary,
    Verbosity, VAL_STREAM,
};
use crate::train_pipeline::PipelineTask;

/// A GPT run's pipeline task.
pub(crate) struct GptPipeline<'a> {
    pub(crate) cfg: &'a TrainConfig,
    pub(crate) data: &'a RunData,
    pub(crate) config: GptConfig,
}

impl<'a> GptPipeline<'a> {
    /// The task of the run `cfg` (resolved) on `data`.
    pub(crate) fn new(cfg: &'a TrainConfig, data: &'a RunData) -> Self {
        GptPipeline {
            cfg,
            data,
            config: gpt_config(cfg),
        }
    }

    /// Parameters from the run seed, in the run's precision, on the CPU.
    fn builder(&self) -> Result<ParamBuilder> {
        Ok(ParamBuilder::new(self.cfg.train.seed)
            .dtype(crate::train::precision_dtype(self.cfg)?)
            .device(Device::Cpu))
    }

    fn batch(&self, seed: u64, step: u64, rows: Range<u64>, val: bool) -> Result<GptBatch> {
        let ds = if val {
            &self.data.val
        } else {
            &self.data.train
        };
        let (ids, targets) = batch_tensors(ds, seed, step, rows, self.cfg.model.block_size)?;
        Ok(GptBatch {
            ids,
            targets,
            ignore_index: None,
        })
    }
}

impl PipelineTask for GptPipeline<'_> {
    type Stage = GptStage;

    fn name(&self) -> &'static str {
        "GPT"
    }

    fn cfg(&self) -> &TrainConfig {
        self.cfg
    }

    fn n_blocks(&self) -> usize {
        self.config.n_layer
    }

    fn build_stage(
        &self,
        spec: StageSpec,
        tp: Option<TensorParallel>,
        delayed: bool,
        checkpointing: bool,
    ) -> Result<GptStage> {
        let mut builder = self.builder()?;
        if delayed {
            builder = builder.delayed_init();
        }
        // Reference mode: the sums tensor parallelism splits are trees over the model's chunk
        // count on every stage, as in the single-device reference run (see `run_model`).
        let plan = GptStage::tp_plan(&spec);
        let mut stage = crate::reference_tp::build_with_plan(self.cfg, builder, tp, plan, |b| {
            GptStage::build(self.config, spec, b)
        })?;
        stage.activation_checkpointing = checkpointing;
        Ok(stage)
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
        header(self.cfg, &self.config, self.data, layout)
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
        let mut model = Gpt::build(self.config, self.builder()?)?;
        load_state_dict(&model, tensors, true)?;
        finish_run(
            self.cfg,
            &mut model,
            self.data.tokenizer.as_ref(),
            rep,
            result,
            verbosity,
        )
    }
}

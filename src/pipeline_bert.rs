//! The BERT (masked LM) under pipeline parallelism: its [`PipelineTask`], driven by
//! [`crate::train_pipeline`].
//!
//! The loss of a step is the summed cross-entropy of the masked tokens divided by their count in
//! the whole global batch. Each microbatch's last stage divides its sum by `count / (M * dp)`
//! (`M` microbatches, `dp` data-parallel ranks), so that the executor's mean over microbatches
//! and the data-parallel average give the global figure. In reference mode each microbatch is one
//! row group divided by the global count itself, and the row groups are added over their tree.

use std::ops::Range;

use anyhow::Result;
use meshgrad_nn::bert::{BertBatch, BertConfig, BertForMaskedLM, BertStage};
use meshgrad_nn::state::load_state_dict;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_nn::{ParamBuilder, StageSpec};
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::pipeline::Microbatch;
use meshgrad_parallel::{micro_rows, Communicator, ReduceOp};
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::train::{LoopResult, Reporter, RunData, TrainSummary, Verbosity};
use crate::train_bert::{bert_config, finish, header, MlmBatch, Sampler, VAL_STREAM};
use crate::train_pipeline::PipelineTask;

/// A BERT run's pipeline task.
pub(crate) struct BertPipeline<'a> {
    sampler: Sampler<'a>,
    data: &'a RunData,
    config: BertConfig,
}

impl<'a> BertPipeline<'a> {
    /// The task of the run `sampler.cfg` on `data`.
    pub(crate) fn new(sampler: Sampler<'a>, data: &'a RunData) -> Self {
        let config = bert_config(sampler.cfg);
        BertPipeline {
            sampler,
            data,
            config,
        }
    }

    fn bert_batch(b: MlmBatch, denominator: f64) -> BertBatch {
        BertBatch {
            ids: b.ids,
            attention_mask: None,
            token_type_ids: None,
            labels: b.labels,
            denominator: Some(denominator),
        }
    }
}

impl PipelineTask for BertPipeline<'_> {
    type Stage = BertStage;

    fn name(&self) -> &'static str {
        "BERT"
    }

    fn cfg(&self) -> &TrainConfig {
        self.sampler.cfg
    }

    fn n_blocks(&self) -> usize {
        self.config.num_hidden_layers
    }

    fn build_stage(
        &self,
        spec: StageSpec,
        tp: Option<TensorParallel>,
        delayed: bool,
        checkpointing: bool,
    ) -> Result<BertStage> {
        let mut builder = ParamBuilder::new(self.cfg().train.seed)
            .dtype(crate::train::precision_dtype(self.cfg())?)
            .device(Device::Cpu);
        if delayed {
            builder = builder.delayed_init();
        }
        // Reference mode: chunked sums on every stage, as in the single-device reference run.
        let plan = BertStage::tp_plan(&spec);
        let mut stage = crate::reference_tp::build_with_plan(self.cfg(), builder, tp, plan, |b| {
            BertStage::build(self.config, spec, b)
        })?;
        stage.activation_checkpointing = checkpointing;
        Ok(stage)
    }

    fn train_microbatches(
        &self,
        step: u64,
        rows: Range<u64>,
        microbatches: usize,
        dp: usize,
    ) -> Result<Vec<Microbatch<BertBatch>>> {
        let seed = self.cfg().train.seed;
        let total = self
            .sampler
            .global_count(&self.data.train, seed, step)?
            .max(1) as f64;
        // Reference mode: one microbatch per row group, each divided by the global count (the
        // executor then scales by 1 and the data-parallel reduction adds).
        let denominator = if self.cfg().train.reference {
            total
        } else {
            total / (microbatches * dp) as f64
        };
        micro_rows(rows, microbatches)?
            .into_iter()
            .map(|r| {
                let b = self
                    .sampler
                    .batch(&self.data.train, seed, step, r.clone())?;
                Ok(Microbatch {
                    first_row: r.start,
                    batch: Self::bert_batch(b, denominator),
                })
            })
            .collect()
    }

    fn val_batches(&self, rows: Range<u64>) -> Result<Vec<BertBatch>> {
        let seed = self.cfg().train.seed ^ VAL_STREAM;
        (0..self.cfg().train.eval_batches.max(1) as u64)
            .map(|i| {
                let b = self.sampler.batch(&self.data.val, seed, i, rows.clone())?;
                Ok(Self::bert_batch(b, 1.0))
            })
            .collect()
    }

    fn val_loss(&self, local_sum: f64, n_batches: usize, dp: &dyn Communicator) -> Result<f64> {
        let seed = self.cfg().train.seed ^ VAL_STREAM;
        let mut count = 0;
        for i in 0..n_batches as u64 {
            count += self.sampler.global_count(&self.data.val, seed, i)?;
        }
        let total = all_reduce_scalar(dp, local_sum, ReduceOp::Sum)?;
        Ok(total / count.max(1) as f64)
    }

    /// Each row group's loss is already divided by the global count of masked tokens.
    fn reference_loss_scale(&self, _total: usize) -> f64 {
        1.0
    }

    /// The row groups' summed token losses over validation batch `batch`'s global count.
    fn reference_val_loss(&self, sum: f64, batch: u64, _total: usize) -> Result<f64> {
        let seed = self.cfg().train.seed ^ VAL_STREAM;
        let count = self.sampler.global_count(&self.data.val, seed, batch)?;
        Ok(sum / count.max(1) as f64)
    }

    fn header(&self, layout: &str) -> String {
        header(self.cfg(), &self.config, self.data, layout)
    }

    fn profile_batch(&self, rows: usize) -> Result<BertBatch> {
        let seed = self.cfg().train.seed;
        let b = self
            .sampler
            .batch(&self.data.train, seed, 0, 0..rows as u64)?;
        let count = b.count.max(1) as f64;
        Ok(Self::bert_batch(b, count))
    }

    fn finish(
        &self,
        tensors: &[(String, Tensor)],
        rep: Reporter,
        result: LoopResult,
        verbosity: Verbosity,
    ) -> Result<TrainSummary> {
        let model = BertForMaskedLM::new(
            self.config,
            self.cfg().train.seed,
            crate::train::precision_dtype(self.cfg())?,
            Device::Cpu,
        )?;
        load_state_dict(&model, tensors, true)?;
        finish(self.cfg(), &model, rep, result, verbosity)
    }
}

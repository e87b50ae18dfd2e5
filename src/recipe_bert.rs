//! The BERT family's [`Recipe`] (`meshgrad train --model bert`, config `model.kind = "bert"`): a
//! [`BertForMaskedLM`] trained by masked language modelling.
//!
//! **Tokenizer.** Token ids are those of the data (bytes 0..=255 for text, the file's ids for a
//! `.bin`), below `model.vocab_size`, and the five special tokens `[PAD] [UNK] [CLS] [SEP]
//! [MASK]` are appended after them: for text with the default `vocab_size = 256` they are ids
//! 256..=260 and the model's vocabulary is 261 (see [`meshgrad_nn::mlm::byte_level`]).
//!
//! **Batches.** Row `b` of step `s` is `[CLS]`, the `block_size - 2` tokens of the data window
//! the GPT sampler draws for `(seed, s, b)`, and `[SEP]`; no padding. [`mlm_mask`](meshgrad_nn::mlm::mlm_mask) then selects
//! 15% of the non-special tokens (80% become `[MASK]`, 10% a random byte, 10% stay) by draws
//! keyed by `(seed, s)` and the token's global row and column, so every layout sees the same
//! batch.
//!
//! **Loss.** The step's loss is Hugging Face's: the mean cross-entropy over the labelled tokens
//! of the whole global batch. Micro-batches and ranks do not hold equal numbers of labelled
//! tokens, so each computes its summed cross-entropy divided by the global count (every rank
//! counts the labels of all rows: masking is a pure function of the global position), scaled
//! by the number of ranks because gradient synchronisation averages. The result equals the
//! single-device step to rounding under any layout. Validation is the mean over all labelled
//! tokens of `eval_batches` fixed batches of the validation split.
//!
//! Concretely, each microbatch's last stage divides its summed cross-entropy by `count / (M *
//! dp)` (`M` microbatches, `dp` data-parallel ranks times the context-parallel degree: each
//! context-parallel rank sums its chunks' tokens), so that the executor's mean over
//! microbatches and the data-parallel average give the global figure. In reference mode each
//! microbatch is one row group divided by the global count itself, and the row groups are added
//! over their tree.

use std::ops::Range;

use anyhow::Result;
use meshgrad_autograd::distributed::ChunkOrder;
use meshgrad_nn::bert::{BertBatch, BertConfig, BertForMaskedLM, IGNORE_INDEX};
use meshgrad_nn::data::{Dataset, TokenSource};
use meshgrad_nn::mlm::{mlm_mask_rows, MlmConfig, SpecialTokens};
use meshgrad_nn::state::{hf_bert, load_state_dict};
use meshgrad_nn::ParamBuilder;
use meshgrad_parallel::comm::all_reduce_scalar;
use meshgrad_parallel::pipeline::Microbatch;
use meshgrad_parallel::{micro_rows, Communicator, ParallelLayout, ReduceOp};
use meshgrad_tensor::{Device, Tensor};

use crate::config::TrainConfig;
use crate::model_configs::{bert_config, mlm_config, special_tokens};
use crate::recipe::{Recipe, StageBuild};
use crate::run_finish::{finish_run, Finish};
use crate::run_setup::{
    precision_dtype, train_device, RunData, TrainOptions, TrainSummary, Verbosity,
};
use crate::step_loop::{LoopResult, Reporter};

/// Mixed into the run seed for the masking draws.
const MLM_STREAM: u64 = 0x6d6c_6d5f_6d61_736b;
/// Mixed into the run seed for validation batches (windows and masks).
pub(crate) const VAL_STREAM: u64 = 0x5eed_0f7a_1d00_0002;

/// One part of a masked batch.
pub(crate) struct MlmBatch {
    pub(crate) ids: Tensor,
    pub(crate) labels: Tensor,
    /// Labelled tokens.
    pub(crate) count: usize,
}

/// What a run needs to draw batches.
pub(crate) struct Sampler {
    /// Tokens per row (`model.block_size`).
    pub(crate) block_size: usize,
    /// Rows of the global batch (`train.batch_size`).
    pub(crate) batch_size: usize,
    pub(crate) sp: SpecialTokens,
    pub(crate) mlm: MlmConfig,
}

impl Sampler {
    /// Global rows `rows` of batch `step` of `ds` (streams `seed`): `[CLS] window [SEP]`, masked.
    pub(crate) fn batch(
        &self,
        ds: &Dataset,
        seed: u64,
        step: u64,
        rows: Range<u64>,
    ) -> Result<MlmBatch> {
        let t = self.block_size;
        let n = (rows.end - rows.start) as usize;
        let b = ds.batch(seed, step, rows.clone(), t - 2)?;
        let mut ids = Vec::with_capacity(n * t);
        for r in 0..n {
            ids.push(self.sp.cls);
            ids.extend_from_slice(&b.inputs[r * (t - 2)..(r + 1) * (t - 2)]);
            ids.push(self.sp.sep);
        }
        let (masked, labels) =
            mlm_mask_rows(&ids, t, rows.start, step, seed ^ MLM_STREAM, &self.mlm)?;
        let count = labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
        Ok(MlmBatch {
            ids: Tensor::from_vec(masked, (n, t), Device::Cpu)?,
            labels: Tensor::from_vec(labels, (n, t), Device::Cpu)?,
            count,
        })
    }

    /// Labelled tokens of the whole global batch `step` (the same on every rank).
    pub(crate) fn global_count(&self, ds: &Dataset, seed: u64, step: u64) -> Result<usize> {
        let rows = 0..self.batch_size as u64;
        Ok(self.batch(ds, seed, step, rows)?.count)
    }
}

impl MlmBatch {
    /// The ids and labels on `device` (the run's: batches are drawn on the host).
    pub(crate) fn on_device(self, device: Device) -> Result<MlmBatch> {
        Ok(MlmBatch {
            ids: self.ids.to_device(device)?,
            labels: self.labels.to_device(device)?,
            count: self.count,
        })
    }
}

/// The run's first log line.
fn header(cfg: &TrainConfig, model: &BertConfig, data: &RunData, layout: &str) -> String {
    format!(
        "meshgrad train: BERT (masked LM, vocabulary {}), {} parameters, {} train / {} val tokens from {}, {} steps of {} x {} tokens{layout}",
        model.vocab_size,
        model.num_parameters(),
        data.train.len(),
        data.val.len(),
        data.source,
        cfg.train.steps,
        cfg.train.batch_size,
        cfg.model.block_size
    )
}

/// A BERT run's recipe.
pub(crate) struct BertRecipe {
    cfg: TrainConfig,
    sampler: Sampler,
    data: RunData,
    config: BertConfig,
    device: Device,
}

impl BertRecipe {
    fn bert_batch(&self, b: MlmBatch, denominator: f64) -> Result<BertBatch> {
        let b = b.on_device(self.device)?;
        Ok(BertBatch {
            ids: b.ids,
            attention_mask: None,
            token_type_ids: None,
            labels: b.labels,
            denominator: Some(denominator),
        })
    }
}

impl Recipe for BertRecipe {
    type Stage = BertForMaskedLM;
    const NAME: &'static str = "BERT";

    fn check(
        cfg: &TrainConfig,
        layout: Option<&ParallelLayout>,
        opts: &TrainOptions,
    ) -> Result<()> {
        if let Some(t) = &cfg.data.tokenizer {
            anyhow::bail!(
                "train --model bert uses the byte-level vocabulary with [PAD] [UNK] [CLS] [SEP] \
                 [MASK] appended; a tokenizer ({t}) is not supported for BERT yet"
            );
        }
        let Some(l) = layout else {
            return Ok(());
        };
        if l.ep() > 1 {
            anyhow::bail!(
                "layout {l}: expert parallelism (ep) needs a model with experts; BERT has none"
            );
        }
        crate::ranks::check_context_parallel(cfg, l)?;
        if l.cp() > 1 && cfg.model.dropout > 0.0 {
            anyhow::bail!(
                "layout {l}: BERT's attention-probability dropout (model.dropout = {}) does not \
                 run under context parallelism (ring and all-gather attention never form the \
                 probabilities): set model.dropout=0",
                cfg.model.dropout
            );
        }
        // The other sizes first; then the vocabulary, whose error names the key that pads it.
        let mut sizes = bert_config(cfg);
        sizes.vocab_size = sizes.vocab_size.next_multiple_of(l.tp());
        meshgrad_nn::bert::check_tp_sizes(
            &sizes,
            l.tp(),
            opts.sequence_parallel.then_some(cfg.model.block_size),
        )?;
        crate::ranks::check_vocab_splits(cfg, bert_config(cfg).vocab_size, l)
    }

    fn new(cfg: TrainConfig, data: RunData) -> Result<Self> {
        let sampler = Sampler {
            block_size: cfg.model.block_size,
            batch_size: cfg.train.batch_size,
            sp: special_tokens(&cfg),
            mlm: mlm_config(&cfg),
        };
        Ok(BertRecipe {
            config: bert_config(&cfg),
            device: train_device(&cfg)?,
            cfg,
            sampler,
            data,
        })
    }

    fn cfg(&self) -> &TrainConfig {
        &self.cfg
    }

    fn n_blocks(&self) -> usize {
        self.config.num_hidden_layers
    }

    fn build_stage(&self, b: StageBuild) -> Result<BertForMaskedLM> {
        let builder = b.prepare(
            ParamBuilder::new(self.cfg.train.seed)
                .dtype(precision_dtype(&self.cfg)?)
                .device(self.device),
        );
        // Reference mode: chunked sums on every stage, as in the single-device reference run.
        let plan = BertForMaskedLM::stage_tp_plan(&b.spec);
        let mut stage =
            crate::reference_tp::build_with_plan(&self.cfg, builder, b.tp, plan, |pb| {
                BertForMaskedLM::build_stage(self.config, b.spec.clone(), pb)
            })?;
        stage.activation_checkpointing = b.checkpointing;
        Ok(stage)
    }

    fn train_microbatches(
        &self,
        step: u64,
        rows: Range<u64>,
        microbatches: usize,
        dp: usize,
    ) -> Result<Vec<Microbatch<BertBatch>>> {
        let seed = self.cfg.train.seed;
        let total = self
            .sampler
            .global_count(&self.data.train, seed, step)?
            .max(1) as f64;
        // Reference mode: one microbatch per row group, each divided by the global count (the
        // executor then scales by 1 and the data-parallel reduction adds).
        let denominator = if self.cfg.train.reference {
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
                    batch: self.bert_batch(b, denominator)?,
                })
            })
            .collect()
    }

    /// The ids, labels and padding cut to this rank's chunks; the denominator (the global
    /// count) stays, so the chunks' summed losses add up to the rows'.
    fn context_chunks(&self, b: BertBatch, order: &ChunkOrder) -> Result<BertBatch> {
        let local = |t: &Tensor| order.local_of(t, 1);
        Ok(BertBatch {
            ids: local(&b.ids)?,
            attention_mask: b.attention_mask.as_ref().map(local).transpose()?,
            token_type_ids: b.token_type_ids.as_ref().map(local).transpose()?,
            labels: local(&b.labels)?,
            denominator: b.denominator,
        })
    }

    fn val_batches(&self, rows: Range<u64>) -> Result<Vec<BertBatch>> {
        let seed = self.cfg.train.seed ^ VAL_STREAM;
        (0..self.cfg.train.eval_batches.max(1) as u64)
            .map(|i| {
                let b = self.sampler.batch(&self.data.val, seed, i, rows.clone())?;
                self.bert_batch(b, 1.0)
            })
            .collect()
    }

    fn val_loss(&self, local_sum: f64, n_batches: usize, dp: &dyn Communicator) -> Result<f64> {
        let seed = self.cfg.train.seed ^ VAL_STREAM;
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
        let seed = self.cfg.train.seed ^ VAL_STREAM;
        let count = self.sampler.global_count(&self.data.val, seed, batch)?;
        Ok(sum / count.max(1) as f64)
    }

    fn header(&self, layout: &str) -> String {
        header(&self.cfg, &self.config, &self.data, layout)
    }

    fn profile_batch(&self, rows: usize) -> Result<BertBatch> {
        let seed = self.cfg.train.seed;
        let b = self
            .sampler
            .batch(&self.data.train, seed, 0, 0..rows as u64)?;
        let count = b.count.max(1) as f64;
        self.bert_batch(b, count)
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
            self.cfg.train.seed,
            precision_dtype(&self.cfg)?,
            self.device,
        )?;
        load_state_dict(&model, tensors, true)?;
        let finish = Finish {
            cfg: &self.cfg,
            tokenizer: None,
            rep,
            result,
            verbosity,
            sampler: None,
            note: format!(" (ln vocab = {:.4})", (self.config.vocab_size as f64).ln()),
        };
        finish_run(finish, |out| Ok(hf_bert::save_bert(&model, out)?))
    }
}

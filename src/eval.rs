//! `meshgrad eval`: mean next-token cross-entropy of a checkpoint over a token file.

use std::path::Path;

use anyhow::{Context, Result};
use meshgrad_autograd::no_grad;
use meshgrad_nn::data::{load_dataset, LoadOptions, TokenSource};
use meshgrad_nn::CausalLm;
use meshgrad_tensor::Tensor;

/// Windows per forward pass during evaluation.
const EVAL_BATCH: usize = 8;

/// Tokens read at a time when checking ids against the model's vocabulary.
const CHECK_CHUNK: usize = 1 << 16;

/// Mean cross-entropy of `model` over `data`, by this definition: windows of the model's
/// context length T starting at 0, T, 2T, ... while `start + T + 1 <= len`; inputs
/// `tokens[s..s+T]`, targets `tokens[s+1..s+T+1]`; the mean over all targets (summed in f64).
pub fn mean_loss(model: &dyn CausalLm, data: &dyn TokenSource) -> Result<f64> {
    let t = model.context_len();
    let vocab = model.sampled_vocab();
    if data.vocab_size() > vocab {
        // Name the first id the model cannot take.
        let mut buf = vec![0u32; CHECK_CHUNK];
        let mut pos = 0;
        while pos < data.len() {
            let n = CHECK_CHUNK.min(data.len() - pos);
            data.read(pos, &mut buf[..n])?;
            if let Some(i) = buf[..n].iter().position(|&id| id as usize >= vocab) {
                anyhow::bail!(
                    "{}: token {} at position {} is outside the model's vocabulary (size {vocab})",
                    data.source(),
                    buf[i],
                    pos + i
                );
            }
            pos += n;
        }
    }
    let starts: Vec<usize> = data.eval_windows(t)?.collect();
    let device = model.device();
    let mut total = 0.0f64;
    let mut count = 0usize;
    no_grad(|| -> Result<()> {
        for chunk in starts.chunks(EVAL_BATCH) {
            let batch = data.batch_at(chunk, t)?;
            let ids = Tensor::from_vec(batch.inputs, (batch.rows, t), device)?;
            let targets = Tensor::from_vec(batch.targets, batch.rows * t, device)?;
            let logits = model.logits(&ids)?;
            // Over every logit the model has: a padded vocabulary's extra ids are never
            // targets, but they are in the softmax, as in training.
            let width = logits.tensor().dims()[2];
            let (rows, _) = logits
                .tensor()
                .reshape((batch.rows * t, width))?
                .cross_entropy_rows(&targets, None)?;
            total += rows.to_vec_f64()?.iter().sum::<f64>();
            count += batch.rows * t;
        }
        Ok(())
    })?;
    Ok(total / count as f64)
}

/// Loads the checkpoint in `checkpoint` and evaluates it on `data`: text and JSONL go through the
/// checkpoint's `tokenizer.json` when it has one (byte-level otherwise); a folder of token shards
/// is evaluated on its validation shards when it has any, on all its shards otherwise.
/// A BERT checkpoint (`"model_type": "bert"`) takes a JSON-lines file of labelled examples
/// instead (see [`crate::eval_bert`]).
pub fn eval_checkpoint(checkpoint: &Path, data: &Path) -> Result<f64> {
    if let Some(ck) = crate::run_checkpoint::open_training_checkpoint(checkpoint)? {
        if crate::run_checkpoint::training_model_kind(&ck)? == crate::config::ModelKind::Bert {
            if let crate::run_checkpoint::CheckpointModel::Bert(m) =
                crate::run_checkpoint::load_training_model(&ck)?
            {
                let examples = crate::eval_bert::read_mlm_jsonl(data, &m.config)?;
                return crate::eval_bert::mean_mlm_loss(&m, &examples);
            }
        }
    }
    if meshgrad_nn::state::hf_bert::is_bert_checkpoint(checkpoint) {
        return crate::eval_bert::eval_bert_checkpoint(checkpoint, data);
    }
    let model = crate::train::load_causal_lm(checkpoint)?;
    let tokenizer = crate::train::load_checkpoint_tokenizer(checkpoint)?;
    let opts = LoadOptions {
        tokenizer: tokenizer.as_ref(),
        shard_vocab_size: model.sampled_vocab(),
    };
    let ds = load_dataset(data, &opts)
        .with_context(|| format!("reading eval data {}", data.display()))?;
    mean_loss(model.as_ref(), &ds)
}

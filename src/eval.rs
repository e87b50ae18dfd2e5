//! `meshgrad eval`: mean next-token cross-entropy of a checkpoint over a token file.

use std::path::Path;

use anyhow::{Context, Result};
use meshgrad_autograd::no_grad;
use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::Gpt;
use meshgrad_tensor::Tensor;

/// Windows per forward pass during evaluation.
const EVAL_BATCH: usize = 8;

/// Mean cross-entropy of `model` over `data`, by this definition: windows of the model's
/// context length T starting at 0, T, 2T, ... while `start + T + 1 <= len`; inputs
/// `tokens[s..s+T]`, targets `tokens[s+1..s+T+1]`; the mean over all targets (summed in f64).
pub fn mean_loss(model: &Gpt, data: &TokenDataset) -> Result<f64> {
    let t = model.config.block_size;
    let vocab = model.config.vocab_size;
    if let Some((pos, &id)) = data
        .tokens
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= vocab)
    {
        anyhow::bail!(
            "{}: token {id} at position {pos} is outside the model's vocabulary (size {vocab})",
            data.source
        );
    }
    let starts: Vec<usize> = data.eval_windows(t)?.collect();
    let device = model.wte.weight.tensor().device();
    let mut total = 0.0f64;
    let mut count = 0usize;
    no_grad(|| -> Result<()> {
        for chunk in starts.chunks(EVAL_BATCH) {
            let batch = data.batch_at(chunk, t)?;
            let ids = Tensor::from_vec(batch.inputs, (batch.rows, t), device)?;
            let targets = Tensor::from_vec(batch.targets, batch.rows * t, device)?;
            let logits = model.forward(&ids)?;
            let (rows, _) = logits
                .tensor()
                .reshape((batch.rows * t, vocab))?
                .cross_entropy_rows(&targets, None)?;
            total += rows.to_vec_f64()?.iter().sum::<f64>();
            count += batch.rows * t;
        }
        Ok(())
    })?;
    Ok(total / count as f64)
}

/// Loads the checkpoint in `checkpoint` and evaluates it on the token file `data`. A BERT
/// checkpoint (`"model_type": "bert"`) takes a JSON-lines file instead (see [`crate::eval_bert`]).
pub fn eval_checkpoint(checkpoint: &Path, data: &Path) -> Result<f64> {
    if meshgrad_nn::state::hf_bert::is_bert_checkpoint(checkpoint) {
        return crate::eval_bert::eval_bert_checkpoint(checkpoint, data);
    }
    let model = crate::train::load_checkpoint(checkpoint)?;
    let ds = TokenDataset::from_path(data)
        .with_context(|| format!("reading eval data {}", data.display()))?;
    mean_loss(&model, &ds)
}

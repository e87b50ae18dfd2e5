//! `meshgrad eval`: a checkpoint's mean next-token cross-entropy over a token file, or a BERT
//! checkpoint's masked-LM loss over a JSON-lines file of labelled examples (the losses are
//! [`meshgrad_nn::eval`]'s).

use std::path::Path;

use anyhow::{Context, Result};
use meshgrad_nn::data::{load_dataset, LoadOptions};
use meshgrad_nn::eval::{mean_loss, mean_mlm_loss, read_mlm_jsonl};
use meshgrad_nn::state::hf_bert;
use meshgrad_tensor::{DType, Device};

/// Loads the checkpoint in `checkpoint` and evaluates it on `data`: text and JSONL go through the
/// checkpoint's `tokenizer.json` when it has one (byte-level otherwise); a folder of token shards
/// is evaluated on its validation shards when it has any, on all its shards otherwise.
/// A BERT checkpoint (`"model_type": "bert"`) takes a JSON-lines file of labelled examples
/// instead (see [`meshgrad_nn::eval`]).
pub fn eval_checkpoint(checkpoint: &Path, data: &Path) -> Result<f64> {
    if let Some(ck) = crate::run_checkpoint::open_training_checkpoint(checkpoint)? {
        if crate::run_checkpoint::training_model_kind(&ck)? == crate::config::ModelKind::Bert {
            if let crate::run_checkpoint::CheckpointModel::Bert(m) =
                crate::run_checkpoint::load_training_model(&ck)?
            {
                let examples = read_mlm_jsonl(data, &m.config)?;
                return Ok(mean_mlm_loss(&m, &examples)?);
            }
        }
    }
    if hf_bert::is_bert_checkpoint(checkpoint) {
        // Its sizes checked against memory first.
        crate::preflight::check_checkpoint(checkpoint)?;
        let model = hf_bert::load_bert(checkpoint, DType::F32, Device::Cpu)
            .with_context(|| format!("loading checkpoint {}", checkpoint.display()))?;
        let examples = read_mlm_jsonl(data, &model.config)?;
        return Ok(mean_mlm_loss(&model, &examples)?);
    }
    let model = crate::train::load_causal_lm(checkpoint)?;
    let tokenizer = crate::train::load_checkpoint_tokenizer(checkpoint)?;
    let opts = LoadOptions {
        tokenizer: tokenizer.as_ref(),
        shard_vocab_size: model.sampled_vocab(),
    };
    let ds = load_dataset(data, &opts)
        .with_context(|| format!("reading eval data {}", data.display()))?;
    Ok(mean_loss(model.as_ref(), &ds)?)
}

//! Evaluation: a model's mean loss over held-out data, as `meshgrad eval` reports it.
//!
//! * [`mean_loss`]: a next-token model's ([`CausalLm`]) mean cross-entropy over a token source,
//!   in windows of its context length.
//! * [`mean_mlm_loss`]: a BERT's masked-LM loss over labelled examples ([`MlmExample`]), read
//!   from a JSON-lines file by [`read_mlm_jsonl`]. Each non-blank line is an object
//!   `{"input_ids": [...], "attention_mask": [...], "token_type_ids": [...], "labels": [...]}`;
//!   `attention_mask` (default all ones) and `token_type_ids` (default all zeros) may be left
//!   out, every given list has the length of `input_ids`, and a label is -100 (ignored) or a
//!   token id. The loss is the mean cross-entropy over all labelled tokens of the file, which is
//!   Hugging Face's `BertForMaskedLM` loss over the concatenated labels. Bad lines are errors
//!   naming the file and the line.
//!
//! ```
//! use meshgrad_nn::bert::{BertConfig, BertForMaskedLM};
//! use meshgrad_nn::eval::{mean_mlm_loss, parse_mlm_example};
//! use meshgrad_tensor::{DType, Device};
//!
//! let config = BertConfig {
//!     vocab_size: 50,
//!     hidden_size: 16,
//!     num_hidden_layers: 1,
//!     num_attention_heads: 2,
//!     intermediate_size: 32,
//!     max_position_embeddings: 8,
//!     ..BertConfig::default()
//! };
//! let model = BertForMaskedLM::new(config.clone(), 0, DType::F32, Device::Cpu)?;
//! let example = parse_mlm_example(r#"{"input_ids": [2, 7, 9], "labels": [-100, 8, -100]}"#, &config)?;
//! assert_eq!(example.attention_mask, vec![1, 1, 1]);
//! let loss = mean_mlm_loss(&model, &[example])?;
//! assert!(loss.is_finite() && loss > 0.0);
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```

use std::path::Path;

use meshgrad_autograd::no_grad;
use meshgrad_tensor::{Error, Result, Tensor};
use serde_json::Value;

use crate::bert::{BertConfig, BertForMaskedLM, IGNORE_INDEX};
use crate::data::TokenSource;
use crate::{CausalLm, Module};

/// Windows (next-token models) or examples (BERT) per forward pass.
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
                return Err(Error::Msg(format!(
                    "{}: token {} at position {} is outside the model's vocabulary (size {vocab})",
                    data.source(),
                    buf[i],
                    pos + i
                )));
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

/// One labelled example.
#[derive(Clone, Debug, PartialEq)]
pub struct MlmExample {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// 1 = attend, 0 = padding.
    pub attention_mask: Vec<u32>,
    /// Segment ids.
    pub token_type_ids: Vec<u32>,
    /// The token to predict at each position, or -100.
    pub labels: Vec<i64>,
}

/// Parses one JSON line against `config` (ids below `vocab_size`, types below `type_vocab_size`,
/// at most `max_position_embeddings` tokens).
pub fn parse_mlm_example(text: &str, config: &BertConfig) -> Result<MlmExample> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| Error::Msg(format!("invalid JSON: {e}")))?;
    let obj = v
        .as_object()
        .ok_or_else(|| Error::msg("expected a JSON object"))?;
    for k in obj.keys() {
        if !["input_ids", "attention_mask", "token_type_ids", "labels"].contains(&k.as_str()) {
            return Err(Error::Msg(format!(
                "unknown key {k:?} (expected input_ids, attention_mask, token_type_ids, labels)"
            )));
        }
    }
    let ints = |k: &str| -> Result<Option<Vec<i64>>> {
        match obj.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_i64()
                        .ok_or_else(|| Error::Msg(format!("{k}[{i}] is {x}, not an integer")))
                })
                .collect::<Result<Vec<i64>>>()
                .map(Some),
            Some(x) => Err(Error::Msg(format!(
                "{k} must be a list of integers, got {x}"
            ))),
        }
    };
    let ids = ints("input_ids")?.ok_or_else(|| Error::msg("missing input_ids"))?;
    let labels = ints("labels")?.ok_or_else(|| Error::msg("missing labels"))?;
    let n = ids.len();
    if n == 0 || n > config.max_position_embeddings {
        return Err(Error::Msg(format!(
            "input_ids has {n} tokens; the model takes 1 to {} (max_position_embeddings)",
            config.max_position_embeddings
        )));
    }
    let vocab = config.vocab_size as i64;
    let check = |k: &str, v: &[i64], ok: &dyn Fn(i64) -> bool, what: &str| -> Result<()> {
        if v.len() != n {
            return Err(Error::Msg(format!(
                "{k} has {} entries but input_ids has {n}",
                v.len()
            )));
        }
        if let Some((i, x)) = v.iter().enumerate().find(|(_, &x)| !ok(x)) {
            return Err(Error::Msg(format!("{k}[{i}] = {x} is not {what}")));
        }
        Ok(())
    };
    let in_vocab = format!("a token id below vocab_size {vocab}");
    check("input_ids", &ids, &|x| (0..vocab).contains(&x), &in_vocab)?;
    check(
        "labels",
        &labels,
        &|x| x == IGNORE_INDEX || (0..vocab).contains(&x),
        &format!("-100 or {in_vocab}"),
    )?;
    let mask = match ints("attention_mask")? {
        Some(m) => {
            check("attention_mask", &m, &|x| x == 0 || x == 1, "0 or 1")?;
            m
        }
        None => vec![1; n],
    };
    let types = match ints("token_type_ids")? {
        Some(t) => {
            let tv = config.type_vocab_size as i64;
            check(
                "token_type_ids",
                &t,
                &|x| (0..tv).contains(&x),
                &format!("a type below type_vocab_size {tv}"),
            )?;
            t
        }
        None => vec![0; n],
    };
    let u = |v: Vec<i64>| v.into_iter().map(|x| x as u32).collect();
    Ok(MlmExample {
        input_ids: u(ids),
        attention_mask: u(mask),
        token_type_ids: u(types),
        labels,
    })
}

/// Reads a JSON-lines file of examples for a model of `config` (blank lines are skipped). Errors
/// name the file and the line.
pub fn read_mlm_jsonl(path: &Path, config: &BertConfig) -> Result<Vec<MlmExample>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::Msg(format!("reading eval data {}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let ex = parse_mlm_example(line, config)
            .map_err(|e| Error::Msg(format!("{}: line {}: {e}", path.display(), i + 1)))?;
        out.push(ex);
    }
    if out.is_empty() {
        return Err(Error::Msg(format!("{}: no examples", path.display())));
    }
    Ok(out)
}

/// The mean cross-entropy of `model` over every labelled token of `examples` (summed in f64).
pub fn mean_mlm_loss(model: &BertForMaskedLM, examples: &[MlmExample]) -> Result<f64> {
    let (mut total, mut count) = (0.0f64, 0usize);
    let v = model.config.vocab_size;
    let table = match model.word_embeddings() {
        Some(table) if model.is_full() => table,
        _ => {
            return Err(Error::Msg(format!(
                "eval: this BERT is a stage ({}), not the whole model",
                model.spec
            )))
        }
    };
    let device = table.tensor().device();
    let was_training = model.is_training();
    model.set_training(false);
    let r = no_grad(|| -> Result<()> {
        let mut start = 0;
        while start < examples.len() {
            let t = examples[start].input_ids.len();
            let mut end = start + 1;
            while end < examples.len()
                && end - start < EVAL_BATCH
                && examples[end].input_ids.len() == t
            {
                end += 1;
            }
            let batch = &examples[start..end];
            let b = batch.len();
            let cat = |f: &dyn Fn(&MlmExample) -> &Vec<u32>| -> Vec<u32> {
                batch.iter().flat_map(|e| f(e).iter().copied()).collect()
            };
            let ids = Tensor::from_vec(cat(&|e| &e.input_ids), (b, t), device)?;
            let mask = Tensor::from_vec(cat(&|e| &e.attention_mask), (b, t), device)?;
            let types = Tensor::from_vec(cat(&|e| &e.token_type_ids), (b, t), device)?;
            let labels: Vec<i64> = batch.iter().flat_map(|e| e.labels.clone()).collect();
            count += labels.iter().filter(|&&l| l != IGNORE_INDEX).count();
            let labels = Tensor::from_vec(labels, b * t, device)?;
            let logits = model.forward(&ids, Some(&mask), Some(&types))?;
            let (rows, _) = logits
                .tensor()
                .reshape((b * t, v))?
                .cross_entropy_rows(&labels, Some(IGNORE_INDEX))?;
            total += rows.to_vec_f64()?.iter().sum::<f64>();
            start = end;
        }
        Ok(())
    });
    model.set_training(was_training);
    r?;
    if count == 0 {
        return Err(Error::msg(
            "the eval data has no labelled token (every label is -100)",
        ));
    }
    Ok(total / count as f64)
}

//! Masked-language-model training of a small BERT (`BertForMaskedLM`, Hugging Face architecture)
//! on the built-in corpus with the library API: byte-level ids with [PAD] [UNK] [CLS] [SEP]
//! [MASK] appended (vocabulary 261), rows `[CLS] bytes [SEP]`, 15% of tokens selected (80% [MASK],
//! 10% random, 10% kept) by counter-based draws keyed by global row and step, AdamW, and a
//! checkpoint in Hugging Face's BERT format that loads back with identical logits.
//!
//! ```text
//! cargo run --release --example train_bert [-- STEPS]     (default 150)
//! ```

use meshgrad::corpus::builtin_dataset;
use meshgrad::nn::bert::{BertConfig, BertForMaskedLM};
use meshgrad::nn::mlm::{byte_level, mlm_mask, MlmConfig};
use meshgrad::nn::state::hf_bert;
use meshgrad::prelude::*;

fn main() -> Result<()> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| {
            s.parse()
                .map_err(|_| Error::msg(format!("STEPS must be a number, got {s}")))
        })
        .transpose()?
        .unwrap_or(150);
    let (batch, seq, seed) = (16usize, 64usize, 3u64);
    let config = BertConfig {
        vocab_size: byte_level::VOCAB_SIZE,
        hidden_size: 96,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 384,
        max_position_embeddings: seq,
        pad_token_id: byte_level::PAD as usize,
        ..BertConfig::default()
    };
    let model = BertForMaskedLM::new(config, seed, DType::F32, Device::Cpu)?;
    println!(
        "BERT: {} parameters, vocab {}",
        model.num_parameters(),
        config.vocab_size
    );

    let data = builtin_dataset();
    let mlm = MlmConfig::byte_level();
    let mut opt = AdamW::for_module(&model).weight_decay(0.01).build()?;
    let schedule = CosineSchedule::new(1e-3, 1e-4, (steps / 10).max(1), steps)?;
    let mut first = None;
    let mut last = f64::NAN;
    for step in 0..steps {
        // Rows of `[CLS] window [SEP]`.
        let b = data.batch(seed, step as u64, 0..batch as u64, seq - 2)?;
        let mut ids = Vec::with_capacity(batch * seq);
        for r in 0..batch {
            ids.push(byte_level::CLS);
            ids.extend_from_slice(&b.inputs[r * (seq - 2)..(r + 1) * (seq - 2)]);
            ids.push(byte_level::SEP);
        }
        let ids = Tensor::from_vec(ids, (batch, seq), Device::Cpu)?;
        let (masked, labels) = mlm_mask(&ids, 0, step as u64, seed, &mlm)?;
        let loss =
            ForwardCtx::new(step as u64, 0).scope(|| model.loss(&masked, None, None, &labels))?;
        opt.zero_grad();
        loss.backward()?;
        clip_grad_norm(&model.parameters(), 1.0)?;
        opt.step(schedule.lr_at(step))?;
        last = loss.tensor().item()?;
        first.get_or_insert(last);
        if step % 25 == 0 {
            println!("step {step}: mlm loss {last:.4}");
        }
    }
    let first = first.unwrap_or(last);
    println!(
        "mlm loss {first:.4} -> {last:.4} in {steps} steps (ln {} = {:.4})",
        config.vocab_size,
        (config.vocab_size as f64).ln()
    );

    // Save in Hugging Face's format and load it back.
    let dir = std::env::temp_dir().join("meshgrad_train_bert_example");
    hf_bert::save_bert(&model, &dir)?;
    let loaded = hf_bert::load_bert(&dir, DType::F32, Device::Cpu)?;
    model.set_training(false);
    loaded.set_training(false);
    let probe = Tensor::from_vec(
        vec![
            byte_level::CLS,
            69,
            108,
            105,
            byte_level::MASK,
            byte_level::SEP,
        ],
        (1, 6),
        Device::Cpu,
    )?;
    let a = no_grad(|| model.forward(&probe, None, None))?
        .tensor()
        .to_vec::<f32>()?;
    let b = no_grad(|| loaded.forward(&probe, None, None))?
        .tensor()
        .to_vec::<f32>()?;
    if a != b {
        return Err(Error::msg("the reloaded checkpoint gives different logits"));
    }
    println!(
        "saved to {} (config.json + model.safetensors); reloaded logits identical",
        dir.display()
    );
    if steps >= 20 && last >= first {
        return Err(Error::msg("the MLM loss did not fall"));
    }
    Ok(())
}

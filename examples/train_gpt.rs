//! Train a small byte-level GPT on the built-in corpus with the library API only: the model,
//! the layout-invariant batch sampler, AdamW with warm-up + cosine decay, gradient clipping,
//! periodic validation, a checkpoint in Hugging Face GPT-2 format, and a sample.
//!
//! ```text
//! cargo run --release --example train_gpt [-- STEPS]     (default 200)
//! ```

use meshgrad::corpus::builtin_dataset;
use meshgrad::nn::state::hf_gpt2;
use meshgrad::prelude::*;

fn main() -> Result<()> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| {
            s.parse()
                .map_err(|_| Error::msg(format!("STEPS must be a number, got {s}")))
        })
        .transpose()?
        .unwrap_or(200);
    let (batch, seq, seed) = (16usize, 64usize, 1337u64);
    let config = GptConfig {
        vocab_size: 256,
        block_size: seq,
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
        dropout: 0.0,
        bias: true,
        layer_norm_eps: 1e-5,
    };
    let model = Gpt::new(config, seed, DType::F32, Device::Cpu)?;
    println!("model: {} parameters", model.num_parameters());

    let (train, val) = builtin_dataset().split(0.1, seq + 1)?;
    let mut opt = AdamW::for_module(&model)
        .weight_decay(0.1)
        .betas(0.9, 0.95)
        .build()?;
    let schedule = CosineSchedule::new(3e-3, 3e-4, (steps / 10).max(1), steps)?;
    let to_tensors = |b: &meshgrad::nn::data::Batch, rows: usize| -> Result<(Tensor, Tensor)> {
        Ok((
            Tensor::from_slice(&b.inputs, (rows, seq), Device::Cpu)?,
            Tensor::from_slice(&b.targets, (rows, seq), Device::Cpu)?,
        ))
    };

    let evaluate = |model: &Gpt| -> Result<f64> {
        model.set_training(false);
        let starts: Vec<usize> = val.eval_windows(seq)?.take(8 * batch).collect();
        let mut total = 0.0;
        let chunks: Vec<&[usize]> = starts.chunks(batch).collect();
        for chunk in &chunks {
            let b = val.batch_at(chunk, seq)?;
            let (ids, targets) = to_tensors(&b, chunk.len())?;
            total += no_grad(|| model.loss(&ids, &targets, None))?
                .tensor()
                .item()?;
        }
        model.set_training(true);
        Ok(total / chunks.len() as f64)
    };

    println!(
        "step 0: val loss {:.4} (ln 256 = {:.4})",
        evaluate(&model)?,
        256f64.ln()
    );
    for step in 0..steps {
        let b = train.batch(seed, step as u64, 0..batch as u64, seq)?;
        let (ids, targets) = to_tensors(&b, batch)?;
        // Dropout masks (none here: dropout 0) would be keyed by this context.
        let loss = ForwardCtx::new(step as u64, 0).scope(|| model.loss(&ids, &targets, None))?;
        opt.zero_grad();
        loss.backward()?;
        let norm = clip_grad_norm(&model.parameters(), 1.0)?;
        opt.step(schedule.lr_at(step))?;
        if step % 50 == 0 || step + 1 == steps {
            println!(
                "step {step}: loss {:.4} grad_norm {norm:.3} lr {:.2e}",
                loss.tensor().item()?,
                schedule.lr_at(step)
            );
        }
    }
    println!("step {steps}: val loss {:.4}", evaluate(&model)?);

    let out = std::env::temp_dir().join("meshgrad_train_gpt_example");
    hf_gpt2::save_gpt2(&model, &out)?;
    let reloaded = hf_gpt2::load_gpt2(&out, DType::F32, Device::Cpu)?;
    let sample = reloaded.generate(
        b"Elizabeth"
            .iter()
            .map(|&b| b as u32)
            .collect::<Vec<_>>()
            .as_slice(),
        80,
        0.8,
        Some(40),
        seed,
        |_| Ok(()),
    )?;
    let text: String = sample.iter().map(|&t| t as u8 as char).collect();
    println!("saved to {}; sample: Elizabeth{text}", out.display());
    Ok(())
}

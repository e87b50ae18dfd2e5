//! The pipeline executor in lockstep with a single device: a small GPT (4 blocks) trained 3
//! steps with AdamW on one device, accumulating gradients over the same M = 4 microbatches
//! (each microbatch's loss divided by M), and under pp=2 and pp=4 (`StageSpec::even`) with the
//! GPipe and 1F1B schedules. Losses and final weights (each stage's parameters compared by name
//! with the full model's; the tied `wte.weight` taken from the first stage, and the last stage's
//! copy checked equal to it bit for bit) must agree within 1e-5 relative (f32).
//!
//! As in `tensor_parallel.rs` the AdamW runs have no biases and no dropout: AdamW's normalised
//! step turns gradients that are rounding noise around zero (the attention key bias, a few
//! dropped-out elements) into layout-dependent differences of ~1e-5. Here the only
//! layout-dependent rounding is the tied table's gradient (the single device adds the
//! embedding's and the head's contributions per microbatch, the pipeline sums each over the
//! microbatches first) and the order of the f64 norm sums.
//!
//! The ranks run with rendezvous sends (a send completes when its receive takes the message), so
//! the schedules are also shown not to deadlock on a backend without buffering.
//!
//! Interleaved and zero-bubble (split backward) schedules are refused with a one-line error.

mod common;

use std::collections::HashMap;
use std::ops::Range;
use std::time::Duration;

use common::{assert_close, full_weights, RunOut};
use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::optim::{clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, Optimizer};
use meshgrad_nn::{ForwardCtx, Gpt, GptBatch, GptConfig, GptStage, Module, StageSpec};
use meshgrad_parallel::comm::{run_ranks, RunOptions};
use meshgrad_parallel::micro_rows;
use meshgrad_parallel::pipeline::{execute, Microbatch, PipelineGrads, Schedule};
use meshgrad_tensor::{DType, Device, Result, Tensor};

const SEED: u64 = 7;
const BATCH: usize = 8;
const MICRO: usize = 4;
const T: usize = 16;
const STEPS: usize = 3;
const LR: f64 = 1e-3;
const CLIP: f64 = 0.5;

fn gpt_config() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: T,
        n_layer: 4,
        n_head: 4,
        n_embd: 32,
        dropout: 0.0,
        bias: false,
        layer_norm_eps: 1e-5,
    }
}

fn dataset() -> TokenDataset {
    let tokens: Vec<u32> = (0..4000u64)
        .map(|i| {
            let h = meshgrad_nn::data::splitmix64(i);
            if h.is_multiple_of(5) {
                (h >> 8) as u32 % 64
            } else {
                ((i * 7 + i / 13) % 64) as u32
            }
        })
        .collect();
    TokenDataset::from_tokens("synthetic", tokens, 64).unwrap()
}

fn batch(data: &TokenDataset, step: usize, rows: Range<u64>) -> Result<GptBatch> {
    let n = (rows.end - rows.start) as usize;
    let b = data
        .batch(SEED, step as u64, rows, T)
        .map_err(|e| meshgrad_tensor::Error::msg(e.to_string()))?;
    Ok(GptBatch {
        ids: Tensor::from_vec(b.inputs, (n, T), Device::Cpu)?,
        targets: Tensor::from_vec(b.targets, (n, T), Device::Cpu)?,
        ignore_index: None,
    })
}

fn optimizer(named: Vec<(String, meshgrad_autograd::Var)>) -> AdamW {
    AdamW::new(param_groups_for_decay(named, 0.1), AdamWConfig::default()).unwrap()
}

/// One device, gradient accumulation over the step's MICRO microbatches.
fn single_device() -> RunOut {
    let data = dataset();
    let model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu).unwrap();
    let mut opt = optimizer(model.named_parameters());
    let mut losses = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad();
        let mut sum = 0.0;
        for rows in micro_rows(0..BATCH as u64, MICRO).unwrap() {
            let b = batch(&data, step, rows.clone()).unwrap();
            let loss = ForwardCtx::new(step as u64, rows.start)
                .scope(|| model.loss(&b.ids, &b.targets, None))
                .unwrap();
            loss.mul_scalar(1.0 / MICRO as f64)
                .unwrap()
                .backward()
                .unwrap();
            sum += loss.tensor().item().unwrap();
        }
        losses.push(sum / MICRO as f64);
        clip_grad_norm(&model.parameters(), CLIP).unwrap();
        opt.step(LR).unwrap();
    }
    RunOut {
        losses,
        weights: full_weights(&model).unwrap(),
    }
}

/// `pp` ranks, each holding its even stage, running `schedule`; the weights joined by name (the
/// tied table from the first stage, checked equal to the last stage's copy).
fn pipeline_run(pp: usize, schedule: &Schedule) -> RunOut {
    let data = dataset();
    // Rendezvous sends: a schedule that would deadlock on NCCL or MPI fails here too.
    let opts = RunOptions::with_timeout(Duration::from_secs(60)).rendezvous();
    let outs = run_ranks(pp, &opts, |ctx| {
        let rank = ctx.comm.rank();
        let spec = StageSpec::even(gpt_config().n_layer, pp)?[rank].clone();
        let stage = GptStage::new(gpt_config(), spec, SEED, DType::F32, Device::Cpu)?;
        let grads = PipelineGrads::new(&stage, ctx.comm.clone())?;
        let mut opt = optimizer(stage.named_parameters());
        let mut losses = Vec::new();
        for step in 0..STEPS {
            opt.zero_grad();
            let mbs = micro_rows(0..BATCH as u64, MICRO)?
                .into_iter()
                .map(|rows| {
                    Ok(Microbatch {
                        first_row: rows.start,
                        batch: batch(&data, step, rows)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            losses.push(execute(
                &stage,
                schedule,
                ctx.comm.as_ref(),
                &mbs,
                step as u64,
                None,
            )?);
            grads.step(&mut opt, Some(CLIP), LR)?;
        }
        Ok((losses, full_weights(&stage)?))
    })
    .unwrap();
    for (r, (l, _)) in outs.iter().enumerate() {
        assert_eq!(l, &outs[0].0, "rank {r} reports the last stage's losses");
    }
    let mut weights: HashMap<String, Vec<f32>> = HashMap::new();
    for (_, ws) in &outs {
        for (name, w) in ws {
            match weights.get(name) {
                // Only the tied table is held twice: the copies take the same updates.
                Some(first) => {
                    assert_eq!(name, "wte.weight");
                    assert_eq!(first, w, "the last stage's wte.weight copy");
                }
                None => {
                    weights.insert(name.clone(), w.clone());
                }
            }
        }
    }
    let full = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu).unwrap();
    let names: Vec<String> = full
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(
        weights.len(),
        names.len(),
        "the stages hold the model's parameters"
    );
    RunOut {
        losses: outs[0].0.clone(),
        weights: names
            .into_iter()
            .map(|n| {
                let w = weights
                    .remove(&n)
                    .unwrap_or_else(|| panic!("no stage holds {n}"));
                (n, w)
            })
            .collect(),
    }
}

#[test]
fn gpipe_and_1f1b_match_single_device() {
    let want = single_device();
    for pp in [2, 4] {
        let s = Schedule::gpipe(pp, MICRO).unwrap();
        assert_close(
            &format!("pp={pp} gpipe"),
            &pipeline_run(pp, &s),
            &want,
            1e-5,
        );
        let s = Schedule::one_f_one_b(pp, MICRO).unwrap();
        assert_close(&format!("pp={pp} 1f1b"), &pipeline_run(pp, &s), &want, 1e-5);
    }
}

#[test]
fn interleaved_and_zero_bubble_are_refused() {
    let data = dataset();
    for (schedule, needle) in [
        (Schedule::interleaved(2, MICRO, 2).unwrap(), "chunks"),
        (Schedule::zero_bubble(2, MICRO).unwrap(), "split"),
    ] {
        let opts = RunOptions::with_timeout(Duration::from_secs(20));
        let errs = run_ranks(2, &opts, |ctx| {
            let rank = ctx.comm.rank();
            let spec = StageSpec::even(gpt_config().n_layer, 2)?[rank].clone();
            let stage = GptStage::new(gpt_config(), spec, SEED, DType::F32, Device::Cpu)?;
            let mbs = micro_rows(0..BATCH as u64, MICRO)?
                .into_iter()
                .map(|rows| {
                    Ok(Microbatch {
                        first_row: rows.start,
                        batch: batch(&data, 0, rows)?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(execute(&stage, &schedule, ctx.comm.as_ref(), &mbs, 0, None)
                .err()
                .map(|e| e.to_string()))
        })
        .unwrap();
        for e in errs {
            let e = e.unwrap_or_else(|| panic!("the {} schedule must be refused", schedule.kind));
            assert!(e.contains(needle), "{e}");
            assert!(e.contains("not supported"), "{e}");
            assert!(!e.contains('\n'), "{e}");
        }
    }
}

//! Delayed parameter initialisation: a model built with `ParamBuilder::delayed_init` allocates no
//! parameter until it is used and then holds exactly the eager model's values; ZeRO-3 / FSDP (alone
//! and with tensor parallelism) cuts its shards from such a model one unit at a time, so no rank
//! ever holds the whole model, and trains bit for bit like the eager run.

use std::time::Duration;

use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::optim::{param_groups_for_decay, AdamWConfig};
use meshgrad_nn::{ForwardCtx, Gpt, GptConfig, Module, ParamBuilder};
use meshgrad_parallel::comm::{all_reduce_scalar, run_ranks, RunOptions};
use meshgrad_parallel::tp::tensor_parallel;
use meshgrad_parallel::zero::{ShardConfig, ShardedDataParallel};
use meshgrad_parallel::{rank_rows, ParallelLayout, ReduceOp};
use meshgrad_tensor::alloc::MemoryTag;
use meshgrad_tensor::{DType, Device, Result, Tensor};

const SEED: u64 = 11;
const T: usize = 16;

fn config() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: T,
        n_layer: 6,
        n_head: 4,
        n_embd: 32,
        dropout: 0.0,
        bias: false,
        layer_norm_eps: 1e-5,
    }
}

fn batch(step: u64, rows: std::ops::Range<u64>) -> Result<(Tensor, Tensor)> {
    let tokens: Vec<u32> = (0..2000u64)
        .map(|i| ((i * 7 + i / 11) % 64) as u32)
        .collect();
    let ds = TokenDataset::from_tokens("synthetic", tokens, 64)?;
    let n = (rows.end - rows.start) as usize;
    let b = ds
        .batch(SEED, step, rows, T)
        .map_err(|e| meshgrad_tensor::Error::msg(e.to_string()))?;
    Ok((
        Tensor::from_vec(b.inputs, (n, T), Device::Cpu)?,
        Tensor::from_vec(b.targets, (n, T), Device::Cpu)?,
    ))
}

#[test]
fn a_delayed_model_allocates_nothing_until_used_then_equals_the_eager_one() {
    let eager = Gpt::new(config(), SEED, DType::F32, Device::Cpu).unwrap();
    let tracker = meshgrad_tensor::alloc::MemoryTracker::new();
    let delayed = meshgrad_tensor::alloc::with_tracker(tracker.clone(), || {
        Gpt::build(config(), ParamBuilder::new(SEED).delayed_init())
    })
    .unwrap();
    assert_eq!(tracker.stats().current_of(MemoryTag::Params), 0);
    assert!(delayed.parameters().iter().all(|p| p.tensor().is_lazy()));
    let (ids, targets) = batch(0, 0..2).unwrap();
    let a = eager
        .loss(&ids, &targets, None)
        .unwrap()
        .tensor()
        .item()
        .unwrap();
    let b = meshgrad_tensor::alloc::with_tracker(tracker.clone(), || {
        delayed.loss(&ids, &targets, None)
    })
    .unwrap()
    .tensor()
    .item()
    .unwrap();
    assert_eq!(a.to_bits(), b.to_bits());
    // Materialised on use, charged as parameters, with the eager values.
    let bytes: usize = eager
        .parameters()
        .iter()
        .map(|p| p.tensor().elem_count() * 4)
        .sum();
    assert_eq!(tracker.stats().current_of(MemoryTag::Params), bytes);
    for ((n, x), (_, y)) in eager
        .named_parameters()
        .iter()
        .zip(delayed.named_parameters())
    {
        assert!(!y.tensor().is_lazy());
        assert_eq!(
            x.tensor().to_vec::<f32>().unwrap(),
            y.tensor().to_vec::<f32>().unwrap(),
            "{n}"
        );
    }
}

/// Trains 3 steps under `layout` (ZeRO-3) from an eager or a delayed model; returns rank 0's
/// losses and every rank's peak parameter bytes while the wrapper was built.
fn fsdp_run(layout: &str, delayed: bool) -> (Vec<f64>, Vec<usize>) {
    let layout: ParallelLayout = layout.parse().unwrap();
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    let outs = run_ranks(layout.world_size(), &opts, |ctx| {
        let mesh = layout.mesh(ctx.comm.clone())?;
        let mut builder = ParamBuilder::new(SEED);
        if mesh.tp_degree() > 1 {
            builder =
                builder.tensor_parallel(tensor_parallel(mesh.tp_group(), false), Gpt::tp_plan());
        }
        if delayed {
            builder = builder.delayed_init();
        }
        let model = Gpt::build(config(), builder)?;
        let sdp = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), 0.1),
            AdamWConfig::default(),
            mesh.shard_topology()?,
            ShardConfig::new(layout.zero().expect("a ZeRO layout")),
        )?;
        let peak = ctx.tracker.stats().peak_of(MemoryTag::Params);
        let rows = rank_rows(4, mesh.dp_degree(), mesh.dp_rank())?;
        let mut losses = Vec::new();
        for step in 0..3u64 {
            sdp.zero_grad();
            let (ids, targets) = batch(step, rows.clone())?;
            let loss =
                ForwardCtx::new(step, rows.start).scope(|| model.loss(&ids, &targets, None))?;
            loss.backward()?;
            sdp.finish()?;
            sdp.step(1e-3)?;
            let l = loss.tensor().item()?;
            losses.push(all_reduce_scalar(
                mesh.dp_group().as_ref(),
                l,
                ReduceOp::Avg,
            )?);
        }
        Ok((losses, peak))
    })
    .unwrap();
    let peaks = outs.iter().map(|o| o.1).collect();
    (outs[0].0.clone(), peaks)
}

#[test]
fn fsdp_from_a_delayed_model_never_holds_the_whole_model_and_trains_identically() {
    let full_bytes = config().num_parameters() * 4;
    for layout in ["fsdp=4", "fsdp=2,tp=2"] {
        let (eager_losses, eager_peaks) = fsdp_run(layout, false);
        let (losses, peaks) = fsdp_run(layout, true);
        assert_eq!(
            losses, eager_losses,
            "{layout}: delayed init changes the run"
        );
        // Eagerly every rank held its whole (tp-local) model; delayed, its shards plus one unit
        // (a block, the largest unit here) at a time.
        let (tp, shard) = if layout.contains("tp=2") {
            (2, 2)
        } else {
            (1, 4)
        };
        let c = config().n_embd;
        let block_bytes = (12 * c * c + 2 * c) * 4 / tp;
        for (&e, &d) in eager_peaks.iter().zip(&peaks) {
            assert!(
                e >= full_bytes / tp,
                "{layout}: eager peak {e} below {}",
                full_bytes / tp
            );
            let bound = e / shard + block_bytes + 1024;
            assert!(
                d <= bound,
                "{layout}: delayed peak {d} bytes above shards + one block ({bound})"
            );
        }
        println!("{layout}: parameter peak while sharding, eager {eager_peaks:?} vs delayed {peaks:?} bytes");
    }
}

//! Sharded data parallelism in lockstep with a single device: a small GPT (2 layers, n_embd 32,
//! vocab 64, T 16, no biases, dropout 0) trained with AdamW (weight decay 0.1 on the decay group,
//! none on biases and norms) and gradient clipping at 0.5, on the same global batch of 8 rows,
//! under ZeRO-1, ZeRO-2, ZeRO-3 (with and without activation checkpointing) and hybrid sharding
//! at world sizes 1, 2 and 4.
//!
//! Tolerances (f32): per-step losses within 1e-5 relative; final weights within 1e-5 of each
//! tensor's largest magnitude (`max |a - b| <= 1e-5 * max |b|`). Bit for bit: a world of one rank
//! equals the single device exactly (every copy is exact, an average over one rank is the value
//! itself, the AdamW kernel is elementwise and the clipping norm is summed in parameter order);
//! every rank ends with identical weights (every rank receives the same bits from each
//! collective); and a layout run twice gives identical losses and weights (reductions in fixed
//! rank order). Across 2 or 4 ranks the batch gradient is summed in a different order (per-rank
//! means, then the average in rank order), so those runs match to rounding only.

use std::collections::HashMap;
use std::sync::OnceLock;
use std::time::Duration;

use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::optim::{
    clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig,
};
use meshgrad_nn::state::{load_state_dict, state_dict};
use meshgrad_nn::ForwardCtx;
use meshgrad_nn::{Gpt, GptConfig, Module};
use meshgrad_parallel::comm::{all_reduce_scalar, run_ranks, RunOptions};
use meshgrad_parallel::zero::{
    FullStateDictOptions, MixedPrecision, ShardConfig, ShardTopology, ShardedDataParallel,
    WrapPolicy, ZeroStage,
};
use meshgrad_parallel::{micro_rows, rank_rows, DeviceMesh, RankCtx, ReduceOp};
use meshgrad_tensor::{DType, Device, Result, Tensor};

const SEED: u64 = 42;
const BATCH: usize = 8;
const T: usize = 16;
const STEPS: usize = 5;
const LR: f64 = 2e-3;
const CLIP: f64 = 0.5;
const WD: f64 = 0.1;

fn gpt_config() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: T,
        n_layer: 2,
        n_head: 2,
        n_embd: 32,
        dropout: 0.0,
        // No biases: the key projection's bias has a gradient that is exactly zero in exact
        // arithmetic (softmax ignores a constant shift of the scores), so in floating point it
        // is rounding noise, which AdamW normalises into lr-sized steps of arbitrary sign:
        // that parameter can only match a differently-summed run to ~1e-4, whatever the
        // strategy. The no-decay group still holds every layer-norm weight.
        bias: false,
        layer_norm_eps: 1e-5,
    }
}

/// A learnable token stream over 64 ids: a repeating pattern with some noise.
fn dataset() -> &'static TokenDataset {
    static DATA: OnceLock<TokenDataset> = OnceLock::new();
    DATA.get_or_init(|| {
        let tokens: Vec<u32> = (0..4000u64)
            .map(|i| {
                let h = meshgrad_nn::data::splitmix64(i ^ 0x5eed);
                if h.is_multiple_of(6) {
                    (h >> 9) as u32 % 64
                } else {
                    ((i * 5 + i / 11) % 64) as u32
                }
            })
            .collect();
        TokenDataset::from_tokens("synthetic", tokens, 64).unwrap()
    })
}

fn batch(step: usize, rows: std::ops::Range<u64>) -> Result<(Tensor, Tensor, ForwardCtx)> {
    let n = (rows.end - rows.start) as usize;
    let b = dataset()
        .batch(SEED, step as u64, rows.clone(), T)
        .map_err(|e| meshgrad_tensor::Error::msg(e.to_string()))?;
    Ok((
        Tensor::from_vec(b.inputs, (n, T), Device::Cpu)?,
        Tensor::from_vec(b.targets, (n, T), Device::Cpu)?,
        ForwardCtx {
            step: step as u64,
            first_row: rows.start,
        },
    ))
}

type Weights = Vec<(String, Vec<f32>)>;

#[derive(Clone, Debug, PartialEq)]
struct RunOut {
    losses: Vec<f64>,
    weights: Weights,
}

fn to_weights(tensors: Vec<(String, Tensor)>) -> Weights {
    tensors
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f32().unwrap()))
        .collect()
}

/// The single-device reference: the whole batch, plain AdamW and clip_grad_norm.
fn single_device(checkpointing: bool, microbatches: usize) -> RunOut {
    let mut model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu).unwrap();
    model.activation_checkpointing = checkpointing;
    let mut opt = AdamW::new(
        param_groups_for_decay(model.named_parameters(), WD),
        AdamWConfig::default(),
    )
    .unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad();
        let mut loss_sum = 0.0;
        for rows in micro_rows(0..BATCH as u64, microbatches).unwrap() {
            let (ids, targets, ctx) = batch(step, rows).unwrap();
            let loss = ctx.scope(|| model.loss(&ids, &targets, None)).unwrap();
            loss_sum += loss.tensor().item().unwrap();
            let loss = if microbatches > 1 {
                loss.mul_scalar(1.0 / microbatches as f64).unwrap()
            } else {
                loss
            };
            loss.backward().unwrap();
        }
        clip_grad_norm(&model.parameters(), CLIP).unwrap();
        opt.step(LR).unwrap();
        losses.push(loss_sum / microbatches as f64);
    }
    RunOut {
        losses,
        weights: to_weights(state_dict(&model)),
    }
}

fn reference() -> &'static RunOut {
    static R: OnceLock<RunOut> = OnceLock::new();
    R.get_or_init(|| single_device(false, 1))
}

/// A parallel layout of the test: `replicate` x `shard` ranks.
#[derive(Clone, Copy, Debug)]
struct Layout {
    stage: ZeroStage,
    replicate: usize,
    shard: usize,
    checkpointing: bool,
    microbatches: usize,
    mp: MixedPrecision,
    param_dtype: DType,
}

impl Layout {
    fn new(stage: ZeroStage, replicate: usize, shard: usize) -> Self {
        Layout {
            stage,
            replicate,
            shard,
            checkpointing: false,
            microbatches: 1,
            mp: MixedPrecision::default(),
            param_dtype: DType::F32,
        }
    }
    fn world(&self) -> usize {
        self.replicate * self.shard
    }
}

fn topology(ctx: &RankCtx, l: &Layout) -> Result<ShardTopology> {
    if l.replicate == 1 {
        Ok(ShardTopology::flat(ctx.comm.clone()))
    } else {
        let mesh = DeviceMesh::new(
            ctx.comm.clone(),
            &["dp_replicate", "dp_shard"],
            &[l.replicate, l.shard],
        )?;
        ShardTopology::from_mesh(&mesh)
    }
}

fn wrap(ctx: &RankCtx, l: &Layout) -> Result<(Gpt, ShardedDataParallel)> {
    // Ranks other than 0 start from other weights: the broadcast must fix that.
    let seed = if ctx.rank == 0 { SEED } else { SEED + 7 };
    let mut model = Gpt::new(gpt_config(), seed, l.param_dtype, Device::Cpu)?;
    model.activation_checkpointing = l.checkpointing;
    let mut config = ShardConfig::new(l.stage);
    config.mixed_precision = l.mp;
    let sdp = ShardedDataParallel::new(
        &model,
        param_groups_for_decay(model.named_parameters(), WD),
        AdamWConfig::default(),
        topology(ctx, l)?,
        config,
    )?;
    Ok((model, sdp))
}

/// One training step of this rank's rows; returns the global mean loss.
fn train_step(
    ctx: &RankCtx,
    model: &Gpt,
    sdp: &ShardedDataParallel,
    l: &Layout,
    step: usize,
) -> Result<f64> {
    sdp.zero_grad();
    let rows = rank_rows(BATCH, l.world(), ctx.rank)?;
    let micro = micro_rows(rows, l.microbatches)?;
    let mut local = 0.0;
    for (m, r) in micro.iter().enumerate() {
        let (ids, targets, fctx) = batch(step, r.clone())?;
        let loss = fctx.scope(|| model.loss(&ids, &targets, None))?;
        local += loss.tensor().item()?;
        let loss = if l.microbatches > 1 {
            loss.mul_scalar(1.0 / l.microbatches as f64)?
        } else {
            loss
        };
        sdp.set_sync(m + 1 == l.microbatches);
        loss.backward()?;
    }
    sdp.finish()?;
    sdp.clip_grad_norm(CLIP)?;
    sdp.step(LR)?;
    all_reduce_scalar(
        ctx.comm.as_ref(),
        local / l.microbatches as f64,
        ReduceOp::Avg,
    )
}

/// Trains `l` for STEPS steps; every rank's losses and full (gathered) weights.
fn run(l: Layout) -> Vec<RunOut> {
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    run_ranks(l.world(), &opts, |ctx| {
        let (model, sdp) = wrap(&ctx, &l)?;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            losses.push(train_step(&ctx, &model, &sdp, &l, step)?);
        }
        let weights = to_weights(sdp.full_state_dict(FullStateDictOptions::default())?);
        Ok(RunOut { losses, weights })
    })
    .unwrap_or_else(|e| panic!("{l:?}: {e}"))
}

/// The relative L2 distance of the weights, `||a - b|| / ||b||` over all tensors together.
fn l2_deviation(got: &RunOut, want: &RunOut) -> f64 {
    let (mut d, mut n) = (0f64, 0f64);
    for ((_, a), (_, b)) in got.weights.iter().zip(&want.weights) {
        for (x, y) in a.iter().zip(b) {
            d += ((x - y) as f64).powi(2);
            n += (*y as f64).powi(2);
        }
    }
    (d / n).sqrt()
}

/// The largest relative deviations of `got` from `want`: over the per-step losses
/// (`|a - b| / |b|`), and over the weights (`max |a - b| / max |b|` per tensor), with the name
/// of the worst tensor.
fn deviation(got: &RunOut, want: &RunOut) -> (f64, f64, String) {
    assert_eq!(got.losses.len(), want.losses.len());
    let loss = got
        .losses
        .iter()
        .zip(&want.losses)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs() / b.abs()));
    let want: HashMap<&str, &Vec<f32>> =
        want.weights.iter().map(|(n, w)| (n.as_str(), w)).collect();
    assert_eq!(got.weights.len(), want.len(), "parameter count");
    let mut worst = (0f64, String::new());
    for (name, a) in &got.weights {
        let b = want[name.as_str()];
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        let diff = a
            .iter()
            .zip(b.iter())
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
        let rel = diff / scale.max(1e-6);
        if rel > worst.0 {
            worst = (rel, name.clone());
        }
    }
    (loss, worst.0, worst.1)
}

fn assert_close(l: &Layout, got: &RunOut, want: &RunOut, loss_tol: f64, weight_tol: f64) {
    let (loss, weights, name) = deviation(got, want);
    assert!(
        loss <= loss_tol,
        "{l:?}: losses {:?} vs single device {:?}: relative deviation {loss:e}",
        got.losses,
        want.losses
    );
    assert!(
        weights <= weight_tol,
        "{l:?}: {name}: max |diff| / max |w| = {weights:e}"
    );
}

/// Every rank holds the same weights and saw the same losses, bit for bit.
fn assert_ranks_agree(l: &Layout, outs: &[RunOut]) {
    for (r, o) in outs.iter().enumerate().skip(1) {
        assert_eq!(o, &outs[0], "{l:?}: rank {r} differs from rank 0");
    }
}

fn lockstep(l: Layout) {
    let outs = run(l);
    assert_ranks_agree(&l, &outs);
    assert_close(&l, &outs[0], reference(), 1e-5, 1e-5);
}

#[test]
fn zero1_matches_single_device() {
    lockstep(Layout::new(ZeroStage::One, 1, 2));
    lockstep(Layout::new(ZeroStage::One, 1, 4));
}

#[test]
fn zero2_matches_single_device() {
    lockstep(Layout::new(ZeroStage::Two, 1, 2));
    lockstep(Layout::new(ZeroStage::Two, 1, 4));
}

#[test]
fn zero3_matches_single_device() {
    lockstep(Layout::new(ZeroStage::Three, 1, 2));
    lockstep(Layout::new(ZeroStage::Three, 1, 4));
}

#[test]
fn zero3_with_activation_checkpointing_matches_single_device() {
    for shard in [2, 4] {
        let mut l = Layout::new(ZeroStage::Three, 1, shard);
        l.checkpointing = true;
        let outs = run(l);
        assert_ranks_agree(&l, &outs);
        // Checkpointing recomputes the same forward: the single device with or without it
        // gives the same bits, so one reference serves both.
        assert_close(&l, &outs[0], reference(), 1e-5, 1e-5);
    }
}

#[test]
fn hybrid_sharding_matches_single_device() {
    // hsdp=2x1 (world 2: two replicas of an unsharded model), hsdp=2x2 (world 4), for the
    // fully sharded strategy and for ZeRO-2 and ZeRO-1 over the same mesh.
    lockstep(Layout::new(ZeroStage::Three, 2, 1));
    lockstep(Layout::new(ZeroStage::Three, 2, 2));
    lockstep(Layout::new(ZeroStage::Two, 2, 2));
    lockstep(Layout::new(ZeroStage::One, 2, 2));
}

#[test]
fn one_rank_equals_single_device_bit_for_bit() {
    let want = reference();
    for stage in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let l = Layout::new(stage, 1, 1);
        let outs = run(l);
        assert_eq!(&outs[0], want, "{l:?}");
    }
    let mut l = Layout::new(ZeroStage::Three, 1, 1);
    l.checkpointing = true;
    assert_eq!(&run(l)[0], &single_device(true, 1), "{l:?}");
}

#[test]
fn runs_are_bitwise_repeatable() {
    for l in [
        Layout::new(ZeroStage::Three, 1, 4),
        Layout::new(ZeroStage::Two, 2, 2),
    ] {
        assert_eq!(run(l), run(l), "{l:?}");
    }
}

#[test]
fn reductions_are_launched_during_backward() {
    // Every unit's reduction starts from the gradient-ready hooks while backward goes on; with
    // sync off for the whole step, finish() launches them all.
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    for stage in [ZeroStage::One, ZeroStage::Two, ZeroStage::Three] {
        let l = Layout::new(stage, 1, 2);
        run_ranks(2, &opts, |ctx| {
            let (model, sdp) = wrap(&ctx, &l)?;
            train_step(&ctx, &model, &sdp, &l, 0)?;
            assert_eq!(sdp.last_reduction_launches(), (3, 0), "{l:?}");
            sdp.zero_grad();
            sdp.set_sync(false);
            let (ids, targets, fctx) = batch(1, rank_rows(BATCH, 2, ctx.rank)?)?;
            fctx.scope(|| model.loss(&ids, &targets, None))?
                .backward()?;
            sdp.set_sync(true);
            sdp.finish()?;
            assert_eq!(sdp.last_reduction_launches(), (0, 3), "{l:?}");
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn zero3_gathers_one_unit_at_a_time_with_the_next_prefetched() {
    // Units root (wte, wpe, ln_f), h.0, h.1 (the default Auto policy). A unit is gathered when
    // one of its parameters is first read; each gather releases the unit gathered before.
    // Forward reads root (embeddings), h.0, h.1, root (ln_f and the tied head); backward keeps
    // root for the head, then reads h.1 and h.0 (the embeddings' backward reads no weight).
    // Step 1 predicts the forward from the registration order (root, h.0, h.1: root on demand,
    // h.0 and h.1 prefetched, root again on demand) and the backward from the reversed forward
    // (h.1 on demand, h.0 prefetched; the guessed root prefetch is abandoned). Step 2 predicts
    // from the recorded orders: root on demand (nothing is prefetched across the optimizer
    // step), then h.0, h.1, root, and in backward h.1 and h.0, all prefetched. So 8 prefetched
    // and 4 on demand in 2 steps (12 on demand without prefetching); never more than one unit
    // gathered at a time, with activation checkpointing too (its recompute reads the block's
    // weights in backward).
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    for (checkpointing, prefetch) in [(false, true), (true, true), (false, false)] {
        run_ranks(2, &opts, |ctx| {
            let mut model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu)?;
            model.activation_checkpointing = checkpointing;
            let mut config = ShardConfig::new(ZeroStage::Three);
            config.prefetch = prefetch;
            let sdp = ShardedDataParallel::new(
                &model,
                param_groups_for_decay(model.named_parameters(), WD),
                AdamWConfig::default(),
                ShardTopology::flat(ctx.comm.clone()),
                config,
            )?;
            let l = Layout::new(ZeroStage::Three, 1, 2);
            for step in 0..2 {
                train_step(&ctx, &model, &sdp, &l, step)?;
            }
            let g = sdp.gather_stats();
            let what = format!("checkpointing {checkpointing}, prefetch {prefetch}: {g:?}");
            assert_eq!(g.max_gathered, 1, "{what}");
            if prefetch {
                assert_eq!((g.prefetched, g.on_demand), (8, 4), "{what}");
            } else {
                assert_eq!((g.prefetched, g.on_demand), (0, 12), "{what}");
            }
            let order = sdp.gather_order();
            assert_eq!(order.forward, ["root", "h.0", "h.1", "root"], "{what}");
            assert_eq!(order.backward, ["h.1", "h.0"], "{what}");
            Ok(())
        })
        .unwrap();
    }
}

#[test]
fn gradient_accumulation_matches_the_large_batch() {
    // Two micro-batches per rank: the first accumulates locally (sync off), the second reduces.
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let mut l = Layout::new(stage, 1, 2);
        l.microbatches = 2;
        let outs = run(l);
        assert_ranks_agree(&l, &outs);
        assert_close(&l, &outs[0], reference(), 1e-5, 1e-5);
    }
}

#[test]
fn bf16_gradient_reduction_stays_close_to_f32() {
    // Gradients reduced in bf16 (8 mantissa bits), master weights and moments in f32. Stated
    // tolerance against the f32 single device over 5 steps: losses within 1e-4 relative, weights
    // within 5e-3 in relative L2 norm (measured: 2.8e-5 and 7.7e-4). Elementwise the weights can
    // differ more (AdamW normalises tiny gradients into lr-sized steps), so the L2 norm is the
    // meaningful measure here.
    let want = reference();
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let mut l = Layout::new(stage, 1, 4);
        l.mp = MixedPrecision::bf16_reduce();
        let outs = run(l);
        assert_ranks_agree(&l, &outs);
        assert!(
            outs[0].losses[STEPS - 1] < outs[0].losses[0],
            "{l:?} does not train"
        );
        let (loss, _, _) = deviation(&outs[0], want);
        let l2 = l2_deviation(&outs[0], want);
        assert!(
            loss <= 1e-4 && l2 <= 5e-3,
            "{l:?}: loss {loss:e}, weights l2 {l2:e}"
        );
    }
}

#[test]
fn bf16_parameters_with_f32_master_weights_train() {
    // bf16 compute (the model built in bf16, so its initial weights are rounded to bf16), bf16
    // gradient reduction, f32 master weights and moments. Stated tolerance against the f32
    // single device: losses within 1e-3 relative, f32 master weights within 1e-2 in relative L2
    // norm (measured: 1.6e-4 and 2.3e-3).
    let want = reference();
    for stage in [ZeroStage::One, ZeroStage::Three] {
        let mut l = Layout::new(stage, 1, 2);
        l.param_dtype = DType::BF16;
        let outs = run(l);
        assert_ranks_agree(&l, &outs);
        assert!(
            outs[0].losses[STEPS - 1] < outs[0].losses[0],
            "{l:?} does not train"
        );
        let (loss, _, _) = deviation(&outs[0], want);
        let l2 = l2_deviation(&outs[0], want);
        assert!(
            loss <= 1e-3 && l2 <= 1e-2,
            "{l:?}: loss {loss:e}, weights l2 {l2:e}"
        );
    }
}

/// Logits of a fixed batch, as f32.
fn logits(model: &Gpt) -> Result<Vec<f32>> {
    let (ids, _, ctx) = batch(99, 0..4)?;
    meshgrad_autograd::no_grad(|| ctx.scope(|| model.forward(&ids)))?
        .tensor()
        .to_vec_f32()
}

#[test]
fn full_state_dict_moves_between_layouts() {
    // Train ZeRO-3 at world 4, save the full state (weights and optimizer), load it into ZeRO-1
    // at world 2 and into a single-device model: all three give identical logits, and one more
    // step continues identically on ZeRO-1 and on a single device with plain AdamW.
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    let l3 = Layout::new(ZeroStage::Three, 1, 4);
    let saved = run_ranks(4, &opts, |ctx| {
        let (model, sdp) = wrap(&ctx, &l3)?;
        for step in 0..2 {
            train_step(&ctx, &model, &sdp, &l3, step)?;
        }
        let full = sdp.full_state_dict(FullStateDictOptions {
            optimizer: true,
            rank0_only: true,
        })?;
        let z3_logits = logits(&model)?;
        Ok((full, z3_logits))
    })
    .unwrap();
    assert!(saved[1].0.is_empty(), "rank0_only: rank 1 gets nothing");
    let (full, z3_logits) = saved[0].clone();
    assert!(full.iter().any(|(n, _)| n == "adamw.m.h.1.mlp.c_fc.weight"));
    for (_, l) in &saved[1..] {
        assert_eq!(l, &z3_logits, "ZeRO-3 ranks disagree on logits");
    }

    // Single device: weights and AdamW state from the dict.
    let single = Gpt::new(gpt_config(), 7, DType::F32, Device::Cpu).unwrap();
    load_state_dict(&single, &full, false).unwrap();
    let mut opt = AdamW::new(
        param_groups_for_decay(single.named_parameters(), WD),
        AdamWConfig::default(),
    )
    .unwrap();
    let optim: Vec<(String, Tensor)> = full
        .iter()
        .filter(|(n, _)| n.starts_with("adamw."))
        .cloned()
        .collect();
    opt.load_state_dict(&optim).unwrap();
    let single_logits = logits(&single).unwrap();
    assert_eq!(single_logits, z3_logits, "single device vs ZeRO-3 logits");
    // One more step on the single device.
    let (ids, targets, ctx) = batch(2, 0..BATCH as u64).unwrap();
    ctx.scope(|| single.loss(&ids, &targets, None))
        .unwrap()
        .backward()
        .unwrap();
    clip_grad_norm(&single.parameters(), CLIP).unwrap();
    opt.step(LR).unwrap();
    let single_next = to_weights(state_dict(&single));

    let l1 = Layout::new(ZeroStage::One, 1, 2);
    let z1 = run_ranks(2, &opts, |ctx| {
        let (model, sdp) = wrap(&ctx, &l1)?;
        sdp.load_full_state_dict(&full, true)?;
        let before = logits(&model)?;
        train_step(&ctx, &model, &sdp, &l1, 2)?;
        let after = to_weights(sdp.full_state_dict(FullStateDictOptions::default())?);
        Ok((before, after))
    })
    .unwrap();
    for (before, after) in &z1 {
        assert_eq!(before, &z3_logits, "ZeRO-1 vs ZeRO-3 logits");
        let got = RunOut {
            losses: vec![],
            weights: after.clone(),
        };
        let want = RunOut {
            losses: vec![],
            weights: single_next.clone(),
        };
        assert_close(&l1, &got, &want, 1e-5, 1e-5);
    }
}

#[test]
fn zero3_keeps_only_shards_between_steps_and_summons_full_params() {
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    let l = Layout::new(ZeroStage::Three, 1, 2);
    run_ranks(2, &opts, |ctx| {
        let (model, sdp) = wrap(&ctx, &l)?;
        train_step(&ctx, &model, &sdp, &l, 0)?;
        for (name, p) in model.named_parameters() {
            assert!(!p.tensor().is_materialized(), "{name} is still gathered");
        }
        // Eval under no_grad gathers and releases unit by unit; the unit used last (root: the
        // tied head) stays until another is needed or reshard() frees it.
        let a = logits(&model)?;
        let present: Vec<String> = model
            .named_parameters()
            .into_iter()
            .filter(|(_, p)| p.tensor().is_materialized())
            .map(|(n, _)| n)
            .collect();
        assert_eq!(present, ["wte.weight", "wpe.weight", "ln_f.weight"]);
        sdp.reshard();
        assert!(model
            .parameters()
            .iter()
            .all(|p| !p.tensor().is_materialized()));
        sdp.summon_full_params()?;
        assert!(model
            .parameters()
            .iter()
            .all(|p| p.tensor().is_materialized()));
        assert_eq!(logits(&model)?, a);
        assert!(model
            .parameters()
            .iter()
            .all(|p| p.tensor().is_materialized()));
        sdp.reshard();
        assert!(model
            .parameters()
            .iter()
            .all(|p| !p.tensor().is_materialized()));
        // The plan: a root unit and one per block; the tied wte is in the root.
        let units: Vec<&str> = sdp.plan().units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(units, vec!["root", "h.0", "h.1"]);
        // The recorded order: the embeddings and the head both read the root unit.
        let order = sdp.gather_order();
        assert_eq!(order.forward, ["root", "h.0", "h.1", "root"]);
        assert_eq!(order.backward, ["h.1", "h.0"]);
        Ok(())
    })
    .unwrap();
}

#[test]
fn whole_model_unit_and_path_wrap_policies_also_match() {
    for wrap in [WrapPolicy::Whole, WrapPolicy::paths(["wte", "h"])] {
        let opts = RunOptions::with_timeout(Duration::from_secs(30));
        let l = Layout::new(ZeroStage::Three, 1, 4);
        let outs = run_ranks(4, &opts, |ctx| {
            let model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu)?;
            let mut config = ShardConfig::new(ZeroStage::Three);
            config.wrap = wrap.clone();
            let sdp = ShardedDataParallel::new(
                &model,
                param_groups_for_decay(model.named_parameters(), WD),
                AdamWConfig::default(),
                ShardTopology::flat(ctx.comm.clone()),
                config,
            )?;
            let mut losses = Vec::new();
            for step in 0..STEPS {
                losses.push(train_step(&ctx, &model, &sdp, &l, step)?);
            }
            let weights = to_weights(sdp.full_state_dict(FullStateDictOptions::default())?);
            Ok(RunOut { losses, weights })
        })
        .unwrap();
        assert_ranks_agree(&l, &outs);
        assert_close(&l, &outs[0], reference(), 1e-5, 1e-5);
    }
}

#[test]
fn bad_configurations_are_errors() {
    let opts = RunOptions::with_timeout(Duration::from_secs(10));
    run_ranks(2, &opts, |ctx| {
        let model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu)?;
        let topo = || ShardTopology::flat(ctx.comm.clone());
        let cfg = ShardConfig::new(ZeroStage::Three);
        // A parameter missing from the optimizer groups.
        let mut groups = param_groups_for_decay(model.named_parameters(), WD);
        let dropped = groups[1].params.pop().unwrap().0;
        let e =
            ShardedDataParallel::new(&model, groups, AdamWConfig::default(), topo(), cfg.clone())
                .unwrap_err()
                .to_string();
        assert!(
            e.contains(&dropped) && e.contains("no optimizer group"),
            "{e}"
        );
        // Negative weight decay.
        let e = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), -1.0),
            AdamWConfig::default(),
            topo(),
            cfg.clone(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("weight_decay -1"), "{e}");
        // A non-float reduce dtype.
        let mut bad = cfg.clone();
        bad.mixed_precision.reduce_dtype = Some(DType::I64);
        let e = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), WD),
            AdamWConfig::default(),
            topo(),
            bad,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("reduce dtype i64"), "{e}");
        // Wrapping twice for ZeRO-3.
        let sdp = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), WD),
            AdamWConfig::default(),
            topo(),
            cfg.clone(),
        )?;
        let e = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), WD),
            AdamWConfig::default(),
            topo(),
            cfg.clone(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("already sharded"), "{e}");
        // finish() with sync off; a bad learning rate; a bad max_norm.
        sdp.set_sync(false);
        assert!(sdp.finish().unwrap_err().to_string().contains("sync off"));
        sdp.set_sync(true);
        assert!(sdp
            .step(f64::NAN)
            .unwrap_err()
            .to_string()
            .contains("learning rate"));
        assert!(sdp.clip_grad_norm(0.0).is_err());
        // A state dict with a wrong shape changes nothing.
        let mut full = sdp.full_state_dict(FullStateDictOptions::default())?;
        let before = full.clone();
        full[0].1 = Tensor::zeros((3, 3), DType::F32, Device::Cpu)?;
        let e = sdp
            .load_full_state_dict(&full, true)
            .unwrap_err()
            .to_string();
        assert!(e.contains("wte.weight") && e.contains("[3, 3]"), "{e}");
        let after = sdp.full_state_dict(FullStateDictOptions::default())?;
        for ((n, a), (_, b)) in after.iter().zip(&before) {
            assert_eq!(a.to_vec_f32()?, b.to_vec_f32()?, "{n} changed");
        }
        // Dropping the wrapper leaves a model that says why it cannot run.
        drop(sdp);
        let e = logits(&model).unwrap_err().to_string();
        assert!(
            e.contains("was dropped") && e.contains("summon_full_params() before dropping"),
            "{e}"
        );
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_failing_rank_makes_the_others_fail_instead_of_hanging() {
    let opts = RunOptions::with_timeout(Duration::from_secs(5));
    let l = Layout::new(ZeroStage::Three, 1, 4);
    let t0 = std::time::Instant::now();
    let r = run_ranks(4, &opts, |ctx| {
        let (model, sdp) = wrap(&ctx, &l)?;
        train_step(&ctx, &model, &sdp, &l, 0)?;
        if ctx.rank == 2 {
            meshgrad_tensor::bail!("injected failure before step 1");
        }
        train_step(&ctx, &model, &sdp, &l, 1)?;
        Ok(())
    });
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("rank 2") && e.contains("injected failure"),
        "{e}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
}

/// SGD in the lockstep tests: momentum 0.9, the same groups (weight decay WD on the decay
/// group, as L2 added to the gradient), clipping at CLIP, a learning rate that moves the weights
/// visibly in STEPS steps.
const SGD: SgdConfig = SgdConfig { momentum: 0.9 };
const SGD_LR: f64 = 0.05;

/// Losses, weights and momentum buffers (by parameter name) of a run.
type SgdOut = (RunOut, Weights);

fn momentum_buffers(state: &[(String, Tensor)]) -> Weights {
    let mut out: Weights = state
        .iter()
        .filter_map(|(n, t)| {
            n.strip_prefix("sgd.momentum_buffer.")
                .map(|p| (p.to_string(), t.to_vec_f32().unwrap()))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn sgd_single_device() -> SgdOut {
    let model = Gpt::new(gpt_config(), SEED, DType::F32, Device::Cpu).unwrap();
    let mut opt = Sgd::new(param_groups_for_decay(model.named_parameters(), WD), SGD).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad();
        let (ids, targets, ctx) = batch(step, 0..BATCH as u64).unwrap();
        let loss = ctx.scope(|| model.loss(&ids, &targets, None)).unwrap();
        losses.push(loss.tensor().item().unwrap());
        loss.backward().unwrap();
        clip_grad_norm(&model.parameters(), CLIP).unwrap();
        opt.step(SGD_LR).unwrap();
    }
    let buffers = momentum_buffers(&opt.state_dict().unwrap());
    let run = RunOut {
        losses,
        weights: to_weights(state_dict(&model)),
    };
    (run, buffers)
}

/// Trains with SGD under `stage` on `world` ranks; every rank's result and full state dict.
fn sgd_run(stage: ZeroStage, world: usize) -> Vec<(SgdOut, Vec<(String, Tensor)>)> {
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    run_ranks(world, &opts, |ctx| {
        let seed = if ctx.rank == 0 { SEED } else { SEED + 7 };
        let model = Gpt::new(gpt_config(), seed, DType::F32, Device::Cpu)?;
        let mut sdp = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), WD),
            SGD,
            ShardTopology::flat(ctx.comm.clone()),
            ShardConfig::new(stage),
        )?;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            // The loop steps the wrapper as it would any optimizer (ZeRO's step is an
            // `Optimizer`).
            Optimizer::zero_grad(&sdp);
            let (ids, targets, fctx) = batch(step, rank_rows(BATCH, world, ctx.rank)?)?;
            let loss = fctx.scope(|| model.loss(&ids, &targets, None))?;
            let local = loss.tensor().item()?;
            loss.backward()?;
            sdp.finish()?;
            sdp.clip_grad_norm(CLIP)?;
            let opt: &mut dyn Optimizer = &mut sdp;
            opt.step(SGD_LR)?;
            losses.push(all_reduce_scalar(ctx.comm.as_ref(), local, ReduceOp::Avg)?);
        }
        let opt: &dyn Optimizer = &sdp;
        assert_eq!(opt.step_count(), STEPS as u64);
        // The trait's groups and state are the shard's: one variable per segment this rank
        // owns, and the state dict of `local_optimizer_state_dict`.
        let shard_vars: usize = opt.param_groups().iter().map(|g| g.params.len()).sum();
        assert!(shard_vars > 0 && shard_vars <= model.named_parameters().len());
        let names = |v: Vec<(String, Tensor)>| v.into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        assert_eq!(
            names(opt.state_dict()?),
            names(sdp.local_optimizer_state_dict()?)
        );
        let full = sdp.full_state_dict(FullStateDictOptions {
            optimizer: true,
            rank0_only: false,
        })?;
        let weights = to_weights(
            full.iter()
                .filter(|(n, _)| !n.starts_with("sgd."))
                .cloned()
                .collect(),
        );
        let buffers = momentum_buffers(&full);
        Ok(((RunOut { losses, weights }, buffers), full))
    })
    .unwrap_or_else(|e| panic!("{stage:?} x {world}: {e}"))
}

#[test]
fn sgd_with_momentum_matches_single_device() {
    // The optimizer is the caller's: SGD with momentum over each rank's shard. One rank equals
    // the single device bit for bit (weights and momentum buffers); 2 and 4 ranks match to
    // rounding (losses 1e-5 relative, weights and buffers 1e-5 of each tensor's largest
    // magnitude), and every rank agrees bit for bit.
    let (want, want_buffers) = sgd_single_device();
    let l = Layout::new(ZeroStage::Two, 1, 1);
    let one = sgd_run(ZeroStage::Two, 1);
    assert_eq!(one[0].0 .0, want, "ZeRO-2 on one rank vs single device");
    assert_eq!(one[0].0 .1, want_buffers, "momentum buffers on one rank");
    let mut saved = None;
    for (stage, world) in [(ZeroStage::Two, 2), (ZeroStage::Three, 4)] {
        let l = Layout::new(stage, 1, world);
        let outs = sgd_run(stage, world);
        for (r, o) in outs.iter().enumerate().skip(1) {
            assert_eq!(o.0, outs[0].0, "{l:?}: rank {r} differs from rank 0");
        }
        let ((got, got_buffers), full) = &outs[0];
        assert_close(&l, got, &want, 1e-5, 1e-5);
        let as_run = |w: &Weights| RunOut {
            losses: vec![],
            weights: w.clone(),
        };
        assert_eq!(got_buffers.len(), want_buffers.len(), "{l:?}: buffers");
        assert_close(&l, &as_run(got_buffers), &as_run(&want_buffers), 0.0, 1e-5);
        if stage == ZeroStage::Two {
            saved = Some(full.clone());
        }
    }
    // The full state (SGD names) moves between layouts: ZeRO-2 x 2 into ZeRO-3 x 4 and back out.
    let full = saved.unwrap();
    assert!(full.iter().any(|(n, _)| n == "sgd.step_count"));
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    let again = run_ranks(4, &opts, |ctx| {
        let model = Gpt::new(gpt_config(), 3, DType::F32, Device::Cpu)?;
        let sdp = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), WD),
            SGD,
            ShardTopology::flat(ctx.comm.clone()),
            ShardConfig::new(ZeroStage::Three),
        )?;
        sdp.load_full_state_dict(&full, true)?;
        assert_eq!(sdp.step_count(), STEPS as u64);
        sdp.full_state_dict(FullStateDictOptions {
            optimizer: true,
            rank0_only: false,
        })
    })
    .unwrap();
    let key = |t: &[(String, Tensor)]| -> Vec<(String, Vec<f64>)> {
        let mut v: Vec<_> = t
            .iter()
            .map(|(n, t)| (n.clone(), t.to_dtype(DType::F64).unwrap().to_vec().unwrap()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    for got in &again {
        assert_eq!(key(got), key(&full), "{l:?}: reloaded state differs");
    }
}

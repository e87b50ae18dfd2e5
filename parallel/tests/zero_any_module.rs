//! ZeRO-3 / FSDP on a model written by the user with `#[derive(Module)]` (not the built-in GPT):
//! an embedding, a list of 3 residual MLP blocks and a head, with no staging or hooks in its
//! forward. Units are chosen by module path (`layers.*`, or the default Auto policy, which finds
//! the same list), and the run is trained in lockstep with a single device on the same global
//! batch. Also: the errors for a unit pattern that matches nothing and for running the model
//! after its wrapper is dropped, without panics or hangs; and an op that reads parameters of two
//! units at once (both are gathered; the one in use is not released under it).
//!
//! Tolerances (f32, 2 ranks): per-step losses within 1e-5 relative; final weights within 1e-5
//! of each tensor's largest magnitude (`max |a - b| <= 1e-5 * max |b|`). The two ranks sum the
//! batch gradient in another order than the single device (per-rank means, then their average),
//! so the match is to rounding, not bitwise.

use std::collections::HashMap;
use std::time::Duration;

use meshgrad_autograd::Var;
use meshgrad_nn::optim::{clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, Optimizer};
use meshgrad_nn::state::state_dict;
use meshgrad_nn::{Embedding, Forward, LayerNorm, Linear, Module, ParamBuilder};
use meshgrad_parallel::comm::{all_reduce_scalar, run_ranks, RunOptions};
use meshgrad_parallel::zero::{
    FullStateDictOptions, ShardConfig, ShardTopology, ShardedDataParallel, WrapPolicy, ZeroStage,
};
use meshgrad_parallel::{rank_rows, RankCtx, ReduceOp};
use meshgrad_tensor::{Device, Result, Tensor};

const SEED: u64 = 11;
const VOCAB: usize = 32;
const WIDTH: usize = 16;
const HIDDEN: usize = 48;
const LAYERS: usize = 3;
const BATCH: usize = 8;
const T: usize = 6;
const STEPS: usize = 4;
const LR: f64 = 3e-3;
const WD: f64 = 0.1;
const CLIP: f64 = 1.0;

/// A residual MLP block: `x + down(relu(up(norm(x))))`.
#[derive(meshgrad_nn::Module)]
#[module(crate = meshgrad_nn)]
struct MlpBlock {
    norm: LayerNorm,
    up: Linear,
    down: Linear,
}

impl Forward for MlpBlock {
    fn forward(&self, x: &Var) -> Result<Var> {
        let h = self.up.forward(&self.norm.forward(x)?)?.relu()?;
        x.add(&self.down.forward(&h)?)
    }
}

/// Token embedding, the blocks, a final norm and an (untied) head.
#[derive(meshgrad_nn::Module)]
#[module(crate = meshgrad_nn)]
struct TinyNet {
    embed: Embedding,
    layers: Vec<MlpBlock>,
    norm: LayerNorm,
    head: Linear,
}

impl TinyNet {
    fn new(seed: u64) -> Result<Self> {
        ParamBuilder::new(seed).build(|p| {
            Ok(TinyNet {
                embed: Embedding::new(p, VOCAB, WIDTH, 0.5)?,
                layers: (0..LAYERS)
                    .map(|_| {
                        Ok(MlpBlock {
                            norm: LayerNorm::new(p, WIDTH, true, 1e-5)?,
                            up: Linear::new(p, WIDTH, HIDDEN)?,
                            down: Linear::new(p, HIDDEN, WIDTH)?,
                        })
                    })
                    .collect::<Result<_>>()?,
                norm: LayerNorm::new(p, WIDTH, true, 1e-5)?,
                head: Linear::new(p, WIDTH, VOCAB)?,
            })
        })
    }

    fn logits(&self, ids: &Tensor) -> Result<Var> {
        let mut x = self.embed.forward(ids)?;
        for block in &self.layers {
            x = block.forward(&x)?;
        }
        self.head.forward(&self.norm.forward(&x)?)
    }

    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Var> {
        let n = ids.elem_count();
        self.logits(ids)?
            .reshape((n, VOCAB))?
            .cross_entropy(&targets.reshape(n)?, None)
    }
}

/// Rows `rows` of step `step`'s global batch: ids and next-token-like targets.
fn batch(step: usize, rows: std::ops::Range<u64>) -> Result<(Tensor, Tensor)> {
    let n = (rows.end - rows.start) as usize;
    let mut ids = Vec::with_capacity(n * T);
    let mut targets = Vec::with_capacity(n * T);
    for r in rows {
        for t in 0..T as u64 {
            let h = meshgrad_nn::data::splitmix64((step as u64) << 32 ^ r << 8 ^ t);
            let id = (h % VOCAB as u64) as u32;
            ids.push(id);
            targets.push((id * 7 + 3 + (h >> 40) as u32 % 2) % VOCAB as u32);
        }
    }
    Ok((
        Tensor::from_vec(ids, (n, T), Device::Cpu)?,
        Tensor::from_vec(targets, (n, T), Device::Cpu)?,
    ))
}

type Weights = Vec<(String, Vec<f32>)>;

fn to_weights(tensors: Vec<(String, Tensor)>) -> Weights {
    tensors
        .into_iter()
        .map(|(n, t)| (n, t.to_vec_f32().unwrap()))
        .collect()
}

/// The single-device reference: the whole batch, plain AdamW and clip_grad_norm.
fn single_device() -> (Vec<f64>, Weights) {
    let model = TinyNet::new(SEED).unwrap();
    let mut opt = AdamW::new(
        param_groups_for_decay(model.named_parameters(), WD),
        AdamWConfig::default(),
    )
    .unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad();
        let (ids, targets) = batch(step, 0..BATCH as u64).unwrap();
        let loss = model.loss(&ids, &targets).unwrap();
        losses.push(loss.tensor().item().unwrap());
        loss.backward().unwrap();
        clip_grad_norm(&model.parameters(), CLIP).unwrap();
        opt.step(LR).unwrap();
    }
    (losses, to_weights(state_dict(&model)))
}

fn wrap(ctx: &RankCtx, model: &TinyNet, wrap: WrapPolicy) -> Result<ShardedDataParallel> {
    let mut config = ShardConfig::new(ZeroStage::Three);
    config.wrap = wrap;
    ShardedDataParallel::new(
        model,
        param_groups_for_decay(model.named_parameters(), WD),
        AdamWConfig::default(),
        ShardTopology::flat(ctx.comm.clone()),
        config,
    )
}

/// One step on this rank's rows; the global mean loss.
fn train_step(
    ctx: &RankCtx,
    model: &TinyNet,
    sdp: &ShardedDataParallel,
    step: usize,
) -> Result<f64> {
    sdp.zero_grad();
    let (ids, targets) = batch(step, rank_rows(BATCH, ctx.world_size, ctx.rank)?)?;
    let loss = model.loss(&ids, &targets)?;
    let local = loss.tensor().item()?;
    loss.backward()?;
    sdp.finish()?;
    sdp.clip_grad_norm(CLIP)?;
    sdp.step(LR)?;
    all_reduce_scalar(ctx.comm.as_ref(), local, ReduceOp::Avg)
}

fn assert_close(what: &str, got: &(Vec<f64>, Weights), want: &(Vec<f64>, Weights)) {
    for (s, (a, b)) in got.0.iter().zip(&want.0).enumerate() {
        let rel = (a - b).abs() / b.abs();
        assert!(rel <= 1e-5, "{what}: step {s} loss {a} vs {b}: {rel:e}");
    }
    let want: HashMap<&str, &Vec<f32>> = want.1.iter().map(|(n, w)| (n.as_str(), w)).collect();
    assert_eq!(got.1.len(), want.len(), "{what}: parameter count");
    for (name, a) in &got.1 {
        let b = want[name.as_str()];
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        let diff = a
            .iter()
            .zip(b.iter())
            .fold(0f64, |m, (x, y)| m.max((x - y).abs() as f64));
        assert!(
            diff <= 1e-5 * scale.max(1e-6),
            "{what}: {name}: max |diff| {diff:e} vs max |w| {scale:e}"
        );
    }
}

#[test]
fn zero3_on_a_derived_module_matches_single_device() {
    let want = single_device();
    assert!(
        want.0[STEPS - 1] < want.0[0],
        "the reference does not train"
    );
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    for policy in [WrapPolicy::paths(["layers.*"]), WrapPolicy::Auto] {
        let outs = run_ranks(2, &opts, |ctx| {
            // Rank 1 starts from other weights: the broadcast must fix that.
            let model = TinyNet::new(if ctx.rank == 0 { SEED } else { SEED + 1 })?;
            let sdp = wrap(&ctx, &model, policy.clone())?;
            let units: Vec<&str> = sdp.plan().units.iter().map(|u| u.name.as_str()).collect();
            assert_eq!(units, ["root", "layers.0", "layers.1", "layers.2"]);
            let mut losses = Vec::new();
            for step in 0..STEPS {
                losses.push(train_step(&ctx, &model, &sdp, step)?);
            }
            // Between steps only the shards are kept.
            assert!(model
                .parameters()
                .iter()
                .all(|p| !p.tensor().is_materialized()));
            // One unit at a time, gathered as the forward and backward read them.
            let g = sdp.gather_stats();
            assert_eq!(g.max_gathered, 1, "{g:?}");
            assert!(g.prefetched > 0, "{g:?}");
            let order = sdp.gather_order();
            assert_eq!(
                order.forward,
                ["root", "layers.0", "layers.1", "layers.2", "root"]
            );
            assert_eq!(order.backward, ["layers.2", "layers.1", "layers.0"]);
            let weights = to_weights(sdp.full_state_dict(FullStateDictOptions::default())?);
            Ok((losses, weights))
        })
        .unwrap_or_else(|e| panic!("{policy:?}: {e}"));
        assert_eq!(outs[0], outs[1], "{policy:?}: the ranks disagree");
        assert_close(&format!("{policy:?}"), &outs[0], &want);
    }
}

#[test]
fn a_unit_pattern_that_matches_nothing_lists_the_module_paths() {
    let opts = RunOptions::with_timeout(Duration::from_secs(10));
    run_ranks(2, &opts, |ctx| {
        let model = TinyNet::new(SEED)?;
        let e = wrap(&ctx, &model, WrapPolicy::paths(["blocks.*"]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`blocks.*` matches no module path")
                && e.contains("embed, layers.0, layers.0.norm, layers.0.up")
                && e.contains("head"),
            "{e}"
        );
        // Overlapping units are refused too.
        let e = wrap(&ctx, &model, WrapPolicy::paths(["layers.*", "layers.1.up"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("layers.1.up.weight is taken by several"), "{e}");
        // The model is untouched and still trains as a plain model.
        assert!(model
            .parameters()
            .iter()
            .all(|p| p.tensor().is_materialized()));
        let (ids, targets) = batch(0, 0..2)?;
        model.loss(&ids, &targets)?.backward()?;
        Ok(())
    })
    .unwrap();
}

#[test]
fn a_model_used_after_its_wrapper_is_dropped_says_what_to_do() {
    let opts = RunOptions::with_timeout(Duration::from_secs(10));
    let t0 = std::time::Instant::now();
    run_ranks(2, &opts, |ctx| {
        let (ids, targets) = batch(9, 0..2)?;
        // Dropped without summon_full_params: an error naming the fix, on every op that reads a
        // parameter; no hang, no panic.
        let model = TinyNet::new(SEED)?;
        let sdp = wrap(&ctx, &model, WrapPolicy::Auto)?;
        train_step(&ctx, &model, &sdp, 0)?;
        drop(sdp);
        let e = model.loss(&ids, &targets).unwrap_err().to_string();
        assert!(
            e.contains("ShardedDataParallel that sharded this model was dropped")
                && e.contains("summon_full_params() before dropping"),
            "{e}"
        );
        let e = model.layers[1].up.weight.tensor().to_vec_f32().unwrap_err();
        assert!(e.to_string().contains("was dropped"), "{e}");
        // Wrapping it again is refused (its parameters are gone).
        let e = wrap(&ctx, &model, WrapPolicy::Auto)
            .unwrap_err()
            .to_string();
        assert!(e.contains("already sharded"), "{e}");

        // With summon_full_params first, the model keeps its weights and is a plain model again.
        let model = TinyNet::new(SEED)?;
        let sdp = wrap(&ctx, &model, WrapPolicy::Auto)?;
        train_step(&ctx, &model, &sdp, 0)?;
        sdp.summon_full_params()?;
        let summoned = model.logits(&ids)?.tensor().to_vec_f32()?;
        drop(sdp);
        assert_eq!(model.logits(&ids)?.tensor().to_vec_f32()?, summoned);
        let sdp = wrap(&ctx, &model, WrapPolicy::Auto)?;
        train_step(&ctx, &model, &sdp, 1)?;
        Ok(())
    })
    .unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
}

/// Two linears whose first op reads a parameter of each (`x a.weightᵀ + b.bias`): with `a` and
/// `b` as separate units, one op needs both units at once.
#[derive(meshgrad_nn::Module)]
#[module(crate = meshgrad_nn)]
struct CrossUnit {
    a: Linear,
    b: Linear,
}

impl CrossUnit {
    fn loss(&self, x: &Var) -> Result<Var> {
        let h = Var::linear(x, &self.a.weight, self.b.bias.as_ref())?.relu()?;
        let y = self.b.forward(&self.a.forward(&h)?.relu()?)?;
        y.sqr()?.mean_all()
    }
}

#[test]
fn an_op_reading_two_units_gathers_both() {
    let build = |seed| {
        ParamBuilder::new(seed).build(|p| {
            Ok(CrossUnit {
                a: Linear::new(p, 8, 8)?,
                b: Linear::new(p, 8, 8)?,
            })
        })
    };
    let input = |rows: std::ops::Range<u64>| -> Result<Var> {
        let n = (rows.end - rows.start) as usize;
        let v: Vec<f32> = rows
            .flat_map(|r| (0..8u64).map(move |c| ((r * 8 + c) % 7) as f32 / 7.0 - 0.4))
            .collect();
        Ok(Var::constant(Tensor::from_vec(v, (n, 8), Device::Cpu)?))
    };
    // Single device.
    let model: CrossUnit = build(SEED).unwrap();
    let mut opt = AdamW::new(
        param_groups_for_decay(model.named_parameters(), WD),
        AdamWConfig::default(),
    )
    .unwrap();
    let mut want = Vec::new();
    for _ in 0..3 {
        opt.zero_grad();
        let loss = model.loss(&input(0..4).unwrap()).unwrap();
        want.push(loss.tensor().item().unwrap());
        loss.backward().unwrap();
        opt.step(LR).unwrap();
    }
    let want = (want, to_weights(state_dict(&model)));
    let opts = RunOptions::with_timeout(Duration::from_secs(30));
    let outs = run_ranks(2, &opts, |ctx| {
        let model: CrossUnit = build(SEED)?;
        let mut config = ShardConfig::new(ZeroStage::Three);
        config.wrap = WrapPolicy::paths(["a", "b"]);
        let sdp = ShardedDataParallel::new(
            &model,
            param_groups_for_decay(model.named_parameters(), WD),
            AdamWConfig::default(),
            ShardTopology::flat(ctx.comm.clone()),
            config,
        )?;
        let mut losses = Vec::new();
        for _ in 0..3 {
            sdp.zero_grad();
            let loss = model.loss(&input(rank_rows(4, 2, ctx.rank)?)?)?;
            let local = loss.tensor().item()?;
            loss.backward()?;
            sdp.finish()?;
            sdp.step(LR)?;
            losses.push(all_reduce_scalar(ctx.comm.as_ref(), local, ReduceOp::Avg)?);
        }
        // The op held a.weight while b was gathered, so both were present at once.
        assert_eq!(sdp.gather_stats().max_gathered, 2);
        let weights = to_weights(sdp.full_state_dict(FullStateDictOptions::default())?);
        Ok((losses, weights))
    })
    .unwrap();
    assert_eq!(outs[0], outs[1]);
    assert_close("cross-unit op", &outs[0], &want);
}

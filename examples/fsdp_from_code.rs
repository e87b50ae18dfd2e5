//! A user-written model made data-parallel (DDP) and fully sharded (ZeRO-3 / FSDP, units chosen
//! by module path) from code, each on 2 ranks (threads, in-process communicator), trained in
//! lockstep with the single-device run on the same global batch: the printed losses agree to
//! rounding, and the example fails if they do not.
//!
//! ```text
//! cargo run --release --example fsdp_from_code [-- STEPS]     (default 5)
//! ```

use std::time::Duration;

use meshgrad::corpus::builtin_dataset;
use meshgrad::nn::optim::AdamWConfig;
use meshgrad::parallel::comm::{all_reduce_scalar, run_ranks, RunOptions};
use meshgrad::parallel::zero::{WrapPolicy, ZeroStage};
use meshgrad::parallel::{
    rank_rows, Ddp, DdpConfig, ReduceOp, ShardConfig, ShardTopology, ShardedDataParallel,
};
use meshgrad::prelude::*;

const BATCH: usize = 8;
const SEQ: usize = 32;
const SEED: u64 = 5;
const LR: f64 = 2e-3;

/// A pre-norm residual MLP block.
#[derive(Module)]
struct Block {
    norm: LayerNorm,
    up: Linear,
    down: Linear,
}

impl Forward for Block {
    fn forward(&self, x: &Var) -> Result<Var> {
        let h = self
            .up
            .forward(&self.norm.forward(x)?)?
            .gelu(Default::default())?;
        x + self.down.forward(&h)?
    }
}

/// A byte-level next-token model: embedding, blocks, norm, head.
#[derive(Module)]
struct ByteNet {
    embed: Embedding,
    blocks: Vec<Block>,
    norm: LayerNorm,
    head: Linear,
}

impl ByteNet {
    fn new() -> Result<Self> {
        ParamBuilder::new(SEED).build(|p| {
            Ok(ByteNet {
                embed: Embedding::new(p, 256, 64, 0.02)?,
                blocks: (0..4)
                    .map(|_| {
                        Ok(Block {
                            norm: LayerNorm::new(p, 64, true, 1e-5)?,
                            up: Linear::new(p, 64, 256)?,
                            down: Linear::new(p, 256, 64)?,
                        })
                    })
                    .collect::<Result<_>>()?,
                norm: LayerNorm::new(p, 64, true, 1e-5)?,
                head: Linear::new(p, 64, 256)?,
            })
        })
    }

    fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Var> {
        let mut x = self.embed.forward(ids)?;
        for b in &self.blocks {
            x = b.forward(&x)?;
        }
        self.head
            .forward(&self.norm.forward(&x)?)?
            .cross_entropy(targets, None)
    }
}

/// Rows `rows` of the global batch of `step`.
fn batch(step: usize, rows: std::ops::Range<u64>) -> Result<(Tensor, Tensor)> {
    let n = (rows.end - rows.start) as usize;
    let b = builtin_dataset().batch(SEED, step as u64, rows, SEQ)?;
    Ok((
        Tensor::from_slice(&b.inputs, (n, SEQ), Device::Cpu)?,
        Tensor::from_slice(&b.targets, (n, SEQ), Device::Cpu)?,
    ))
}

fn main() -> Result<()> {
    let steps: usize = std::env::args()
        .nth(1)
        .map(|s| {
            s.parse()
                .map_err(|_| Error::msg(format!("STEPS must be a number, got {s}")))
        })
        .transpose()?
        .unwrap_or(5);

    // 1. One device, the whole batch.
    let model = ByteNet::new()?;
    let mut opt = AdamW::for_module(&model).weight_decay(0.1).build()?;
    let mut single = Vec::new();
    for step in 0..steps {
        let (ids, targets) = batch(step, 0..BATCH as u64)?;
        let loss = model.loss(&ids, &targets)?;
        opt.zero_grad();
        loss.backward()?;
        opt.step(LR)?;
        single.push(loss.tensor().item()?);
    }

    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    // 2. DDP on 2 ranks: each rank its half of the batch; gradients averaged during backward.
    let ddp = run_ranks(2, &opts, |ctx| {
        let model = ByteNet::new()?;
        let ddp = Ddp::new(
            model.named_parameters(),
            ctx.comm.clone(),
            DdpConfig::default(),
        )?;
        let mut opt = AdamW::for_module(&model).weight_decay(0.1).build()?;
        let mut losses = Vec::new();
        for step in 0..steps {
            let (ids, targets) = batch(step, rank_rows(BATCH, 2, ctx.rank)?)?;
            let loss = model.loss(&ids, &targets)?;
            opt.zero_grad();
            loss.backward()?;
            ddp.finish()?;
            opt.step(LR)?;
            losses.push(all_reduce_scalar(
                ctx.comm.as_ref(),
                loss.tensor().item()?,
                ReduceOp::Avg,
            )?);
        }
        Ok(losses)
    })?;

    // 3. ZeRO-3 / FSDP on 2 ranks: one unit per block (by module path), the rest in a root unit;
    //    each rank keeps half of every unit and gathers a unit only while it is used.
    let fsdp = run_ranks(2, &opts, |ctx| {
        let model = ByteNet::new()?;
        let mut config = ShardConfig::new(ZeroStage::Three);
        config.wrap = WrapPolicy::paths(["blocks.*"]);
        let groups = AdamW::for_module(&model).weight_decay(0.1).groups();
        let sdp = ShardedDataParallel::new(
            &model,
            groups,
            AdamWConfig::default(),
            ShardTopology::flat(ctx.comm.clone()),
            config,
        )?;
        let mut losses = Vec::new();
        for step in 0..steps {
            sdp.zero_grad();
            let (ids, targets) = batch(step, rank_rows(BATCH, 2, ctx.rank)?)?;
            let loss = model.loss(&ids, &targets)?;
            loss.backward()?;
            sdp.finish()?;
            sdp.step(LR)?;
            losses.push(all_reduce_scalar(
                ctx.comm.as_ref(),
                loss.tensor().item()?,
                ReduceOp::Avg,
            )?);
        }
        Ok(losses)
    })?;

    println!("step  single      ddp(2)      fsdp(2)");
    for s in 0..steps {
        println!(
            "{s:>4}  {:.6}  {:.6}  {:.6}",
            single[s], ddp[0][s], fsdp[0][s]
        );
        for (what, l) in [("ddp", ddp[0][s]), ("fsdp", fsdp[0][s])] {
            let rel = (l - single[s]).abs() / single[s].abs();
            if rel > 1e-5 {
                return Err(Error::msg(format!(
                    "{what} step {s}: loss {l} vs single device {}: {rel:e} relative",
                    single[s]
                )));
            }
        }
    }
    println!("DDP and FSDP track the single-device run within 1e-5 relative");
    Ok(())
}

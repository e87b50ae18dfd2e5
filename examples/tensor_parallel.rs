//! Tensor parallelism on a model written by the user: a two-layer MLP whose plan splits the
//! up-projection by output features and the down-projection by input features (Megatron's MLP),
//! trained for a few steps on 2 ranks (threads) and on one device from the same seed. Prints both
//! loss curves and the largest relative difference of the gathered weights.
//!
//! ```text
//! cargo run --release --example tensor_parallel
//! ```

use meshgrad::nn::tp::{full_state_dict, ParallelStyle, TpPlan};
use meshgrad::parallel::comm::{run_ranks, RunOptions};
use meshgrad::parallel::tp::tensor_parallel;
use meshgrad::prelude::*;
use meshgrad::tensor::GeluKind;

#[derive(Module)]
struct Mlp {
    up: Linear,
    down: Linear,
}

impl Mlp {
    fn build(p: ParamBuilder) -> Result<Mlp> {
        p.build(|p| {
            Ok(Mlp {
                up: Linear::new(p, 16, 64)?,
                down: Linear::new(p, 64, 16)?,
            })
        })
    }

    fn plan() -> TpPlan {
        TpPlan::new()
            .with("up", ParallelStyle::Colwise { chunks: 1 })
            .with("down", ParallelStyle::Rowwise)
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> Result<Var> {
        let h = self
            .up
            .forward(&Var::constant(x.clone()))?
            .gelu(GeluKind::Tanh)?;
        let out = self.down.forward(&h)?;
        (out - Var::constant(y.clone()))?.sqr()?.mean_all()
    }
}

/// Per-step losses and the full (gathered) weights by name.
type Run = (Vec<f64>, Vec<(String, Tensor)>);

/// Trains for 5 steps.
fn train(model: &Mlp) -> Result<Run> {
    let x = Tensor::randn((32, 16), 1)?;
    let y = Tensor::randn((32, 16), 2)?;
    let mut opt = Sgd::for_module(model).momentum(0.9).build()?;
    let mut losses = Vec::new();
    for _ in 0..5 {
        opt.zero_grad();
        let loss = model.loss(&x, &y)?;
        loss.backward()?;
        opt.step(0.1)?;
        losses.push(loss.tensor().item()?);
    }
    Ok((losses, full_state_dict(model)?))
}

fn main() -> anyhow::Result<()> {
    let (single_losses, single_weights) = train(&Mlp::build(ParamBuilder::new(0))?)?;
    let ranks = run_ranks(2, &RunOptions::default(), |ctx| {
        let tp = tensor_parallel(ctx.comm.clone(), false);
        let model = Mlp::build(ParamBuilder::new(0).tensor_parallel(tp, Mlp::plan()))?;
        println!(
            "rank {}: up.weight {} of [64, 16], down.weight {} of [16, 64]",
            ctx.rank,
            model.up.weight.tensor().shape(),
            model.down.weight.tensor().shape()
        );
        train(&model)
    })?;
    let (tp_losses, tp_weights) = &ranks[0];
    println!("single device: {single_losses:.6?}");
    println!("tp=2:          {tp_losses:.6?}");
    let mut worst = 0f64;
    for ((name, a), (_, b)) in tp_weights.iter().zip(&single_weights) {
        let (a, b) = (a.to_vec_f64()?, b.to_vec_f64()?);
        let d: f64 = a.iter().zip(&b).map(|(x, y)| (x - y) * (x - y)).sum();
        let n: f64 = b.iter().map(|y| y * y).sum();
        let rel = (d / n).sqrt();
        println!("{name}: relative difference {rel:.1e}");
        worst = worst.max(rel);
    }
    anyhow::ensure!(
        worst < 1e-5,
        "tp=2 drifted from the single device: {worst:e}"
    );
    Ok(())
}

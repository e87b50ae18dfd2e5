//! GPT stages compose with tensor (and sequence) parallelism: on every rank of tp=2, the stages
//! of a GPT built through a tensor-parallel `ParamBuilder` with `Gpt::stage_tp_plan`, chained,
//! give the loss and this rank's parameter shards and gradients of the tensor-parallel full
//! model bit for bit (the tied `wte.weight` gradient summed over its two copies), with dropout
//! and activation checkpointing.

use std::collections::HashMap;
use std::time::Duration;

use meshgrad_autograd::Var;
use meshgrad_nn::{
    ForwardCtx, Gpt, GptBatch, GptConfig, ModelStage, Module, ParamBuilder, StageSpec,
};
use meshgrad_parallel::comm::{run_ranks, RunOptions};
use meshgrad_parallel::tp::tensor_parallel;
use meshgrad_tensor::{Device, Result, Tensor};

const SEED: u64 = 11;
const T: usize = 8;

fn config() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: T,
        n_layer: 3,
        n_head: 4,
        n_embd: 32,
        dropout: 0.1,
        bias: true,
        layer_norm_eps: 1e-5,
    }
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

fn batch() -> Result<GptBatch> {
    let ids: Vec<u32> = (0..2 * T as u32).map(|i| (i * 7 + 3) % 64).collect();
    let targets: Vec<u32> = (0..2 * T as u32).map(|i| (i * 5 + 1) % 64).collect();
    Ok(GptBatch {
        ids: Tensor::from_vec(ids, (2, T), Device::Cpu)?,
        targets: Tensor::from_vec(targets, (2, T), Device::Cpu)?,
        ignore_index: None,
    })
}

fn check(sp: bool) {
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    run_ranks(2, &opts, |ctx| {
        let cfg = config();
        let b = batch()?;
        let tp = || tensor_parallel(ctx.comm.clone(), sp);
        // The tensor-parallel full model.
        let mut full = Gpt::build(
            cfg,
            ParamBuilder::new(SEED).tensor_parallel(tp(), Gpt::tp_plan()),
        )?;
        full.activation_checkpointing = true;
        let loss = ForwardCtx::new(2, 0).scope(|| full.loss(&b.ids, &b.targets, None))?;
        loss.backward()?;
        // Its stages, chained.
        let mut stages = Vec::new();
        for spec in StageSpec::split(cfg.n_layer, &[1, 1, 1])? {
            let builder = ParamBuilder::new(SEED).tensor_parallel(tp(), Gpt::stage_tp_plan(&spec));
            let mut st = Gpt::build_stage(cfg, spec, builder)?;
            st.activation_checkpointing = true;
            stages.push(st);
        }
        let mut inputs: Vec<Option<Var>> = vec![None];
        let mut outputs = Vec::new();
        for (i, st) in stages.iter().enumerate() {
            let out = ForwardCtx::new(2, 0).scope(|| st.forward_stage(&b, inputs[i].as_ref()))?;
            if sp && i + 1 < stages.len() {
                // Sequence parallelism: a stage hands on this rank's positions.
                assert_eq!(out.tensor().dims(), &[2, T / 2, 32]);
            }
            inputs.push(Some(Var::leaf(out.tensor().clone())));
            outputs.push(out);
        }
        let staged_loss = outputs.last().unwrap().clone();
        staged_loss.backward()?;
        for i in (0..stages.len() - 1).rev() {
            outputs[i].backward_with(inputs[i + 1].as_ref().unwrap().grad().unwrap())?;
        }
        assert_eq!(bits(staged_loss.tensor())?, bits(loss.tensor())?, "loss");
        let mut grads: HashMap<String, Tensor> = HashMap::new();
        for st in &stages {
            for (n, p) in st.named_parameters() {
                let g = p.grad().unwrap();
                let g = match grads.remove(&n) {
                    Some(other) => other.add(&g)?,
                    None => g,
                };
                grads.insert(n, g);
            }
        }
        let shards: HashMap<String, Var> =
            stages.iter().flat_map(|s| s.named_parameters()).collect();
        assert_eq!(grads.len(), full.named_parameters().len());
        assert!(
            shards.values().any(|p| p.placement().is_some()),
            "nothing is split"
        );
        for (n, p) in full.named_parameters() {
            assert_eq!(
                format!("{:?}", shards[&n].placement()),
                format!("{:?}", p.placement()),
                "placement of {n}"
            );
            assert_eq!(
                bits(shards[&n].tensor())?,
                bits(p.tensor())?,
                "shard of {n}"
            );
            assert_eq!(
                bits(&grads[&n])?,
                bits(&p.grad().unwrap())?,
                "gradient of {n}"
            );
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn tp2_stages_match_the_tp2_model() {
    check(false);
}

#[test]
fn tp2_sequence_parallel_stages_match_the_tp2_model() {
    check(true);
}

//! Tensor and sequence parallelism in lockstep with a single device: a small GPT trained on the
//! same seed and global batch under tp=2, tp=4, tp=2 with sequence parallelism, and tp composed
//! with data parallelism on one mesh (dp=2,tp=2; fsdp=2,tp=2; hsdp=2x2,tp=2 with sequence
//! parallelism; clipping across every dimension). Losses and the gathered final weights must
//! agree within 1e-5 relative (f32). The initial shards must equal their slices of the
//! single-device parameters bit for bit (initialisation by global index).
//!
//! As in the DDP tests the AdamW runs have no biases (the attention key bias has an identically
//! zero gradient that AdamW turns into layout-dependent noise) and no dropout: with dropout a few
//! weight elements get gradients that are rounding noise around zero, and AdamW's normalised step
//! turns that noise into differences of ~1e-5 (one element of 4096 in the last MLP projection,
//! measured). The bias paths (column-parallel bias, row-parallel bias added after the reduction)
//! and the dropout masks (replicated, and keyed by global position under sequence parallelism)
//! are checked with SGD with momentum, which does not amplify rounding.

use crate::common;

use std::time::Duration;

use common::{assert_close, full_weights, DataParallel, OptKind, RunOut};
use meshgrad_nn::data::TokenDataset;
use meshgrad_nn::optim::{
    clip_grad_norm, param_groups_for_decay, AdamW, AdamWConfig, Optimizer, Sgd, SgdConfig,
};
use meshgrad_nn::{ForwardCtx, Gpt, GptConfig, Module, ParamBuilder, StageInput};
use meshgrad_parallel::comm::{all_reduce_scalar, run_ranks, RunOptions};
use meshgrad_parallel::tp::tensor_parallel;
use meshgrad_parallel::zero::FullStateDictOptions;
use meshgrad_parallel::{rank_rows, ParallelLayout, ReduceOp};
use meshgrad_tensor::{DType, Device, Result, Tensor};

const SEED: u64 = 7;
const BATCH: usize = 4;
const T: usize = 16;
const STEPS: usize = 4;
const LR: f64 = 1e-3;

fn gpt_config(bias: bool, dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: T,
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        dropout,
        bias,
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

#[derive(Clone, Copy)]
struct Setup {
    bias: bool,
    dropout: f64,
    sgd: bool,
    clip: bool,
}

const ADAMW: Setup = Setup {
    bias: false,
    dropout: 0.0,
    sgd: false,
    clip: true,
};

fn optimizer(model: &Gpt, s: Setup) -> Result<Box<dyn Optimizer>> {
    let groups = param_groups_for_decay(model.named_parameters(), 0.1);
    Ok(if s.sgd {
        Box::new(Sgd::new(groups, SgdConfig { momentum: 0.9 })?)
    } else {
        Box::new(AdamW::new(groups, AdamWConfig::default())?)
    })
}

/// Forward and backward of `rows` at `step`; the local mean loss.
fn forward_backward(
    model: &Gpt,
    data: &TokenDataset,
    step: usize,
    rows: std::ops::Range<u64>,
) -> Result<f64> {
    let n = (rows.end - rows.start) as usize;
    let b = data
        .batch(SEED, step as u64, rows.clone(), T)
        .map_err(|e| meshgrad_tensor::Error::msg(e.to_string()))?;
    let ids = Tensor::from_vec(b.inputs, (n, T), Device::Cpu)?;
    let targets = Tensor::from_vec(b.targets, (n, T), Device::Cpu)?;
    let loss =
        ForwardCtx::new(step as u64, rows.start).scope(|| model.loss(&ids, &targets, None))?;
    loss.backward()?;
    loss.tensor().item()
}

fn single_device(s: Setup) -> RunOut {
    let data = dataset();
    let model = Gpt::new(gpt_config(s.bias, s.dropout), SEED, DType::F32, Device::Cpu).unwrap();
    let mut opt = optimizer(&model, s).unwrap();
    let mut losses = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad();
        losses.push(forward_backward(&model, &data, step, 0..BATCH as u64).unwrap());
        if s.clip {
            clip_grad_norm(&model.parameters(), 0.5).unwrap();
        }
        opt.step(LR).unwrap();
    }
    RunOut {
        losses,
        weights: full_weights(&model).unwrap(),
    }
}

/// The run under `layout` (rank 0's view, full weights gathered), with the initial shards
/// checked against `initial` (the single-device initial weights).
fn mesh_run(layout: &str, sp: bool, s: Setup, initial: &[(String, Vec<f32>)]) -> RunOut {
    let data = dataset();
    let layout: ParallelLayout = layout.parse().unwrap();
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    let outs = run_ranks(layout.world_size(), &opts, |ctx| {
        let mesh = layout.mesh(ctx.comm.clone())?;
        let tp = mesh.tp_degree();
        let builder = ParamBuilder::new(SEED)
            .tensor_parallel(tensor_parallel(mesh.tp_group(), sp), Gpt::tp_plan());
        let model = Gpt::build(gpt_config(s.bias, s.dropout), builder)?;
        // Initialisation by global index: each shard is its slice of the single-device tensor.
        for ((name, p), (_, want)) in model.named_parameters().iter().zip(initial) {
            let full = match p.placement() {
                Some(pl) => pl.gather(p.tensor())?,
                None => p.tensor().clone(),
            };
            assert_eq!(&full.to_vec::<f32>()?, want, "initial {name}");
        }
        if sp {
            // Sequence parallelism is really on: the final hidden states hold T / tp positions.
            let ids = Tensor::zeros((1, T), DType::I64, Device::Cpu)?;
            let hidden = model.hidden(StageInput::Ids(&ids))?;
            assert_eq!(hidden.tensor().dims(), &[1, T / tp, 32]);
        }
        let dp_group = mesh.dp_group();
        let groups = param_groups_for_decay(model.named_parameters(), 0.1);
        let kind = if s.sgd { OptKind::Sgd } else { OptKind::AdamW };
        let mut wrapper = DataParallel::new(&model, &mesh, groups, kind)?;
        let rows = rank_rows(BATCH, mesh.dp_degree(), mesh.dp_rank())?;
        let mut losses = Vec::new();
        for step in 0..STEPS {
            wrapper.zero_grad();
            let local = forward_backward(&model, &data, step, rows.clone())?;
            wrapper.step(&model.parameters(), s.clip.then_some(0.5), LR)?;
            losses.push(all_reduce_scalar(dp_group.as_ref(), local, ReduceOp::Avg)?);
        }
        // ZeRO's full state dict gathers over the tensor-parallel ranks too, and loads back
        // (each rank taking its part): the single-device names and shapes, weights and moments.
        let dict = match wrapper.sharded() {
            Some(z) => {
                let opts = FullStateDictOptions {
                    optimizer: true,
                    rank0_only: false,
                };
                let dict = z.full_state_dict(opts)?;
                z.load_full_state_dict(&dict, true)?;
                let again = z.full_state_dict(opts)?;
                assert_eq!(dict.len(), again.len());
                for ((k, a), (_, b)) in dict.iter().zip(&again) {
                    assert_eq!(a.to_vec_f64()?, b.to_vec_f64()?, "{k} after a round trip");
                }
                z.summon_full_params()?;
                Some(dict)
            }
            None => None,
        };
        let weights = full_weights(&model)?;
        if let Some(dict) = dict {
            for (name, w) in &weights {
                let (_, t) = dict
                    .iter()
                    .find(|(k, _)| k == name)
                    .expect("every parameter");
                assert_eq!(&t.to_vec::<f32>()?, w, "full_state_dict {name}");
            }
            let (_, m) = dict
                .iter()
                .find(|(k, _)| k == "adamw.m.wte.weight")
                .expect("AdamW's first moment of wte.weight");
            assert_eq!(m.dims(), &[64, 32], "moments gathered over tp");
        }
        Ok(RunOut { losses, weights })
    })
    .unwrap();
    outs.into_iter().next().unwrap()
}

fn initial(s: Setup) -> Vec<(String, Vec<f32>)> {
    let m = Gpt::new(gpt_config(s.bias, s.dropout), SEED, DType::F32, Device::Cpu).unwrap();
    full_weights(&m).unwrap()
}

#[test]
fn tp2_and_tp4_match_single_device() {
    let want = single_device(ADAMW);
    let init = initial(ADAMW);
    assert_close("tp=2", &mesh_run("tp=2", false, ADAMW, &init), &want, 1e-5);
    assert_close("tp=4", &mesh_run("tp=4", false, ADAMW, &init), &want, 1e-5);
}

#[test]
fn sequence_parallel_matches_single_device() {
    let want = single_device(ADAMW);
    let init = initial(ADAMW);
    assert_close(
        "tp=2 +sp",
        &mesh_run("tp=2", true, ADAMW, &init),
        &want,
        1e-5,
    );
    assert_close(
        "tp=4 +sp",
        &mesh_run("tp=4", true, ADAMW, &init),
        &want,
        1e-5,
    );
}

#[test]
fn dp2_tp2_matches_single_device() {
    let want = single_device(ADAMW);
    let init = initial(ADAMW);
    assert_close(
        "dp=2,tp=2",
        &mesh_run("dp=2,tp=2", false, ADAMW, &init),
        &want,
        1e-5,
    );
}

#[test]
fn fsdp2_tp2_and_hsdp_tp2_match_single_device() {
    let want = single_device(ADAMW);
    let init = initial(ADAMW);
    let got = mesh_run("fsdp=2,tp=2", false, ADAMW, &init);
    assert_close("fsdp=2,tp=2", &got, &want, 1e-5);
    let got = mesh_run("hsdp=2x2,tp=2", false, ADAMW, &init);
    assert_close("hsdp=2x2,tp=2", &got, &want, 1e-5);
    let got = mesh_run("hsdp=2x2,tp=2", true, ADAMW, &init);
    assert_close("hsdp=2x2,tp=2 +sp", &got, &want, 1e-5);
}

#[test]
fn biases_and_dropout_with_sgd() {
    let s = Setup {
        bias: true,
        dropout: 0.1,
        sgd: true,
        clip: true,
    };
    let want = single_device(s);
    let init = initial(s);
    assert_close("tp=2 bias", &mesh_run("tp=2", false, s, &init), &want, 1e-5);
    assert_close(
        "tp=2 +sp bias",
        &mesh_run("tp=2", true, s, &init),
        &want,
        1e-5,
    );
    assert_close(
        "tp=4 +sp bias",
        &mesh_run("tp=4", true, s, &init),
        &want,
        1e-5,
    );
}

#[test]
fn sizes_that_do_not_split_are_refused_naming_them() {
    let opts = RunOptions::with_timeout(Duration::from_secs(20));
    let errs = run_ranks(2, &opts, |ctx| {
        let mut cfg = gpt_config(false, 0.0);
        cfg.n_head = 2;
        cfg.vocab_size = 63;
        let builder = ParamBuilder::new(SEED)
            .tensor_parallel(tensor_parallel(ctx.comm.clone(), false), Gpt::tp_plan());
        Ok(Gpt::build(cfg, builder).err().map(|e| e.to_string()))
    })
    .unwrap();
    let e = errs[0]
        .clone()
        .expect("a vocabulary of 63 must not split over 2 ranks");
    assert!(e.contains("wte.weight") && e.contains("63"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    let cfg = GptConfig {
        n_head: 3,
        n_embd: 33,
        ..gpt_config(false, 0.0)
    };
    let e = meshgrad_nn::gpt::check_tp_sizes(&cfg, 2, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("n_head = 3") && e.contains("tp = 2"), "{e}");
    let e = meshgrad_nn::gpt::check_tp_sizes(&gpt_config(false, 0.0), 2, Some(15))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sequence length 15"), "{e}");
}

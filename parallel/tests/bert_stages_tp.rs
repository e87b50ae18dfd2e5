//! BERT stages compose with tensor (and sequence) parallelism: on every rank of tp=2, the
//! stages of a `BertForMaskedLM` built through a tensor-parallel `ParamBuilder` with
//! `BertForMaskedLM::stage_tp_plan`, chained, give the loss and this rank's parameter shards and gradients
//! of the tensor-parallel full model bit for bit (the tied word-embedding gradient summed over
//! its two copies), with padding, two token types, dropout on every dropout, activation
//! checkpointing on and off, and delayed initialisation of the stages.

use std::collections::HashMap;
use std::time::Duration;

use meshgrad_autograd::Var;
use meshgrad_nn::bert::IGNORE_INDEX;
use meshgrad_nn::{
    BertBatch, BertConfig, BertForMaskedLM, ForwardCtx, ModelStage, Module, ParamBuilder, StageSpec,
};
use meshgrad_parallel::comm::{run_ranks, RunOptions};
use meshgrad_parallel::tp::tensor_parallel;
use meshgrad_tensor::{Device, Result, Tensor};

const SEED: u64 = 11;
const T: usize = 8;
const HIDDEN: usize = 32;

fn config() -> BertConfig {
    BertConfig {
        vocab_size: 64,
        hidden_size: HIDDEN,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        intermediate_size: 64,
        max_position_embeddings: T,
        type_vocab_size: 2,
        layer_norm_eps: 1e-12,
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.1,
        pad_token_id: 0,
        initializer_range: 0.02,
    }
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
}

/// Two rows: the first full, the second with 5 real tokens and 3 of padding; token type 1 on
/// the second half of the real tokens; every third real token labelled.
fn batch() -> Result<BertBatch> {
    let lens = [T, 5];
    let (mut ids, mut mask, mut types, mut labels) = (vec![], vec![], vec![], vec![]);
    for (r, &len) in lens.iter().enumerate() {
        for c in 0..T {
            let i = (r * T + c) as u32;
            let real = c < len;
            ids.push(if real { 1 + (i * 7 + 3) % 63 } else { 0 });
            mask.push(u32::from(real));
            types.push(u32::from(real && c >= len / 2));
            labels.push(if real && c % 3 == 1 {
                i64::from((i * 5 + 1) % 64)
            } else {
                IGNORE_INDEX
            });
        }
    }
    let u = |v: Vec<u32>| Tensor::from_vec(v, (2, T), Device::Cpu);
    Ok(BertBatch {
        ids: u(ids)?,
        attention_mask: Some(u(mask)?),
        token_type_ids: Some(u(types)?),
        labels: Tensor::from_vec(labels, (2, T), Device::Cpu)?,
        denominator: None,
    })
}

/// `delayed`: the stages' parameters are built with delayed initialisation (allocated on first
/// use, as a sharding wrapper builds them).
fn check(sp: bool, ckpt: bool, delayed: bool) {
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    run_ranks(2, &opts, |ctx| {
        let cfg = config();
        let b = batch()?;
        let tp = || tensor_parallel(ctx.comm.clone(), sp);
        // The tensor-parallel full model.
        let mut full = BertForMaskedLM::build(
            cfg,
            ParamBuilder::new(SEED).tensor_parallel(tp(), BertForMaskedLM::tp_plan()),
        )?;
        full.activation_checkpointing = ckpt;
        let loss = ForwardCtx::new(2, 0).scope(|| {
            full.loss(
                &b.ids,
                b.attention_mask.as_ref(),
                b.token_type_ids.as_ref(),
                &b.labels,
            )
        })?;
        loss.backward()?;
        // Its stages, chained.
        let mut stages = Vec::new();
        for spec in StageSpec::split(cfg.num_hidden_layers, &[1, 1, 1])? {
            let mut builder = ParamBuilder::new(SEED);
            if delayed {
                builder = builder.delayed_init();
            }
            let builder = builder.tensor_parallel(tp(), BertForMaskedLM::stage_tp_plan(&spec));
            let mut st = BertForMaskedLM::build_stage(cfg, spec, builder)?;
            st.activation_checkpointing = ckpt;
            stages.push(st);
        }
        let mut inputs: Vec<Option<Var>> = vec![None];
        let mut outputs = Vec::new();
        for (i, st) in stages.iter().enumerate() {
            let out = ForwardCtx::new(2, 0).scope(|| st.forward_stage(&b, inputs[i].as_ref()))?;
            if i + 1 < stages.len() {
                // Sequence parallelism: a stage hands on this rank's positions.
                let t = if sp { T / 2 } else { T };
                assert_eq!(out.tensor().dims(), &[2, t, HIDDEN]);
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
                    Some(other) => {
                        assert!(st.tied_parameters().contains(&n), "{n} in two stages");
                        other.add(&g)?
                    }
                    None => g,
                };
                grads.insert(n, g);
            }
        }
        let full_params: HashMap<String, Var> = full.named_parameters().into_iter().collect();
        assert_eq!(grads.len(), full_params.len());
        // Every stage's parameter (both copies of the tied table) is its shard of the full
        // model's, placed alike.
        let mut split = 0;
        for (n, p) in stages.iter().flat_map(|s| s.named_parameters()) {
            let q = &full_params[&n];
            assert_eq!(
                format!("{:?}", p.placement()),
                format!("{:?}", q.placement()),
                "placement of {n}"
            );
            assert_eq!(bits(p.tensor())?, bits(q.tensor())?, "shard of {n}");
            split += usize::from(p.placement().is_some());
        }
        assert!(split > 0, "nothing is split");
        for (n, p) in &full_params {
            assert_eq!(
                bits(&grads[n])?,
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
    check(false, true, false);
    check(false, false, true);
}

#[test]
fn tp2_sequence_parallel_stages_match_the_tp2_model() {
    check(true, true, false);
    check(true, false, true);
}

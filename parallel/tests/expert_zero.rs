//! Expert parallelism with ZeRO: under `fsdp=4,ep=2` a rank's experts get a sharded wrapper of
//! their own at the layout's stage over the 2 ranks holding the same ones (the
//! expert-replica group), beside the dense wrapper on the same blocks: both gather their units
//! when read and prefetch the next (the parameters built with delayed initialisation, as
//! `meshgrad train` builds them under fsdp), a rank keeps the AdamW moments of half of the
//! experts it holds (ZeRO-1 too), and `fsdp=2,ep=2` (one holder) keeps them whole.

use std::time::Duration;

use meshgrad_nn::gpt::GptBatch;
use meshgrad_nn::moe::MoeSettings;
use meshgrad_nn::optim::{param_groups_for_decay, AdamW, AdamWConfig};
use meshgrad_nn::{
    CausalFamily, ForwardCtx, LlamaConfig, ModelStage, Module, ParamBuilder, StageSpec,
};
use meshgrad_parallel::pipeline::PipelineGrads;
use meshgrad_parallel::tp::expert_parallel;
use meshgrad_parallel::{run_ranks, DataParallel, ParallelLayout, RunOptions, ZeroStage};
use meshgrad_tensor::{Device, Tensor};

/// What a rank of `layout` reports after 2 training steps of a tiny Mixtral (2 layers, 4
/// experts of width 32 over n_embd 64, top 2): the expert wrapper's stage and shard degree, its
/// optimizer state's elements (moments), its prefetched gathers and the most units it held
/// gathered at once, and the dense wrapper's prefetched gathers.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Seen {
    stage: ZeroStage,
    degree: usize,
    moments: usize,
    prefetched: usize,
    max_gathered: usize,
    dense_prefetched: usize,
}

fn train(spec: &str) -> Vec<Seen> {
    let layout: ParallelLayout = spec.parse().unwrap();
    let mut model_cfg = LlamaConfig::new(64, 16, 64, 2, 4);
    model_cfg.n_kv_head = 2;
    model_cfg.intermediate_size = 32;
    model_cfg.moe = Some(MoeSettings::new(4, 2));
    let opts = RunOptions::with_timeout(Duration::from_secs(60));
    run_ranks(layout.world_size(), &opts, |ctx| {
        let mesh = layout.mesh(ctx.comm.clone())?;
        let builder =
            ParamBuilder::new(5).expert_parallel(expert_parallel(mesh.ep_group().unwrap()));
        let stage = StageSpec::full(2);
        let delayed = layout.zero() == Some(ZeroStage::Three);
        let model = meshgrad_nn::Mixtral::build_stage(model_cfg, stage, builder, delayed)?;
        let mut opt = AdamW::new(
            param_groups_for_decay(model.named_parameters(), 0.1),
            AdamWConfig::default(),
        )?;
        let wrapper = DataParallel::for_layout(&mesh, &model, &opt)?;
        let grads = PipelineGrads::new(std::slice::from_ref(&model), mesh.pp_group())?;
        let rank = mesh.batch_rank() as u32;
        for step in 0..2u32 {
            wrapper.zero_grad(&opt);
            let ids: Vec<u32> = (0..16u32)
                .map(|i| (i * 7 + step * 3 + rank * 5) % 64)
                .collect();
            let targets: Vec<u32> = ids.iter().map(|i| (i + 1) % 64).collect();
            let batch = GptBatch {
                ids: Tensor::from_vec(ids, (1, 16), Device::Cpu)?,
                targets: Tensor::from_vec(targets, (1, 16), Device::Cpu)?,
                ignore_index: None,
            };
            let fctx = ForwardCtx {
                step: step as u64,
                first_row: rank as u64,
            };
            fctx.scope(|| model.forward_stage(&batch, None))?
                .backward()?;
            wrapper.finish()?;
            let norm = wrapper.grad_norm(&grads)?;
            wrapper.clip_grads_with_norm(&grads, 1.0, norm)?;
            wrapper.step(&mut opt, 1e-3)?;
        }
        let DataParallel::Experts(e) = &wrapper else {
            meshgrad_tensor::bail!("{spec}: not the expert wrapper");
        };
        let esdp = e
            .experts_sharded()
            .expect("a sharding entry shards the experts");
        let moments = esdp
            .local_optimizer_state_dict()?
            .iter()
            .filter(|(k, _)| k.starts_with("adamw.m.") || k.starts_with("adamw.v."))
            .map(|(_, t)| t.elem_count())
            .sum();
        Ok(Seen {
            stage: esdp.stage(),
            degree: esdp.topology().shard_degree(),
            moments,
            prefetched: esdp.gather_stats().prefetched,
            max_gathered: esdp.gather_stats().max_gathered,
            dense_prefetched: wrapper.sharded().unwrap().gather_stats().prefetched,
        })
    })
    .unwrap()
}

#[test]
fn fsdp_shards_the_experts_over_their_replicas_beside_the_dense_wrapper() {
    // A rank holds 2 of the 4 experts of each of the 2 layers: 2 x 2 x 3 x 64 x 32 elements.
    let held = 2 * 2 * 3 * 64 * 32;
    for s in train("fsdp=4,ep=2") {
        assert_eq!((s.stage, s.degree), (ZeroStage::Three, 2), "{s:?}");
        // Two moments of half the held experts (each layer's 12288 split evenly).
        assert_eq!(s.moments, 2 * held / 2, "{s:?}");
        // Both wrappers gather when read and prefetch what follows (the second step's
        // forward and backward follow the first's order); one expert unit at a time.
        assert!(s.prefetched > 0 && s.dense_prefetched > 0, "{s:?}");
        assert_eq!(s.max_gathered, 1, "{s:?}");
    }
    for s in train("zero1=4,ep=2") {
        assert_eq!((s.stage, s.degree), (ZeroStage::One, 2), "{s:?}");
        assert_eq!(s.moments, 2 * held / 2, "{s:?}");
    }
    // One rank per expert block: nothing to shard, the experts and their moments whole.
    for s in train("fsdp=2,ep=2") {
        assert_eq!((s.stage, s.degree), (ZeroStage::One, 1), "{s:?}");
        assert_eq!(s.moments, 2 * held, "{s:?}");
    }
}

//! The memory report (the README table): per-rank peak bytes of parameters, gradients, optimizer
//! state and activations, measured by each rank's tracker during real training steps.
//!
//! * At world size 4 under DDP and ZeRO-1/2/3, the ZeRO-3 target: the model states held at one
//!   time by a rank are at most 1/4 of the unsharded model states (16 bytes per parameter: f32
//!   parameters, gradients and two AdamW moments) plus the largest unit's gathered parameters.
//! * Under tensor parallelism: with tp=4 each rank holds at most 1/4 of the split parameters
//!   (the blocks' matmul weights and column-parallel biases, the token table) plus the replicated
//!   ones (norms, row-parallel biases, position table), the bound computed here from the config;
//!   sequence parallelism lowers the activation bytes per rank.
//!
//! Byte counts are deterministic (the same allocations in the same order on every run).

use meshgrad_nn::{Gpt, GptConfig, Llama, LlamaConfig};
use meshgrad_parallel::memory_report::{memory_report, MemoryReportConfig, MemoryStrategy};
use meshgrad_parallel::zero::ZeroStage;

/// The README's configuration: a 6-layer GPT (n_embd 128, 4 heads, vocab 512, context 64,
/// 1.26 M parameters), global batch 8 x 64 tokens, 3 steps, data-parallel rows on 4 ranks.
fn small_gpt() -> MemoryReportConfig<GptConfig> {
    MemoryReportConfig {
        model: GptConfig {
            vocab_size: 512,
            block_size: 64,
            n_layer: 6,
            n_head: 4,
            n_embd: 128,
            dropout: 0.0,
            bias: true,
            layer_norm_eps: 1e-5,
        },
        world: 4,
        global_batch: 8,
        seq_len: 64,
        steps: 3,
        seed: 1,
    }
}

#[test]
fn zero3_meets_the_memory_target_at_world_4() {
    let cfg = small_gpt();
    let report = memory_report::<Gpt>(&cfg, &MemoryStrategy::data_parallel(4).unwrap()).unwrap();
    println!("{}", report.to_markdown());
    let row = |s: MemoryStrategy| *report.row(&s).unwrap();
    let ddp = row(MemoryStrategy::ddp(4).unwrap());
    let z1 = row(MemoryStrategy::zero(ZeroStage::One, 4).unwrap());
    let z2 = row(MemoryStrategy::zero(ZeroStage::Two, 4).unwrap());
    let z3 = row(MemoryStrategy::zero(ZeroStage::Three, 4).unwrap());
    let p = 4 * report.num_params; // f32 parameter bytes
                                   // The target: a quarter of the model states, plus the largest unit's parameters and
                                   // gradient, whole while it is used.
    assert!(
        z3.model_states <= report.zero3_target(),
        "ZeRO-3 model states {} > target {}",
        z3.model_states,
        report.zero3_target()
    );
    // Optimizer state: two f32 moments, whole for DDP, a quarter (plus padding) when sharded.
    let pad = 4 * 4 * 2 * 16; // < world elements of padding per unit and buffer, generously
    assert_eq!(ddp.optimizer, 2 * p);
    for z in [z1, z2, z3] {
        assert!(z.optimizer <= 2 * p / 4 + pad, "{z:?}");
    }
    // Gradients: ZeRO-1 keeps them whole, ZeRO-2/3 a shard plus the unit being reduced.
    assert!(z1.grads >= p, "{z1:?}");
    assert!(z2.grads < z1.grads && z3.grads < z1.grads, "{z2:?} {z3:?}");
    // Parameters: whole for DDP and ZeRO-1/2; ZeRO-3 a shard plus one gathered unit.
    assert_eq!(ddp.params, p);
    assert_eq!(z1.params, p);
    assert_eq!(z2.params, p);
    assert!(
        z3.params <= p / 4 + report.largest_unit_params + pad,
        "{z3:?} vs {}",
        p / 4 + report.largest_unit_params
    );
    assert!(z3.model_states < z2.model_states && z2.model_states < z1.model_states);
    assert!(z1.model_states < ddp.model_states);
    // Every rank of every strategy runs the same forward on 2 rows.
    assert!(ddp.activations > 0);
    for z in [z1, z2, z3] {
        assert_eq!(z.activations, ddp.activations, "{z:?}");
    }
    // The measured figures stay within the theory's; DDP's gradients within 2% of it (the
    // theory leaves out the fresh gradients of the parameters whose bucket has not launched yet
    // when the last one is flattened: 45 KiB of 4.8 MiB here).
    for r in [ddp, z1, z2, z3] {
        assert!(r.params <= r.theory.params, "{r:?}");
        assert!(r.optimizer <= r.theory.optimizer, "{r:?}");
    }
    for r in [z1, z2, z3] {
        assert!(r.grads <= r.theory.grads, "{r:?}");
    }
    assert!(ddp.grads >= ddp.theory.grads, "{ddp:?}");
    assert!(
        ddp.grads <= ddp.theory.grads + ddp.theory.grads / 50,
        "{ddp:?}"
    );
}

#[test]
fn tensor_parallelism_splits_parameters_and_sequence_parallelism_activations() {
    let cfg = small_gpt();
    let m = cfg.model;
    assert!(m.n_head.is_multiple_of(4) && m.vocab_size.is_multiple_of(4));
    let strategies = [
        MemoryStrategy::new("tp=2", false).unwrap(),
        MemoryStrategy::new("tp=2", true).unwrap(),
        MemoryStrategy::new("tp=4", false).unwrap(),
        MemoryStrategy::new("fsdp=2,tp=2", false).unwrap(),
    ];
    let report = memory_report::<Gpt>(&cfg, &strategies).unwrap();
    println!("{}", report.to_markdown());
    let row = |i: usize| *report.row(&strategies[i]).unwrap();
    let (tp2, tp2_sp, tp4, fsdp2_tp2) = (row(0), row(1), row(2), row(3));

    // The bound from the config (f32, biases on): split over tp are the token table and, per
    // block, the q/k/v and MLP up-projection weights and biases and both output-projection
    // weights; replicated are the position table, the LayerNorms (weight and bias) and the two
    // row-parallel output-projection biases per block.
    let (c, l) = (m.n_embd, m.n_layer);
    assert!(m.bias);
    let split_per_block = (3 * c * c + 3 * c) + (4 * c * c + 4 * c) + c * c + 4 * c * c;
    let split = m.vocab_size * c + l * split_per_block;
    let replicated = m.block_size * c + l * (2 * c + 2 * c + c + c) + 2 * c;
    assert_eq!(split + replicated, report.num_params);
    assert_eq!(split, report.split_params);
    assert_eq!(replicated, report.replicated_params);
    let bound = |tp: usize| 4 * (split / tp + replicated);

    // tp=4: every rank holds at most a quarter of the split parameters plus the replicated ones,
    // and as many gradient bytes (autograd's, accumulated on the parameters: one data-parallel
    // rank has no wrapper) and twice as many bytes of AdamW moments.
    assert!(
        tp4.params <= bound(4),
        "tp=4 parameters {} > {}",
        tp4.params,
        bound(4)
    );
    assert!(tp4.grads <= bound(4), "{tp4:?}");
    assert!(tp4.optimizer <= 2 * bound(4), "{tp4:?}");
    assert!(tp4.params > 0 && tp4.optimizer > 0);
    assert!(tp2.params <= bound(2), "{tp2:?}");
    assert!(tp4.model_states < tp2.model_states);

    // fsdp=2 x tp=2: the tp=2 parameters sharded over 2 ranks plus one gathered unit.
    assert!(fsdp2_tp2.params < tp2.params, "{fsdp2_tp2:?}");
    assert!(
        fsdp2_tp2.optimizer <= tp2.optimizer / 2 + 4 * 2 * 16,
        "{fsdp2_tp2:?}"
    );
    assert!(fsdp2_tp2.model_states < tp2.model_states);

    // Sequence parallelism: the same model states, fewer activation bytes per rank.
    assert_eq!(tp2_sp.params, tp2.params);
    assert_eq!(tp2_sp.optimizer, tp2.optimizer);
    assert!(
        tp2_sp.activations < tp2.activations,
        "tp=2 +sp activations {} >= tp=2 {}",
        tp2_sp.activations,
        tp2.activations
    );

    // The measured figures stay within the theory's.
    for r in [tp2, tp2_sp, tp4, fsdp2_tp2] {
        assert!(r.params <= r.theory.params, "{r:?}");
        assert!(r.grads <= r.theory.grads, "{r:?}");
        assert!(r.optimizer <= r.theory.optimizer, "{r:?}");
    }
    assert_eq!(tp4.theory.params, bound(4));
}

/// The report is the family's: a grouped-query Llama with an untied head under DDP, ZeRO-3 and
/// tensor parallelism, its parameters counted from the model and held within the theory.
#[test]
fn a_llama_is_measured_the_same_way() {
    let mut model = LlamaConfig::new(256, 32, 64, 2, 4);
    model.n_kv_head = 2;
    model.intermediate_size = 128;
    let cfg = MemoryReportConfig {
        model,
        world: 2,
        global_batch: 4,
        seq_len: 32,
        steps: 2,
        seed: 3,
    };
    let strategies = vec![
        MemoryStrategy::ddp(2).unwrap(),
        MemoryStrategy::zero(ZeroStage::Three, 2).unwrap(),
        MemoryStrategy::new("tp=2", true).unwrap(),
    ];
    let report = memory_report::<Llama>(&cfg, &strategies).unwrap();
    println!("{}", report.to_markdown());
    assert!(
        report.model.starts_with("Llama n_layer 2 n_embd 64"),
        "{}",
        report.model
    );
    assert_eq!(report.num_params, model.num_parameters());
    assert_eq!(
        report.split_params + report.replicated_params,
        report.num_params
    );
    // The norms are all a tensor-parallel rank holds whole.
    assert_eq!(report.replicated_params, (2 * 2 + 1) * 64);
    for r in &report.rows {
        assert!(r.params <= r.theory.params, "{r:?}");
        assert!(r.optimizer <= r.theory.optimizer, "{r:?}");
        assert!(r.grads > 0 && r.activations > 0, "{r:?}");
    }
    let tp2 = report.rows[2];
    assert_eq!(tp2.grads, tp2.theory.grads, "{tp2:?}");
    assert!(report.rows[1].model_states < report.rows[0].model_states);
}

/// A tiny Mixtral-style Llama (2 layers, n_embd 64, 4 experts of width 32, top 2) on `world`
/// ranks, 4 rows of 32 tokens, 2 steps.
fn tiny_mixtral(world: usize) -> MemoryReportConfig<LlamaConfig> {
    let mut model = LlamaConfig::new(256, 32, 64, 2, 4);
    model.n_kv_head = 2;
    model.intermediate_size = 32;
    model.moe = Some(meshgrad_nn::moe::MoeSettings::new(4, 2));
    MemoryReportConfig {
        model,
        world,
        global_batch: 4,
        seq_len: 32,
        steps: 2,
        seed: 3,
    }
}

/// What the planner (and the preflight check) predicts per rank for `spec` with `cfg`'s model
/// and batch: (parameters, gradients, optimizer state) bytes.
fn planner_prediction(cfg: &MemoryReportConfig<LlamaConfig>, spec: &str) -> (u64, u64, u64) {
    let layout = spec.parse().unwrap();
    let e = meshgrad_parallel::plan::memory::estimate_training(
        &meshgrad_parallel::plan::memory::TrainingRun::new(
            cfg.model.shape(),
            &layout,
            cfg.global_batch,
        ),
    );
    (e.params, e.grads, e.optimizer)
}

/// Expert parallelism: under `ep=2` a rank holds half of a Mixtral's experts (the router and
/// the rest whole), so its parameter bytes are the `dp=2` rank's less half the experts' bytes.
#[test]
fn expert_parallelism_halves_the_experts_per_rank() {
    let cfg = tiny_mixtral(2);
    let strategies = vec![
        MemoryStrategy::ddp(2).unwrap(),
        MemoryStrategy::new("ep=2", false).unwrap(),
    ];
    let report = memory_report::<meshgrad_nn::Mixtral>(&cfg, &strategies).unwrap();
    let md = report.to_markdown();
    println!("{md}");
    // 2 layers x 4 experts x (w1, w2, w3) of 64 x 32.
    let experts = 2 * 4 * 3 * 64 * 32;
    assert_eq!(report.expert_params, experts);
    let (dp, ep) = (report.rows[0], report.rows[1]);
    assert_eq!(ep.strategy.kind(), "DDP + EP");
    assert_eq!(dp.expert_params, experts);
    assert_eq!(ep.expert_params, experts / 2);
    assert_eq!(ep.params, dp.params - 4 * experts / 2, "{ep:?} vs {dp:?}");
    for r in [dp, ep] {
        assert!(r.params <= r.theory.params, "{r:?}");
        assert!(r.optimizer <= r.theory.optimizer, "{r:?}");
    }
    assert!(
        md.contains(&format!("`dp=2,ep=2` {} of {experts} (1/2)", experts / 2)),
        "{md}"
    );
    // The preflight check's and the planner's formula gives each rank's parameter bytes
    // exactly: half the experts under ep=2, the router and the rest whole.
    assert_eq!(planner_prediction(&cfg, "dp=2").0, dp.params as u64);
    assert_eq!(planner_prediction(&cfg, "ep=2").0, ep.params as u64);
}

/// Expert parallelism with ZeRO: a rank holds half of the experts, sharded at the layout's stage
/// over the 2 ranks holding the same ones (the expert-replica group), and its shard of the
/// rest, so `zero1=4,ep=2` and `fsdp=4,ep=2` keep a quarter of the dense moments plus half of
/// the held experts' moments (a quarter of all the experts'), half of `dp=4,ep=2`'s expert
/// moments; `fsdp=4,ep=2` keeps half of the held experts' parameters plus one block's held
/// experts gathered whole.
#[test]
fn expert_parallelism_with_zero_shards_the_experts_over_their_replicas() {
    let cfg = tiny_mixtral(4);
    let specs = ["dp=4,ep=2", "zero1=4,ep=2", "fsdp=4,ep=2", "hsdp=2x2,ep=2"];
    let strategies: Vec<MemoryStrategy> = specs
        .iter()
        .map(|s| MemoryStrategy::new(s, false).unwrap())
        .collect();
    let report = memory_report::<meshgrad_nn::Mixtral>(&cfg, &strategies).unwrap();
    let md = report.to_markdown();
    println!("{md}");
    // 2 layers x 4 experts x (w1, w2, w3) of 64 x 32.
    let experts = 2 * 4 * 3 * 64 * 32;
    assert_eq!(report.expert_params, experts);
    let dense = report.num_params - experts;
    let [ddp, z1, z3, hsdp] = [0, 1, 2, 3].map(|i| report.rows[i]);
    assert_eq!(z1.strategy.kind(), "ZeRO-1 + EP");
    assert_eq!(z3.strategy.kind(), "ZeRO-3 / FSDP + EP");
    for r in [ddp, z1, z3, hsdp] {
        assert_eq!(r.expert_params, experts / 2, "{r:?}");
        // Measured within the theory's figures, and its optimizer state exactly.
        assert!(r.params <= r.theory.params, "{r:?}");
        assert!(r.grads <= r.theory.grads, "{r:?}");
        assert_eq!(r.optimizer, r.theory.optimizer, "{r:?}");
        if r.strategy.layout.zero() != Some(ZeroStage::Two)
            && r.strategy.layout.zero() != Some(ZeroStage::Three)
        {
            // DDP and ZeRO-1 hold whole gradients: the theory's figure exactly.
            assert_eq!(r.grads, r.theory.grads, "{r:?}");
        }
        // The planner's formula (and the preflight check's) gives both exactly.
        let (params, _, optimizer) = planner_prediction(&cfg, &r.strategy.name());
        assert_eq!(params, r.params as u64, "planner, {r:?}");
        assert_eq!(optimizer, r.optimizer as u64, "planner, {r:?}");
    }
    // Hand count. Parameters: whole dense ones and half the experts (DDP, ZeRO-1).
    assert_eq!(ddp.params, 4 * (dense + experts / 2));
    assert_eq!(z1.params, ddp.params);
    // AdamW's two f32 moments: DDP whole; ZeRO a quarter of the dense parameters' (padding:
    // under 4 elements per unit and group) plus half of the held experts' (each block's 2
    // experts, 12288 elements, split evenly over the 2 replicas: no padding).
    assert_eq!(ddp.optimizer, 8 * (dense + experts / 2));
    let pad = 4 * 8 * 4 * 2;
    for z in [z1, z3] {
        let want = 8 * (dense / 4 + experts / 2 / 2);
        assert!(
            z.optimizer >= want && z.optimizer <= want + pad,
            "{z:?}: {want}"
        );
        // The experts' share: half of DDP's (whose dense share is 4 times the ZeRO one's).
        let dense_share = z.optimizer - 8 * experts / 4;
        assert!(dense_share >= 8 * dense / 4 && dense_share <= 8 * dense / 4 + pad);
        assert_eq!(ddp.optimizer - 8 * dense, 2 * (8 * experts / 4));
    }
    // hsdp=2x2 shards the dense parameters 2 ways, the experts over their 2 replicas.
    let want = 8 * (dense / 2 + experts / 2 / 2);
    assert!(hsdp.optimizer >= want && hsdp.optimizer <= want + pad);
    // Gradients: ZeRO-1 keeps the whole dense gradient and the held experts' whole.
    assert_eq!(z1.grads, 4 * (dense + experts / 2));
    // ZeRO-3 parameters: a quarter of the dense ones (padded) and the largest dense unit, half
    // of the held experts (6144 elements per block, 12288 in all) and one block's held experts
    // (2 x 3 x 64 x 32 = 12288) gathered whole.
    let block_held = 2 * 3 * 64 * 32;
    let experts_z3 = 4 * (experts / 2 / 2 + block_held);
    assert!(z3.params > experts_z3 && z3.params < z1.params);
    assert!(z3.params < z1.params && z3.model_states < z1.model_states);
    assert!(
        md.contains(&format!("`fsdp=4,ep=2` {} of {experts} (1/2)", experts / 2)),
        "{md}"
    );
}

/// With 4 layers the sharded experts show in ZeRO-3's parameters too: `fsdp=4,ep=2` holds half
/// of the held experts (a quarter of all) plus one block's held experts gathered, less than the
/// held experts whole, and exactly the planner's figure; `fsdp=2,ep=2` (one rank per expert
/// block: nothing to shard) keeps them whole.
#[test]
fn fsdp_with_expert_parallelism_shards_the_experts_parameters() {
    let mut cfg = tiny_mixtral(4);
    cfg.model.n_layer = 4;
    let specs = ["zero1=4,ep=2", "fsdp=4,ep=2", "fsdp=2,ep=2"];
    let strategies: Vec<MemoryStrategy> = specs
        .iter()
        .map(|s| MemoryStrategy::new(s, false).unwrap())
        .collect();
    let report = memory_report::<meshgrad_nn::Mixtral>(&cfg, &strategies).unwrap();
    println!("{}", report.to_markdown());
    // 4 layers x 4 experts x (w1, w2, w3) of 64 x 32.
    let experts = 4 * 4 * 3 * 64 * 32;
    assert_eq!(report.expert_params, experts);
    let dense = report.num_params - experts;
    let (z1, z3) = (report.rows[0], report.rows[1]);
    assert_eq!(z1.params, 4 * (dense + experts / 2));
    // fsdp=4: the dense quarter (padded: under 4 elements per unit) plus the largest dense unit
    // at most (a block, or the root's embedding and head: 2 x 256 x 64 and a norm).
    let block_held = 2 * 3 * 64 * 32;
    let experts_z3 = 4 * (experts / 2 / 2 + block_held);
    assert!(experts_z3 < 4 * experts / 2);
    let root = 2 * 256 * 64 + 64;
    let dense_z3 = z3.params - experts_z3;
    assert!(
        dense_z3 >= 4 * dense / 4 && dense_z3 <= 4 * (dense / 4 + 16 + root),
        "{z3:?}"
    );
    assert_eq!(z3.params, z3.theory.params, "{z3:?}");
    let (params, _, _) = planner_prediction(&cfg, "fsdp=4,ep=2");
    assert_eq!(params, z3.params as u64);
    // fsdp=2,ep=2: the held experts whole (parameters and both moments), the dense half (its
    // moments padded under 2 elements per unit).
    let two = report.rows[2];
    assert!(two.params >= 4 * (dense / 2 + experts / 2), "{two:?}");
    let want = 8 * (dense / 2 + experts / 2);
    assert!(
        two.optimizer >= want && two.optimizer <= want + 8 * 16,
        "{two:?}"
    );
    assert_eq!(two.optimizer, two.theory.optimizer, "{two:?}");
    let (params, _, optimizer) = planner_prediction(&cfg, "fsdp=2,ep=2");
    assert_eq!(
        (params, optimizer),
        (two.params as u64, two.optimizer as u64)
    );
}

/// Context parallelism: at cp=4 a rank of a 1024-token GPT allocates at most 0.35 of one
/// device's activation bytes during the forward (its 256 tokens are a quarter of the sequence;
/// ring attention adds the key/value blocks in flight and the rows' log-sum-exp).
#[test]
fn context_parallelism_divides_the_activations_per_rank() {
    let cfg = MemoryReportConfig {
        model: GptConfig {
            vocab_size: 64,
            block_size: 1024,
            n_layer: 2,
            n_head: 2,
            n_embd: 32,
            dropout: 0.0,
            bias: true,
            layer_norm_eps: 1e-5,
        },
        world: 4,
        global_batch: 1,
        seq_len: 1024,
        steps: 1,
        seed: 1,
    };
    let one = MemoryStrategy::new("dp=1", false).unwrap();
    let cp4 = MemoryStrategy::new("cp=4", false).unwrap();
    let report = memory_report::<Gpt>(&cfg, &[one, cp4]).unwrap();
    println!("{}", report.to_markdown());
    let (a1, a4) = (
        report.row(&one).unwrap().activations,
        report.row(&cp4).unwrap().activations,
    );
    let ratio = a4 as f64 / a1 as f64;
    println!("cp=4 activations per rank / one device's: {ratio:.3}");
    assert!(ratio <= 0.35, "cp=4: {a4} vs {a1} bytes ({ratio:.3})");
    assert!(report.to_markdown().contains("`cp=4` holds"));
    // Gradients are averaged over the context-parallel ranks (DDP's bucket copy): the theory
    // counts what the ranks hold.
    let r4 = report.row(&cp4).unwrap();
    assert_eq!(r4.grads, r4.theory.grads, "{r4:?}");
    assert_eq!(r4.strategy.kind(), "DDP + CP");
}

//! The memory report at world size 4 (the README table): per-rank peak bytes of parameters,
//! gradients and optimizer state under DDP and ZeRO-1/2/3, measured by each rank's tracker
//! during real training steps, and the ZeRO-3 target: the model states held at one time by a
//! rank are at most 1/4 of the unsharded model states (16 bytes per parameter: f32 parameters,
//! gradients and two AdamW moments) plus the largest unit's gathered parameters.

use meshgrad_parallel::zero::memory::{memory_report, MemoryReportConfig, MemoryStrategy};
use meshgrad_parallel::zero::ZeroStage;

#[test]
fn zero3_meets_the_memory_target_at_world_4() {
    let cfg = MemoryReportConfig::small_gpt(4);
    let report = memory_report(&cfg, &MemoryStrategy::ALL).unwrap();
    println!("{}", report.to_markdown());
    let row = |s| *report.row(s).unwrap();
    let ddp = row(MemoryStrategy::Ddp);
    let z1 = row(MemoryStrategy::Zero(ZeroStage::One));
    let z2 = row(MemoryStrategy::Zero(ZeroStage::Two));
    let z3 = row(MemoryStrategy::Zero(ZeroStage::Three));
    let p = 4 * report.num_params; // f32 parameter bytes
                                   // The target.
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
}

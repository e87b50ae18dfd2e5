//! Pipeline parallelism: schedules (which rank runs which forward, backward and transfer, in
//! which order), a simulator that checks a schedule and measures its bubble and activation
//! memory, a per-layer profiler and the partitioner that cuts a model into stages, an executor
//! that runs any schedule on a model's stages, forward-only evaluation and timelines. `meshgrad
//! train --layout pp=P` drives all of it.
//!
//! * [`schedule`]: [`Action`], [`Schedule`] and the generators GPipe, 1F1B, interleaved 1F1B
//!   (Megatron) and a ZB-H1-style zero-bubble schedule.
//! * [`simulate`](mod@simulate): [`simulate()`](simulate::simulate) with per-action [`Costs`]:
//!   dependency checks, deadlock detection under grouped rendezvous transfers, makespan, bubble and peak
//!   in-flight activations.
//! * [`partition`]: where to cut a model into pipeline stages — a dynamic program over per-layer
//!   costs minimising the slowest stage's time or the largest stage's memory (under an optional
//!   per-stage memory limit), even splits, explicit boundaries and the `--partition` spec.
//! * [`evaluate`]: [`forward_only`], a batch through the stages without gradients (validation).
//! * [`trace`]: a [`Timeline`] per rank of what it did when (the executor records every action),
//!   written as a Chrome trace ([`write_chrome_trace`]) and measured ([`measure_idle`], the
//!   counterpart of the simulated bubble).
//! * [`timelines`]: a training run's timelines and step windows on every rank, the measured idle
//!   fraction after the first step, and their gathering on rank 0 in a job of processes.
//! * [`profile`](mod@profile): [`profile_layers`] measures each layer's forward + backward time
//!   and memory of a [`ModelStage`](meshgrad_nn::ModelStage) model on its device and returns the
//!   per-layer costs the partitioner consumes.
//! * [`execute`](mod@execute): [`execute()`](execute::execute) runs one rank's action list of any
//!   schedule (GPipe, 1F1B, interleaved with several chunks per rank, zero-bubble with split
//!   backwards through [`Var::backward_input`](meshgrad_autograd::Var::backward_input), or a
//!   hand-made one) on the rank's [`ModelStage`](meshgrad_nn::ModelStage) chunks over the
//!   pipeline group, with consecutive transfers grouped (posted together, then waited for, as
//!   NCCL groups them); [`PipelineGrads`] finishes the step (tied-table gradient sum, clipping
//!   across stages, optimizer step).
//!
//! ```
//! use meshgrad_parallel::pipeline::{simulate, Costs, Schedule};
//!
//! let s = Schedule::one_f_one_b(4, 8).unwrap();
//! let r = simulate(&s, &Costs::uniform(1.0, 1.0, 1.0, 0.0)).unwrap();
//! assert!((r.bubble - 3.0 / 11.0).abs() < 1e-12); // (P - 1) / (M + P - 1)
//! assert_eq!(r.peak_activations, vec![4, 3, 2, 1]);
//! ```

pub mod evaluate;
pub mod execute;
pub mod partition;
pub mod profile;
pub mod schedule;
pub mod simulate;
pub mod timelines;
pub mod trace;

pub use evaluate::forward_only;
pub use execute::{
    check_supported, exact_sq_sum_over, execute, execute_scaled, execute_with, mean_loss,
    ApartParams, ExecuteOptions, Microbatch, MicrobatchHook, PipelineGrads,
};
pub use profile::{profile_layers, profile_lines, ProfileOptions};
pub use schedule::{Action, Schedule, ScheduleArgError, ScheduleKind, MAX_SCHEDULE_ACTIONS};
pub use simulate::{simulate, Blocked, Costs, ScheduleError, SimReport, Slot};
pub use timelines::{gather_timelines, measured_idle_after_warmup, StepWindow, Timelines};
pub use trace::{
    chrome_trace, chrome_trace_json, measure_idle, measure_idle_between, measured_costs,
    write_chrome_trace, IdleReport, Span, SpanKind, Timeline,
};

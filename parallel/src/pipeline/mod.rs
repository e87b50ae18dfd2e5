//! Pipeline parallelism, as data and algorithms for now: schedules (which rank runs which
//! forward, backward and transfer, in which order), a simulator that checks a schedule and
//! measures its bubble and activation memory, and the partitioner that cuts a model into stages.
//! No executor runs them on a model yet.
//!
//! * [`schedule`]: [`Action`], [`Schedule`] and the generators GPipe, 1F1B, interleaved 1F1B
//!   (Megatron) and a ZB-H1-style zero-bubble schedule.
//! * [`simulate`](mod@simulate): [`simulate()`](simulate::simulate) with per-action [`Costs`]:
//!   dependency checks, deadlock detection under rendezvous sends, makespan, bubble and peak
//!   in-flight activations.
//! * [`partition`]: where to cut a model into pipeline stages — a dynamic program over per-layer
//!   costs minimising the slowest stage's time or the largest stage's memory (under an optional
//!   per-stage memory limit), even splits, explicit boundaries and the `--partition` spec.
//!
//! ```
//! use meshgrad_parallel::pipeline::{simulate, Costs, Schedule};
//!
//! let s = Schedule::one_f_one_b(4, 8).unwrap();
//! let r = simulate(&s, &Costs::uniform(1.0, 1.0, 1.0, 0.0)).unwrap();
//! assert!((r.bubble - 3.0 / 11.0).abs() < 1e-12); // (P - 1) / (M + P - 1)
//! assert_eq!(r.peak_activations, vec![4, 3, 2, 1]);
//! ```

pub mod partition;
pub mod schedule;
pub mod simulate;

pub use schedule::{Action, Schedule, ScheduleArgError, ScheduleKind};
pub use simulate::{simulate, Blocked, Costs, ScheduleError, SimReport, Slot};

//! `meshgrad schedule`: builds a pipeline schedule ([`meshgrad_parallel::pipeline`]), runs it
//! through the simulator with unit costs and prints it as a grid.
//!
//! Costs: forward, input backward and weight backward 1 time step per chunk, a full backward 2,
//! transfers free. The bubble fraction does not depend on the time unit, so an interleaved
//! schedule's figure is also the one for chunk costs 1/V. The last line is
//! `bubble=<fraction> peak_activations=<max over ranks> deadlock=no`, the fraction with 4
//! decimals (`3/11` prints `0.2727`), or `deadlock=yes: <the blocked ranks and actions>`.

use anyhow::{anyhow, Result};
use meshgrad_parallel::pipeline::{simulate, Costs, Schedule, ScheduleError, ScheduleKind};

/// The largest grid (time steps x ranks) printed; a larger schedule prints its summary alone.
pub const MAX_GRID_CELLS: usize = 100_000;

/// What `meshgrad schedule` prints, and whether the schedule deadlocked.
pub struct ScheduleOutput {
    /// Stdout, ending with the `bubble=... deadlock=...` line.
    pub text: String,
    /// The deadlock, if any (the command then exits non-zero).
    pub deadlock: Option<String>,
}

/// Builds, simulates and renders the schedule (the grid when it has at most
/// [`MAX_GRID_CELLS`] cells). Bad arguments (no stages or microbatches, interleaved with M not
/// divisible by P, `chunks` for another kind, a schedule of more than
/// [`MAX_SCHEDULE_ACTIONS`](meshgrad_parallel::pipeline::MAX_SCHEDULE_ACTIONS) actions) are
/// errors.
pub fn schedule_output(
    kind: &str,
    stages: usize,
    microbatches: usize,
    chunks: Option<usize>,
) -> Result<ScheduleOutput> {
    let kind: ScheduleKind = kind.parse().map_err(|e: String| anyhow!(e))?;
    let schedule = Schedule::generate(kind, stages, microbatches, chunks)?;
    let mut text = format!(
        "schedule={kind} stages={stages} microbatches={microbatches} chunks={}\n\
         unit costs per chunk: F 1, full backward B 2 (zb: input-gradient B 1 + weight-gradient \
         W 1), transfers 0\n",
        schedule.chunks
    );
    match simulate(&schedule, &Costs::uniform(1.0, 1.0, 1.0, 0.0)) {
        Ok(r) => {
            let cells = (r.makespan.ceil() as usize).saturating_mul(stages);
            if cells <= MAX_GRID_CELLS {
                text.push_str(&r.grid(1.0));
            } else {
                text.push_str(&format!(
                    "grid omitted: {} time steps x {stages} ranks is more than {MAX_GRID_CELLS} \
                     cells\n",
                    r.makespan.ceil()
                ));
            }
            text.push_str(&format!(
                "makespan={} compute_per_rank={:?} peak_activations_per_rank={:?} \
                 awaiting_weight_grad_per_rank={:?}\n",
                r.makespan, r.busy, r.peak_activations, r.peak_held
            ));
            text.push_str(&format!(
                "bubble={:.4} peak_activations={} deadlock=no\n",
                r.bubble,
                r.max_peak_activations()
            ));
            Ok(ScheduleOutput {
                text,
                deadlock: None,
            })
        }
        Err(e @ ScheduleError::Deadlock { .. }) => {
            let what = e.to_string();
            text.push_str(&format!("deadlock=yes: {what}\n"));
            Ok(ScheduleOutput {
                text,
                deadlock: Some(what),
            })
        }
        Err(e) => Err(anyhow!("the {kind} schedule is invalid: {e}")),
    }
}

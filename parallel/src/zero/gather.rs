//! ZeRO-3: gathering a unit's full parameters into the model's own parameter tensors
//! (`materialize_from`) before they are needed, releasing them (`release_storage`) after, and the
//! forward / pre-backward hooks that decide when.
//!
//! For stage `s` of the model's forward, reading units `U(s)`:
//!
//! * **pre-forward**: gather `U(s)` (waiting for a prefetch if one is in flight), then launch the
//!   all-gather of `U(s+1)` (prefetch) so it overlaps this stage's compute;
//! * **post-forward**: register a pre-backward hook on the stage's output, then release the units
//!   of `U(s)` the next stage does not read. The last stage keeps its units when a backward will
//!   follow (its backward comes first); without a backward (under `no_grad`) everything is
//!   released;
//! * **pre-backward** (right before the output's node runs, so after every later stage's
//!   backward): release the units of `U(s+1)` (their backward is over), gather `U(s)` again,
//!   prefetch `U(s-1)`. With activation checkpointing this is also the moment the stage's forward
//!   is recomputed, so its parameters are present for it;
//! * **post-backward**: when the gradients of all of a unit's parameters have arrived, its
//!   parameters are released at once (see `grads`) and its gradient reduce-scattered.

use std::sync::{Arc, Weak};

use meshgrad_autograd::Var;
use meshgrad_nn::hooks::ForwardHooks;
use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{Error, Result};

use super::config::ZeroStage;
use super::wrapper::{lock, Inner, ShardedDataParallel, State};
use crate::comm::Work;

/// Whether a unit's full parameters are present.
pub(crate) enum GatherState {
    /// Released: only the shard exists.
    Released,
    /// An all-gather (prefetch) is in flight.
    InFlight(Work),
    /// The parameter tensors hold the full values.
    Gathered,
}

impl Inner {
    fn err(&self, what: &str, e: Error) -> Error {
        Error::msg(format!(
            "rank {} (shard rank {}): ZeRO-3 {what}: {e}",
            self.topo.dp.global_rank(),
            self.shard_rank
        ))
    }

    /// Launches the all-gather of unit `u`'s shards (cast to the parameter dtype).
    fn launch_gather(&self, st: &State, u: usize) -> Result<Work> {
        let Some(master) = &st.master[u] else {
            meshgrad_tensor::bail!("unit {} has no shard", self.plan.units[u].name);
        };
        let local = master.to_dtype(self.param_dtype)?;
        self.topo.shard.all_gather(&local)
    }

    /// Launches the all-gather of unit `u` unless it is gathered or in flight.
    pub(crate) fn prefetch(&self, st: &mut State, u: usize) -> Result<()> {
        if matches!(st.gather[u], GatherState::Released) {
            let w = self.launch_gather(st, u).map_err(|e| {
                self.err(&format!("prefetching unit {}", self.plan.units[u].name), e)
            })?;
            st.gather[u] = GatherState::InFlight(w);
        }
        Ok(())
    }

    /// Makes unit `u`'s full parameters present (waiting for its prefetch, or gathering now).
    pub(crate) fn ensure_gathered(&self, st: &mut State, u: usize) -> Result<()> {
        let what = || format!("gathering unit {}", self.plan.units[u].name);
        let work = match std::mem::replace(&mut st.gather[u], GatherState::Released) {
            GatherState::Gathered => {
                st.gather[u] = GatherState::Gathered;
                return Ok(());
            }
            GatherState::InFlight(w) => {
                st.gather_stats.prefetched += 1;
                w
            }
            GatherState::Released => {
                st.gather_stats.on_demand += 1;
                self.launch_gather(st, u)
                    .map_err(|e| self.err(&what(), e))?
            }
        };
        let full = work.wait().map_err(|e| self.err(&what(), e))?;
        with_tag(MemoryTag::Params, || -> Result<()> {
            for &pi in &self.plan.units[u].params {
                let p = &self.plan.params[pi];
                self.vars[pi]
                    .tensor()
                    .materialize_from(&full.narrow(0, p.offset, p.numel)?)
                    .map_err(|e| Error::msg(format!("parameter {}: {e}", p.name)))?;
            }
            Ok(())
        })
        .map_err(|e| self.err(&what(), e))?;
        st.gather[u] = GatherState::Gathered;
        if !st.summoned {
            let n = st
                .gather
                .iter()
                .filter(|g| matches!(g, GatherState::Gathered))
                .count();
            st.gather_stats.max_gathered = st.gather_stats.max_gathered.max(n);
        }
        Ok(())
    }

    /// Frees unit `u`'s full parameters (ZeRO-3 only; not while summoned). A prefetch in flight
    /// is abandoned (its peers still complete it).
    pub(crate) fn release(&self, st: &mut State, u: usize) {
        if self.config.stage != ZeroStage::Three || st.summoned {
            return;
        }
        for &pi in &self.plan.units[u].params {
            self.vars[pi].tensor().release_storage();
        }
        st.gather[u] = GatherState::Released;
    }

    fn check_stage(&self, stage: usize) -> Result<()> {
        if stage >= self.stage_units.len() {
            meshgrad_tensor::bail!(
                "ZeRO-3: the model ran forward stage {stage}, but it declared {} stages",
                self.stage_units.len()
            );
        }
        Ok(())
    }

    /// The units of stage `s` that stage `other` does not read.
    fn units_not_in(&self, s: usize, other: Option<usize>) -> Vec<usize> {
        self.stage_units[s]
            .iter()
            .copied()
            .filter(|u| other.is_none_or(|o| !self.stage_units[o].contains(u)))
            .collect()
    }

    fn pre_forward(&self, s: usize) -> Result<()> {
        self.check_stage(s)?;
        let mut st = lock(&self.state);
        if st.summoned {
            return Ok(());
        }
        for &u in &self.stage_units[s] {
            self.ensure_gathered(&mut st, u)?;
        }
        if self.config.prefetch && s + 1 < self.stage_units.len() {
            for u in self.units_not_in(s + 1, Some(s)) {
                self.prefetch(&mut st, u)?;
            }
        }
        Ok(())
    }

    fn post_forward(self: &Arc<Self>, s: usize, out: &Var) -> Result<()> {
        self.check_stage(s)?;
        let backward = out.requires_grad() && !out.is_leaf();
        if backward {
            let weak = Arc::downgrade(self);
            out.register_pre_backward_hook(Arc::new(move |_v: &Var| match weak.upgrade() {
                Some(i) => i.pre_backward(s),
                None => Err(dropped()),
            }))?;
        }
        let mut st = lock(&self.state);
        if st.summoned {
            return Ok(());
        }
        let last = s + 1 == self.stage_units.len();
        let release = if last {
            if backward {
                Vec::new()
            } else {
                self.stage_units[s].clone()
            }
        } else {
            self.units_not_in(s, Some(s + 1))
        };
        for u in release {
            self.release(&mut st, u);
        }
        Ok(())
    }

    fn pre_backward(&self, s: usize) -> Result<()> {
        let mut st = lock(&self.state);
        if st.summoned {
            return Ok(());
        }
        // The later stage's backward is over: free its units before gathering this one's, so
        // at most one stage's units are present at a time.
        if s + 1 < self.stage_units.len() {
            for u in self.units_not_in(s + 1, Some(s)) {
                self.release(&mut st, u);
            }
        }
        for &u in &self.stage_units[s] {
            self.ensure_gathered(&mut st, u)?;
        }
        if self.config.prefetch && s > 0 {
            for u in self.units_not_in(s - 1, Some(s)) {
                self.prefetch(&mut st, u)?;
            }
        }
        Ok(())
    }
}

fn dropped() -> Error {
    Error::msg(
        "ZeRO-3: the ShardedDataParallel that sharded this model was dropped, so its parameters \
         are released; keep the wrapper alive while using the model (or call \
         summon_full_params before dropping it)",
    )
}

/// The forward hooks ZeRO-3 installs in the model.
pub(crate) struct FsdpHooks {
    inner: Weak<Inner>,
}

impl FsdpHooks {
    pub(crate) fn new(inner: Weak<Inner>) -> Self {
        FsdpHooks { inner }
    }
}

impl ForwardHooks for FsdpHooks {
    fn pre_forward(&self, stage: usize) -> Result<()> {
        self.inner.upgrade().ok_or_else(dropped)?.pre_forward(stage)
    }

    fn post_forward(&self, stage: usize, output: &Var) -> Result<()> {
        self.inner
            .upgrade()
            .ok_or_else(dropped)?
            .post_forward(stage, output)
    }
}

impl ShardedDataParallel {
    /// ZeRO-3: gathers every unit's full parameters into the model and keeps them (the hooks
    /// stop releasing) until [`ShardedDataParallel::reshard`], e.g. for evaluation, generation or
    /// reading the weights. A no-op for ZeRO-1/2, whose parameters are always whole. Collective:
    /// every rank of the shard group must call it.
    pub fn summon_full_params(&self) -> Result<()> {
        let i = &self.inner;
        let mut st = lock(&i.state);
        if i.config.stage != ZeroStage::Three {
            return Ok(());
        }
        for u in 0..i.plan.units.len() {
            i.ensure_gathered(&mut st, u)?;
        }
        st.summoned = true;
        Ok(())
    }

    /// Ends [`ShardedDataParallel::summon_full_params`]: releases the full parameters again.
    pub fn reshard(&self) {
        let i = &self.inner;
        let mut st = lock(&i.state);
        st.summoned = false;
        for u in 0..i.plan.units.len() {
            i.release(&mut st, u);
        }
    }

    /// The names of the model's stages and, for each, the names of the units it reads.
    pub fn stage_units(&self) -> Vec<(String, Vec<String>)> {
        let i = &self.inner;
        i.stage_names
            .iter()
            .zip(&i.stage_units)
            .map(|(n, us)| {
                (
                    n.clone(),
                    us.iter().map(|&u| i.plan.units[u].name.clone()).collect(),
                )
            })
            .collect()
    }
}

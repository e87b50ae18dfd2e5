//! ZeRO-3: gathering a unit's full parameters into the model's own parameter tensors
//! (`materialize_from`) when they are first read, releasing them after, and prefetching the unit
//! needed next. Nothing is asked of the model beyond [`meshgrad_nn::Module`].
//!
//! * **Materialise on read.** Between uses a parameter's storage is released
//!   ([`Tensor::release_storage`](meshgrad_tensor::Tensor::release_storage)) and carries a
//!   materialiser ([`Tensor::set_materializer`](meshgrad_tensor::Tensor::set_materializer)) for
//!   its unit. The first op that reads any parameter of a released unit (a forward, the forward
//!   that activation checkpointing recomputes, or a backward closure reading the weights it
//!   captured) runs it: the unit is all-gathered (or its prefetch waited for) and materialised,
//!   then the op proceeds. Reads of a gathered unit cost nothing extra.
//! * **Release.** When a unit is gathered, every other gathered unit is released first, except
//!   the one predicted next (being prefetched), so at most the current unit and the prefetched
//!   one are present; a unit needed again is simply gathered again. A parameter that an op is
//!   reading at that moment (an op reading parameters of two units) is left alone, and its unit
//!   released at a later gather. After backward, a unit is released as soon as all its
//!   gradients have arrived (see `grads`); `finish`, `step` and `reshard` release everything.
//! * **Order and prefetch.** Each forward and each backward records the order in which units
//!   were gathered (whether a read belongs to backward is asked of the autograd engine,
//!   [`meshgrad_autograd::is_backward_running`]). The next forward (backward) is predicted from
//!   the last one: when a unit is gathered, the unit that followed it last time is prefetched
//!   (its all-gather launched so it overlaps compute). The last unit of a forward with gradients
//!   enabled prefetches the first unit of the backward. Before the first forward the guess is
//!   the units' registration order; before the first backward, the reverse of the forward.
//!   A wrong prediction only costs a wasted all-gather: a prefetch not used by the next gather is
//!   abandoned.
//!
//! Every rank runs the same program, so every rank reads the same parameters in the same order
//! and issues the same all-gathers: reading a released parameter on one rank only (printing a
//! weight on rank 0) would start a collective the others never join, and fail with a timeout.

use std::sync::{Arc, Weak};

use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::storage::Materializer;
use meshgrad_tensor::{Error, Result};

use super::config::ZeroStage;
use super::wrapper::{lock, Inner, ShardedDataParallel, State};
use crate::comm::Work;

/// Whether a unit's full parameters are present.
pub(crate) enum GatherState {
    /// Released: only the shard exists.
    Released,
    /// Released, with an all-gather (prefetch) in flight.
    InFlight(Work),
    /// The parameter tensors hold the full values (all of them, or some if a release found a
    /// parameter in use).
    Gathered,
}

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    Forward,
    Backward,
}

/// The recorded order of unit gathers, and the prediction of the next one.
pub(crate) struct UnitOrder {
    /// The phase being recorded (`None` right after a boundary: `finish`, `step`, `reshard`).
    phase: Option<Phase>,
    /// Units gathered so far in this phase, in order (capped).
    current: Vec<usize>,
    /// The order this phase is predicted from, and the position reached in it.
    reference: Vec<usize>,
    cursor: usize,
    /// The last completed forward's gathers (before the first: the registration-order guess).
    forward: Vec<usize>,
    /// `forward` was recorded, not guessed.
    forward_known: bool,
    /// The last completed backward's gathers (empty before the first).
    backward: Vec<usize>,
    cap: usize,
}

impl UnitOrder {
    /// An order that first guesses `guess` (units by registration order) for the forward.
    pub(crate) fn new(guess: Vec<usize>) -> Self {
        let cap = 8 * guess.len() + 16;
        UnitOrder {
            phase: None,
            current: Vec::new(),
            reference: Vec::new(),
            cursor: 0,
            forward: guess,
            forward_known: false,
            backward: Vec::new(),
            cap,
        }
    }

    /// Ends the phase in progress, keeping its record.
    pub(crate) fn end_phase(&mut self) {
        let current = std::mem::take(&mut self.current);
        match self.phase.take() {
            Some(Phase::Forward) if !current.is_empty() => {
                self.forward = current;
                self.forward_known = true;
            }
            Some(Phase::Backward) if !current.is_empty() => self.backward = current,
            _ => {}
        }
    }

    /// The predicted backward order: the last backward's, else the reverse of the last forward
    /// without its last unit (still gathered when backward starts).
    fn backward_reference(&self) -> Vec<usize> {
        if !self.backward.is_empty() {
            return self.backward.clone();
        }
        let mut r: Vec<usize> = self.forward.iter().rev().copied().collect();
        r.dedup();
        if !r.is_empty() {
            r.remove(0);
        }
        r
    }

    /// Records that unit `u` was gathered in `phase`; returns the unit predicted next.
    pub(crate) fn record(&mut self, phase: Phase, u: usize, grad_enabled: bool) -> Option<usize> {
        if self.phase != Some(phase) {
            self.end_phase();
            self.phase = Some(phase);
            self.reference = match phase {
                Phase::Forward => self.forward.clone(),
                Phase::Backward => self.backward_reference(),
            };
            self.cursor = 0;
        }
        if self.current.len() < self.cap {
            self.current.push(u);
        }
        let i = self.cursor + self.reference[self.cursor..].iter().position(|&x| x == u)?;
        self.cursor = i + 1;
        match self.reference.get(i + 1) {
            Some(&next) => Some(next),
            None if phase == Phase::Forward && self.forward_known && grad_enabled => {
                self.backward_reference().first().copied()
            }
            None => None,
        }
    }

    /// The last recorded forward and backward orders.
    pub(crate) fn recorded(&self) -> (&[usize], &[usize]) {
        let f: &[usize] = if self.forward_known {
            &self.forward
        } else {
            &[]
        };
        (f, &self.backward)
    }
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

    /// Launches the all-gather of unit `u` if it is released.
    pub(crate) fn prefetch(&self, st: &mut State, u: usize) -> Result<()> {
        if matches!(st.gather[u], GatherState::Released) {
            let w = self.launch_gather(st, u).map_err(|e| {
                self.err(&format!("prefetching unit {}", self.plan.units[u].name), e)
            })?;
            st.gather[u] = GatherState::InFlight(w);
        }
        Ok(())
    }

    /// Makes every parameter of unit `u` present (waiting for its prefetch, or gathering now).
    pub(crate) fn ensure_gathered(&self, st: &mut State, u: usize) -> Result<()> {
        let params = &self.plan.units[u].params;
        let what = || format!("gathering unit {}", self.plan.units[u].name);
        let work = match std::mem::replace(&mut st.gather[u], GatherState::Released) {
            GatherState::Gathered => {
                st.gather[u] = GatherState::Gathered;
                if params
                    .iter()
                    .all(|&pi| self.vars[pi].tensor().is_materialized())
                {
                    return Ok(());
                }
                // Partly released (a parameter was in use when the unit was released).
                st.gather_stats.on_demand += 1;
                self.launch_gather(st, u)
                    .map_err(|e| self.err(&what(), e))?
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
            for &pi in params {
                let p = &self.plan.params[pi];
                let t = self.vars[pi].tensor();
                if t.is_materialized() {
                    continue;
                }
                t.materialize_from(&full.narrow(0, p.offset, p.numel)?)
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

    /// Frees unit `u`'s full parameters (ZeRO-3 only; not while summoned), except any that an op
    /// is reading right now (the unit then stays gathered, to be released later). A prefetch in
    /// flight is abandoned (its peers still complete it).
    pub(crate) fn release(&self, st: &mut State, u: usize) {
        if self.config.stage != ZeroStage::Three || st.summoned {
            return;
        }
        if let GatherState::Gathered = st.gather[u] {
            let mut all = true;
            for &pi in &self.plan.units[u].params {
                all &= self.vars[pi].tensor().try_release_storage();
            }
            if !all {
                return;
            }
        }
        st.gather[u] = GatherState::Released;
    }

    /// Releases every unit.
    pub(crate) fn release_all(&self, st: &mut State) {
        for u in 0..self.plan.units.len() {
            self.release(st, u);
        }
    }

    /// The materialiser of unit `u`'s parameters: runs when an op reads one of them while it is
    /// released.
    fn on_read(&self, u: usize) -> Result<()> {
        let mut st = lock(&self.state);
        if st.summoned {
            return self.ensure_gathered(&mut st, u);
        }
        let phase = if meshgrad_autograd::is_backward_running() {
            Phase::Backward
        } else {
            Phase::Forward
        };
        let next = st
            .order
            .record(phase, u, meshgrad_autograd::is_grad_enabled())
            .filter(|&n| n != u && self.config.prefetch);
        // Free everything but `u` and the prefetch of `next` already in flight: at most one
        // unit gathered and one in flight. (`next` still gathered is released too, and
        // prefetched again below: memory stays at one unit plus one prefetch.)
        for v in 0..self.plan.units.len() {
            let in_flight_next =
                Some(v) == next && matches!(st.gather[v], GatherState::InFlight(_));
            if v != u && !in_flight_next {
                self.release(&mut st, v);
            }
        }
        self.ensure_gathered(&mut st, u)?;
        if let Some(n) = next {
            self.prefetch(&mut st, n)?;
        }
        Ok(())
    }

    /// The materialiser installed on unit `u`'s parameters.
    pub(crate) fn materializer(inner: &Arc<Inner>, u: usize) -> Materializer {
        let weak: Weak<Inner> = Arc::downgrade(inner);
        Arc::new(move || match weak.upgrade() {
            Some(i) => i.on_read(u),
            None => Err(dropped()),
        })
    }
}

fn dropped() -> Error {
    Error::msg(
        "ZeRO-3: the ShardedDataParallel that sharded this model was dropped, so its parameters \
         are released; keep the wrapper alive while using the model, or call \
         summon_full_params() before dropping it (the model then keeps its full parameters)",
    )
}

/// The units' recorded order of use (see [`ShardedDataParallel::gather_order`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatherOrder {
    /// The units gathered by the last forward, in order (a unit gathered twice, such as a root
    /// unit holding both the embeddings and the final norm, appears twice).
    pub forward: Vec<String>,
    /// The units gathered by the last backward, in order.
    pub backward: Vec<String>,
}

impl ShardedDataParallel {
    /// ZeRO-3: gathers every unit's full parameters into the model and keeps them (nothing is
    /// released) until [`ShardedDataParallel::reshard`], e.g. for evaluation, generation or
    /// reading the weights; dropping the wrapper while summoned leaves the model with its full
    /// parameters, a plain model again. A no-op for ZeRO-1/2, whose parameters are always
    /// whole. Collective: every rank of the shard group must call it.
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

    /// Ends [`ShardedDataParallel::summon_full_params`], and in any case releases every gathered
    /// unit now (ZeRO-3 keeps the unit it gathered last until another is needed; call this to
    /// free it after an evaluation forward, for example).
    pub fn reshard(&self) {
        let i = &self.inner;
        let mut st = lock(&i.state);
        st.summoned = false;
        st.order.end_phase();
        i.release_all(&mut st);
    }

    /// ZeRO-3: the order in which the last forward and the last backward gathered the units,
    /// by unit name (what the next ones are predicted and prefetched from). Empty before the
    /// first forward (backward), and for ZeRO-1/2.
    pub fn gather_order(&self) -> GatherOrder {
        let i = &self.inner;
        let st = lock(&i.state);
        let (f, b) = st.order.recorded();
        let names = |us: &[usize]| -> Vec<String> {
            us.iter().map(|&u| i.plan.units[u].name.clone()).collect()
        };
        GatherOrder {
            forward: names(f),
            backward: names(b),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_predicts_the_next_unit() {
        // GPT-like: root (embeddings), h.0, h.1, root again (final norm); backward h.1, h.0.
        let (root, h0, h1) = (0, 1, 2);
        let mut o = UnitOrder::new(vec![root, h0, h1]);
        let (f, b) = (Phase::Forward, Phase::Backward);
        // First forward: from the registration-order guess; it ends unknown.
        assert_eq!(o.record(f, root, true), Some(h0));
        assert_eq!(o.record(f, h0, true), Some(h1));
        assert_eq!(o.record(f, h1, true), None);
        assert_eq!(o.record(f, root, true), None);
        // First backward: the reverse of that forward, root (still gathered) left out.
        assert_eq!(o.record(b, h1, true), Some(h0));
        assert_eq!(o.record(b, h0, true), Some(root));
        o.end_phase();
        assert_eq!(o.recorded(), (&[root, h0, h1, root][..], &[h1, h0][..]));
        // Second step: learned orders; the forward's end prefetches the backward's start.
        assert_eq!(o.record(f, root, true), Some(h0));
        assert_eq!(o.record(f, h0, true), Some(h1));
        assert_eq!(o.record(f, h1, true), Some(root));
        assert_eq!(o.record(f, root, true), Some(h1));
        assert_eq!(o.record(b, h1, true), Some(h0));
        assert_eq!(o.record(b, h0, true), None);
        // Without gradients the forward's end predicts nothing.
        o.end_phase();
        o.record(f, root, false);
        o.record(f, h0, false);
        o.record(f, h1, false);
        assert_eq!(o.record(f, root, false), None);
        // An unexpected unit predicts nothing, and the position stays.
        o.end_phase();
        assert_eq!(o.record(f, 7, true), None);
        assert_eq!(o.record(f, root, true), Some(h0));
    }
}

//! [`ShardedDataParallel`]: construction, the shared per-rank state and the public entry points.
//! The work is split over the sibling modules: gradient reduction (`grads`), gathering and
//! releasing ZeRO-3 units (`gather`), the sharded optimizer and clipping (`optim`), and full state
//! dicts (`checkpoint`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use meshgrad_autograd::{Var, VarId};
use meshgrad_nn::optim::{Optimizer, ParamGroup};
use meshgrad_nn::Module;
use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{DType, Error, Result, Tensor};

use super::config::{ShardConfig, ZeroStage};
use super::gather::{GatherState, UnitOrder};
use super::optim::OptimizerFactory;
use super::plan::{ParamSpec, Segment, ShardPlan};
use super::topology::ShardTopology;
use crate::comm::Work;

/// The variable the optimizer updates for one segment this rank owns: a leaf over the
/// segment's elements of this rank's weights (the master shard, or without a separate master
/// the parameter's own elements), so an in-place update writes the real weights. It is named
/// after its parameter (a parameter has at most one segment per rank: it lies in one unit, and
/// a rank's shard of a unit is one contiguous range). Its gradient is set to the segment's
/// reduced gradient for the optimizer's step only.
pub(crate) struct ShardVar {
    pub(crate) unit: usize,
    pub(crate) seg: Segment,
    pub(crate) var: Var,
}

/// Everything one rank's wrapper shares with its hooks.
pub(crate) struct Inner {
    /// The optimizer's groups over the shard variables (what [`Optimizer::param_groups`]
    /// lends out; the optimizer itself sits behind the state's lock).
    pub(crate) groups: Vec<ParamGroup>,
    pub(crate) plan: ShardPlan,
    pub(crate) vars: Vec<Var>,
    pub(crate) index_of: HashMap<VarId, usize>,
    pub(crate) config: ShardConfig,
    pub(crate) topo: ShardTopology,
    /// The optimizer's variables, one per segment of this rank, in unit and segment order.
    pub(crate) shards: Vec<ShardVar>,
    /// Per parameter: its index in `shards`, if this rank owns some of it.
    pub(crate) shard_of: Vec<Option<usize>>,
    /// The order units' gradients are reduced in: reverse unit order (the order backward
    /// completes them in), the root unit last.
    pub(crate) launch_order: Vec<usize>,
    pub(crate) param_dtype: DType,
    pub(crate) reduce_dtype: DType,
    pub(crate) master_dtype: DType,
    /// This rank's index in the shard group.
    pub(crate) shard_rank: usize,
    pub(crate) sync: AtomicBool,
    pub(crate) state: Mutex<State>,
}

/// The mutable state of one rank.
pub(crate) struct State {
    // ----- the backward in progress -----
    /// Per parameter: its gradient arrived in this backward (since its unit was last launched).
    pub(crate) ready: Vec<bool>,
    /// Per unit: parameters whose gradient has not arrived yet.
    pub(crate) pending: Vec<usize>,
    /// Per unit: the flat gradient being assembled (reduce dtype).
    pub(crate) flats: Vec<Option<Tensor>>,
    /// Position in `launch_order` of the next unit to reduce.
    pub(crate) next_launch: usize,
    /// Per unit: reductions in flight, one per synchronised backward.
    pub(crate) works: Vec<Vec<Work>>,
    /// Per parameter: got a gradient on this rank since the last `finish`.
    pub(crate) had_grad: Vec<bool>,
    /// Reductions launched since the last `finish` from gradient-ready hooks (during backward)
    /// and by `finish` itself; and those counts for the last completed `finish`.
    pub(crate) launches: (usize, usize),
    pub(crate) last_launches: (usize, usize),
    // ----- the step -----
    /// Per unit: reduced gradients in the master dtype; ZeRO-1 the whole padded flat, ZeRO-2/3
    /// this rank's shard.
    pub(crate) grads: Vec<Option<Tensor>>,
    /// Per parameter: got a gradient on some rank (set by `finish`; the optimizer skips the rest).
    pub(crate) used: Vec<bool>,
    // ----- the optimizer -----
    /// Per unit: this rank's shard of the weights in the master dtype. ZeRO-3: always (it is
    /// the parameter storage between uses); ZeRO-1/2: only when the parameters have another
    /// dtype (otherwise the parameters' own elements are updated in place).
    pub(crate) master: Vec<Option<Tensor>>,
    /// The user's optimizer over the shard variables ([`Inner::shards`]); it owns the
    /// optimizer state (moments, momentum buffers, step counts) of this rank's shard.
    pub(crate) opt: Box<dyn Optimizer + Send>,
    // ----- ZeRO-3 -----
    /// Per unit: whether its full parameters are present, in flight, or released.
    pub(crate) gather: Vec<GatherState>,
    /// `summon_full_params` is in effect: every unit stays gathered.
    pub(crate) summoned: bool,
    /// Counters of the gathers so far.
    pub(crate) gather_stats: GatherStats,
    /// The recorded order of unit gathers, for prefetching.
    pub(crate) order: UnitOrder,
}

/// ZeRO-3 gather counters (see [`ShardedDataParallel::gather_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatherStats {
    /// Units made present from a prefetch launched earlier (communication overlapped).
    pub prefetched: usize,
    /// Units gathered on demand (launched and waited for at once).
    pub on_demand: usize,
    /// The most units whose full parameters were present at one time (in-flight prefetches
    /// not counted), outside `summon_full_params`: 1 when no op reads parameters of two units.
    pub max_gathered: usize,
}

pub(crate) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // Sections leave the state consistent; a panic elsewhere is reported by the launcher.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sharded data parallelism (ZeRO-1, ZeRO-2, ZeRO-3 / FSDP, hybrid) with any
/// [`meshgrad_nn::optim::Optimizer`] updating this rank's shard. See the
/// [module docs](crate::zero) for the semantics and the training loop.
pub struct ShardedDataParallel {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for ShardedDataParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = &self.inner;
        write!(
            f,
            "ShardedDataParallel({:?}, {} params in {} units, {:?})",
            i.config.stage,
            i.plan.params.len(),
            i.plan.units.len(),
            i.topo
        )
    }
}

impl ShardedDataParallel {
    /// Wraps `model` for sharded data parallelism over `topo`. `groups` must list every
    /// parameter of the model exactly once (e.g.
    /// [`meshgrad_nn::optim::param_groups_for_decay`]); `optimizer` builds the update rule
    /// ([`OptimizerFactory`]: an [`AdamWConfig`](meshgrad_nn::optim::AdamWConfig), an
    /// [`SgdConfig`](meshgrad_nn::optim::SgdConfig), or a closure building any optimizer) over
    /// the same groups with each parameter replaced by this rank's part of it (see the
    /// [module docs](crate::zero#optimizer)).
    ///
    /// Any [`Module`] can be wrapped: units are chosen by module path
    /// ([`ShardConfig::wrap`]), and ZeRO-3 needs nothing else from the model.
    ///
    /// Every rank of `topo.dp` must call it with the same model structure and configuration.
    /// It broadcasts the parameters from data-parallel rank 0 (unless
    /// [`ShardConfig::broadcast_params`] is off), builds the plan, registers a gradient-ready
    /// hook on every parameter and, for ZeRO-3, keeps only this rank's shard of each unit:
    /// the parameters' storage is released and given a materialiser that gathers their unit when
    /// an op first reads them (see the [module docs](crate::zero)). Run the model as usual while
    /// the wrapper is alive. A ZeRO-3 model cannot run after its wrapper is dropped (its
    /// parameters stay released, and reading them is an error saying so) unless
    /// [`ShardedDataParallel::summon_full_params`] was called first.
    pub fn new(
        model: &dyn Module,
        groups: Vec<ParamGroup>,
        optimizer: impl OptimizerFactory,
        topo: ShardTopology,
        config: ShardConfig,
    ) -> Result<Self> {
        let ctx = |e: Error| Error::msg(format!("sharded data parallel: {e}"));
        config.mixed_precision.validate().map_err(ctx)?;
        topo.validate().map_err(ctx)?;
        let all = model.named_parameters();
        let kept: Vec<bool> = all
            .iter()
            .map(|(n, _)| !config.ignored.contains(n))
            .collect();
        let named: Vec<(String, Var)> = all
            .into_iter()
            .zip(&kept)
            .filter_map(|(p, &k)| k.then_some(p))
            .collect();
        let mut seen: HashMap<VarId, &str> = HashMap::new();
        for (name, v) in &named {
            if let Some(first) = seen.insert(v.id(), name) {
                return Err(ctx(Error::msg(format!(
                    "parameter {first} is also reachable as {name}: a parameter shared by two \
                     modules cannot be sharded twice; keep it in one module and read it from \
                     there (as the GPT's tied head reads wte.weight)"
                ))));
            }
            if v.tensor().has_materializer() && !v.tensor().is_lazy() {
                return Err(ctx(Error::msg(format!(
                    "parameter {name} is already sharded by a ZeRO-3 ShardedDataParallel (is the \
                     model wrapped twice, or was its wrapper dropped without \
                     summon_full_params()?); wrap a model once"
                ))));
            }
        }
        let mut groups = groups;
        for g in &mut groups {
            g.params.retain(|(n, _)| !config.ignored.contains(n));
        }
        let group_of = assign_groups(&named, &mut groups).map_err(ctx)?;
        let param_dtype = named
            .first()
            .map(|(_, v)| v.tensor().dtype())
            .ok_or_else(|| ctx(Error::msg("the model has no parameters")))?;
        for (name, v) in &named {
            let t = v.tensor();
            if t.dtype() != param_dtype || !t.dtype().is_float() {
                return Err(ctx(Error::msg(format!(
                    "parameter {name} has dtype {}, but every parameter must share one float \
                     dtype ({} for {})",
                    t.dtype(),
                    param_dtype,
                    named[0].0
                ))));
            }
            if !t.is_contiguous()
                || t.layout().offset() != 0
                || !(t.is_materialized() || t.is_lazy())
            {
                return Err(ctx(Error::msg(format!(
                    "parameter {name} (shape {}) must be a whole, contiguous, materialised (or \
                     delayed-initialisation) tensor",
                    t.shape()
                ))));
            }
        }
        let (unit_names, unit_of) = config.wrap.assign(model).map_err(ctx)?;
        let (unit_names, unit_of) = without_ignored(unit_names, unit_of, &kept);
        let specs = named
            .iter()
            .enumerate()
            .map(|(i, (n, v))| ParamSpec {
                name: n.clone(),
                shape: v.tensor().dims().to_vec(),
                unit: unit_of[i],
                group: group_of[i],
            })
            .collect();
        let plan = ShardPlan::new(specs, unit_names, topo.shard_degree()).map_err(ctx)?;
        let vars: Vec<Var> = named.into_iter().map(|(_, v)| v).collect();
        if config.broadcast_params {
            broadcast_params(&plan, &vars, &topo)?;
        }
        let n_units = plan.units.len();
        let mut launch_order: Vec<usize> = (0..n_units).rev().collect();
        if let Some(pos) = plan.units.iter().position(|u| u.name == "root") {
            launch_order.retain(|&u| u != pos);
            launch_order.push(pos);
        }
        let mp = config.mixed_precision;
        let shard_rank = topo.shard.rank();
        let master_dtype = mp.master_dtype;
        let separate_master = config.stage == ZeroStage::Three || param_dtype != master_dtype;
        let master = if separate_master {
            // ZeRO-3: the shards are the parameters' storage between uses.
            let tag = if config.stage == ZeroStage::Three {
                MemoryTag::Params
            } else {
                MemoryTag::OptimizerState
            };
            (0..n_units)
                .map(|u| {
                    let shard = params_shard(&plan, &vars, shard_rank, param_dtype, u)?;
                    if config.stage == ZeroStage::Three {
                        // Released unit by unit (not all at the end), so delayed-initialisation
                        // parameters are whole one unit at a time.
                        for &pi in &plan.units[u].params {
                            vars[pi].tensor().release_storage();
                        }
                    }
                    with_tag(tag, || shard.to_dtype(master_dtype)?.deep_clone()).map(Some)
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            vec![None; n_units]
        };
        let (shards, opt_groups) = shard_vars(&plan, &vars, &master, shard_rank, &groups)?;
        let mut shard_of = vec![None; plan.params.len()];
        for (k, sv) in shards.iter().enumerate() {
            shard_of[sv.seg.param] = Some(k);
        }
        let groups = opt_groups.clone();
        let opt = optimizer
            .build(opt_groups)
            .map_err(|e| ctx(Error::msg(format!("building the optimizer: {e}"))))?;
        let inner = Inner {
            groups,
            index_of: vars.iter().enumerate().map(|(i, v)| (v.id(), i)).collect(),
            vars,
            shards,
            shard_of,
            launch_order,
            param_dtype,
            reduce_dtype: mp.reduce_dtype.unwrap_or(param_dtype),
            master_dtype,
            shard_rank,
            sync: AtomicBool::new(true),
            state: Mutex::new(State {
                ready: vec![false; plan.params.len()],
                pending: plan.units.iter().map(|u| u.params.len()).collect(),
                flats: vec![None; n_units],
                next_launch: 0,
                works: (0..n_units).map(|_| Vec::new()).collect(),
                had_grad: vec![false; plan.params.len()],
                launches: (0, 0),
                last_launches: (0, 0),
                grads: vec![None; n_units],
                used: vec![false; plan.params.len()],
                master,
                opt,
                gather: (0..n_units).map(|_| GatherState::Gathered).collect(),
                summoned: false,
                gather_stats: GatherStats::default(),
                order: UnitOrder::new(registration_order(&plan)),
            }),
            plan,
            config,
            topo,
        };
        let inner = Arc::new(inner);
        for v in &inner.vars {
            let weak: Weak<Inner> = Arc::downgrade(&inner);
            v.register_grad_ready_hook(Arc::new(move |v: &Var| match weak.upgrade() {
                Some(i) => i.grad_ready(v),
                None => Ok(()),
            }));
        }
        if inner.config.stage == ZeroStage::Three {
            let mut st = lock(&inner.state);
            for u in 0..n_units {
                for v in inner.plan.units[u].params.iter().map(|&pi| &inner.vars[pi]) {
                    v.tensor().release_storage();
                    v.tensor()
                        .set_materializer(Some(Inner::materializer(&inner, u)));
                }
                st.gather[u] = GatherState::Released;
            }
        }
        Ok(ShardedDataParallel { inner })
    }

    /// The strategy.
    pub fn stage(&self) -> ZeroStage {
        self.inner.config.stage
    }

    /// The configuration.
    pub fn config(&self) -> &ShardConfig {
        &self.inner.config
    }

    /// The process groups.
    pub fn topology(&self) -> &ShardTopology {
        &self.inner.topo
    }

    /// The sharding plan (units, parameters, segments).
    pub fn plan(&self) -> &ShardPlan {
        &self.inner.plan
    }

    /// This rank's index in the shard group.
    pub fn shard_rank(&self) -> usize {
        self.inner.shard_rank
    }

    /// Whether the next backward reduces gradients (see [`ShardedDataParallel::set_sync`]).
    pub fn is_sync(&self) -> bool {
        self.inner.sync.load(Ordering::SeqCst)
    }

    /// Turns gradient reduction on or off for the following backward passes. Off (the
    /// non-final micro-batches of gradient accumulation), gradients accumulate locally in the
    /// parameters' `.grad` at full size and are reduced by the next synchronised backward;
    /// on (the default), every backward reduces its gradients unit by unit as they become ready
    /// and keeps only the reduced shard, the memory-lean choice.
    pub fn set_sync(&self, on: bool) {
        self.inner.sync.store(on, Ordering::SeqCst);
    }

    /// How many unit reductions the last [`ShardedDataParallel::finish`] completed that were
    /// launched during backward (from gradient-ready hooks, overlapping the rest of backward),
    /// and how many `finish` had to launch itself.
    pub fn last_reduction_launches(&self) -> (usize, usize) {
        lock(&self.inner.state).last_launches
    }

    /// ZeRO-3 gather counters since the wrapper was built (zero for ZeRO-1/2).
    pub fn gather_stats(&self) -> GatherStats {
        lock(&self.inner.state).gather_stats
    }

    /// Completed optimizer steps (the optimizer's [`Optimizer::step_count`]).
    pub fn step_count(&self) -> u64 {
        lock(&self.inner.state).opt.step_count()
    }

    /// Drops the reduced gradients (and any local `.grad`), before the next step's backward.
    pub fn zero_grad(&self) {
        let mut st = lock(&self.inner.state);
        st.grads.iter_mut().for_each(|g| *g = None);
        st.used.iter_mut().for_each(|u| *u = false);
        for v in &self.inner.vars {
            v.zero_grad();
        }
    }
}

impl Drop for ShardedDataParallel {
    /// ZeRO-3: a summoned model keeps its full parameters and becomes a plain model again (its
    /// materialisers are removed); otherwise every unit is released, and reading a parameter
    /// is an error that says the wrapper was dropped.
    fn drop(&mut self) {
        let i = &self.inner;
        if i.config.stage != ZeroStage::Three {
            return;
        }
        let mut st = lock(&i.state);
        if st.summoned {
            for v in &i.vars {
                v.tensor().set_materializer(None);
            }
        } else {
            i.release_all(&mut st);
        }
    }
}

/// The units in the order of their first parameter: the guess of the first forward's order.
fn registration_order(plan: &ShardPlan) -> Vec<usize> {
    let mut units: Vec<usize> = (0..plan.units.len()).collect();
    units.sort_by_key(|&u| plan.units[u].params.iter().min().copied());
    units
}

impl Inner {
    /// The parameter's index in the plan and its name, for a var.
    pub(crate) fn param_index(&self, v: &Var) -> Option<usize> {
        self.index_of.get(&v.id()).copied()
    }

    /// This rank's shard of unit `u` read from the (materialised) parameters, in their dtype;
    /// padding is zero.
    pub(crate) fn shard_from_params(&self, u: usize) -> Result<Tensor> {
        params_shard(&self.plan, &self.vars, self.shard_rank, self.param_dtype, u)
    }
}

/// Rank `rank`'s shard of unit `u` read from the (materialised) parameters `vars`, in `dtype`
/// (theirs); padding is zero.
fn params_shard(
    plan: &ShardPlan,
    vars: &[Var],
    rank: usize,
    dtype: DType,
    u: usize,
) -> Result<Tensor> {
    let shard = Tensor::zeros(plan.units[u].shard_len, dtype, meshgrad_tensor::Device::Cpu)?;
    for s in plan.segments(u, rank) {
        shard
            .narrow(0, s.shard_offset, s.len())?
            .copy_from(&param_segment(plan, vars, &s)?)?;
    }
    Ok(shard)
}

/// Segment `s`'s elements of its parameter (a view).
fn param_segment(plan: &ShardPlan, vars: &[Var], s: &Segment) -> Result<Tensor> {
    let p = &plan.params[s.param];
    vars[s.param]
        .tensor()
        .reshape(p.numel)?
        .narrow(0, s.param_range.start, s.len())
}

/// The shard variables of rank `rank` (see [`ShardVar`]) over the weights it updates, `master`
/// or (units without one) the parameters, and the user's `groups` with each parameter replaced
/// by its shard variable (parameters this rank owns none of are left out; a group may end up
/// empty).
fn shard_vars(
    plan: &ShardPlan,
    vars: &[Var],
    master: &[Option<Tensor>],
    rank: usize,
    groups: &[ParamGroup],
) -> Result<(Vec<ShardVar>, Vec<ParamGroup>)> {
    let mut out_groups: Vec<ParamGroup> = groups
        .iter()
        .map(|g| ParamGroup {
            params: Vec::new(),
            weight_decay: g.weight_decay,
            lr_scale: g.lr_scale,
        })
        .collect();
    let mut shards = Vec::new();
    for (u, m) in master.iter().enumerate() {
        for seg in plan.segments(u, rank) {
            let weights = match m {
                Some(m) => m.narrow(0, seg.shard_offset, seg.len())?,
                None => param_segment(plan, vars, &seg)?,
            };
            let var = Var::leaf(weights);
            let p = &plan.params[seg.param];
            out_groups[p.group]
                .params
                .push((p.name.clone(), var.clone()));
            shards.push(ShardVar { unit: u, seg, var });
        }
    }
    Ok((shards, out_groups))
}

/// Maps every model parameter to its group; checks the groups against the model.
/// The optimizer group of every parameter of `named`. A frozen parameter (see
/// `Module::freeze`) that no group lists goes into an extra group appended to `groups`: it is
/// sharded like the others but never gets a gradient, so the optimizer never updates it.
/// The units of the kept parameters (`kept[i]` for the model's parameter `i`): `unit_of`
/// restricted to them, units left empty dropped and the rest renumbered in order.
pub(crate) fn without_ignored(
    unit_names: Vec<String>,
    unit_of: Vec<usize>,
    kept: &[bool],
) -> (Vec<String>, Vec<usize>) {
    let of: Vec<usize> = unit_of
        .into_iter()
        .zip(kept)
        .filter_map(|(u, &k)| k.then_some(u))
        .collect();
    let mut renumber = vec![None; unit_names.len()];
    let mut names = Vec::new();
    for (u, name) in unit_names.into_iter().enumerate() {
        if of.contains(&u) {
            renumber[u] = Some(names.len());
            names.push(name);
        }
    }
    let of = of
        .into_iter()
        .map(|u| renumber[u].expect("a kept parameter's unit is kept"))
        .collect();
    (names, of)
}

fn assign_groups(named: &[(String, Var)], groups: &mut Vec<ParamGroup>) -> Result<Vec<usize>> {
    let mut of: HashMap<VarId, usize> = HashMap::new();
    let model_ids: HashMap<VarId, &str> = named.iter().map(|(n, v)| (v.id(), n.as_str())).collect();
    for (gi, g) in groups.iter().enumerate() {
        for (what, x) in [("weight_decay", g.weight_decay), ("lr_scale", g.lr_scale)] {
            if !x.is_finite() || x < 0.0 {
                meshgrad_tensor::bail!(
                    "optimizer group {gi} has {what} {x}; it must be finite and >= 0"
                );
            }
        }
        for (name, v) in &g.params {
            if !model_ids.contains_key(&v.id()) {
                meshgrad_tensor::bail!(
                    "optimizer group {gi} lists {name}, which is not a parameter of the model"
                );
            }
            if let Some(prev) = of.insert(v.id(), gi) {
                meshgrad_tensor::bail!(
                    "parameter {name} is in optimizer groups {prev} and {gi}; list it once"
                );
            }
        }
    }
    let mut out = Vec::with_capacity(named.len());
    let mut frozen_group = None;
    for (name, v) in named {
        match of.get(&v.id()) {
            Some(&g) => out.push(g),
            None if !v.requires_grad() => {
                let g = *frozen_group.get_or_insert_with(|| {
                    groups.push(ParamGroup::new(Vec::new(), 0.0));
                    groups.len() - 1
                });
                out.push(g);
            }
            None => meshgrad_tensor::bail!(
                "parameter {name} is in no optimizer group; every trainable parameter must be in \
                 one"
            ),
        }
    }
    Ok(out)
}

/// Copies every parameter's values from data-parallel rank 0.
fn broadcast_params(plan: &ShardPlan, vars: &[Var], topo: &ShardTopology) -> Result<()> {
    let dp = topo.dp.as_ref();
    if dp.world_size() == 1 {
        return Ok(());
    }
    // Delayed-initialisation parameters get the same values on every rank (they are drawn from
    // the seed and their names), so they are not read, let alone sent.
    let eager: Vec<(&crate::zero::plan::PlanParam, &Var)> = plan
        .params
        .iter()
        .zip(vars)
        .filter(|(_, v)| !v.tensor().is_lazy())
        .collect();
    let works: Vec<Work> = eager
        .iter()
        .map(|(_, v)| dp.broadcast(v.tensor(), 0))
        .collect::<Result<_>>()?;
    for ((p, v), w) in eager.into_iter().zip(works) {
        let t = w.wait().map_err(|e| {
            Error::msg(format!(
                "sharded data parallel: broadcasting parameter {}: {e}",
                p.name
            ))
        })?;
        if dp.rank() != 0 {
            v.tensor().copy_from(&t)?;
        }
    }
    Ok(())
}

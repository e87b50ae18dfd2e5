//! [`ParamBuilder`]: creating a model's parameters by shape and [`Init`], then initialising
//! each one by its full name (eagerly, delayed until first use, or as this rank's part under
//! tensor parallelism), from the run seed or from given [`InitialValues`] (fine-tuning).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use meshgrad_autograd::Var;
use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{DType, Device, Random, Result, Shape, Tensor};

use crate::cp::ContextParallel;
use crate::module::{name_seed, Module};
use crate::tp::{Placement, TensorParallel, TpPlan};

/// How a new parameter is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Normal with mean 0 and this standard deviation.
    Normal(f64),
    /// Uniform in `[-a, a)`.
    Uniform(f64),
}

impl Init {
    /// The values of parameter `name` of `shape` for run seed `seed`.
    fn values(
        self,
        seed: u64,
        name: &str,
        shape: Shape,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let s = name_seed(seed, name);
        match self {
            Init::Zeros => Tensor::zeros(shape, dtype, device),
            Init::Ones => Tensor::ones(shape, dtype, device),
            Init::Normal(std) => Random::new(s)
                .dtype(dtype)
                .device(device)
                .normal(shape, 0.0, std),
            Init::Uniform(a) => Random::new(s)
                .dtype(dtype)
                .device(device)
                .uniform(shape, -a, a),
        }
    }

    /// This rank's part (`placement`, local shape `local`) of the values of parameter `name`:
    /// element for element the slice of [`Init::values`] of the full shape, drawn by global
    /// index without creating the full tensor.
    fn shard_values(
        self,
        seed: u64,
        name: &str,
        placement: &Placement,
        local: &[usize],
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        if matches!(self, Init::Zeros | Init::Ones) {
            return self.values(seed, name, local.into(), dtype, device);
        }
        let global = placement.global_dims(local);
        let d = placement.dim;
        let outer: usize = global[..d].iter().product();
        let inner: usize = global[d + 1..].iter().product();
        let ranges = placement.ranges(global[d], placement.index());
        let s = name_seed(seed, name);
        let mut runs = Vec::with_capacity(outer * ranges.len());
        for o in 0..outer {
            for r in &ranges {
                let start = (o * global[d] + r.start) * inner;
                let rng = Random::new(s).offset(start as u64).dtype(dtype);
                let n = r.len() * inner;
                runs.push(match self {
                    Init::Normal(std) => rng.normal(n, 0.0, std)?,
                    Init::Uniform(a) => rng.uniform(n, -a, a)?,
                    Init::Zeros | Init::Ones => unreachable!("handled above"),
                });
            }
        }
        let refs: Vec<&Tensor> = runs.iter().collect();
        Tensor::cat(&refs, 0)?
            .reshape(local.to_vec())?
            .to_device(device)
    }
}

/// The values a model starts from instead of its [`Init`]s (pretrained weights): every
/// parameter's whole tensor under its full name, as the single-device model names and shapes it.
/// Each rank copies out its own part (its tensor-parallel slice; under delayed initialisation
/// when the parameter is first used).
pub type InitialValues = HashMap<String, Tensor>;

/// This rank's part of `full` under `placement` ([`Placement::shard_of`]), or `full` itself
/// without one; checked against the parameter's `local` shape and cast to its dtype and device.
fn part_of(
    name: &str,
    full: &Tensor,
    placement: Option<&Placement>,
    local: &[usize],
    dtype: DType,
    device: Device,
) -> Result<Tensor> {
    let global = placement.map_or_else(|| local.to_vec(), |p| p.global_dims(local));
    if full.dims() != global.as_slice() {
        meshgrad_tensor::bail!(
            "initial values: {name} has shape {} but the model's parameter is {global:?}",
            full.shape()
        );
    }
    let part = match placement {
        None => full.clone(),
        Some(p) => p.shard_of(full)?,
    };
    part.to_dtype(dtype)?.to_device(device)?.contiguous()
}

/// Creates a model's parameters and initialises each one by its full name.
///
/// Layers take `&ParamBuilder` and create their parameters with [`ParamBuilder::param`],
/// giving only a shape and an [`Init`]; names come later from the model tree. [`ParamBuilder::init`]
/// (or [`ParamBuilder::build`], which calls it) then walks the finished model, fills every
/// parameter from the stream `(seed, full name)` — so a parameter's initial values depend only on
/// the run seed and its name, never on creation order or on how it is sharded — calls
/// [`Module::on_init`] on every module, and checks that every parameter it created is reachable
/// from the model (a field whose type does not derive `Module` would otherwise be silently left
/// out of training).
pub struct ParamBuilder {
    seed: u64,
    dtype: DType,
    device: Device,
    created: Mutex<Vec<(Var, Init)>>,
    initialised: std::sync::atomic::AtomicBool,
    /// A meta build: parameters get shapes but no storage (to learn names before allocating).
    meta: bool,
    /// Delayed initialisation: parameters are allocated and filled on first use.
    delayed: bool,
    /// Tensor parallelism: the group and the plan.
    tp: Option<(TensorParallel, TpPlan)>,
    /// Under a plan, the placement of the n-th parameter created (from the meta build).
    splits: Mutex<Vec<Option<Placement>>>,
    /// Values to start from instead of the [`Init`]s.
    initial: Option<Arc<InitialValues>>,
    /// Context parallelism: the group the model's layers split sequences over.
    cp: Option<ContextParallel>,
    /// Expert parallelism: the group a mixture of experts' experts are sharded over.
    ep: Option<crate::moe::ExpertParallel>,
}

impl std::fmt::Debug for ParamBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ParamBuilder(seed={}, {}, {:?}, {} params)",
            self.seed,
            self.dtype,
            self.device,
            self.created().len()
        )
    }
}

impl ParamBuilder {
    /// A builder for f32 parameters on the CPU with run seed `seed`.
    pub fn new(seed: u64) -> Self {
        ParamBuilder {
            seed,
            dtype: DType::F32,
            device: Device::Cpu,
            created: Mutex::new(Vec::new()),
            initialised: std::sync::atomic::AtomicBool::new(false),
            meta: false,
            delayed: false,
            tp: None,
            splits: Mutex::new(Vec::new()),
            initial: None,
            cp: None,
            ep: None,
        }
    }

    /// Delayed parameter initialisation: no parameter is allocated when the model is built; each
    /// gets its values (the same as without delay) when an op first uses it
    /// ([`Tensor::set_lazy_values`]). A sharding wrapper (ZeRO-3 / FSDP) then reads one parameter
    /// at a time to cut its shard and releases it, so a model larger than one rank's memory can
    /// start. (SageMaker's model-parallel library calls this delayed parameter initialisation.)
    pub fn delayed_init(mut self) -> Self {
        self.delayed = true;
        self
    }

    /// Fills every parameter from `values` (by full name) instead of its [`Init`]: fine-tuning
    /// from pretrained weights. [`ParamBuilder::init`] fails in one line when a parameter is
    /// missing from `values` or has another shape there.
    pub fn initial_values(mut self, values: Arc<InitialValues>) -> Self {
        self.initial = Some(values);
        self
    }

    /// Builds the model tensor-parallel over `tp` as `plan` says (see [`crate::tp`]): each
    /// parameter the plan splits is created at its local shape only, filled with the values of
    /// its slice of the single-device parameter, and records its [`Placement`]; the matched
    /// modules get their styles. The model function runs twice (first without allocating
    /// anything, to learn the parameters' names), so it must be deterministic.
    pub fn tensor_parallel(mut self, tp: TensorParallel, plan: TpPlan) -> Self {
        self.tp = Some((tp, plan));
        self
    }

    /// The tensor parallelism this builder builds for, if any (so a model can check that its
    /// sizes split before building).
    pub fn tensor_parallel_group(&self) -> Option<&TensorParallel> {
        self.tp.as_ref().map(|(tp, _)| tp)
    }

    /// Builds the model context-parallel over `cp` (see [`crate::cp`]): its attention layers run
    /// ring attention over the group and its position encodings read global positions. Creates
    /// no parameter differently.
    pub fn context_parallel(mut self, cp: ContextParallel) -> Self {
        self.cp = Some(cp);
        self
    }

    /// The context parallelism this builder builds for, if any (layers keep it).
    pub fn context_parallel_group(&self) -> Option<&ContextParallel> {
        self.cp.as_ref()
    }

    /// Builds the model expert-parallel over `ep` (see [`crate::moe::ep`]): each mixture of
    /// experts creates only this rank's block of its experts (under their global names) and
    /// moves tokens to them with all-to-alls.
    pub fn expert_parallel(mut self, ep: crate::moe::ExpertParallel) -> Self {
        self.ep = Some(ep);
        self
    }

    /// The expert parallelism this builder builds for, if any.
    pub fn expert_parallel_group(&self) -> Option<&crate::moe::ExpertParallel> {
        self.ep.as_ref()
    }

    /// Sets the parameter dtype.
    pub fn dtype(mut self, dtype: DType) -> Self {
        self.dtype = dtype;
        self
    }

    /// Sets the parameter device.
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// The run seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The parameter dtype.
    pub fn param_dtype(&self) -> DType {
        self.dtype
    }

    /// The parameter device.
    pub fn param_device(&self) -> Device {
        self.device
    }

    fn created(&self) -> std::sync::MutexGuard<'_, Vec<(Var, Init)>> {
        self.created.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A new parameter of `shape`, filled by `init` when [`ParamBuilder::init`] names it. Counted
    /// as parameter memory.
    pub fn param(&self, shape: impl Into<Shape>, init: Init) -> Result<Var> {
        let shape = shape.into();
        if self.meta {
            let v = Var::leaf(Tensor::unallocated(shape, self.dtype, self.device));
            self.created().push((v.clone(), init));
            return Ok(v);
        }
        let index = self.created().len();
        let split = self
            .splits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(index)
            .cloned()
            .flatten();
        let local: Shape = match &split {
            Some(p) => p.local_dims(shape.dims())?.into(),
            None => shape,
        };
        let t = if self.delayed {
            Tensor::unallocated(local, self.dtype, self.device)
        } else {
            with_tag(MemoryTag::Params, || {
                Tensor::zeros(local, self.dtype, self.device)
            })?
        };
        let v = Var::leaf(t);
        v.set_placement(split);
        self.created().push((v.clone(), init));
        Ok(v)
    }

    /// Builds a model with `f` and initialises it ([`ParamBuilder::init`]).
    pub fn build<M: Module>(self, f: impl Fn(&ParamBuilder) -> Result<M>) -> Result<M> {
        if let Some((tp, plan)) = &self.tp {
            let splits = self.plan_splits(&f, tp, plan)?;
            *self.splits.lock().unwrap_or_else(|e| e.into_inner()) = splits;
        }
        let m = f(&self)?;
        self.init(&m)?;
        if let Some((tp, plan)) = &self.tp {
            plan.apply(&m, tp)?;
        }
        Ok(m)
    }

    /// Runs `f` once without allocating to learn each parameter's name, and returns the
    /// placement the plan gives the n-th parameter created (checking that its shape splits).
    fn plan_splits<M: Module>(
        &self,
        f: &impl Fn(&ParamBuilder) -> Result<M>,
        tp: &TensorParallel,
        plan: &TpPlan,
    ) -> Result<Vec<Option<Placement>>> {
        let mut meta = ParamBuilder::new(self.seed)
            .dtype(self.dtype)
            .device(self.device);
        meta.meta = true;
        meta.ep = self.ep.clone();
        let model = f(&meta)?;
        meta.initialised
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let styles = plan.resolve(&model)?;
        let names: std::collections::HashMap<meshgrad_autograd::VarId, String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, v)| (v.id(), n))
            .collect();
        let created = std::mem::take(&mut *meta.created());
        created
            .iter()
            .map(|(v, _)| {
                let Some(name) = names.get(&v.id()) else {
                    return Ok(None);
                };
                let Some((dim, chunks)) = TpPlan::split_of(&styles, name) else {
                    return Ok(None);
                };
                let p = tp.placement(dim, chunks);
                p.local_dims(v.tensor().dims()).map_err(|e| {
                    meshgrad_tensor::Error::msg(format!(
                        "tensor parallelism over {} ranks: parameter {name}: {e}",
                        tp.degree()
                    ))
                })?;
                Ok(Some(p))
            })
            .collect()
    }

    /// Fills every parameter this builder created from `(seed, full name)` by its [`Init`], calls
    /// [`Module::on_init`] on every module of `model`, and checks that every created parameter
    /// is reachable from `model` exactly once under one name.
    pub fn init<M: Module + ?Sized>(&self, model: &M) -> Result<()> {
        self.initialised
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let created = std::mem::take(&mut *self.created());
        let mut index: std::collections::HashMap<meshgrad_autograd::VarId, usize> = created
            .iter()
            .enumerate()
            .map(|(i, (v, _))| (v.id(), i))
            .collect();
        let mut named: Vec<(String, Var, Init)> = Vec::with_capacity(created.len());
        for (name, v) in model.named_parameters() {
            if let Some(i) = index.remove(&v.id()) {
                named.push((name, v, created[i].1));
            }
        }
        if !index.is_empty() {
            let mut lost: Vec<usize> = index.into_values().collect();
            lost.sort_unstable();
            let shapes: Vec<String> = lost
                .iter()
                .map(|&i| created[i].0.tensor().shape().to_string())
                .collect();
            meshgrad_tensor::bail!(
                "ParamBuilder::init: {} parameter(s) created for this {} are not reachable \
                 through its fields (shapes {}): a field holding them is skipped; does its type \
                 derive Module (or is it marked #[module(skip)])?",
                lost.len(),
                model.module_type(),
                shapes.join(", ")
            );
        }
        if let Some(values) = &self.initial {
            let missing: Vec<&str> = named
                .iter()
                .filter(|(n, _, _)| !values.contains_key(n))
                .map(|(n, _, _)| n.as_str())
                .collect();
            if !missing.is_empty() {
                meshgrad_tensor::bail!(
                    "initial values: no tensor for {} parameter(s) of this {}: {}",
                    missing.len(),
                    model.module_type(),
                    missing.join(", ")
                );
            }
        }
        with_tag(MemoryTag::Params, || -> Result<()> {
            for (name, v, init) in &named {
                if let Some(values) = &self.initial {
                    let (values, name) = (values.clone(), name.clone());
                    let (t, placement) = (v.tensor(), v.placement());
                    let (dims, dtype, device) = (t.dims().to_vec(), t.dtype(), t.device());
                    let part = move || {
                        part_of(
                            &name,
                            &values[&name],
                            placement.as_ref(),
                            &dims,
                            dtype,
                            device,
                        )
                    };
                    if self.delayed {
                        t.set_lazy_values(part)?;
                    } else {
                        t.copy_from(&part()?)?;
                    }
                    continue;
                }
                if self.delayed {
                    let (init, seed, name) = (*init, self.seed, name.clone());
                    let (t, placement) = (v.tensor(), v.placement());
                    let (dims, dtype, device) = (t.dims().to_vec(), t.dtype(), t.device());
                    t.set_lazy_values(move || match &placement {
                        Some(p) => init.shard_values(seed, &name, p, &dims, dtype, device),
                        None => init.values(seed, &name, dims.clone().into(), dtype, device),
                    })?;
                    continue;
                }
                if matches!(init, Init::Zeros) {
                    continue;
                }
                let t = v.tensor();
                let vals = match v.placement() {
                    Some(p) => {
                        init.shard_values(self.seed, name, &p, t.dims(), t.dtype(), t.device())?
                    }
                    None => {
                        init.values(self.seed, name, t.shape().clone(), t.dtype(), t.device())?
                    }
                };
                t.copy_from(&vals)?;
            }
            Ok(())
        })?;
        let seed = self.seed;
        model.visit_modules("", &mut |path, m| m.on_init(path, seed));
        Ok(())
    }
}

impl Drop for ParamBuilder {
    fn drop(&mut self) {
        let n = self.created().len();
        if n > 0 && !self.initialised.load(std::sync::atomic::Ordering::Relaxed) {
            eprintln!(
                "meshgrad: warning: {n} parameter(s) were created by a ParamBuilder that was \
                 dropped without init(&model); they hold zeros (use ParamBuilder::build or init)"
            );
        }
    }
}

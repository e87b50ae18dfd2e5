//! AdamW (decoupled weight decay), as PyTorch's `torch.optim.AdamW`.

use std::collections::{HashMap, HashSet};

use meshgrad_autograd::{no_grad, Var};
use meshgrad_tensor::{AdamWStep, DType, Result, Tensor};

use super::{
    counter_tensor, ctx_err, kernel_grad, read_counter, state_copy_as, state_zeros_as,
    validate_groups, validate_lr, Optimizer, ParamGroup, StateKind,
};

/// AdamW hyper-parameters shared by all groups (weight decay is per group).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// First-moment decay (PyTorch default 0.9).
    pub beta1: f64,
    /// Second-moment decay (PyTorch default 0.999; GPT training often uses 0.95).
    pub beta2: f64,
    /// Denominator epsilon (PyTorch default 1e-8).
    pub eps: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }
}

impl AdamWConfig {
    /// Checks `0 <= beta < 1` and `eps >= 0` (all finite).
    pub fn validate(&self) -> Result<()> {
        for (n, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                meshgrad_tensor::bail!("adamw: {n} = {b} must be in [0, 1)");
            }
        }
        if !self.eps.is_finite() || self.eps < 0.0 {
            meshgrad_tensor::bail!("adamw: eps = {} must be finite and >= 0", self.eps);
        }
        Ok(())
    }
}

/// The state of one parameter: moments and its own step count (PyTorch keeps one per parameter,
/// so a parameter that skipped steps for lack of a gradient gets its own bias correction), and
/// for a half-precision parameter its f32 master copy.
#[derive(Clone, Debug)]
struct AdamState {
    m: Tensor,
    v: Tensor,
    step: u64,
    master: Option<Tensor>,
}

/// Whether parameter `p` is kept with an f32 master copy (bf16 and f16 parameters).
fn is_half(p: &Var) -> bool {
    matches!(p.tensor().dtype(), DType::BF16 | DType::F16)
}

/// The dtype of `p`'s optimizer state: f32 for half-precision parameters, else the parameter's.
fn state_dtype(p: &Var) -> DType {
    if is_half(p) {
        DType::F32
    } else {
        p.tensor().dtype()
    }
}

/// AdamW with PyTorch semantics. For each parameter `p` with gradient `g`, step `t` (counted per
/// parameter from 1), group learning rate `lr = base_lr * lr_scale` and weight decay `wd`:
///
/// ```text
/// p -= lr * wd * p                        (decoupled decay, before the Adam update)
/// m  = beta1 * m + (1 - beta1) * g
/// v  = beta2 * v + (1 - beta2) * g²
/// p -= lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
/// ```
///
/// The update is the fused kernel [`Tensor::adamw_step_`] over each parameter's flat buffer, run
/// under `no_grad`. Moments are created (zero) at a parameter's first step and are charged to
/// `MemoryTag::OptimizerState`.
///
/// # Mixed precision (master weights)
///
/// A parameter in f32 or f64 is updated in place and its moments have its dtype. A parameter in
/// bf16 or f16 (the model built in half precision: forward and backward run in it) gets an
/// **f32 master copy**, made from the parameter at its first step (or loaded from a checkpoint),
/// and f32 moments: each step casts the gradient to f32 (multiplied by the step's gradient
/// multiplier, see [`AdamW::step_scaled`]), updates the master with the same kernel, and writes
/// the master rounded to the parameter's dtype back into the parameter. The rounding error of
/// small updates thus accumulates in the master, never in the half-precision weights. The
/// master is charged to `MemoryTag::OptimizerState` with the moments.
///
/// State-dict names: `adamw.step_count` (completed `step` calls), and for every parameter that
/// has state, `adamw.m.<name>`, `adamw.v.<name>` and `adamw.step.<name>` (one-element i64), and
/// for a half-precision parameter `adamw.master.<name>` (f32, the parameter's shape).
/// [`Optimizer::load_state_dict`] of a half-precision parameter without a saved master makes
/// one from the parameter; an f32 or f64 parameter given a master (a half-precision run's
/// state resumed where the optimizer updates f32 copies, as ZeRO's master shards) takes the
/// master's values, which are the run's exact weights.
pub struct AdamW {
    config: AdamWConfig,
    groups: Vec<ParamGroup>,
    state: Vec<Vec<Option<AdamState>>>,
    step_count: u64,
}

impl AdamW {
    /// An optimizer over `groups` (parameter names must be unique across groups).
    pub fn new(groups: Vec<ParamGroup>, config: AdamWConfig) -> Result<Self> {
        config.validate()?;
        validate_groups("adamw", &groups)?;
        let state = groups.iter().map(|g| vec![None; g.params.len()]).collect();
        Ok(AdamW {
            config,
            groups,
            state,
            step_count: 0,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// The first and second moments and the step count of parameter `name`, once it has state.
    pub fn moments(&self, name: &str) -> Option<(Tensor, Tensor, u64)> {
        self.find(name)
            .and_then(|(gi, pi)| self.state[gi][pi].as_ref())
            .map(|s| (s.m.clone(), s.v.clone(), s.step))
    }

    /// The f32 master copy of half-precision parameter `name`, once it has state (`None` for
    /// f32 and f64 parameters, which are updated in place).
    pub fn master(&self, name: &str) -> Option<Tensor> {
        self.find(name)
            .and_then(|(gi, pi)| self.state[gi][pi].as_ref())
            .and_then(|s| s.master.clone())
    }

    /// [`Optimizer::step`] with every gradient multiplied by `grad_mul` (in the state's dtype,
    /// f32 for half-precision parameters, after the cast) before the update. Mixed-precision
    /// training passes `clip_coef / loss_scale` here, so unscaling the f16 loss scale and
    /// gradient clipping act on the f32 gradients and the half-precision gradients are never
    /// rewritten. `grad_mul` must be finite and > 0; 1 is exactly [`Optimizer::step`].
    pub fn step_scaled(&mut self, lr: f64, grad_mul: f64) -> Result<()> {
        validate_lr("adamw", lr)?;
        if !grad_mul.is_finite() || grad_mul <= 0.0 {
            meshgrad_tensor::bail!("adamw: gradient multiplier {grad_mul} must be finite and > 0");
        }
        let c = self.config;
        no_grad(|| {
            // Gather every update first (creating state as needed), then run them all in one
            // multi-tensor call; step counts advance only for the updates that succeeded.
            let mut work: Vec<(&str, &Var, Tensor, Tensor, &mut AdamState, AdamWStep)> = Vec::new();
            for (group, states) in self.groups.iter().zip(self.state.iter_mut()) {
                for ((name, p), slot) in group.params.iter().zip(states.iter_mut()) {
                    let Some(g) = p.grad() else { continue };
                    let prep = |slot: &mut Option<AdamState>| -> Result<Tensor> {
                        let dt = state_dtype(p);
                        let mut g = kernel_grad(p, &g)?;
                        if g.dtype() != dt {
                            g = g.to_dtype(dt)?;
                        }
                        if grad_mul != 1.0 {
                            g = g.mul_scalar(grad_mul)?;
                        }
                        if slot.is_none() {
                            let master = if is_half(p) {
                                Some(state_copy_as("adamw.master", name, p, p.tensor(), dt)?)
                            } else {
                                None
                            };
                            *slot = Some(AdamState {
                                m: state_zeros_as(p, dt)?,
                                v: state_zeros_as(p, dt)?,
                                step: 0,
                                master,
                            });
                        }
                        g.contiguous()
                    };
                    let g = prep(slot).map_err(|e| ctx_err("adamw", name, e))?;
                    let s = slot.as_mut().expect("state created above");
                    let hp = AdamWStep {
                        lr: lr * group.lr_scale,
                        beta1: c.beta1,
                        beta2: c.beta2,
                        eps: c.eps,
                        weight_decay: group.weight_decay,
                        step: s.step + 1,
                    };
                    let target = s.master.clone().unwrap_or_else(|| p.tensor().clone());
                    work.push((name.as_str(), p, target, g, s, hp));
                }
            }
            let items: Vec<_> = work
                .iter()
                .map(|(_, _, p, g, s, hp)| (p, g, &s.m, &s.v, *hp))
                .collect();
            let results = Tensor::adamw_step_many(&items);
            drop(items);
            let mut first_err = None;
            for ((name, p, _, _, s, _), r) in work.iter_mut().zip(results) {
                // A half-precision parameter takes its updated master, rounded.
                let r = r.and_then(|()| match &s.master {
                    Some(m) => p.tensor().copy_from(&m.to_dtype(p.tensor().dtype())?),
                    None => Ok(()),
                });
                match r {
                    Ok(()) => s.step += 1,
                    Err(e) => {
                        first_err.get_or_insert_with(|| ctx_err("adamw", name, e));
                    }
                }
            }
            match first_err {
                Some(e) => Err(e),
                None => Ok::<(), meshgrad_tensor::Error>(()),
            }
        })?;
        self.step_count += 1;
        Ok(())
    }

    fn find(&self, name: &str) -> Option<(usize, usize)> {
        self.groups.iter().enumerate().find_map(|(gi, g)| {
            g.params
                .iter()
                .position(|(n, _)| n == name)
                .map(|pi| (gi, pi))
        })
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, lr: f64) -> Result<()> {
        self.step_scaled(lr, 1.0)
    }

    fn param_groups(&self) -> &[ParamGroup] {
        &self.groups
    }

    fn step_count(&self) -> u64 {
        self.step_count
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![(
            "adamw.step_count".to_string(),
            counter_tensor(self.step_count)?,
        )];
        for (group, states) in self.groups.iter().zip(&self.state) {
            for ((name, _), s) in group.params.iter().zip(states) {
                if let Some(s) = s {
                    out.push((format!("adamw.m.{name}"), s.m.clone()));
                    out.push((format!("adamw.v.{name}"), s.v.clone()));
                    out.push((format!("adamw.step.{name}"), counter_tensor(s.step)?));
                    if let Some(master) = &s.master {
                        out.push((format!("adamw.master.{name}"), master.clone()));
                    }
                }
            }
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, tensors: &[(String, Tensor)]) -> Result<()> {
        let mut map: HashMap<&str, &Tensor> = HashMap::new();
        for (n, t) in tensors {
            if map.insert(n.as_str(), t).is_some() {
                meshgrad_tensor::bail!("adamw load_state_dict: tensor {n} appears twice");
            }
        }
        let Some(sc) = map.get("adamw.step_count") else {
            meshgrad_tensor::bail!(
                "adamw load_state_dict: missing adamw.step_count (is this an AdamW state dict?)"
            );
        };
        let step_count = read_counter("adamw.step_count", sc)?;
        let mut used: HashSet<String> = HashSet::from(["adamw.step_count".to_string()]);
        let mut new_state = Vec::with_capacity(self.groups.len());
        let mut exact: Vec<(Var, Tensor)> = Vec::new();
        for group in &self.groups {
            let mut gs = Vec::with_capacity(group.params.len());
            for (name, p) in &group.params {
                let keys = [
                    format!("adamw.m.{name}"),
                    format!("adamw.v.{name}"),
                    format!("adamw.step.{name}"),
                ];
                let found: Vec<Option<&&Tensor>> =
                    keys.iter().map(|k| map.get(k.as_str())).collect();
                match (found[0], found[1], found[2]) {
                    (None, None, None) => gs.push(None),
                    (Some(m), Some(v), Some(st)) => {
                        let dt = state_dtype(p);
                        // A half-precision parameter's master: the saved one, or (a state
                        // saved without one) the parameter itself, as a first step makes it.
                        let master_key = format!("adamw.master.{name}");
                        let master = match (is_half(p), map.get(master_key.as_str())) {
                            (false, Some(saved)) => {
                                // A half-precision run's state for an f32 parameter (ZeRO's
                                // f32 shards): the parameter takes the exact master values.
                                used.insert(master_key);
                                let v = state_copy_as("adamw.master", name, p, saved, dt)?;
                                exact.push((p.clone(), v));
                                None
                            }
                            (false, None) => None,
                            (true, Some(saved)) => {
                                used.insert(master_key);
                                Some(state_copy_as("adamw.master", name, p, saved, dt)?)
                            }
                            (true, None) => {
                                Some(state_copy_as("adamw.master", name, p, p.tensor(), dt)?)
                            }
                        };
                        let s = AdamState {
                            m: state_copy_as("adamw.m", name, p, m, dt)?,
                            v: state_copy_as("adamw.v", name, p, v, dt)?,
                            step: read_counter(&keys[2], st)?,
                            master,
                        };
                        used.extend(keys);
                        gs.push(Some(s));
                    }
                    _ => meshgrad_tensor::bail!("adamw load_state_dict: parameter {name} needs all of {}, {} and {}, the state dict has only some", keys[0], keys[1], keys[2]),
                }
            }
            new_state.push(gs);
        }
        let mut unexpected: Vec<&str> =
            map.keys().copied().filter(|k| !used.contains(*k)).collect();
        if !unexpected.is_empty() {
            unexpected.sort_unstable();
            meshgrad_tensor::bail!(
                "adamw load_state_dict: unexpected tensors (no such parameter): {}",
                unexpected.join(", ")
            );
        }
        no_grad(|| exact.iter().try_for_each(|(p, v)| p.tensor().copy_from(v)))?;
        self.state = new_state;
        self.step_count = step_count;
        Ok(())
    }

    fn state_kind(&self, key: &str) -> Option<StateKind> {
        if key == "adamw.step_count" {
            return Some(StateKind::Global);
        }
        StateKind::parse(key, "adamw.m.", true)
            .or_else(|| StateKind::parse(key, "adamw.v.", true))
            .or_else(|| StateKind::parse(key, "adamw.master.", true))
            .or_else(|| StateKind::parse(key, "adamw.step.", false))
    }

    fn exact_weights_key(&self, param: &str) -> Option<String> {
        Some(format!("adamw.master.{param}"))
    }
}

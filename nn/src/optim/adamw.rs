//! AdamW (decoupled weight decay), as PyTorch's `torch.optim.AdamW`.

use std::collections::{HashMap, HashSet};

use meshgrad_autograd::no_grad;
use meshgrad_tensor::{AdamWStep, Result, Tensor};

use super::{
    counter_tensor, ctx_err, kernel_grad, read_counter, state_copy, state_zeros, validate_groups,
    validate_lr, Optimizer, ParamGroup, StateKind,
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
/// so a parameter that skipped steps for lack of a gradient gets its own bias correction).
#[derive(Clone, Debug)]
struct AdamState {
    m: Tensor,
    v: Tensor,
    step: u64,
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
/// under `no_grad`. Moments have the parameter's dtype, are created (zero) at a parameter's first
/// step and are charged to `MemoryTag::OptimizerState`.
///
/// State-dict names: `adamw.step_count` (completed `step` calls), and for every parameter that
/// has state, `adamw.m.<name>`, `adamw.v.<name>` and `adamw.step.<name>` (one-element i64).
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
        validate_lr("adamw", lr)?;
        let c = self.config;
        no_grad(|| {
            // Gather every update first (creating state as needed), then run them all in one
            // multi-tensor call; step counts advance only for the updates that succeeded.
            let mut work: Vec<(&str, Tensor, Tensor, &mut AdamState, AdamWStep)> = Vec::new();
            for (group, states) in self.groups.iter().zip(self.state.iter_mut()) {
                for ((name, p), slot) in group.params.iter().zip(states.iter_mut()) {
                    let Some(g) = p.grad() else { continue };
                    let prep = |slot: &mut Option<AdamState>| -> Result<Tensor> {
                        let g = kernel_grad(p, &g)?;
                        if slot.is_none() {
                            *slot = Some(AdamState {
                                m: state_zeros(p)?,
                                v: state_zeros(p)?,
                                step: 0,
                            });
                        }
                        Ok(g)
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
                    work.push((name.as_str(), p.tensor().clone(), g, s, hp));
                }
            }
            let items: Vec<_> = work
                .iter()
                .map(|(_, p, g, s, hp)| (p, g, &s.m, &s.v, *hp))
                .collect();
            let results = Tensor::adamw_step_many(&items);
            drop(items);
            let mut first_err = None;
            for ((name, _, _, s, _), r) in work.iter_mut().zip(results) {
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
                        let s = AdamState {
                            m: state_copy("adamw.m", name, p, m)?,
                            v: state_copy("adamw.v", name, p, v)?,
                            step: read_counter(&keys[2], st)?,
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
            .or_else(|| StateKind::parse(key, "adamw.step.", false))
    }
}

//! Stochastic gradient descent with momentum, as PyTorch's `torch.optim.SGD`.

use std::collections::{HashMap, HashSet};

use meshgrad_autograd::no_grad;
use meshgrad_tensor::{Result, Tensor};

use super::{
    counter_tensor, ctx_err, kernel_grad, read_counter, state_copy, state_zeros, validate_groups,
    validate_lr, Optimizer, ParamGroup, StateKind,
};

/// SGD hyper-parameters shared by all groups (weight decay is per group).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct SgdConfig {
    /// Momentum factor (0 = plain SGD, no state kept).
    pub momentum: f64,
}

/// SGD with PyTorch semantics (dampening 0, no Nesterov). For each parameter `p` with gradient
/// `g`, group learning rate `lr = base_lr * lr_scale` and weight decay `wd`:
///
/// ```text
/// g   = g + wd * p                        (L2 decay added to the gradient)
/// buf = g                   at the parameter's first step, else   buf = momentum * buf + g
/// p  -= lr * buf
/// ```
///
/// With `momentum == 0` no buffer is kept (`p -= lr * g`). Momentum buffers are created at a
/// parameter's first step, charged to `MemoryTag::OptimizerState`; the update is the fused kernel
/// [`Tensor::sgd_step_`], run under `no_grad`.
///
/// State-dict names: `sgd.step_count` and `sgd.momentum_buffer.<name>` for every parameter that
/// has a buffer.
pub struct Sgd {
    config: SgdConfig,
    groups: Vec<ParamGroup>,
    buffers: Vec<Vec<Option<Tensor>>>,
    step_count: u64,
}

impl Sgd {
    /// An optimizer over `groups` (parameter names must be unique across groups).
    pub fn new(groups: Vec<ParamGroup>, config: SgdConfig) -> Result<Self> {
        if !config.momentum.is_finite() || config.momentum < 0.0 {
            meshgrad_tensor::bail!("sgd: momentum {} must be finite and >= 0", config.momentum);
        }
        validate_groups("sgd", &groups)?;
        let buffers = groups.iter().map(|g| vec![None; g.params.len()]).collect();
        Ok(Sgd {
            config,
            groups,
            buffers,
            step_count: 0,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &SgdConfig {
        &self.config
    }

    /// The momentum buffer of parameter `name`, once it has one.
    pub fn momentum_buffer(&self, name: &str) -> Option<Tensor> {
        self.groups.iter().zip(&self.buffers).find_map(|(g, b)| {
            g.params
                .iter()
                .position(|(n, _)| n == name)
                .and_then(|i| b[i].clone())
        })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, lr: f64) -> Result<()> {
        validate_lr("sgd", lr)?;
        let momentum = self.config.momentum;
        no_grad(|| {
            for (group, bufs) in self.groups.iter().zip(self.buffers.iter_mut()) {
                for ((name, p), slot) in group.params.iter().zip(bufs.iter_mut()) {
                    let Some(g) = p.grad() else { continue };
                    let run = |slot: &mut Option<Tensor>| -> Result<()> {
                        let g = kernel_grad(p, &g)?;
                        let lr = lr * group.lr_scale;
                        if momentum == 0.0 {
                            // No state: a scratch buffer that the kernel overwrites with g (+ wd p).
                            let scratch = p.tensor().zeros_like()?;
                            return p.tensor().sgd_step_(
                                &g,
                                &scratch,
                                lr,
                                0.0,
                                group.weight_decay,
                                true,
                            );
                        }
                        let first = slot.is_none();
                        let buf = match slot {
                            Some(b) => b,
                            None => slot.insert(state_zeros(p)?),
                        };
                        p.tensor()
                            .sgd_step_(&g, buf, lr, momentum, group.weight_decay, first)
                    };
                    run(slot).map_err(|e| ctx_err("sgd", name, e))?;
                }
            }
            Ok::<(), meshgrad_tensor::Error>(())
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
            "sgd.step_count".to_string(),
            counter_tensor(self.step_count)?,
        )];
        for (group, bufs) in self.groups.iter().zip(&self.buffers) {
            for ((name, _), b) in group.params.iter().zip(bufs) {
                if let Some(b) = b {
                    out.push((format!("sgd.momentum_buffer.{name}"), b.clone()));
                }
            }
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, tensors: &[(String, Tensor)]) -> Result<()> {
        let mut map: HashMap<&str, &Tensor> = HashMap::new();
        for (n, t) in tensors {
            if map.insert(n.as_str(), t).is_some() {
                meshgrad_tensor::bail!("sgd load_state_dict: tensor {n} appears twice");
            }
        }
        let Some(sc) = map.get("sgd.step_count") else {
            meshgrad_tensor::bail!(
                "sgd load_state_dict: missing sgd.step_count (is this an SGD state dict?)"
            );
        };
        let step_count = read_counter("sgd.step_count", sc)?;
        let mut used: HashSet<String> = HashSet::from(["sgd.step_count".to_string()]);
        let mut new_buffers = Vec::with_capacity(self.groups.len());
        for group in &self.groups {
            let mut bs = Vec::with_capacity(group.params.len());
            for (name, p) in &group.params {
                let key = format!("sgd.momentum_buffer.{name}");
                match map.get(key.as_str()) {
                    Some(t) => {
                        bs.push(Some(state_copy("sgd.momentum_buffer", name, p, t)?));
                        used.insert(key);
                    }
                    None => bs.push(None),
                }
            }
            new_buffers.push(bs);
        }
        let mut unexpected: Vec<&str> =
            map.keys().copied().filter(|k| !used.contains(*k)).collect();
        if !unexpected.is_empty() {
            unexpected.sort_unstable();
            meshgrad_tensor::bail!(
                "sgd load_state_dict: unexpected tensors (no such parameter): {}",
                unexpected.join(", ")
            );
        }
        self.buffers = new_buffers;
        self.step_count = step_count;
        Ok(())
    }

    fn state_kind(&self, key: &str) -> Option<StateKind> {
        if key == "sgd.step_count" {
            return Some(StateKind::Global);
        }
        StateKind::parse(key, "sgd.momentum_buffer.", true)
    }
}

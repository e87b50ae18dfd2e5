//! The `Module` trait: hierarchical parameter names, train/eval mode.

use meshgrad_autograd::Var;
use meshgrad_tensor::alloc::{with_tag, MemoryTag};
use meshgrad_tensor::{DType, Device, Random, Result, Shape, Tensor};

/// A layer or model: something that owns parameters under stable hierarchical names.
///
/// Names are dotted paths (`h.0.attn.c_attn.weight`) built from each container's field names,
/// so they are stable across runs and match the checkpoint formats.
pub trait Module {
    /// Calls `f(name, param)` for every parameter, names prefixed by `prefix` (`""` at the top).
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var));

    /// Switches dropout (and any other mode-dependent behaviour) between training and eval.
    fn set_training(&self, _training: bool) {}

    /// All parameters with their names, in a fixed order (the order of `visit_params`).
    fn named_parameters(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        self.visit_params("", &mut |n, v| out.push((n, v.clone())));
        out
    }

    /// All parameters.
    fn parameters(&self) -> Vec<Var> {
        self.named_parameters()
            .into_iter()
            .map(|(_, v)| v)
            .collect()
    }

    /// Total number of parameter elements.
    fn num_parameters(&self) -> usize {
        self.parameters()
            .iter()
            .map(|p| p.tensor().elem_count())
            .sum()
    }

    /// Clears every parameter's gradient.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }
}

/// Joins a prefix and a name with a dot (`"" + "w"` is `"w"`).
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// A 64-bit FNV-1a hash of `name` mixed with `seed`: the RNG stream of a named parameter, so its
/// initial values depend only on the run seed and its name (never on creation order or sharding).
pub fn name_seed(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for b in name.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

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

/// Where and how parameters are created.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamFactory {
    /// Run seed; each parameter's stream is `name_seed(seed, full_name)`.
    pub seed: u64,
    /// Parameter dtype.
    pub dtype: DType,
    /// Parameter device.
    pub device: Device,
}

impl Default for ParamFactory {
    fn default() -> Self {
        ParamFactory {
            seed: 0,
            dtype: DType::F32,
            device: Device::Cpu,
        }
    }
}

impl ParamFactory {
    /// Creates the parameter `name` (the full dotted name) of `shape`, counted as parameter memory.
    pub fn param(&self, name: &str, shape: impl Into<Shape>, init: Init) -> Result<Var> {
        let shape = shape.into();
        let (dtype, device) = (self.dtype, self.device);
        let s = name_seed(self.seed, name);
        let t = with_tag(MemoryTag::Params, || match init {
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
        })?;
        Ok(Var::leaf(t))
    }
}

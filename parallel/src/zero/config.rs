//! Options of sharded data parallelism: the stage, the wrap policy and the mixed-precision
//! policy.

use meshgrad_nn::module::{path_selects, Module};
use meshgrad_tensor::{DType, Result};

pub use crate::layout::ZeroStage;

/// Which parameters form each sharding unit (FSDP's wrap policy), chosen by module path. Each
/// unit is a flat buffer that is sharded, reduce-scattered and (ZeRO-3) gathered as a whole;
/// a root unit (named `root`) takes every parameter no other unit takes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum WrapPolicy {
    /// The default: one unit per element of the model's shallowest module lists (the module
    /// paths ending in an index at the smallest depth: `h.0`, `h.1`, ... of a GPT,
    /// `encoder.layer.0`, ... of a BERT), and the root unit for the rest (embeddings, final
    /// norm, head). A model with no module list (holding parameters) is a single unit.
    #[default]
    Auto,
    /// One unit per distinct match of each pattern. A pattern is a dotted path whose `*`
    /// matches any one component ([`meshgrad_nn::module::path_matches`]); it matches a module
    /// path or a parameter name, or a prefix of them (`h` takes every `h.*` block as one unit,
    /// `h.*` makes each block a unit, `wte.weight` a single parameter). A unit is named by the
    /// path it matched (`h.3`). A pattern that matches nothing, or two patterns taking the same
    /// parameter, is an error.
    Paths(Vec<String>),
    /// A single unit with every parameter.
    Whole,
}

impl WrapPolicy {
    /// [`WrapPolicy::Paths`] from any list of patterns: `WrapPolicy::paths(["layers.*"])`.
    pub fn paths<S: Into<String>>(patterns: impl IntoIterator<Item = S>) -> Self {
        WrapPolicy::Paths(patterns.into_iter().map(Into::into).collect())
    }

    /// The unit names and, for every parameter of `model` (in
    /// [`Module::named_parameters`] order), its unit index. The root unit (index 0, named
    /// `root`) holds the parameters no other unit takes and is left out when empty; the other
    /// units follow in the order of their first parameter.
    pub fn assign(&self, model: &dyn Module) -> Result<(Vec<String>, Vec<usize>)> {
        let names: Vec<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        let patterns: Vec<String> = match self {
            WrapPolicy::Whole => Vec::new(),
            WrapPolicy::Auto => auto_units(model, &names),
            WrapPolicy::Paths(p) => {
                check_patterns(p)?;
                p.clone()
            }
        };
        // Each parameter's unit key: the prefix of its name that a pattern matched.
        let mut keys: Vec<Option<String>> = Vec::with_capacity(names.len());
        let mut matched = vec![false; patterns.len()];
        for n in &names {
            let hits: Vec<usize> = (0..patterns.len())
                .filter(|&k| path_selects(&patterns[k], n))
                .collect();
            match hits.as_slice() {
                [] => keys.push(None),
                [k] => {
                    matched[*k] = true;
                    let depth = patterns[*k].split('.').count();
                    keys.push(Some(n.split('.').take(depth).collect::<Vec<_>>().join(".")));
                }
                _ => meshgrad_tensor::bail!(
                    "wrap policy: parameter {n} is taken by several unit patterns ({}); units \
                     must not overlap",
                    hits.iter()
                        .map(|&k| format!("`{}`", patterns[k]))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
        if let Some(k) = matched.iter().position(|m| !m) {
            meshgrad_tensor::bail!(
                "wrap policy: pattern `{}` matches no module path or parameter of this {} \
                 (`*` matches one path component); its module paths: {}",
                patterns[k],
                model.module_type(),
                module_path_list(model)
            );
        }
        let mut unit_names = vec!["root".to_string()];
        let mut of = Vec::with_capacity(names.len());
        for key in keys {
            match key {
                None => of.push(0),
                Some(key) => match unit_names.iter().skip(1).position(|u| *u == key) {
                    Some(i) => of.push(i + 1),
                    None => {
                        unit_names.push(key);
                        of.push(unit_names.len() - 1);
                    }
                },
            }
        }
        if !of.contains(&0) {
            unit_names.remove(0);
            of.iter_mut().for_each(|u| *u -= 1);
        }
        Ok((unit_names, of))
    }
}

fn check_patterns(patterns: &[String]) -> Result<()> {
    for (i, p) in patterns.iter().enumerate() {
        if p.is_empty() || p.split('.').any(str::is_empty) {
            meshgrad_tensor::bail!(
                "wrap policy: pattern `{p}` is not a dotted module path (e.g. `h.*`, \
                 `encoder.layer.*`)"
            );
        }
        if patterns[..i].contains(p) {
            meshgrad_tensor::bail!("wrap policy: pattern `{p}` is listed twice");
        }
    }
    Ok(())
}

/// [`WrapPolicy::Auto`]'s units: the module paths ending in an index, at the smallest depth
/// among those that hold parameters.
fn auto_units(model: &dyn Module, names: &[String]) -> Vec<String> {
    let mut lists: Vec<String> = Vec::new();
    model.visit_modules("", &mut |path, _| {
        let last = path.rsplit('.').next().unwrap_or("");
        if !path.is_empty() && last.parse::<usize>().is_ok() {
            lists.push(path.to_string());
        }
    });
    lists.retain(|p| names.iter().any(|n| path_selects(p, n)));
    let Some(depth) = lists.iter().map(|p| p.split('.').count()).min() else {
        return Vec::new();
    };
    lists.retain(|p| p.split('.').count() == depth);
    lists
}

/// The model's module paths for messages (the first 64).
fn module_path_list(model: &dyn Module) -> String {
    let paths: Vec<String> = model
        .module_paths()
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect();
    if paths.is_empty() {
        return "(none: the model has no submodules)".to_string();
    }
    const SHOWN: usize = 64;
    let mut s = paths
        .iter()
        .take(SHOWN)
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join(", ");
    if paths.len() > SHOWN {
        s.push_str(&format!(", ... ({} more)", paths.len() - SHOWN));
    }
    s
}

/// The mixed-precision policy.
///
/// * The **parameter dtype** (compute) is the dtype the model was built in: build it in bf16 for
///   bf16 compute (`Gpt::new(.., DType::BF16, ..)`).
/// * Gradients are reduced (reduce-scatter / all-reduce) in `reduce_dtype` (default: the
///   parameter dtype). bf16 halves the traffic; the in-process backend accumulates bf16 in f32 and
///   rounds once.
/// * The optimizer keeps its shard of the weights (the **master weights**), its moments and its
///   gradient shard in `master_dtype` (default f32). When the parameters are in another dtype
///   the updated master shard is cast to it before the all-gather.
///
/// f32 everywhere is the lockstep baseline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedPrecision {
    /// Dtype of the gradient reduction (`None`: the parameter dtype).
    pub reduce_dtype: Option<DType>,
    /// Dtype of the master weights, moments and gradient shards.
    pub master_dtype: DType,
}

impl Default for MixedPrecision {
    fn default() -> Self {
        MixedPrecision {
            reduce_dtype: None,
            master_dtype: DType::F32,
        }
    }
}

impl MixedPrecision {
    /// Gradients reduced in bf16, master weights in f32.
    pub fn bf16_reduce() -> Self {
        MixedPrecision {
            reduce_dtype: Some(DType::BF16),
            master_dtype: DType::F32,
        }
    }

    /// Checks that the dtypes are float dtypes.
    pub fn validate(&self) -> Result<()> {
        if let Some(d) = self.reduce_dtype {
            if !d.is_float() {
                meshgrad_tensor::bail!("mixed precision: reduce dtype {d} must be a float dtype");
            }
        }
        if !self.master_dtype.is_float() {
            meshgrad_tensor::bail!(
                "mixed precision: master dtype {} must be a float dtype",
                self.master_dtype
            );
        }
        Ok(())
    }
}

/// Options of [`crate::zero::ShardedDataParallel`].
#[derive(Clone, Debug, PartialEq)]
pub struct ShardConfig {
    /// What is sharded: optimizer state (ZeRO-1), + gradients (ZeRO-2), + parameters (ZeRO-3).
    pub stage: ZeroStage,
    /// Which parameters form each unit.
    pub wrap: WrapPolicy,
    /// Dtypes of compute, reduction and master weights.
    pub mixed_precision: MixedPrecision,
    /// ZeRO-3: launch the all-gather of the next unit (in forward, and in backward the unit
    /// before) while the current one computes. Default true.
    pub prefetch: bool,
    /// Broadcast the parameters from data-parallel rank 0 when wrapping, so every rank starts
    /// from the same weights. Default true.
    pub broadcast_params: bool,
    /// Parameters (by full name) the wrapper leaves alone, as PyTorch FSDP's `ignored_states`:
    /// not sharded, reduced, broadcast or stepped; another strategy owns them (the experts under
    /// expert parallelism, [`crate::ExpertDataParallel`]). Default none.
    pub ignored: Vec<String>,
    /// Some parameters may get no gradient on some ranks in a backward (a mixture of experts'
    /// experts that a rank's tokens did not reach), as DDP's `find_unused_parameters`: a unit is
    /// then not complete on every rank at the same moment, so its reduction is not launched
    /// during the backward but by [`ShardedDataParallel::finish`](super::ShardedDataParallel::finish),
    /// every unit in the fixed order; every rank then issues the same collectives in the same
    /// order (the backward's all-gathers, then the reductions). The whole flat gradients exist
    /// at once before they are reduced. Under ZeRO-3 a unit is not released when its gradients
    /// are complete (that moment differs between ranks) but at the next gather of another
    /// unit or `finish`, so every rank gathers it at the same reads. Default false.
    pub sometimes_unused: bool,
}

impl ShardConfig {
    /// The defaults for `stage`.
    pub fn new(stage: ZeroStage) -> Self {
        ShardConfig {
            stage,
            wrap: WrapPolicy::default(),
            mixed_precision: MixedPrecision::default(),
            prefetch: true,
            broadcast_params: true,
            ignored: Vec::new(),
            sometimes_unused: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use meshgrad_nn::{Gpt, GptConfig};
    use meshgrad_tensor::Device;

    fn gpt() -> Gpt {
        let c = GptConfig {
            vocab_size: 16,
            block_size: 8,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            dropout: 0.0,
            bias: false,
            layer_norm_eps: 1e-5,
        };
        Gpt::new(c, 0, DType::F32, Device::Cpu).unwrap()
    }

    fn units_of(model: &Gpt, policy: &WrapPolicy) -> Vec<(String, String)> {
        let (units, of) = policy.assign(model).unwrap();
        model
            .named_parameters()
            .into_iter()
            .zip(of)
            .map(|((n, _), u)| (n, units[u].clone()))
            .collect()
    }

    #[test]
    fn wrap_policies_assign_units() {
        let m = gpt();
        // Auto: the blocks, the rest in root.
        let (units, _) = WrapPolicy::Auto.assign(&m).unwrap();
        assert_eq!(units, vec!["root", "h.0", "h.1"]);
        let by = units_of(&m, &WrapPolicy::Auto);
        assert!(by.contains(&("wte.weight".into(), "root".into())));
        assert!(by.contains(&("h.1.attn.c_attn.weight".into(), "h.1".into())));
        assert!(by.contains(&("ln_f.weight".into(), "root".into())));
        // Patterns: `h.*` equals Auto; `h` is one unit of every block.
        assert_eq!(
            WrapPolicy::paths(["h.*"]).assign(&m).unwrap(),
            WrapPolicy::Auto.assign(&m).unwrap()
        );
        let (units, _) = WrapPolicy::paths(["wte", "h"]).assign(&m).unwrap();
        assert_eq!(units, vec!["root", "wte", "h"]);
        let (units, _) = WrapPolicy::paths(["h.*.attn", "h.*.mlp"])
            .assign(&m)
            .unwrap();
        assert_eq!(
            units,
            vec!["root", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp"]
        );
        // Whole; and patterns that take everything leave no root.
        let (units, of) = WrapPolicy::Whole.assign(&m).unwrap();
        assert_eq!(units, vec!["root"]);
        assert!(of.iter().all(|&u| u == 0));
        let (units, _) = WrapPolicy::paths(["wte", "wpe", "h", "ln_f"])
            .assign(&m)
            .unwrap();
        assert_eq!(units, vec!["wte", "wpe", "h", "ln_f"]);
    }

    #[test]
    fn bad_patterns_say_what_the_model_has() {
        let m = gpt();
        let e = WrapPolicy::paths(["layers.*"])
            .assign(&m)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`layers.*` matches no module path")
                && e.contains("h.0, h.0.ln_1")
                && e.contains("ln_f"),
            "{e}"
        );
        let e = WrapPolicy::paths(["h.7"])
            .assign(&m)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`h.7` matches no"), "{e}");
        let e = WrapPolicy::paths(["h", "h.*.attn"])
            .assign(&m)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("h.0.attn.c_attn.weight is taken by several"),
            "{e}"
        );
        let e = WrapPolicy::paths(["h.*", "h.*"])
            .assign(&m)
            .unwrap_err()
            .to_string();
        assert!(e.contains("listed twice"), "{e}");
        let e = WrapPolicy::paths(["h..x"])
            .assign(&m)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a dotted module path"), "{e}");
    }
}

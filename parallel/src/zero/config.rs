//! Options of sharded data parallelism: the stage, the wrap policy and the mixed-precision
//! policy.

use meshgrad_nn::hooks::{prefix_matches, Stage};
use meshgrad_tensor::{DType, Result};

pub use crate::layout::ZeroStage;

/// Which parameters form each sharding unit (FSDP's wrap policy). Each unit is a flat buffer
/// that is sharded, reduce-scattered and (ZeRO-3) gathered as a whole.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum WrapPolicy {
    /// One unit per stage that has [`Stage::own_unit`] set (a transformer block), and one root
    /// unit with every other parameter (embeddings, final norm, tied head). The default.
    #[default]
    Stages,
    /// One unit per listed name prefix (`h.0`, `h.1`, ...; a prefix covers the parameter of that
    /// name and everything below it), and a root unit for the parameters no prefix covers.
    Prefixes(Vec<String>),
    /// A single unit with every parameter.
    Whole,
}

impl WrapPolicy {
    /// The unit names and, for every parameter name, its unit index. The root unit (index 0,
    /// named `root`) holds the parameters no other unit takes; it is left out when empty.
    pub fn assign(&self, names: &[String], stages: &[Stage]) -> Result<(Vec<String>, Vec<usize>)> {
        let prefixes: Vec<String> = match self {
            WrapPolicy::Whole => Vec::new(),
            WrapPolicy::Stages => stages
                .iter()
                .filter(|s| s.own_unit)
                .flat_map(|s| s.param_prefixes.iter().cloned())
                .collect(),
            WrapPolicy::Prefixes(p) => p.clone(),
        };
        for (i, p) in prefixes.iter().enumerate() {
            if prefixes[..i].contains(p) {
                meshgrad_tensor::bail!("wrap policy: unit prefix {p} is listed twice");
            }
        }
        // Unit 0 is the root; prefix k is unit k + 1 (renumbered below if the root is empty).
        let mut of: Vec<usize> = Vec::with_capacity(names.len());
        for n in names {
            let hits: Vec<usize> = prefixes
                .iter()
                .enumerate()
                .filter(|(_, p)| prefix_matches(p, n))
                .map(|(k, _)| k)
                .collect();
            match hits.as_slice() {
                [] => of.push(0),
                [k] => of.push(k + 1),
                _ => meshgrad_tensor::bail!(
                    "wrap policy: parameter {n} matches several unit prefixes ({})",
                    hits.iter()
                        .map(|&k| prefixes[k].as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }
        }
        for (k, p) in prefixes.iter().enumerate() {
            if !of.contains(&(k + 1)) {
                meshgrad_tensor::bail!("wrap policy: unit prefix {p} matches no parameter");
            }
        }
        let mut unit_names = vec!["root".to_string()];
        unit_names.extend(prefixes);
        if !of.contains(&0) {
            unit_names.remove(0);
            of.iter_mut().for_each(|u| *u -= 1);
        }
        Ok((unit_names, of))
    }
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stage(name: &str, prefixes: &[&str], own: bool) -> Stage {
        Stage {
            name: name.into(),
            param_prefixes: prefixes.iter().map(|s| s.to_string()).collect(),
            own_unit: own,
        }
    }

    #[test]
    fn wrap_policies_assign_units() {
        let names: Vec<String> = ["wte.weight", "h.0.w", "h.0.b", "h.1.w", "ln_f.weight"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let stages = vec![
            stage("embed", &["wte"], false),
            stage("h.0", &["h.0"], true),
            stage("h.1", &["h.1"], true),
            stage("head", &["ln_f", "wte"], false),
        ];
        let (units, of) = WrapPolicy::Stages.assign(&names, &stages).unwrap();
        assert_eq!(units, vec!["root", "h.0", "h.1"]);
        assert_eq!(of, vec![0, 1, 1, 2, 0]);
        let (units, of) = WrapPolicy::Whole.assign(&names, &stages).unwrap();
        assert_eq!(units, vec!["root"]);
        assert_eq!(of, vec![0; 5]);
        let all = WrapPolicy::Prefixes(vec!["wte".into(), "h".into(), "ln_f".into()]);
        let (units, of) = all.assign(&names, &stages).unwrap();
        assert_eq!(units, vec!["wte", "h", "ln_f"]);
        assert_eq!(of, vec![0, 1, 1, 1, 2]);
        let e = WrapPolicy::Prefixes(vec!["h.7".into()])
            .assign(&names, &stages)
            .unwrap_err();
        assert!(e.to_string().contains("h.7 matches no parameter"), "{e}");
        let e = WrapPolicy::Prefixes(vec!["h".into(), "h.0".into()])
            .assign(&names, &stages)
            .unwrap_err();
        assert!(e.to_string().contains("h.0.w matches several"), "{e}");
    }
}

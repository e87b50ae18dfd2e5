//! Forward hooks: named points in a model's forward where a wrapper can act.
//!
//! A model that implements [`Staged`] divides its forward into an ordered list of *stages*
//! ([`Stage`]: a name and the parameter-name prefixes the stage reads) and runs each through
//! [`run_stage`], which calls the [`ForwardHooks`] installed in its [`HookSlot`] around it:
//! `pre_forward(stage)` before, `post_forward(stage, &output)` after. Sharded data parallelism
//! (FSDP / ZeRO-3) uses them to all-gather a stage's parameters just before it runs, release them
//! just after, and register a pre-backward hook on the stage's output to re-gather them for its
//! backward. Because the hook sits on the stage's *output* variable, it also fires at the right
//! point for an activation-checkpointed stage, whose forward is re-run inside its backward node.
//!
//! With no hooks installed, [`run_stage`] is a plain call of the stage's closure (one uncontended
//! read lock per forward to look the slot up); nothing is allocated.

use std::sync::{Arc, RwLock};

use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::Module;

/// Callbacks around each stage of a [`Staged`] model's forward. `stage` is the stage's index in
/// [`Staged::stages`]. An error aborts the forward and is returned from it.
pub trait ForwardHooks: Send + Sync {
    /// Runs just before stage `stage`'s forward.
    fn pre_forward(&self, stage: usize) -> Result<()>;
    /// Runs just after stage `stage`'s forward, with the stage's output.
    fn post_forward(&self, stage: usize, output: &Var) -> Result<()>;
}

/// Where a model keeps its (optional) [`ForwardHooks`]. Installing takes `&self`, so a wrapper
/// can attach to a model it only borrows.
#[derive(Default)]
pub struct HookSlot {
    hooks: RwLock<Option<Arc<dyn ForwardHooks>>>,
}

impl std::fmt::Debug for HookSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HookSlot({})",
            if self.is_set() { "set" } else { "empty" }
        )
    }
}

impl HookSlot {
    /// Installs `hooks` (or removes them with `None`) and returns the previous ones.
    pub fn set(&self, hooks: Option<Arc<dyn ForwardHooks>>) -> Option<Arc<dyn ForwardHooks>> {
        let mut g = self.hooks.write().unwrap_or_else(|e| e.into_inner());
        std::mem::replace(&mut *g, hooks)
    }

    /// The installed hooks, if any.
    pub fn get(&self) -> Option<Arc<dyn ForwardHooks>> {
        self.hooks.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether hooks are installed.
    pub fn is_set(&self) -> bool {
        self.hooks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

/// Runs stage `stage` of a forward: `f()` between the hooks' `pre_forward` and `post_forward`,
/// or just `f()` when `hooks` is `None`.
pub fn run_stage(
    hooks: Option<&Arc<dyn ForwardHooks>>,
    stage: usize,
    f: impl FnOnce() -> Result<Var>,
) -> Result<Var> {
    match hooks {
        None => f(),
        Some(h) => {
            h.pre_forward(stage)?;
            let out = f()?;
            h.post_forward(stage, &out)?;
            Ok(out)
        }
    }
}

/// One stage of a [`Staged`] model's forward.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// A short name for messages (`embed`, `h.3`, `head`).
    pub name: String,
    /// The stage reads the parameters whose names equal one of these or start with one of them
    /// followed by a dot (`h.3` covers `h.3.attn.c_attn.weight`).
    pub param_prefixes: Vec<String>,
    /// Whether, by default, the stage's parameters form a sharding unit of their own (transformer
    /// blocks); the parameters of the other stages go to a shared root unit.
    pub own_unit: bool,
}

impl Stage {
    /// Whether parameter `name` is one this stage reads.
    pub fn reads(&self, name: &str) -> bool {
        self.param_prefixes.iter().any(|p| prefix_matches(p, name))
    }
}

/// Whether `prefix` names `name` or one of its ancestors in the dotted hierarchy.
pub fn prefix_matches(prefix: &str, name: &str) -> bool {
    name == prefix
        || (name.len() > prefix.len()
            && name.starts_with(prefix)
            && name.as_bytes()[prefix.len()] == b'.')
}

/// A model whose forward runs as an ordered list of [`Stage`]s, each through [`run_stage`] with
/// the hooks of [`Staged::forward_hooks`]. Backward visits the stages in reverse order.
pub trait Staged: Module {
    /// The stages, in forward order.
    fn stages(&self) -> Vec<Stage>;
    /// The hook slot the forward consults.
    fn forward_hooks(&self) -> &HookSlot;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_whole_components() {
        assert!(prefix_matches("h.1", "h.1.attn.c_attn.weight"));
        assert!(prefix_matches("wte", "wte"));
        assert!(prefix_matches("wte", "wte.weight"));
        assert!(!prefix_matches("h.1", "h.10.attn.c_attn.weight"));
        assert!(!prefix_matches("h.1", "h"));
    }
}

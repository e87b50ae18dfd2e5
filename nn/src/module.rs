//! The `Module` trait: a tree of named parameters and submodules, train/eval mode, freezing, and
//! the [`ParamBuilder`](crate::ParamBuilder) that creates parameters and initialises them by name.
//!
//! Write a model as a struct and derive [`Module`](macro@crate::Module): every parameter and
//! submodule is named once, by its field name, and the names form dotted paths
//! (`h.0.attn.c_attn.weight`) that are stable across runs and match checkpoint formats.
//!
//! ```
//! use meshgrad_nn::{Forward, Linear, Module, ParamBuilder};
//! use meshgrad_autograd::Var;
//! use meshgrad_tensor::{Device, Result, Tensor};
//!
//! #[derive(meshgrad_nn::Module)]
//! #[module(crate = meshgrad_nn)] // code that uses the `meshgrad` crate leaves this out
//! struct Mlp {
//!     up: Linear,
//!     down: Linear,
//!     width: usize, // plain data: not visited
//! }
//!
//! impl Forward for Mlp {
//!     fn forward(&self, x: &Var) -> Result<Var> {
//!         self.down.forward(&self.up.forward(x)?.relu()?)
//!     }
//! }
//!
//! let model = ParamBuilder::new(0).build(|p| {
//!     Ok(Mlp { up: Linear::new(p, 4, 16)?, down: Linear::new(p, 16, 2)?, width: 16 })
//! })?;
//! let names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(names, ["up.weight", "up.bias", "down.weight", "down.bias"]);
//! let y = model.forward(&Var::constant(Tensor::zeros((3, 4), meshgrad_tensor::DType::F32, Device::Cpu)?))?;
//! assert_eq!(y.tensor().dims(), &[3, 2]);
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```

use std::sync::Arc;

use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::tp::{ParallelStyle, TensorParallel};

/// One immediate child of a module: a parameter or a submodule.
#[derive(Clone, Copy)]
pub enum Child<'a> {
    /// A parameter.
    Param(&'a Var),
    /// A submodule.
    Module(&'a dyn Module),
}

/// A layer or model: a tree of parameters and submodules under stable names.
///
/// Implement it with `#[derive(Module)]`, which writes [`Module::visit_children`] from the
/// fields; everything else is provided. Leaf layers with state beyond parameters (dropout)
/// override [`Module::set_own_training`] or [`Module::on_init`].
pub trait Module: AsDynModule + Send + Sync {
    /// Calls `f(name, child)` for every immediate parameter and submodule, in a fixed order.
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>));

    /// A short name of the module's type for messages (the struct name when derived).
    fn module_type(&self) -> &'static str {
        "Module"
    }

    /// Switches this module's own mode-dependent behaviour (dropout); children are switched by
    /// [`Module::set_training`].
    fn set_own_training(&self, _training: bool) {}

    /// Called once per module by [`ParamBuilder::init`](crate::ParamBuilder::init) with the module's full path and the
    /// run seed (dropout keys its random stream by them).
    fn on_init(&self, _path: &str, _seed: u64) {}

    /// Takes the tensor-parallel `style` a [`TpPlan`](crate::tp::TpPlan) gives this module (at
    /// `path`): its forward then splits its work over `tp`. Its parameters already have their
    /// local shapes. The default refuses with an error naming the module: only layers that know
    /// a split form accept one (`Linear`, `Embedding`, `LayerNorm`, `Dropout`, `LmHead`).
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        let _ = tp;
        meshgrad_tensor::bail!(
            "tensor-parallel plan: module `{path}` ({}) has no {style:?} form",
            self.module_type()
        )
    }

    /// Calls `f(name, param)` for every parameter in the tree, names prefixed by `prefix` (`""`
    /// at the top).
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(String, &Var)) {
        self.visit_children(&mut |name, child| {
            let path = join(prefix, name);
            match child {
                Child::Param(v) => f(path, v),
                Child::Module(m) => m.visit_params(&path, f),
            }
        });
    }

    /// Calls `f(path, module)` for this module (path `prefix`) and every submodule below it, in
    /// pre-order.
    fn visit_modules(&self, prefix: &str, f: &mut dyn FnMut(&str, &dyn Module)) {
        f(prefix, self.as_dyn_module());
        self.visit_children(&mut |name, child| {
            if let Child::Module(m) = child {
                m.visit_modules(&join(prefix, name), f);
            }
        });
    }

    /// Switches dropout (and any other mode-dependent behaviour) in the whole tree between
    /// training and eval.
    fn set_training(&self, training: bool) {
        self.visit_modules("", &mut |_, m| m.set_own_training(training));
    }

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

    /// The parameters that are not frozen (see [`Module::freeze`]).
    fn trainable_parameters(&self) -> Vec<(String, Var)> {
        self.named_parameters()
            .into_iter()
            .filter(|(_, v)| v.requires_grad())
            .collect()
    }

    /// The paths of every submodule (the root is `""`).
    fn module_paths(&self) -> Vec<String> {
        let mut out = Vec::new();
        self.visit_modules("", &mut |p, _| out.push(p.to_string()));
        out
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

    /// Freezes the parameters selected by `pattern` (see [`path_matches`]: a parameter name or
    /// a module path, `*` matching one component, e.g. `h.*.attn` or `wte.weight`): they get no
    /// gradient and the optimizers skip them. Returns how many were frozen; an error naming the
    /// module's top-level children if the pattern selects nothing.
    fn freeze(&self, pattern: &str) -> Result<usize> {
        set_frozen(self, pattern, true)
    }

    /// Undoes [`Module::freeze`] for the parameters selected by `pattern`.
    fn unfreeze(&self, pattern: &str) -> Result<usize> {
        set_frozen(self, pattern, false)
    }

    /// Writes every parameter, by name, to a safetensors file (atomically: the file holds its old
    /// contents or the complete new ones).
    fn save(&self, path: impl AsRef<std::path::Path>) -> Result<()>
    where
        Self: Sized,
    {
        crate::state::save_safetensors(path, &crate::state::state_dict(self), None)
    }

    /// Loads every parameter from a safetensors file written by [`Module::save`] (or any file with
    /// the same names and shapes), strictly: a missing, unknown or misshapen tensor is an error
    /// naming it, and on error the module is unchanged.
    fn load(&self, path: impl AsRef<std::path::Path>) -> Result<()>
    where
        Self: Sized,
    {
        let tensors = crate::state::load_safetensors(path)?;
        crate::state::load_state_dict(self, &tensors, true)
    }
}

fn set_frozen<M: Module + ?Sized>(m: &M, pattern: &str, frozen: bool) -> Result<usize> {
    let mut n = 0;
    let mut err = None;
    m.visit_params("", &mut |name, v| {
        if err.is_none() && path_selects(pattern, &name) {
            match v.set_requires_grad(!frozen) {
                Ok(()) => n += 1,
                Err(e) => err = Some(e),
            }
        }
    });
    if let Some(e) = err {
        return Err(e);
    }
    if n == 0 {
        meshgrad_tensor::bail!(
            "{}: pattern `{pattern}` selects no parameter of this {} (its children: {})",
            if frozen { "freeze" } else { "unfreeze" },
            m.module_type(),
            child_names(m).join(", ")
        );
    }
    Ok(n)
}

/// The names of a module's immediate children (for error messages).
pub fn child_names<M: Module + ?Sized>(m: &M) -> Vec<String> {
    let mut out = Vec::new();
    m.visit_children(&mut |n, _| out.push(n.to_string()));
    out
}

/// Whether the dotted path `pattern` matches `path` component by component, `*` matching any
/// one component (`h.*` matches `h.3` but not `h.3.attn` or `h`).
pub fn path_matches(pattern: &str, path: &str) -> bool {
    let (mut p, mut q) = (pattern.split('.'), path.split('.'));
    loop {
        match (p.next(), q.next()) {
            (None, None) => return true,
            (Some(a), Some(b)) if a == "*" || a == b => {}
            _ => return false,
        }
    }
}

/// Whether `pattern` selects parameter `name`: the pattern matches the name itself or one of its
/// ancestors (`h.*` selects `h.3.attn.c_attn.weight`).
pub fn path_selects(pattern: &str, name: &str) -> bool {
    let parts: Vec<&str> = name.split('.').collect();
    let n = pattern.split('.').count();
    n <= parts.len() && path_matches(pattern, &parts[..n].join("."))
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

/// A module with a forward pass from one variable to one variable: what [`crate::Sequential`]
/// chains and what generic wrappers call. Models with several inputs (token ids, masks) add
/// their own methods.
pub trait Forward: Module {
    /// Applies the module to `x`.
    fn forward(&self, x: &Var) -> Result<Var>;
}

impl<M: Module + ?Sized> Module for Box<M> {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        (**self).visit_children(f)
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        (**self).parallelize(path, style, tp)
    }
    fn module_type(&self) -> &'static str {
        (**self).module_type()
    }
    fn set_own_training(&self, training: bool) {
        (**self).set_own_training(training)
    }
    fn on_init(&self, path: &str, seed: u64) {
        (**self).on_init(path, seed)
    }
}

impl<M: Module + ?Sized> Module for Arc<M> {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        (**self).visit_children(f)
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        (**self).parallelize(path, style, tp)
    }
    fn module_type(&self) -> &'static str {
        (**self).module_type()
    }
    fn set_own_training(&self, training: bool) {
        (**self).set_own_training(training)
    }
    fn on_init(&self, path: &str, seed: u64) {
        (**self).on_init(path, seed)
    }
}

impl<M: Forward + ?Sized> Forward for Box<M> {
    fn forward(&self, x: &Var) -> Result<Var> {
        (**self).forward(x)
    }
}

impl<M: Forward + ?Sized> Forward for Arc<M> {
    fn forward(&self, x: &Var) -> Result<Var> {
        (**self).forward(x)
    }
}

/// What a struct field can contribute to its module's children (used by the derive).
pub trait ModuleField {
    /// Visits the field's parameters and submodules under `name`.
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>));
}

impl ModuleField for Var {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>)) {
        f(name, Child::Param(self))
    }
}

impl<M: Module> ModuleField for M {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>)) {
        f(name, Child::Module(self))
    }
}

/// Views a module as `&dyn Module` (implemented for every sized module; lets provided methods
/// of [`Module`] hand `self` out as a trait object).
pub trait AsDynModule {
    /// `self` as a trait object.
    fn as_dyn_module(&self) -> &dyn Module;
}

impl<M: Module> AsDynModule for M {
    fn as_dyn_module(&self) -> &dyn Module {
        self
    }
}

impl<T: ModuleField> ModuleField for Option<T> {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>)) {
        if let Some(x) = self {
            x.visit_field(name, f)
        }
    }
}

impl<T: ModuleField> ModuleField for Vec<T> {
    fn visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>)) {
        for (i, x) in self.iter().enumerate() {
            x.visit_field(&format!("{name}.{i}"), f)
        }
    }
}

/// Support code for `#[derive(Module)]`: picks [`ModuleField`] for fields that implement it and
/// ignores every other field (plain data), by method-resolution order. Not part of the API.
#[doc(hidden)]
pub mod __derive {
    use super::{Child, ModuleField};

    /// Wraps a field reference.
    pub struct Wrap<'a, T: ?Sized>(pub &'a T);

    /// Chosen for fields that are parameters or modules.
    pub trait ViaField {
        /// Visits the field.
        fn __visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>));
    }

    impl<T: ModuleField + ?Sized> ViaField for &Wrap<'_, T> {
        fn __visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>)) {
            self.0.visit_field(name, f)
        }
    }

    /// Chosen for every other field: nothing to visit.
    pub trait ViaNothing {
        /// Does nothing.
        fn __visit_field(&self, name: &str, f: &mut dyn FnMut(&str, Child<'_>));
    }

    impl<T: ?Sized> ViaNothing for Wrap<'_, T> {
        fn __visit_field(&self, _name: &str, _f: &mut dyn FnMut(&str, Child<'_>)) {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_components() {
        assert!(path_matches("h.*", "h.3"));
        assert!(!path_matches("h.*", "h.3.attn"));
        assert!(!path_matches("h.*", "h"));
        assert!(path_matches("wte", "wte"));
        assert!(path_selects("h.*", "h.3.attn.c_attn.weight"));
        assert!(path_selects("h.1", "h.1.ln_1.weight"));
        assert!(!path_selects("h.1", "h.10.ln_1.weight"));
        assert!(path_selects("wte.weight", "wte.weight"));
        assert!(!path_selects("wte.weight.x", "wte.weight"));
    }
}

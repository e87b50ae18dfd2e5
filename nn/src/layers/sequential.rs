//! `Sequential`: layers applied one after another.

use meshgrad_autograd::Var;
use meshgrad_tensor::Result;

use crate::module::{Child, Forward, Module};

/// Layers applied in order, named `0`, `1`, ... (as PyTorch's `nn.Sequential`).
///
/// ```
/// use meshgrad_nn::{Activation, Forward, Linear, Module, ParamBuilder, Sequential};
/// let mlp = ParamBuilder::new(7).build(|p| {
///     Ok(Sequential::new()
///         .push(Linear::new(p, 8, 32)?)
///         .push(Activation::Gelu)
///         .push(Linear::new(p, 32, 8)?))
/// })?;
/// assert_eq!(mlp.named_parameters()[2].0, "2.weight");
/// # Ok::<(), meshgrad_tensor::Error>(())
/// ```
#[derive(Default)]
pub struct Sequential {
    layers: Vec<Box<dyn Forward>>,
}

impl Sequential {
    /// An empty sequence (the identity).
    pub fn new() -> Self {
        Sequential::default()
    }

    /// Appends a layer.
    pub fn push(mut self, layer: impl Forward + 'static) -> Self {
        self.layers.push(Box::new(layer));
        self
    }

    /// The number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether there are no layers.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// Layer `i`.
    pub fn get(&self, i: usize) -> Option<&dyn Forward> {
        self.layers.get(i).map(|b| &**b)
    }
}

impl Module for Sequential {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        for (i, l) in self.layers.iter().enumerate() {
            f(&i.to_string(), Child::Module(l.as_ref().as_dyn_module()));
        }
    }
    fn module_type(&self) -> &'static str {
        "Sequential"
    }
}

impl Forward for Sequential {
    fn forward(&self, x: &Var) -> Result<Var> {
        let mut x = x.clone();
        for (i, l) in self.layers.iter().enumerate() {
            x = l.forward(&x).map_err(|e| {
                meshgrad_tensor::Error::msg(format!(
                    "sequential layer {i} ({}): {e}",
                    l.module_type()
                ))
            })?;
        }
        Ok(x)
    }
}

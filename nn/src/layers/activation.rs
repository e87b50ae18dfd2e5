//! Parameter-free activations as modules (for [`super::Sequential`]).

use meshgrad_autograd::Var;
use meshgrad_tensor::{GeluKind, Result};

use crate::module::{Child, Forward, Module};

/// An elementwise activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `max(x, 0)`
    Relu,
    /// GELU, tanh approximation (GPT-2).
    Gelu,
    /// GELU, exact (erf; BERT).
    GeluExact,
    /// `tanh(x)`
    Tanh,
    /// `1 / (1 + exp(-x))`
    Sigmoid,
}

impl Module for Activation {
    fn visit_children(&self, _f: &mut dyn FnMut(&str, Child<'_>)) {}
    fn module_type(&self) -> &'static str {
        "Activation"
    }
}

impl Forward for Activation {
    fn forward(&self, x: &Var) -> Result<Var> {
        match self {
            Activation::Relu => x.relu(),
            Activation::Gelu => x.gelu(GeluKind::Tanh),
            Activation::GeluExact => x.gelu(GeluKind::Erf),
            Activation::Tanh => x.tanh(),
            Activation::Sigmoid => x.sigmoid(),
        }
    }
}

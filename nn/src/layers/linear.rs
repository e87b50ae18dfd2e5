//! Fully connected layer.

use std::sync::OnceLock;

use meshgrad_autograd::distributed::{
    all_gather_dim, all_reduce_backward, all_reduce_forward, reduce_scatter_dim,
};
use meshgrad_autograd::Var;
use meshgrad_tensor::{GeluKind, Result};

use crate::module::{Child, Forward, Module};
use crate::param_builder::{Init, ParamBuilder};
use crate::tp::reference::{add_bias_positions, column_linear, linear_positions, row_linear};
use crate::tp::{ParallelStyle, TensorParallel};

/// `y = x Wᵀ + b` with `W` stored `[out, in]` (the PyTorch `nn.Linear` convention; the
/// transposed read is a strided view, never a copy).
///
/// Under tensor parallelism ([`ParallelStyle::Colwise`] / [`ParallelStyle::Rowwise`]) the
/// parameters hold this rank's rows / columns and the forward communicates (see [`crate::tp`]).
/// Under [`ParallelStyle::SequenceParallel`] the layer stays replicated and, with sequence
/// parallelism on, applies to this rank's positions, its gradients summed over the ranks (BERT's
/// MLM-head transform).
pub struct Linear {
    /// `[out_features, in_features]` (this rank's part under tensor parallelism)
    pub weight: Var,
    /// `[out_features]`, if present.
    pub bias: Option<Var>,
    path: OnceLock<String>,
    tp: OnceLock<(ParallelStyle, TensorParallel)>,
}

/// Options of a [`Linear`] layer: sizes, bias, and the weight's initial standard deviation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearConfig {
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// Whether the layer has a bias (zero-initialised). Default true.
    pub bias: bool,
    /// The weight is drawn from N(0, std). Default 0.02 (GPT-2).
    pub std: f64,
}

impl LinearConfig {
    /// `in_features -> out_features` with a bias and N(0, 0.02) weights.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        LinearConfig {
            in_features,
            out_features,
            bias: true,
            std: 0.02,
        }
    }

    /// With or without a bias.
    pub fn bias(mut self, bias: bool) -> Self {
        self.bias = bias;
        self
    }

    /// The weight's initial standard deviation.
    pub fn std(mut self, std: f64) -> Self {
        self.std = std;
        self
    }

    /// Creates the layer's parameters through `p`.
    pub fn build(self, p: &ParamBuilder) -> Result<Linear> {
        let weight = p.param(
            (self.out_features, self.in_features),
            Init::Normal(self.std),
        )?;
        let bias = if self.bias {
            Some(p.param(self.out_features, Init::Zeros)?)
        } else {
            None
        };
        Ok(Linear {
            weight,
            bias,
            path: OnceLock::new(),
            tp: OnceLock::new(),
        })
    }
}

impl Linear {
    /// `in_features -> out_features` with a bias and N(0, 0.02) weights (see [`LinearConfig`]
    /// for the other options).
    pub fn new(p: &ParamBuilder, in_features: usize, out_features: usize) -> Result<Self> {
        LinearConfig::new(in_features, out_features).build(p)
    }

    /// The layer's path in its model (empty before [`ParamBuilder::init`]).
    pub fn path(&self) -> &str {
        self.path.get().map(String::as_str).unwrap_or("")
    }
}

impl Forward for Linear {
    /// Applies the layer to `x [..., in]`.
    fn forward(&self, x: &Var) -> Result<Var> {
        self.forward_with(x, None)
    }
}

impl Linear {
    /// `gelu(layer(x))` for `x [..., in]`: the same values and gradients as
    /// `self.forward(x)?.gelu(kind)`, with the GELU fused into the layer's product
    /// ([`Var::linear_gelu`]) wherever the layer's output is one local product: unsharded,
    /// column-parallel (after the input's all-gather or identity, exactly as
    /// [`Forward::forward`] communicates; the GELU applies to this rank's output features) and
    /// sequence-parallel. A row-parallel layer sums over the ranks before its bias, so there the
    /// GELU stays a separate op after the communication.
    pub fn forward_gelu(&self, x: &Var, kind: GeluKind) -> Result<Var> {
        self.forward_with(x, Some(kind))
    }

    /// The forward, with the GELU of `gelu` applied to the output when given.
    fn forward_with(&self, x: &Var, gelu: Option<GeluKind>) -> Result<Var> {
        let in_features = self.weight.tensor().dims()[1];
        if x.tensor().dims().last() != Some(&in_features) {
            meshgrad_tensor::bail!(
                "linear {}: input of shape {} does not end in in_features {in_features} (weight {})",
                self.path(),
                x.tensor().shape(),
                self.weight.tensor().shape()
            );
        }
        match self.tp.get() {
            // Reference mode's folded position order: the layer once per position leaf.
            Some((style, tp)) if tp.is_active() => match tp.folded_for(x.tensor()) {
                Some(folded) => {
                    let mut params = vec![&self.weight];
                    params.extend(self.bias.as_ref());
                    folded.leafwise(x, 1, &params, |xl| {
                        self.forward_parallel(xl, *style, tp, gelu)
                    })
                }
                None => self.forward_parallel(x, *style, tp, gelu),
            },
            // One fused op: a single gemm over all rows with the bias as its starting value.
            _ => local(x, &self.weight, self.bias.as_ref(), gelu),
        }
    }

    /// Column-parallel: the (sequence-gathered or replicated) input times this rank's rows.
    /// Row-parallel: this rank's columns times its input features, summed over the ranks (or
    /// reduce-scattered along the sequence), then the replicated bias. Sequence-parallel: the
    /// replicated layer on this rank's positions, its parameters' gradients summed. `gelu`: the
    /// GELU applied to the result (fused into the local product but in the row-parallel case).
    /// In reference mode (also on one device) the split products are computed piece by piece
    /// ([`column_linear`], [`row_linear`], the GELU after them), and a row-parallel bias's and a
    /// sequence-parallel layer's parameter gradients are trees over position chunks.
    fn forward_parallel(
        &self,
        x: &Var,
        style: ParallelStyle,
        tp: &TensorParallel,
        gelu: Option<GeluKind>,
    ) -> Result<Var> {
        let g = &tp.group;
        let sp = tp.splits_sequence();
        match style {
            ParallelStyle::SequenceParallel => {
                let (w, b) = tp.replicated_params(&self.weight, self.bias.as_ref())?;
                match tp.position_chunks() {
                    // Reference mode (also on one device): parameter gradients as trees over
                    // position chunks, the same with or without sequence parallelism.
                    Some(chunks) => {
                        let y = linear_positions(x, &w, b.as_ref(), chunks)?;
                        match gelu {
                            Some(kind) => y.gelu(kind),
                            None => Ok(y),
                        }
                    }
                    None => local(x, &w, b.as_ref(), gelu),
                }
            }
            ParallelStyle::Colwise { chunks } => {
                let x = if sp {
                    all_gather_dim(x, 1, g)?
                } else {
                    all_reduce_backward(x, g)?
                };
                match tp.local_chunks() {
                    Some(units) => {
                        let y = column_linear(&x, &self.weight, self.bias.as_ref(), chunks, units)?;
                        match gelu {
                            Some(kind) => y.gelu(kind),
                            None => Ok(y),
                        }
                    }
                    None => local(&x, &self.weight, self.bias.as_ref(), gelu),
                }
            }
            _ => {
                let y = self.forward_rowwise(x, tp)?;
                match gelu {
                    Some(kind) => y.gelu(kind),
                    None => Ok(y),
                }
            }
        }
    }

    /// The row-parallel forward (see [`Linear::forward_parallel`]).
    fn forward_rowwise(&self, x: &Var, tp: &TensorParallel) -> Result<Var> {
        let g = &tp.group;
        let sp = tp.splits_sequence();
        let partial = match tp.local_chunks() {
            Some(chunks) => row_linear(x, &self.weight, chunks)?,
            None => Var::linear(x, &self.weight, None)?,
        };
        let y = if sp {
            reduce_scatter_dim(&partial, 1, g)?
        } else {
            all_reduce_forward(&partial, g)?
        };
        // No backward reads the partial product (the product's backward reads its input and
        // weight, the reduction's nothing): free it now instead of when the graph goes, when
        // this handle is the only one left to it (a group may still hold it, or have returned
        // it as the sum).
        let reduced = g.size() > 1;
        release_if_exclusive(&partial, reduced);
        let b = match &self.bias {
            None => return Ok(y),
            // Under sequence parallelism each rank adds the bias to its own positions, so its
            // gradient is summed over the ranks.
            Some(b) if sp => all_reduce_backward(b, g)?,
            Some(b) => b.clone(),
        };
        match tp.position_chunks() {
            Some(chunks) => add_bias_positions(&y, &b, chunks),
            None => {
                let out = y.add(&b)?;
                // Nor does any backward read the sum once the bias is added.
                release_if_exclusive(&y, reduced);
                Ok(out)
            }
        }
    }
}

/// Frees `v`'s values when `when` and its tensor handle is the only one to its storage (no
/// clone, view or communicator holds it): its graph node keeps only the shape.
fn release_if_exclusive(v: &Var, when: bool) {
    if when && v.tensor().is_exclusive() {
        v.tensor().release_storage();
    }
}

/// One local layer: `x Wᵀ + b`, with the GELU of `gelu` fused in when given.
fn local(x: &Var, w: &Var, b: Option<&Var>, gelu: Option<GeluKind>) -> Result<Var> {
    match gelu {
        None => Var::linear(x, w, b),
        Some(kind) => Var::linear_gelu(x, w, b, kind),
    }
}

impl Module for Linear {
    fn visit_children(&self, f: &mut dyn FnMut(&str, Child<'_>)) {
        f("weight", Child::Param(&self.weight));
        if let Some(b) = &self.bias {
            f("bias", Child::Param(b));
        }
    }
    fn module_type(&self) -> &'static str {
        "Linear"
    }
    fn on_init(&self, path: &str, _seed: u64) {
        let _ = self.path.set(path.to_string());
    }
    fn parallelize(&self, path: &str, style: &ParallelStyle, tp: &TensorParallel) -> Result<()> {
        if !matches!(
            style,
            ParallelStyle::Colwise { .. }
                | ParallelStyle::Rowwise
                | ParallelStyle::SequenceParallel
        ) {
            meshgrad_tensor::bail!(
                "tensor-parallel plan: linear `{path}` takes Colwise, Rowwise or \
                 SequenceParallel, not {style:?}"
            );
        }
        let _ = self.tp.set((*style, tp.clone()));
        Ok(())
    }
}

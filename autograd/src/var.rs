//! `Var`: a tensor that records how it was computed, so gradients can flow back to it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use meshgrad_tensor::{Result, Tensor};

use crate::distributed::Placement;
use crate::engine::DeferredWeightGrads;
use crate::grad_mode;

/// A process-unique, creation-ordered variable identity. Later vars have larger ids, which the
/// backward engine uses to run nodes in a fixed order (reverse creation order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VarId(u64);

impl VarId {
    pub(crate) fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        VarId(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// The backward function of a node: from the gradient of the node's output and a mask of the
/// inputs whose gradients the engine wants (one `bool` per input, in order), the gradients of its
/// inputs (`None` for an input that gets none).
///
/// The mask lets a rule skip work: `wanted[i]` is false for an input that does not require grad,
/// and, in the split backward ([`Var::backward_input`]), for the inputs whose gradients belong
/// to the other pass (the parameters during the input pass, the activations during the weight
/// pass). A rule may ignore the mask and compute every gradient: a gradient returned for an
/// unwanted input that requires grad is still used (the input pass keeps it for the weight
/// pass), and `None` for an unwanted input means "not computed". A rule must return the same
/// gradient for a wanted input whatever else the mask says (that is what makes the split
/// backward bit-identical to the full one).
pub type BackwardFn = Box<dyn Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync>;

/// A hook run when a leaf's gradient for the current backward pass is complete (accumulated).
pub type GradReadyHook = Arc<dyn Fn(&Var) -> Result<()> + Send + Sync>;

/// A hook run on a non-leaf just before its node's backward function runs.
pub type PreBackwardHook = Arc<dyn Fn(&Var) -> Result<()> + Send + Sync>;

pub(crate) struct Node {
    pub(crate) op: &'static str,
    pub(crate) inputs: Vec<Var>,
    pub(crate) backward: BackwardFn,
    pub(crate) pre_hooks: Mutex<Vec<PreBackwardHook>>,
}

pub(crate) struct VarInner {
    pub(crate) id: VarId,
    pub(crate) value: Tensor,
    pub(crate) requires_grad: AtomicBool,
    pub(crate) node: Option<Node>,
    pub(crate) grad: Mutex<Option<Tensor>>,
    pub(crate) grad_hooks: Mutex<Vec<GradReadyHook>>,
    pub(crate) placement: Mutex<Option<Placement>>,
}

/// A differentiable value: a tensor plus, for results of ops on variables that require grad,
/// the node that computed it. Cloning is cheap and shares the variable.
#[derive(Clone)]
pub struct Var(pub(crate) Arc<VarInner>);

/// Prints the value as a tensor prints (see [`Tensor::fmt_named`]) under the name `Var`, with
/// `requires_grad` and, for a recorded result, the op that computed it:
/// `Var([1.0000, 2.0000], shape=[2], dtype=f32, device=cpu, requires_grad=true, op=mul)`.
impl std::fmt::Debug for Var {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let requires_grad = self.requires_grad();
        match &self.0.node {
            Some(n) => self.0.value.fmt_named(
                f,
                "Var",
                &[("requires_grad", &requires_grad), ("op", &n.op)],
            ),
            None => self
                .0
                .value
                .fmt_named(f, "Var", &[("requires_grad", &requires_grad)]),
        }
    }
}

/// The same as `Debug`.
impl std::fmt::Display for Var {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self, f)
    }
}

impl Var {
    fn build(value: Tensor, requires_grad: bool, node: Option<Node>) -> Var {
        Var(Arc::new(VarInner {
            id: VarId::next(),
            value,
            requires_grad: AtomicBool::new(requires_grad),
            node,
            grad: Mutex::new(None),
            grad_hooks: Mutex::new(Vec::new()),
            placement: Mutex::new(None),
        }))
    }

    /// A leaf that does not require grad (a constant).
    pub fn constant(value: Tensor) -> Var {
        Var::build(value, false, None)
    }

    /// A leaf that requires grad (a parameter or an input being differentiated).
    pub fn leaf(value: Tensor) -> Var {
        Var::build(value, true, None)
    }

    /// The result of an op: a node is recorded when grad mode is on and any input requires grad;
    /// otherwise the result is a constant. `backward` maps the output gradient (and the mask of
    /// wanted inputs, see [`BackwardFn`]) to one optional gradient per input. This is how every op (and every custom function) joins the graph.
    pub fn from_op(op: &'static str, value: Tensor, inputs: &[&Var], backward: BackwardFn) -> Var {
        let needs = inputs.iter().any(|v| v.requires_grad());
        if !needs {
            return Var::constant(value);
        }
        if !grad_mode::is_enabled() {
            grad_mode::record_leaves(inputs);
            return Var::constant(value);
        }
        let node = Node {
            op,
            inputs: inputs.iter().map(|v| (*v).clone()).collect(),
            backward,
            pre_hooks: Mutex::new(Vec::new()),
        };
        Var::build(value, true, Some(node))
    }

    /// This variable's identity.
    pub fn id(&self) -> VarId {
        self.0.id
    }

    /// How this variable is split across ranks (`None`: replicated, or not parallel at all).
    /// Parameters of tensor-parallel layers record theirs (see [`Placement`]); gradient
    /// clipping, checkpoints and sharded data parallelism read it.
    pub fn placement(&self) -> Option<Placement> {
        self.0
            .placement
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records how this variable is split across ranks (see [`Var::placement`]).
    pub fn set_placement(&self, placement: Option<Placement>) {
        *self.0.placement.lock().unwrap_or_else(|e| e.into_inner()) = placement;
    }

    /// The value.
    pub fn tensor(&self) -> &Tensor {
        &self.0.value
    }

    /// Whether gradients flow to this variable.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Freezes (`false`) or unfreezes (`true`) a leaf: a frozen parameter receives no gradient
    /// and ops on it record no graph unless another input requires grad. Changing it affects
    /// ops recorded afterwards. An error on a non-leaf, whose gradient requirement follows from
    /// its inputs.
    pub fn set_requires_grad(&self, requires_grad: bool) -> Result<()> {
        if !self.is_leaf() {
            meshgrad_tensor::bail!(
                "set_requires_grad: {} is the result of op {}, not a leaf; detach() it first",
                self.tensor().shape(),
                self.op_name().unwrap_or("?")
            );
        }
        self.0.requires_grad.store(requires_grad, Ordering::Relaxed);
        Ok(())
    }

    /// Whether this is a leaf (not computed by a recorded op).
    pub fn is_leaf(&self) -> bool {
        self.0.node.is_none()
    }

    /// The name of the op that computed this variable, if recorded.
    pub fn op_name(&self) -> Option<&'static str> {
        self.0.node.as_ref().map(|n| n.op)
    }

    /// A constant with the same value (shares storage; no gradient flows through it).
    pub fn detach(&self) -> Var {
        Var::constant(self.0.value.clone())
    }

    /// The accumulated gradient of a leaf, if any.
    pub fn grad(&self) -> Option<Tensor> {
        self.0
            .grad
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Replaces the accumulated gradient (data-parallel wrappers write reduced gradients here).
    pub fn set_grad(&self, grad: Option<Tensor>) {
        *self.0.grad.lock().unwrap_or_else(|e| e.into_inner()) = grad;
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        self.set_grad(None)
    }

    /// Adds `g` to the accumulated gradient (sets it if none). The accumulated gradient counts
    /// as [`MemoryTag::Grads`](meshgrad_tensor::alloc::MemoryTag::Grads) in the memory tracker,
    /// whatever was current when the backward allocated it.
    pub(crate) fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        let mut slot = self.0.grad.lock().unwrap_or_else(|e| e.into_inner());
        let sum = match slot.take() {
            None => g,
            Some(old) => crate::engine::accumulate(old, g)?,
        };
        sum.retag_memory(meshgrad_tensor::alloc::MemoryTag::Grads);
        *slot = Some(sum);
        Ok(())
    }

    /// Registers a hook run when this leaf's gradient for a backward pass is complete.
    pub fn register_grad_ready_hook(&self, hook: GradReadyHook) {
        self.0
            .grad_hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(hook);
    }

    /// Removes all gradient-ready hooks of this leaf.
    pub fn clear_grad_ready_hooks(&self) {
        self.0
            .grad_hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Registers a hook run just before the backward of the node that computed this variable.
    /// An error if this is a leaf (it has no node).
    pub fn register_pre_backward_hook(&self, hook: PreBackwardHook) -> Result<()> {
        match &self.0.node {
            Some(n) => {
                n.pre_hooks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(hook);
                Ok(())
            }
            None => Err(meshgrad_tensor::Error::msg(
                "register_pre_backward_hook: a leaf has no backward node",
            )),
        }
    }

    /// Runs backward from this scalar (one-element) variable with gradient 1, accumulating into
    /// the `.grad` of every leaf that requires grad.
    pub fn backward(&self) -> Result<()> {
        if self.tensor().elem_count() != 1 {
            meshgrad_tensor::bail!(
                "backward: needs a one-element output, got shape {}; use backward_with to supply a gradient",
                self.tensor().shape()
            );
        }
        let one = self.tensor().ones_like()?;
        crate::engine::backward(&[(self.clone(), one)])
    }

    /// Runs backward from this variable with the supplied gradient (same shape as the value).
    pub fn backward_with(&self, grad: Tensor) -> Result<()> {
        crate::engine::backward(&[(self.clone(), grad)])
    }

    /// The input pass of a split backward from this variable (with `grad`, or 1 for a
    /// one-element variable when `None`): accumulates into the `.grad` of `inputs` (leaves, such
    /// as a pipeline stage's input activation) and defers every other leaf's gradient (the
    /// parameters') to the returned [`DeferredWeightGrads`], whose
    /// [`run`](DeferredWeightGrads::run) finishes the backward. Both passes together give the
    /// gradients of one full backward, bit for bit; see [`crate::backward_input`].
    ///
    /// ```
    /// use meshgrad_autograd::Var;
    /// use meshgrad_tensor::{Device, Tensor};
    /// let x = Var::leaf(Tensor::from_vec(vec![1f32, 2.], (1, 2), Device::Cpu)?);
    /// let w = Var::leaf(Tensor::from_vec(vec![3f32, 4.], (1, 2), Device::Cpu)?);
    /// let y = Var::linear(&x, &w, None)?.sum_all()?;
    /// let weights = y.backward_input(None, &[x.clone()])?;
    /// assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![3., 4.]);
    /// assert!(w.grad().is_none()); // not yet
    /// weights.run()?;
    /// assert_eq!(w.grad().unwrap().to_vec::<f32>()?, vec![1., 2.]);
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn backward_input(
        &self,
        grad: Option<Tensor>,
        inputs: &[Var],
    ) -> Result<DeferredWeightGrads> {
        let grad = match grad {
            Some(g) => g,
            None => {
                if self.tensor().elem_count() != 1 {
                    meshgrad_tensor::bail!(
                        "backward_input: needs a one-element output without a gradient, got \
                         shape {}",
                        self.tensor().shape()
                    );
                }
                self.tensor().ones_like()?
            }
        };
        crate::engine::backward_input(&[(self.clone(), grad)], inputs)
    }
}

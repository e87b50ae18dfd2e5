//! The backward engine: runs the recorded graph in reverse, in a fixed order.
//!
//! Order: a leaf whose gradient is complete is handled (accumulated, hooks fired) before any
//! further node runs, so gradient-ready hooks fire as early as possible, in reverse order of use;
//! among the nodes whose output gradient is complete, the most recently created runs first.
//! Gradient contributions to one variable are summed in that processing order, so a backward
//! pass is bit-for-bit repeatable.
//!
//! # Split backward
//!
//! [`backward_input`] and [`DeferredWeightGrads::run`] split one backward in two passes, as a
//! zero-bubble pipeline needs: the input pass computes only the gradients of some input leaves
//! (what the previous pipeline stage waits for), the weight pass later the parameters'. The
//! input pass runs the nodes with a path to those inputs, in the order above, and asks their
//! rules for the input-side gradients only (the mask of [`BackwardFn`](crate::BackwardFn)); the
//! weight pass replays the same order over the whole graph without running the input side again,
//! except the rules that left weight-side gradients out, which run again for those alone. So
//! every gradient is summed in the same order as in one full backward: the same bits.

use std::cell::Cell;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};

use meshgrad_tensor::{profile, Error, Result, Tensor};

use crate::var::{Node, Var, VarId};

/// What the engine does with leaf gradients.
enum Sink<'a> {
    /// Accumulate into `.grad` and fire gradient-ready hooks.
    Accumulate,
    /// Return the gradients of exactly these variables; touch no `.grad`.
    Capture(&'a [Var]),
}

/// Runs backward from `roots` (each with its gradient), accumulating into leaf `.grad`s and
/// firing gradient-ready hooks as each leaf's gradient completes.
pub fn backward(roots: &[(Var, Tensor)]) -> Result<()> {
    run(roots, Sink::Accumulate, None).map(|_| ())
}

/// Computes the gradients of `roots` with respect to `wrt` (like `torch.autograd.grad`),
/// without touching any `.grad`. A variable the roots do not depend on gets `None`.
pub fn grad(roots: &[(Var, Tensor)], wrt: &[Var]) -> Result<Vec<Option<Tensor>>> {
    run(roots, Sink::Capture(wrt), None)
}

thread_local! {
    /// How many backward passes ([`backward`] or [`grad`]) are running on this thread (nested:
    /// a checkpointed block's backward runs `grad` inside the outer pass).
    static BACKWARD_DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Whether a backward pass ([`backward`] or [`grad`]) is running on this thread: true inside
/// backward closures, gradient-ready and pre-backward hooks, and the forward that activation
/// checkpointing recomputes during backward. Sharded data parallelism asks it to tell whether
/// a parameter is read by the forward or by the backward.
pub fn is_backward_running() -> bool {
    BACKWARD_DEPTH.with(|d| d.get() > 0)
}

/// Marks this thread as running a backward pass while alive (panic-safe).
struct BackwardScope;

impl BackwardScope {
    fn enter() -> Self {
        BACKWARD_DEPTH.with(|d| d.set(d.get() + 1));
        BackwardScope
    }
}

impl Drop for BackwardScope {
    fn drop(&mut self) {
        BACKWARD_DEPTH.with(|d| d.set(d.get() - 1));
    }
}

fn run(
    roots: &[(Var, Tensor)],
    sink: Sink<'_>,
    split: Option<Split>,
) -> Result<Vec<Option<Tensor>>> {
    let _phase = profile::phase(profile::Phase::Backward);
    let _scope = BackwardScope::enter();
    let (mut consumers, vars) = discover(roots)?;
    // The weight pass of a split backward replays this full order; the input side's nodes are
    // not run again (see `Split`).
    let weight_pass = split.is_some();
    let (input_side, reached, mut recorded) = match split {
        Some(s) => (s.input_side, s.reached, s.nodes),
        None => (HashSet::new(), HashSet::new(), HashMap::new()),
    };
    let side = if weight_pass {
        Side::Weight {
            input_side: &input_side,
            reached: &reached,
        }
    } else {
        Side::Full
    };

    let capture: BTreeMap<VarId, usize> = match &sink {
        Sink::Capture(w) => w.iter().enumerate().map(|(i, v)| (v.id(), i)).collect(),
        Sink::Accumulate => BTreeMap::new(),
    };
    let mut captured: Vec<Option<Tensor>> = vec![None; capture.len()];

    let mut pending: HashMap<VarId, Tensor> = HashMap::new();
    let mut ready: BinaryHeap<(bool, VarId)> = BinaryHeap::new();
    for (v, g) in roots {
        if !side.replayed(v.id()) {
            add_into(&mut pending, v.id(), g.clone())?;
        }
    }
    for (v, _) in roots {
        if consumers.get(&v.id()).copied().unwrap_or(0) == 0
            && !ready.iter().any(|&r| r == ready_key(v))
        {
            ready.push(ready_key(v));
        }
    }

    while let Some((_, id)) = ready.pop() {
        let v = vars[&id].clone();
        if side.replayed(id) {
            // Weight pass, input side: the input pass ran this node (or handled this leaf);
            // deliver its gradients for the weight side now, in the full backward's order.
            if let Some(node) = &v.0.node {
                if let Some(d) = recorded.remove(&id) {
                    let grads = d.weight_grads(node, &v)?;
                    for (inp, gi) in node.inputs.iter().zip(grads) {
                        if let Some(gi) = gi {
                            add_into(&mut pending, inp.id(), gi)?;
                        }
                    }
                }
                release_inputs(node, &side, &mut consumers, &mut pending, &mut ready);
            }
            continue;
        }
        let g = pending
            .remove(&id)
            .expect("a ready variable has a gradient");
        if let Some(&slot) = capture.get(&id) {
            captured[slot] = Some(g.clone());
        }
        match &v.0.node {
            None => {
                if let Sink::Accumulate = sink {
                    accumulate_leaf(&v, g)?;
                }
            }
            Some(node) => {
                run_pre_hooks(&v)?;
                let wanted: Vec<bool> = node.inputs.iter().map(|i| i.requires_grad()).collect();
                let grads = call_backward(node, &g, &wanted)?;
                drop(g);
                for ((inp, gi), &w) in node.inputs.iter().zip(grads).zip(&wanted) {
                    if let (true, Some(gi)) = (w, gi) {
                        add_into(&mut pending, inp.id(), gi)?;
                    }
                }
                release_inputs(node, &side, &mut consumers, &mut pending, &mut ready);
            }
        }
    }
    Ok(captured)
}

/// Which variables a pass tracks, and how it tells that one got a gradient.
enum Side<'a> {
    /// An ordinary backward: every variable, gradients in `pending`.
    Full,
    /// The input pass of a split backward: only the input side.
    Input(&'a HashSet<VarId>),
    /// The weight pass: every variable; the input side is replayed from the input pass.
    Weight {
        input_side: &'a HashSet<VarId>,
        reached: &'a HashSet<VarId>,
    },
}

impl Side<'_> {
    /// Whether the pass counts this variable's consumers and may make it ready.
    fn tracks(&self, id: VarId) -> bool {
        match self {
            Side::Input(s) => s.contains(&id),
            _ => true,
        }
    }

    /// Whether the weight pass replays this variable from the input pass instead of running it.
    fn replayed(&self, id: VarId) -> bool {
        match self {
            Side::Weight { input_side, .. } => input_side.contains(&id),
            _ => false,
        }
    }

    /// Whether a gradient reached the variable (once all its consumers ran).
    fn has_grad(&self, id: VarId, pending: &HashMap<VarId, Tensor>) -> bool {
        match self {
            Side::Weight {
                input_side,
                reached,
            } if input_side.contains(&id) => reached.contains(&id),
            _ => pending.contains_key(&id),
        }
    }
}

/// Discovers the graph behind `roots` (checking the roots): every variable that requires grad,
/// by id, and for each the number of edges from recorded nodes into it.
fn discover(roots: &[(Var, Tensor)]) -> Result<(HashMap<VarId, usize>, HashMap<VarId, Var>)> {
    let mut consumers: HashMap<VarId, usize> = HashMap::new();
    let mut vars: HashMap<VarId, Var> = HashMap::new();
    let mut stack: Vec<Var> = Vec::new();
    for (v, g) in roots {
        if g.shape() != v.tensor().shape() {
            return Err(Error::ShapeMismatch {
                op: "backward (root gradient)",
                lhs: v.tensor().shape().clone(),
                rhs: g.shape().clone(),
            });
        }
        if !v.requires_grad() {
            meshgrad_tensor::bail!(
                "backward: the root ({:?}) does not require grad",
                v.tensor()
            );
        }
        if vars.insert(v.id(), v.clone()).is_none() {
            stack.push(v.clone());
        }
    }
    while let Some(v) = stack.pop() {
        if let Some(node) = &v.0.node {
            for inp in &node.inputs {
                if !inp.requires_grad() {
                    continue;
                }
                *consumers.entry(inp.id()).or_insert(0) += 1;
                if vars.insert(inp.id(), inp.clone()).is_none() {
                    stack.push(inp.clone());
                }
            }
        }
    }
    Ok((consumers, vars))
}

/// Accumulates a leaf's complete gradient into `.grad` and fires its gradient-ready hooks.
fn accumulate_leaf(v: &Var, g: Tensor) -> Result<()> {
    v.accumulate_grad(g)?;
    let hooks =
        v.0.grad_hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
    for h in hooks {
        h(v)?;
    }
    Ok(())
}

/// Fires the pre-backward hooks of the node that computed `v`.
fn run_pre_hooks(v: &Var) -> Result<()> {
    if let Some(node) = &v.0.node {
        let hooks = node
            .pre_hooks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for h in hooks {
            h(v)?;
        }
    }
    Ok(())
}

/// Runs a node's backward rule with the mask `wanted` and checks the number of gradients and
/// the shape of each one kept (wanted, or given for an input that requires grad).
fn call_backward(node: &Node, g: &Tensor, wanted: &[bool]) -> Result<Vec<Option<Tensor>>> {
    let mut grads = (node.backward)(g, wanted)?;
    if grads.len() != node.inputs.len() {
        meshgrad_tensor::bail!(
            "backward of {}: returned {} gradients for {} inputs",
            node.op,
            grads.len(),
            node.inputs.len()
        );
    }
    for (inp, gi) in node.inputs.iter().zip(grads.iter_mut()) {
        if !inp.requires_grad() {
            *gi = None;
            continue;
        }
        if let Some(t) = gi {
            if t.shape() != inp.tensor().shape() {
                return Err(Error::ShapeMismatch {
                    op: node.op,
                    lhs: inp.tensor().shape().clone(),
                    rhs: t.shape().clone(),
                });
            }
        }
    }
    Ok(grads)
}

/// The node that computed a variable has run: one consumer fewer for each of its inputs; an
/// input whose consumers have all run becomes ready, or, when no gradient reached it, passes
/// "nothing" on to its own inputs.
fn release_inputs(
    node: &Node,
    side: &Side<'_>,
    consumers: &mut HashMap<VarId, usize>,
    pending: &mut HashMap<VarId, Tensor>,
    ready: &mut BinaryHeap<(bool, VarId)>,
) {
    for inp in &node.inputs {
        if release_one(inp, side, consumers, pending, ready) {
            release_unreached(inp, side, consumers, pending, ready);
        }
    }
}

/// One consumer of `inp` has run. When it was the last, `inp` becomes ready if a gradient
/// reached it; returns true when none did (its own inputs then lose this path too).
fn release_one(
    inp: &Var,
    side: &Side<'_>,
    consumers: &mut HashMap<VarId, usize>,
    pending: &mut HashMap<VarId, Tensor>,
    ready: &mut BinaryHeap<(bool, VarId)>,
) -> bool {
    if !inp.requires_grad() || !side.tracks(inp.id()) {
        return false;
    }
    let c = consumers
        .get_mut(&inp.id())
        .expect("counted during discovery");
    *c -= 1;
    if *c != 0 {
        return false;
    }
    if side.has_grad(inp.id(), pending) {
        ready.push(ready_key(inp));
        false
    } else {
        true
    }
}

/// A variable all of whose consumers produced no gradient: propagate "nothing" to its inputs.
fn release_unreached(
    v: &Var,
    side: &Side<'_>,
    consumers: &mut HashMap<VarId, usize>,
    pending: &mut HashMap<VarId, Tensor>,
    ready: &mut BinaryHeap<(bool, VarId)>,
) {
    let mut stack = vec![v.clone()];
    while let Some(v) = stack.pop() {
        if let Some(node) = &v.0.node {
            for inp in &node.inputs {
                if release_one(inp, side, consumers, pending, ready) {
                    stack.push(inp.clone());
                }
            }
        }
    }
}

/// The split backward's bookkeeping: the input side of the graph and what the input pass left
/// for the weight pass.
struct Split {
    /// The variables with a path to one of the requested inputs, the inputs included.
    input_side: HashSet<VarId>,
    /// The input-side variables the input pass handled (a gradient reached them).
    reached: HashSet<VarId>,
    /// The input-side nodes with weight-side inputs, by the id of the variable they computed.
    nodes: HashMap<VarId, DeferredNode>,
}

/// What the input pass left for the weight pass at one input-side node with weight-side
/// inputs.
struct DeferredNode {
    /// Per input: the weight-side gradient the rule returned anyway in the input pass.
    grads: Vec<Option<Tensor>>,
    /// Per input: the weight-side inputs the rule left out; the weight pass runs it again for
    /// them.
    rerun: Vec<bool>,
    /// The node's output gradient, kept when the rule runs again.
    out_grad: Option<Tensor>,
}

impl DeferredNode {
    /// The node's gradients for its weight-side inputs (running its rule again, after its
    /// pre-backward hooks, for those the input pass left out).
    fn weight_grads(self, node: &Node, v: &Var) -> Result<Vec<Option<Tensor>>> {
        let mut grads = self.grads;
        if let Some(g) = self.out_grad {
            run_pre_hooks(v)?;
            let more = call_backward(node, &g, &self.rerun)?;
            for ((slot, gi), &r) in grads.iter_mut().zip(more).zip(&self.rerun) {
                if r {
                    *slot = gi;
                }
            }
        }
        Ok(grads)
    }
}

/// The weight half of a split backward, returned by [`backward_input`] (or
/// [`Var::backward_input`]): the parameters' gradients, not computed yet. [`run`](Self::run)
/// computes them and accumulates them into the parameters' `.grad`, firing gradient-ready hooks,
/// exactly as the full backward would have (same order, same bits).
///
/// It holds the graph (activations) and the output gradients of the deferred nodes until it
/// runs; dropping it without running loses the parameters' gradients of this backward.
#[must_use = "the parameters' gradients are only computed by DeferredWeightGrads::run"]
pub struct DeferredWeightGrads {
    roots: Vec<(Var, Tensor)>,
    split: Split,
}

impl std::fmt::Debug for DeferredWeightGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredWeightGrads")
            .field("roots", &self.roots.len())
            .field("input_side_vars", &self.split.input_side.len())
            .field("split_nodes", &self.split.nodes.len())
            .finish()
    }
}

impl DeferredWeightGrads {
    /// The weight pass: computes the gradients the input pass deferred and accumulates them
    /// into the parameters' `.grad` (gradient-ready hooks fire as each completes).
    pub fn run(self) -> Result<()> {
        run(&self.roots, Sink::Accumulate, Some(self.split)).map(|_| ())
    }
}

/// The input pass of a split backward (PyTorch pipelining's `stage_backward_input`): from
/// `roots` (each with its gradient), computes only the gradients of `inputs` (leaves that
/// require grad, typically a pipeline stage's input activation) and accumulates them into their
/// `.grad`, firing their gradient-ready hooks. Everything else — the gradients of the leaves
/// that are not among `inputs`, the parameters — is left to the returned
/// [`DeferredWeightGrads`] (`stage_backward_weight`).
///
/// The *input side* of the graph is every variable with a path to one of `inputs`; the input
/// pass runs only its nodes, in the order the full backward would, asking each rule
/// (through the mask of [`BackwardFn`](crate::BackwardFn)) for its input-side inputs only. Where
/// a rule has weight-side inputs (a linear layer's weight and bias), what it returned for them
/// anyway is kept and, for those it left out, the node and its output gradient are kept; the
/// weight pass replays the full backward's order, running those rules again for the weight side
/// only and running the weight side's own nodes (an embedding lookup, a transpose of a weight).
/// Input pass then weight pass give the same gradients as one full backward, bit for bit, as
/// long as every rule returns the same gradient for an input whatever the mask says.
///
/// Activation checkpointing: a [`checkpoint`](crate::checkpoint)ed block's rule recomputes
/// the block and returns every gradient at once, so a checkpointed block on the input side is
/// computed entirely in the input pass (its parameters' gradients are kept for the weight pass).
///
/// Hooks: the inputs' gradient-ready hooks fire in the input pass, the parameters' in the
/// weight pass; a node's pre-backward hooks fire before each run of its rule (so twice for a
/// rule the weight pass runs again: a sharded wrapper that gathers a weight in the hook gathers
/// it for both).
///
/// Errors: an input that is not a leaf or does not require grad, and everything
/// [`backward`] refuses.
pub fn backward_input(roots: &[(Var, Tensor)], inputs: &[Var]) -> Result<DeferredWeightGrads> {
    for (i, x) in inputs.iter().enumerate() {
        if !x.is_leaf() {
            meshgrad_tensor::bail!(
                "backward_input: input {i} is the result of op {}, not a leaf (the input pass \
                 stops at leaves)",
                x.op_name().unwrap_or("?")
            );
        }
        if !x.requires_grad() {
            meshgrad_tensor::bail!("backward_input: input {i} does not require grad");
        }
    }
    let split = run_input(roots, inputs)?;
    // The weight pass needs the input side's root gradients only for their shapes (it does not
    // run the input side again): the root's own value stands in, so the gradient is not kept.
    let roots = roots
        .iter()
        .map(|(v, g)| {
            let g = if split.input_side.contains(&v.id()) {
                v.tensor().clone()
            } else {
                g.clone()
            };
            (v.clone(), g)
        })
        .collect();
    Ok(DeferredWeightGrads { roots, split })
}

/// The variables of `vars` with a path to one of `inputs` (the inputs included). A node's inputs
/// were created before it, so in increasing id order every input is decided before its users.
fn input_side(vars: &HashMap<VarId, Var>, inputs: &[Var]) -> HashSet<VarId> {
    let mut side: HashSet<VarId> = inputs.iter().map(|v| v.id()).collect();
    let mut ids: Vec<VarId> = vars.keys().copied().collect();
    ids.sort_unstable();
    for id in ids {
        if let Some(node) = &vars[&id].0.node {
            if node
                .inputs
                .iter()
                .any(|i| i.requires_grad() && side.contains(&i.id()))
            {
                side.insert(id);
            }
        }
    }
    side
}

/// The input pass (see [`backward_input`]): runs the input side in the full backward's order and
/// records what the weight pass needs.
fn run_input(roots: &[(Var, Tensor)], inputs: &[Var]) -> Result<Split> {
    let _phase = profile::phase(profile::Phase::Backward);
    let _scope = BackwardScope::enter();
    let (_, vars) = discover(roots)?;
    let input_side = input_side(&vars, inputs);
    let is_input = |v: &Var| v.requires_grad() && input_side.contains(&v.id());
    // Every consumer of an input-side variable is on the input side: count those edges only.
    let mut consumers: HashMap<VarId, usize> = HashMap::new();
    for v in vars.values() {
        if let (true, Some(node)) = (input_side.contains(&v.id()), &v.0.node) {
            for inp in node.inputs.iter().filter(|i| is_input(i)) {
                *consumers.entry(inp.id()).or_insert(0) += 1;
            }
        }
    }
    let side = Side::Input(&input_side);
    let mut pending: HashMap<VarId, Tensor> = HashMap::new();
    let mut ready: BinaryHeap<(bool, VarId)> = BinaryHeap::new();
    for (v, g) in roots.iter().filter(|(v, _)| is_input(v)) {
        add_into(&mut pending, v.id(), g.clone())?;
    }
    for (v, _) in roots.iter().filter(|(v, _)| is_input(v)) {
        if consumers.get(&v.id()).copied().unwrap_or(0) == 0
            && !ready.iter().any(|&r| r == ready_key(v))
        {
            ready.push(ready_key(v));
        }
    }
    let mut reached: HashSet<VarId> = HashSet::new();
    let mut nodes: HashMap<VarId, DeferredNode> = HashMap::new();
    while let Some((_, id)) = ready.pop() {
        reached.insert(id);
        let v = vars[&id].clone();
        let g = pending
            .remove(&id)
            .expect("a ready variable has a gradient");
        let Some(node) = &v.0.node else {
            accumulate_leaf(&v, g)?;
            continue;
        };
        run_pre_hooks(&v)?;
        let wanted: Vec<bool> = node.inputs.iter().map(is_input).collect();
        let mut grads = call_backward(node, &g, &wanted)?;
        let weight_side: Vec<bool> = node
            .inputs
            .iter()
            .map(|i| i.requires_grad() && !input_side.contains(&i.id()))
            .collect();
        if weight_side.iter().any(|&w| w) {
            let n = node.inputs.len();
            let mut kept = vec![None; n];
            let mut rerun = vec![false; n];
            for i in (0..n).filter(|&i| weight_side[i]) {
                match grads[i].take() {
                    Some(t) => kept[i] = Some(t),
                    None => rerun[i] = true,
                }
            }
            let out_grad = rerun.iter().any(|&r| r).then(|| g.clone());
            nodes.insert(
                id,
                DeferredNode {
                    grads: kept,
                    rerun,
                    out_grad,
                },
            );
        }
        drop(g);
        for ((inp, gi), &w) in node.inputs.iter().zip(grads).zip(&wanted) {
            if let (true, Some(gi)) = (w, gi) {
                add_into(&mut pending, inp.id(), gi)?;
            }
        }
        release_inputs(node, &side, &mut consumers, &mut pending, &mut ready);
    }
    Ok(Split {
        input_side,
        reached,
        nodes,
    })
}

/// The priority of a variable whose gradient is complete: leaves first (their gradient is final,
/// and a gradient-ready hook may start communication that overlaps the rest of backward), then
/// nodes by decreasing creation order. Leaves have no inputs, so handling them early never
/// changes the order in which nodes run or gradients are summed.
fn ready_key(v: &Var) -> (bool, VarId) {
    (v.is_leaf(), v.id())
}

fn add_into(pending: &mut HashMap<VarId, Tensor>, id: VarId, g: Tensor) -> Result<()> {
    let _prof = profile::scope("grad_accumulate");
    match pending.remove(&id) {
        None => {
            pending.insert(id, g);
        }
        Some(old) => {
            pending.insert(id, accumulate(old, g)?);
        }
    }
    Ok(())
}

/// `old + g`, in place in whichever operand nobody else holds (float addition commutes exactly,
/// so the result is the same bits as `old.add(&g)`), else into a new tensor.
pub(crate) fn accumulate(old: Tensor, g: Tensor) -> Result<Tensor> {
    let fits = |a: &Tensor, b: &Tensor| {
        a.is_exclusive()
            && a.is_contiguous()
            && b.is_contiguous()
            && a.shape() == b.shape()
            && a.dtype() == b.dtype()
            && a.dtype().is_float()
    };
    if fits(&old, &g) {
        old.add_assign(&g)?;
        Ok(old)
    } else if fits(&g, &old) {
        g.add_assign(&old)?;
        Ok(g)
    } else {
        old.add(&g)
    }
}

#[cfg(test)]
mod tests {
    use meshgrad_tensor::{Device, Tensor};

    use super::accumulate;

    #[test]
    fn backward_running_is_visible_inside_backward_only() {
        use std::sync::{Arc, Mutex};
        let x = crate::Var::leaf(Tensor::from_vec(vec![1f32, 2.], 2, Device::Cpu).unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        x.register_grad_ready_hook(Arc::new(move |_| {
            s.lock().unwrap().push(super::is_backward_running());
            Ok(())
        }));
        assert!(!super::is_backward_running());
        x.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        assert!(!super::is_backward_running());
        assert_eq!(*seen.lock().unwrap(), vec![true]);
    }

    #[test]
    fn accumulate_never_writes_into_a_shared_tensor() {
        let a = Tensor::from_vec(vec![1f32, 2., 3.], 3, Device::Cpu).unwrap();
        let b = Tensor::from_vec(vec![10f32, 20., 30.], 3, Device::Cpu).unwrap();
        let (a_seen, b_seen) = (a.clone(), b.clone());
        let s = accumulate(a, b).unwrap();
        assert_eq!(s.to_vec::<f32>().unwrap(), vec![11., 22., 33.]);
        assert_eq!(a_seen.to_vec::<f32>().unwrap(), vec![1., 2., 3.]);
        assert_eq!(b_seen.to_vec::<f32>().unwrap(), vec![10., 20., 30.]);
        // An exclusive operand is reused in place.
        let c = Tensor::from_vec(vec![1f32, 1., 1.], 3, Device::Cpu).unwrap();
        let s2 = accumulate(s, c).unwrap();
        assert_eq!(s2.to_vec::<f32>().unwrap(), vec![12., 23., 34.]);
        // A view of the same storage blocks in-place reuse too.
        let d = Tensor::from_vec(vec![1f32, 2., 3., 4.], 4, Device::Cpu).unwrap();
        let view = d.narrow(0, 0, 3).unwrap();
        let e = Tensor::from_vec(vec![5f32, 5., 5.], 3, Device::Cpu).unwrap();
        let e_seen = e.clone();
        let s3 = accumulate(view, e).unwrap();
        assert_eq!(s3.to_vec::<f32>().unwrap(), vec![6., 7., 8.]);
        assert_eq!(d.to_vec::<f32>().unwrap(), vec![1., 2., 3., 4.]);
        assert_eq!(e_seen.to_vec::<f32>().unwrap(), vec![5., 5., 5.]);
    }
}

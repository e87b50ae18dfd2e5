//! The backward engine: runs the recorded graph in reverse, in a fixed order.
//!
//! Order: a leaf whose gradient is complete is handled (accumulated, hooks fired) before any
//! further node runs, so gradient-ready hooks fire as early as possible, in reverse order of use;
//! among the nodes whose output gradient is complete, the most recently created runs first.
//! Gradient contributions to one variable are summed in that processing order, so a backward
//! pass is bit-for-bit repeatable.

use std::cell::Cell;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use meshgrad_tensor::{profile, Error, Result, Tensor};

use crate::var::{Var, VarId};

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
    run(roots, Sink::Accumulate).map(|_| ())
}

/// Computes the gradients of `roots` with respect to `wrt` (like `torch.autograd.grad`),
/// without touching any `.grad`. A variable the roots do not depend on gets `None`.
pub fn grad(roots: &[(Var, Tensor)], wrt: &[Var]) -> Result<Vec<Option<Tensor>>> {
    run(roots, Sink::Capture(wrt))
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

fn run(roots: &[(Var, Tensor)], sink: Sink<'_>) -> Result<Vec<Option<Tensor>>> {
    let _phase = profile::phase(profile::Phase::Backward);
    let _scope = BackwardScope::enter();
    // Discover the graph and count, for every variable, the edges from recorded nodes into it.
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

    let capture: BTreeMap<VarId, usize> = match &sink {
        Sink::Capture(w) => w.iter().enumerate().map(|(i, v)| (v.id(), i)).collect(),
        Sink::Accumulate => BTreeMap::new(),
    };
    let mut captured: Vec<Option<Tensor>> = vec![None; capture.len()];

    let mut pending: HashMap<VarId, Tensor> = HashMap::new();
    let mut ready: BinaryHeap<(bool, VarId)> = BinaryHeap::new();
    for (v, g) in roots {
        add_into(&mut pending, v.id(), g.clone())?;
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
        let g = pending
            .remove(&id)
            .expect("a ready variable has a gradient");
        if let Some(&slot) = capture.get(&id) {
            captured[slot] = Some(g.clone());
        }
        match &v.0.node {
            None => {
                if let Sink::Accumulate = sink {
                    v.accumulate_grad(g)?;
                    let hooks =
                        v.0.grad_hooks
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .clone();
                    for h in hooks {
                        h(&v)?;
                    }
                }
            }
            Some(node) => {
                let hooks = node
                    .pre_hooks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                for h in hooks {
                    h(&v)?;
                }
                let grads = (node.backward)(&g)?;
                drop(g);
                if grads.len() != node.inputs.len() {
                    meshgrad_tensor::bail!(
                        "backward of {}: returned {} gradients for {} inputs",
                        node.op,
                        grads.len(),
                        node.inputs.len()
                    );
                }
                for (inp, gi) in node.inputs.iter().zip(grads) {
                    if !inp.requires_grad() {
                        continue;
                    }
                    if let Some(gi) = gi {
                        if gi.shape() != inp.tensor().shape() {
                            return Err(Error::ShapeMismatch {
                                op: node.op,
                                lhs: inp.tensor().shape().clone(),
                                rhs: gi.shape().clone(),
                            });
                        }
                        add_into(&mut pending, inp.id(), gi)?;
                    }
                    let c = consumers
                        .get_mut(&inp.id())
                        .expect("counted during discovery");
                    *c -= 1;
                    if *c == 0 {
                        if pending.contains_key(&inp.id()) {
                            ready.push(ready_key(inp));
                        } else {
                            // No gradient reached it; its own inputs lose this path too.
                            release_unreached(inp, &mut consumers, &mut pending, &mut ready);
                        }
                    }
                }
            }
        }
    }
    Ok(captured)
}

/// A variable all of whose consumers produced no gradient: propagate "nothing" to its inputs.
fn release_unreached(
    v: &Var,
    consumers: &mut HashMap<VarId, usize>,
    pending: &mut HashMap<VarId, Tensor>,
    ready: &mut BinaryHeap<(bool, VarId)>,
) {
    let mut stack = vec![v.clone()];
    while let Some(v) = stack.pop() {
        if let Some(node) = &v.0.node {
            for inp in &node.inputs {
                if !inp.requires_grad() {
                    continue;
                }
                let c = consumers
                    .get_mut(&inp.id())
                    .expect("counted during discovery");
                *c -= 1;
                if *c == 0 {
                    if pending.contains_key(&inp.id()) {
                        ready.push(ready_key(inp));
                    } else {
                        stack.push(inp.clone());
                    }
                }
            }
        }
    }
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

//! Gradients set aside per source: how a layer hands a parameter's gradient contributions from
//! different sources to its caller apart, instead of adding them into the parameter's `.grad`.
//!
//! Reference mode adds a parameter's per-row-group gradients over the aligned tree of the row
//! groups. A layer that computes, in one pass, a parameter's contributions from the row groups of
//! several ranks (a mixture of experts' expert under expert parallelism, which meets the token
//! copies of every rank of its group) would add them in `.grad` in an order one device never
//! uses. Instead it reads the parameter through [`set_aside`] once per source: the gradient that
//! reaches that view is deposited here, keyed by parameter and source, and the caller takes it
//! ([`take`]) to place it at the source's leaf of its tree.
//!
//! Deposits are collected while a [`Collecting`] guard lives on the thread that built the views
//! (a rank of the in-process backend is a thread); without one, [`set_aside`] is the parameter
//! itself and gradients reach `.grad` as usual.
//!
//! ```
//! use meshgrad_autograd::{source_grads, Var};
//! use meshgrad_tensor::{Device, Tensor};
//! let w = Var::leaf(Tensor::from_vec(vec![2f32], 1, Device::Cpu)?);
//! let guard = source_grads::collect();
//! let a = source_grads::set_aside(&w, 0)?.mul_scalar(3.0)?;
//! let b = source_grads::set_aside(&w, 1)?.mul_scalar(5.0)?;
//! a.add(&b)?.sum_all()?.backward()?;
//! assert!(w.grad().is_none());
//! let got = source_grads::take(&[w.id()]);
//! let mut by_source: Vec<(usize, f32)> = got
//!     .iter()
//!     .map(|g| (g.source, g.grad.to_vec::<f32>().unwrap()[0]))
//!     .collect();
//! by_source.sort_by_key(|x| x.0); // deposited in backward order
//! assert_eq!(by_source, vec![(0, 3.0), (1, 5.0)]);
//! drop(guard);
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use meshgrad_tensor::{Result, Tensor};

use crate::{Var, VarId};

/// A gradient set aside: what reached [`set_aside`]`(param, source)`'s view in a backward.
#[derive(Clone, Debug)]
pub struct SourceGrad {
    /// The parameter's identity ([`Var::id`]).
    pub param: VarId,
    /// The source the view was made for.
    pub source: usize,
    /// The gradient (contributions of one backward to the same view and source added).
    pub grad: Tensor,
}

type Deposits = Arc<Mutex<Vec<SourceGrad>>>;

thread_local! {
    static COLLECTOR: RefCell<Option<Deposits>> = const { RefCell::new(None) };
}

/// While alive, [`set_aside`] on this thread sets gradients aside (see the [module
/// docs](self)); dropping it ends the collection (what was not taken is dropped).
pub struct Collecting {
    previous: Option<Deposits>,
}

impl Drop for Collecting {
    fn drop(&mut self) {
        let previous = self.previous.take();
        COLLECTOR.with(|c| *c.borrow_mut() = previous);
    }
}

/// Starts collecting on this thread until the guard is dropped (a nested guard collects apart
/// and restores the outer one).
pub fn collect() -> Collecting {
    let previous = COLLECTOR.with(|c| c.borrow_mut().replace(Arc::default()));
    Collecting { previous }
}

/// Whether this thread collects ([`collect`]).
pub fn is_collecting() -> bool {
    COLLECTOR.with(|c| c.borrow().is_some())
}

/// `param` read for `source`: while collecting, a view of the same values whose gradient is set
/// aside for [`take`] and never reaches `param`'s `.grad`; otherwise `param` itself.
pub fn set_aside(param: &Var, source: usize) -> Result<Var> {
    let Some(deposits) = COLLECTOR.with(|c| c.borrow().clone()) else {
        return Ok(param.clone());
    };
    let id = param.id();
    Ok(Var::from_op(
        "set_aside",
        param.tensor().clone(),
        &[param],
        Box::new(move |g, _| {
            let mut d = deposits.lock().unwrap_or_else(|e| e.into_inner());
            match d.iter_mut().find(|x| x.param == id && x.source == source) {
                Some(x) => x.grad = x.grad.add(g)?,
                None => d.push(SourceGrad {
                    param: id,
                    source,
                    grad: g.clone(),
                }),
            }
            Ok(vec![None])
        }),
    ))
}

/// Takes out the gradients set aside so far for the parameters `params` (in the order they were
/// deposited); the others stay. Empty when this thread does not collect.
pub fn take(params: &[VarId]) -> Vec<SourceGrad> {
    let Some(deposits) = COLLECTOR.with(|c| c.borrow().clone()) else {
        return Vec::new();
    };
    let mut d = deposits.lock().unwrap_or_else(|e| e.into_inner());
    let (mine, rest): (Vec<_>, Vec<_>) = d.drain(..).partition(|x| params.contains(&x.param));
    *d = rest;
    mine
}

#[cfg(test)]
mod tests {
    use meshgrad_tensor::{Device, Tensor};

    use super::*;

    #[test]
    fn without_a_collection_the_parameter_is_used_itself() {
        let w = Var::leaf(Tensor::from_vec(vec![2f32], 1, Device::Cpu).unwrap());
        assert!(!is_collecting());
        let y = set_aside(&w, 3).unwrap().mul_scalar(4.0).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(w.grad().unwrap().to_vec::<f32>().unwrap(), vec![4.0]);
        assert!(take(&[w.id()]).is_empty());
    }

    #[test]
    fn take_leaves_other_parameters_and_a_guard_ends_the_collection() {
        let w = Var::leaf(Tensor::from_vec(vec![2f32], 1, Device::Cpu).unwrap());
        let v = Var::leaf(Tensor::from_vec(vec![1f32], 1, Device::Cpu).unwrap());
        {
            let _g = collect();
            let a = set_aside(&w, 0).unwrap();
            let b = set_aside(&v, 0).unwrap().mul_scalar(7.0).unwrap();
            // Two uses of one view for one source add up.
            let y = a.add(&a).unwrap().add(&b).unwrap();
            y.sum_all().unwrap().backward().unwrap();
            let got = take(&[w.id()]);
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].grad.to_vec::<f32>().unwrap(), vec![2.0]);
            let got = take(&[v.id()]);
            assert_eq!(got[0].grad.to_vec::<f32>().unwrap(), vec![7.0]);
            assert!(take(&[w.id(), v.id()]).is_empty());
        }
        assert!(!is_collecting());
        assert!(w.grad().is_none() && v.grad().is_none());
    }
}

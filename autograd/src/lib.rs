//! meshgrad autograd: [`Var`] records the ops applied to it in a dynamic graph; backward runs the
//! graph in reverse (in a fixed, documented order) with hooks for the parallel strategies:
//! gradient-ready hooks on leaves, pre-backward hooks on nodes, and backward from any variable
//! with a supplied gradient, and a split backward (input gradients first, parameter gradients
//! later: [`Var::backward_input`]) for zero-bubble pipelines. Custom functions define forward and backward together; activation
//! checkpointing recomputes a block during backward; [`gradcheck`] checks rules numerically.
//!
//! ```
//! use meshgrad_autograd::Var;
//! use meshgrad_tensor::{Device, Tensor};
//! let x = Var::leaf(Tensor::from_vec(vec![1f32, 2., 3.], 3, Device::Cpu)?);
//! let y = x.sqr()?.sum_all()?; // sum(x²)
//! y.backward()?;
//! assert_eq!(x.grad().unwrap().to_vec::<f32>()?, vec![2., 4., 6.]);
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```
//!
//! # Operators
//!
//! [`Var`] has the operators of `meshgrad_tensor::Tensor` (the table is in that crate's
//! documentation), recorded in the graph as the named ops they stand for: `+ - * /` between
//! variables, owned or borrowed, and with `f64` scalars on either side, and unary `-`. Each
//! returns `Result<Var>`, and they are implemented on `Result<Var>` as well (with a `Var` or
//! `&Var` on the other side), so a chain needs a single `?` at its end; the first error met is
//! the one returned. Between two `Result`s, or a `Result` and an `f64`, Rust's orphan rules allow
//! no operator (neither type belongs to this crate): put a `?` there. An RMSNorm with a weight:
//!
//! ```
//! use meshgrad_autograd::Var;
//! use meshgrad_tensor::{Device, Tensor};
//! let x = Var::leaf(Tensor::from_vec(vec![3f64, -4., 1., 1.], (2, 2), Device::Cpu)?);
//! let w = Var::leaf(Tensor::from_vec(vec![1f64, 2.], 2, Device::Cpu)?);
//!
//! let inv_rms = (x.sqr()?.mean(&[-1], true)? + 1e-6)?.powf(-0.5)?;
//! let y = (&x * inv_rms * &w)?;
//!
//! let rms0 = (12.5f64 + 1e-6).sqrt(); // row 0: mean of 9 and 16
//! let want = [3. / rms0, -8. / rms0];
//! let got = y.tensor().to_vec::<f64>()?;
//! assert!((got[0] - want[0]).abs() < 1e-12 && (got[1] - want[1]).abs() < 1e-12);
//!
//! // Gradients flow through the operators; errors are values, not panics.
//! (y.sum_all()? * 0.5)?.backward()?;
//! assert_eq!(w.grad().unwrap().dims(), &[2]);
//! let e = (&x * &w + &Var::constant(Tensor::zeros(3, x.tensor().dtype(), Device::Cpu)?))
//!     .unwrap_err();
//! assert_eq!(e.to_string(), "add: shape mismatch: [2, 2] vs [3]");
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```

mod checkpoint;
pub mod distributed;
mod engine;
mod forward_ctx;
mod function;
mod grad_mode;
mod gradcheck;
mod ops;
pub mod source_grads;
mod var;

pub use checkpoint::{checkpoint, BlockFn};
pub use engine::{backward, backward_input, grad, is_backward_running, DeferredWeightGrads};
pub use forward_ctx::{loss_scale, next_use, ForwardCtx};
pub use function::{apply, Function};
pub use grad_mode::{enable_grad, is_enabled as is_grad_enabled, no_grad};
pub use gradcheck::{gradcheck, GradcheckOptions};
pub use ops::DropoutSpec;
pub use var::{BackwardFn, GradReadyHook, PreBackwardHook, Var, VarId};

//! meshgrad autograd: [`Var`] records the ops applied to it in a dynamic graph; backward runs the
//! graph in reverse (in a fixed, documented order) with hooks for the parallel strategies:
//! gradient-ready hooks on leaves, pre-backward hooks on nodes, and backward from any variable
//! with a supplied gradient. Custom functions define forward and backward together; activation
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

mod checkpoint;
mod engine;
mod forward_ctx;
mod function;
mod grad_mode;
mod gradcheck;
mod ops;
mod var;

pub use checkpoint::{checkpoint, BlockFn};
pub use engine::{backward, grad, is_backward_running};
pub use forward_ctx::{next_use, ForwardCtx};
pub use function::{apply, Function};
pub use grad_mode::{enable_grad, is_enabled as is_grad_enabled, no_grad};
pub use gradcheck::{gradcheck, GradcheckOptions};
pub use ops::DropoutSpec;
pub use var::{BackwardFn, GradReadyHook, PreBackwardHook, Var, VarId};

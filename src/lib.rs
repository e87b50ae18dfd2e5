//! meshgrad: a deep-learning framework written from scratch in Rust, with parallel training
//! built in. This crate re-exports the workspace crates ([`tensor`], [`autograd`], [`nn`],
//! [`parallel`]), gathers the everyday names in [`prelude`], and holds the `meshgrad` CLI's logic
//! (training, evaluation, generation), so it can be driven from code and tests too.
//!
//! ```
//! use meshgrad::prelude::*;
//!
//! #[derive(Module)]
//! struct TwoLayer {
//!     fc1: Linear,
//!     fc2: Linear,
//! }
//!
//! impl Forward for TwoLayer {
//!     fn forward(&self, x: &Var) -> Result<Var> {
//!         self.fc2.forward(&self.fc1.forward(x)?.relu()?)
//!     }
//! }
//!
//! let model = ParamBuilder::new(42).build(|p| {
//!     Ok(TwoLayer { fc1: Linear::new(p, 3, 8)?, fc2: Linear::new(p, 8, 1)? })
//! })?;
//! let mut opt = AdamW::for_module(&model).build()?;
//! let x = Var::constant(Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (2, 3), Device::Cpu)?);
//! let loss = model.forward(&x)?.sqr()?.mean_all()?;
//! loss.backward()?;
//! opt.step(1e-2)?;
//! assert_eq!(model.num_parameters(), 3 * 8 + 8 + 8 + 1);
//! # Ok::<(), meshgrad::tensor::Error>(())
//! ```

extern crate self as meshgrad;

#[cfg(feature = "cli")]
pub mod bench_pytorch;
#[cfg(feature = "cli")]
pub mod compare;
#[cfg(feature = "cli")]
mod compare_plot;
#[cfg(feature = "cli")]
pub mod config;
pub mod corpus;
#[cfg(feature = "cli")]
mod cpu_profile;
#[cfg(feature = "cli")]
pub mod eval;
#[cfg(feature = "cli")]
mod expert_load;
#[cfg(feature = "cli")]
pub mod flight;
#[cfg(feature = "cli")]
pub mod generate;
pub mod guide;
#[cfg(feature = "cli")]
pub mod init_from;
#[cfg(feature = "cli")]
pub mod launch;
#[cfg(feature = "cli")]
pub mod model_configs;
#[cfg(feature = "cli")]
mod pipeline_plan;
#[cfg(feature = "cli")]
pub mod plan_cmd;
#[cfg(feature = "cli")]
pub mod preflight;
#[cfg(feature = "cli")]
mod rank_sync;
#[cfg(feature = "cli")]
mod rank_train;
#[cfg(feature = "cli")]
pub mod ranks;
#[cfg(feature = "cli")]
mod recipe;
#[cfg(feature = "cli")]
mod recipe_bert;
#[cfg(feature = "cli")]
mod recipe_causal;
/// Reference mode: bit-identical training under every layout.
#[cfg(feature = "cli")]
mod reference;
/// Reference mode under tensor parallelism.
#[cfg(feature = "cli")]
mod reference_tp;
#[cfg(feature = "cli")]
pub mod run_checkpoint;
#[cfg(feature = "cli")]
pub mod run_dir;
#[cfg(feature = "cli")]
mod run_finish;
#[cfg(feature = "cli")]
pub mod run_setup;
#[cfg(feature = "cli")]
pub mod schedule_cmd;
#[cfg(feature = "cli")]
mod step_loop;
#[cfg(feature = "cli")]
pub mod stop;
#[cfg(feature = "cli")]
pub mod train;

#[doc(inline)]
pub use meshgrad_autograd as autograd;
#[doc(inline)]
pub use meshgrad_nn as nn;
#[doc(inline)]
pub use meshgrad_parallel as parallel;
#[doc(inline)]
pub use meshgrad_tensor as tensor;

/// The everyday names: `use meshgrad::prelude::*;`.
pub mod prelude {
    pub use crate::autograd::{checkpoint, no_grad, ForwardCtx, Var};
    pub use crate::nn::optim::{clip_grad_norm, AdamW, CosineSchedule, Optimizer, Sgd};
    pub use crate::nn::{
        Activation, Dropout, Embedding, Forward, Gpt, GptConfig, Init, LayerNorm, Linear,
        LinearConfig, Module, ParamBuilder, Sequential,
    };
    pub use crate::tensor::{DType, Device, Error, Result, Shape, Tensor};
}

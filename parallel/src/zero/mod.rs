//! Sharded data parallelism: one wrapper, [`ShardedDataParallel`], with the strategies
//!
//! | stage | optimizer state | gradients | parameters |
//! |-------|-----------------|-----------|------------|
//! | ZeRO-1 | sharded | all-reduced, whole on every rank | whole |
//! | ZeRO-2 | sharded | reduce-scattered, a shard per rank | whole |
//! | ZeRO-3 / FSDP | sharded | reduce-scattered | sharded; a unit is gathered when its forward or backward reads it |
//!
//! and **hybrid sharding** ([`ShardTopology::hybrid`], a `[dp_replicate, dp_shard]`
//! [`crate::DeviceMesh`]): everything is sharded within groups of the shard degree and replicated
//! across them; the gradient shards are averaged across replicas with an all-reduce. Plain ZeRO
//! over N ranks is the special case of one replica ([`ShardTopology::flat`]).
//!
//! Every rank processes its own rows of the global batch; gradients are averaged over all
//! data-parallel ranks, so a run equals the single-device run on the global batch.
//!
//! # Sharding plan
//!
//! Parameters are grouped into units by a [`WrapPolicy`] over module paths: the default
//! [`WrapPolicy::Auto`] makes each element of the model's shallowest module list a unit (`h.0`,
//! `h.1`, ... of a GPT: one unit per transformer block), [`WrapPolicy::Paths`] takes patterns
//! (`layers.*`, `encoder.layer.*`; `*` matches one path component), and a root unit holds every
//! parameter no unit takes (embeddings, final norm, tied head). Each unit is a flat buffer of
//! its parameters in registration order, padded to a multiple of the shard degree; rank r of
//! the shard group owns the contiguous slice r ([`ShardPlan`]). Parameters may straddle
//! shards: the optimizer updates every [`Segment`] (a shard's intersection with a parameter)
//! with that parameter's group hyper-parameters and step count.
//!
//! # Optimizer
//!
//! The update rule is pluggable: [`ShardedDataParallel::new`] takes an [`OptimizerFactory`], an
//! [`AdamWConfig`](meshgrad_nn::optim::AdamWConfig) or [`SgdConfig`](meshgrad_nn::optim::SgdConfig)
//! for those optimizers, or a closure building any [`meshgrad_nn::optim::Optimizer`]. ZeRO keeps
//! the plan, the gradient reduction, the master weights, clipping across shards and the gathers;
//! the optimizer runs over one *shard variable* per segment this rank owns: a leaf over the
//! segment's weights (so its in-place update writes the real weights), named after its
//! parameter, in its parameter's group (same weight decay and learning-rate scale). Before each
//! step its gradient is set to the segment's reduced gradient. Optimizer state (moments,
//! momentum buffers, step counts) lives in the optimizer, keyed by those names, and covers only
//! this rank's segments.
//!
//! # ZeRO-3 on any model
//!
//! ZeRO-3 needs nothing from the model beyond [`meshgrad_nn::Module`] (a `#[derive(Module)]`
//! struct will do): no staging, no hooks in its forward. Between uses each parameter's storage is
//! released and carries a *materialiser*
//! ([`Tensor::set_materializer`](meshgrad_tensor::Tensor::set_materializer)):
//!
//! * **Gather on first read.** The first op that reads a parameter of a released unit, in the
//!   forward, in the forward that activation checkpointing recomputes, or in a backward closure
//!   reading a weight it captured, runs the materialiser: the unit is all-gathered (or its
//!   prefetch waited for) into the parameters' own tensors, then the op proceeds.
//! * **Release.** Gathering a unit first releases every other gathered unit, so at most one
//!   unit is gathered and one prefetch is in flight; a unit needed again (GPT's root, read by
//!   the embeddings and by the tied head) is gathered again. After backward a unit is released
//!   as soon as all its gradients have arrived. `finish`, `step` and
//!   [`ShardedDataParallel::reshard`] release everything; the unit an evaluation forward read
//!   last stays gathered until one of them (or the next gather).
//! * **Prefetch.** Each forward and backward records the order it gathered units in
//!   ([`ShardedDataParallel::gather_order`]); the autograd engine says which of the two is
//!   running ([`meshgrad_autograd::is_backward_running`]). When a unit is gathered, the one that
//!   followed it last time is prefetched; the end of a forward with gradients enabled
//!   prefetches the start of the backward. The first forward is predicted from the registration
//!   order, the first backward from the reversed forward. [`GatherStats`] counts prefetched
//!   and on-demand gathers.
//! * **Rules.** Every rank must read the same parameters in the same order (true of one program
//!   on every rank; a rank printing a released weight on its own would start an all-gather the
//!   others never join, which times out with an error). Keep the wrapper alive while the model
//!   runs: after it is dropped, reading a parameter is an error that says so, unless
//!   [`ShardedDataParallel::summon_full_params`] was called first (the model then keeps its full
//!   parameters). A model is wrapped once.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use meshgrad_parallel::{Communicator, zero::*};
//! # use meshgrad_nn::{Module, optim::{param_groups_for_decay, SgdConfig}};
//! # fn f(comm: Arc<dyn Communicator>, model: &dyn Module) -> meshgrad_tensor::Result<()> {
//! let mut config = ShardConfig::new(ZeroStage::Three);
//! config.wrap = WrapPolicy::paths(["layers.*"]); // each `layers.i` a unit, the rest in root
//! let sdp = ShardedDataParallel::new(
//!     model,
//!     param_groups_for_decay(model.named_parameters(), 1e-4),
//!     SgdConfig { momentum: 0.9 }, // SGD with momentum over each rank's shard
//!     ShardTopology::flat(comm),
//!     config,
//! )?;
//! # Ok(()) }
//! ```
//!
//! # Training loop
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use meshgrad_parallel::{Communicator, zero::*};
//! # use meshgrad_nn::{Gpt, Module, optim::{param_groups_for_decay, AdamWConfig}};
//! # fn f(comm: Arc<dyn Communicator>, model: &Gpt) -> meshgrad_tensor::Result<()> {
//! let groups = param_groups_for_decay(model.named_parameters(), 0.1);
//! let sdp = ShardedDataParallel::new(
//!     model,
//!     groups,
//!     AdamWConfig::default(), // AdamW over each rank's shard
//!     ShardTopology::flat(comm),
//!     ShardConfig::new(ZeroStage::Three),
//! )?;
//! // per step:
//! sdp.zero_grad();
//! // loss = model.loss(this rank's rows ...)?; loss.backward()?;
//! sdp.finish()?;                // wait for the reductions
//! sdp.clip_grad_norm(1.0)?;     // optional: the global norm across shards
//! sdp.step(3e-4)?;              // update this rank's shard; ZeRO-1/2 all-gather the parameters
//! # Ok(()) }
//! ```
//!
//! # Mixed precision
//!
//! [`MixedPrecision`]: the model's dtype is the compute dtype (build it in bf16 for bf16
//! compute); gradients are reduced in `reduce_dtype`; the optimizer's shard of the weights
//! (master weights), the gradient shards and so the optimizer's state (created in the dtype of
//! the shard variables) are kept in `master_dtype` (f32).
//!
//! # Reproducibility
//!
//! * Every collective combines contributions in rank order and every rank receives the same
//!   bits, so all ranks hold bit-identical parameters after every step, and a run repeated with
//!   the same layout is bit-for-bit identical.
//! * AdamW and SGD are elementwise: a segment's update is exactly the unsharded update of
//!   those elements given the same gradient. On one rank every strategy therefore equals the
//!   single-device run bit for bit (copies into flat buffers and averages over one rank are
//!   exact; the clipping norm adds per-parameter sums of squares in parameter order, as
//!   [`meshgrad_nn::optim::grad_sq_sum`] does).
//! * Across several ranks the batch's gradient is summed differently (per-rank means, then the
//!   average in rank order; hybrid: within the shard group, then across replicas), so results
//!   match the single device to rounding (1e-5 relative in the lockstep tests), not bitwise.
//!
//! # Memory
//!
//! Parameters are tagged [`MemoryTag::Params`](meshgrad_tensor::alloc::MemoryTag::Params)
//! (ZeRO-3: the shards and the gathered units), reduced gradients and the flat buffers being
//! assembled [`MemoryTag::Grads`](meshgrad_tensor::alloc::MemoryTag::Grads), and ZeRO-1/2's
//! separate master weights and the optimizer's state (which nn's optimizers allocate under it)
//! [`MemoryTag::OptimizerState`](meshgrad_tensor::alloc::MemoryTag::OptimizerState).
//! [`crate::memory_report`] measures them per rank during training.

mod checkpoint;
mod config;
mod gather;
mod grads;
mod optim;
mod pieces;
pub mod plan;
mod topology;
mod wrapper;

pub use checkpoint::FullStateDictOptions;
pub use config::{MixedPrecision, ShardConfig, WrapPolicy, ZeroStage};
pub use gather::GatherOrder;
pub use optim::OptimizerFactory;
pub use plan::{Segment, ShardPlan};
pub use topology::ShardTopology;
pub(crate) use wrapper::without_ignored;
pub use wrapper::{GatherStats, ShardedDataParallel};

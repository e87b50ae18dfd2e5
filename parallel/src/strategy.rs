//! The strategy seam: what a rank's model is wrapped in for its layout's data parallelism, chosen
//! in one place ([`DataParallel::for_layout`]) for every model and every training loop.
//!
//! * one data-parallel rank (one device, `tp=T`, `pp=P`): nothing; the gradients are whole;
//! * `dp=N` (nothing sharded): [`Ddp`] over the mesh's data-parallel group, its bucketed
//!   all-reduces launched during the backward of the step's last microbatch;
//! * `zero1/2=N`, `fsdp=N`, `hsdp=RxS`, `dp=R,zero1=S`, ...: [`ShardedDataParallel`] over the
//!   mesh's shard topology, which also owns the optimizer state (its shard of it) and steps.
//!
//! A loop drives every variant the same way: [`DataParallel::set_sync`] before each backward
//! (on for the last microbatch only, or off throughout when the loop reduces after the
//! schedule), [`DataParallel::finish`] after the last, then clipping and the step through the
//! loop's own code (a sharded wrapper holds the shards those need: [`DataParallel::sharded`]).

use meshgrad_nn::optim::{AdamW, Optimizer};
use meshgrad_nn::Module;
use meshgrad_tensor::Result;

use crate::zero::{ShardConfig, ShardedDataParallel};
use crate::{Ddp, DdpConfig, LayoutMesh};

/// A rank's data-parallel wrapper (see the [module docs](self)).
pub enum DataParallel {
    /// One data-parallel rank: nothing to reduce.
    Local,
    /// Replicated parameters and optimizer, gradients averaged by [`Ddp`].
    Ddp(Ddp),
    /// ZeRO-1/2/3 over the layout's shard topology.
    Sharded(ShardedDataParallel),
}

impl DataParallel {
    /// The wrapper of `module` (whose optimizer is `opt`) on this rank of `mesh`: sharded when
    /// the layout names a ZeRO stage, [`Ddp`] over the data-parallel group when that group has
    /// more than one rank, nothing otherwise. [`Ddp`] broadcasts rank 0's parameters.
    pub fn for_layout(mesh: &LayoutMesh, module: &dyn Module, opt: &AdamW) -> Result<Self> {
        Ok(match mesh.layout().zero() {
            Some(stage) => DataParallel::Sharded(ShardedDataParallel::new(
                module,
                opt.param_groups().to_vec(),
                *opt.config(),
                mesh.shard_topology()?,
                ShardConfig::new(stage),
            )?),
            None if mesh.dp_degree() > 1 => DataParallel::Ddp(Ddp::new(
                module.named_parameters(),
                mesh.dp_group(),
                DdpConfig::default(),
            )?),
            None => DataParallel::Local,
        })
    }

    /// Whether the following backward passes reduce their gradients (off: they accumulate
    /// locally until a backward with sync on, or [`DataParallel::finish`]).
    pub fn set_sync(&self, on: bool) {
        match self {
            DataParallel::Local => {}
            DataParallel::Ddp(ddp) => ddp.set_sync(on),
            DataParallel::Sharded(sdp) => sdp.set_sync(on),
        }
    }

    /// Clears the gradients before a step: the optimizer's, or the sharded wrapper's.
    pub fn zero_grad(&self, opt: &AdamW) {
        match self {
            DataParallel::Sharded(sdp) => sdp.zero_grad(),
            _ => opt.zero_grad(),
        }
    }

    /// Completes the step's reduction (turning sync on first): every bucket or shard not
    /// reduced during the backward is reduced now, and every rank holds the averaged gradients
    /// (whole, or its shard).
    pub fn finish(&self) -> Result<()> {
        self.set_sync(true);
        match self {
            DataParallel::Local => Ok(()),
            DataParallel::Ddp(ddp) => ddp.finish(),
            DataParallel::Sharded(sdp) => sdp.finish(),
        }
    }

    /// The sharded wrapper, when the layout shards.
    pub fn sharded(&self) -> Option<&ShardedDataParallel> {
        match self {
            DataParallel::Sharded(sdp) => Some(sdp),
            _ => None,
        }
    }

    /// fsdp/hsdp keep only shards: gathers the full parameters (every rank takes part), for a
    /// checkpoint or a sample. Nothing to do for the other layouts.
    pub fn summon_full_params(&self) -> Result<()> {
        match self {
            DataParallel::Sharded(sdp) => sdp.summon_full_params(),
            _ => Ok(()),
        }
    }
}

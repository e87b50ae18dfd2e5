//! Data parallelism under expert parallelism: [`ExpertDataParallel`], the wrapper
//! [`DataParallel::for_layout`] picks when the layout has `ep=E`.
//!
//! A rank holds every parameter but the experts whole (or its shard of them), and its block of
//! the experts (or its shard of that block). The two kinds are reduced apart, as torchtitan does
//! (its experts live on a mesh of their own):
//!
//! * the **dense** parameters (router, attention, norms, embeddings) over the whole
//!   data-parallel group, by [`Ddp`] or, under `zero1/zero2/fsdp/hsdp`, by the sharded wrapper
//!   ([`ShardedDataParallel`] over the layout's shard topology, told to leave the experts alone:
//!   [`ShardConfig::ignored`]);
//! * the **experts** over the `D / E` ranks that hold the same ones
//!   ([`LayoutMesh::expert_replica_group`]): without a sharding entry by [`Ddp`], whole on every
//!   one of them (they are already split `E` ways); under a sharding entry by a second
//!   [`ShardedDataParallel`] at the same ZeRO stage over that group
//!   ([`ShardTopology::flat`]; its `ignored` are the dense parameters, and
//!   [`ShardConfig::sometimes_unused`] is on, as an expert may get no tokens on a rank): ZeRO-1
//!   shards their optimizer state over the replicas, ZeRO-2 their gradients too, ZeRO-3 (`fsdp`,
//!   `hsdp`) their parameters too, gathered unit by unit when read (the two wrappers' hooks
//!   and prefetches sit on different parameters of the same blocks). With one replica
//!   (`fsdp=2,ep=2`) there is nothing to shard: the expert wrapper is ZeRO-1 over that one rank,
//!   which keeps the experts, their gradients and their optimizer state whole and steps them.
//!   The run's optimizer is unused under a sharding entry: the two wrappers step their shards.
//!
//! The gradient norm adds the experts' squares (summed over their shards in the replica group,
//! then over the expert-parallel group) to the dense ones, then over the pipeline: every element
//! counted once ([`ApartParams`] without sharding). A checkpoint under a sharding entry holds the
//! dense parameters' segments and the experts' segments, both under their global names, with
//! their optimizers' state ([`DataParallel::local_pieces`]), so it loads under any other layout.

use std::sync::Arc;

use meshgrad_autograd::{no_grad, Var};
use meshgrad_nn::optim::{clip_grads_with_norm, grad_sq_sum, AdamW, Optimizer};
use meshgrad_nn::Module;
use meshgrad_tensor::exact_sum::ExactSum;
use meshgrad_tensor::{Device, Result, Tensor};

use crate::checkpoint::{Checkpoint, Piece, Role, StateRole};
use crate::comm::{all_reduce_scalar, Communicator};
use crate::pipeline::{ApartParams, PipelineGrads};
use crate::strategy::{sharded_sq_sum, DataParallel, ScaledStep};
use crate::zero::{ShardConfig, ShardTopology, ShardedDataParallel, ZeroStage};
use crate::{Ddp, DdpConfig, LayoutMesh, ReduceOp};

/// What reduces (and under a sharding entry shards and steps) a rank's experts.
enum ExpertReduce {
    /// No sharding entry and one replica: nothing to reduce (the run's optimizer steps them).
    Local,
    /// No sharding entry: [`Ddp`] over the replica group (the run's optimizer steps them).
    Ddp(Ddp),
    /// A sharding entry: ZeRO over the replica group, at the layout's stage (ZeRO-1 over a
    /// single replica), which also owns the experts' optimizer state and steps them.
    Sharded(ShardedDataParallel),
}

/// Data parallelism under expert parallelism (`ep=E` over `D` data-parallel ranks; see the
/// [module docs](self)). The experts' scaling: the loss is averaged over the `D` ranks, and an
/// expert's gradient on a rank already sums the contributions of the tokens of its `E`
/// expert-parallel ranks (the all-to-all's backward brings them), so summing over the `D / E`
/// replicas and dividing by `D` (their average times `1 / E`) gives one device's gradient.
pub struct ExpertDataParallel {
    /// The dense parameters' wrapper: [`DataParallel::Ddp`] or [`DataParallel::Sharded`].
    dense: DataParallel,
    experts: ExpertReduce,
    params: Vec<Var>,
    ep: Arc<dyn Communicator>,
    /// What the experts' averaged gradients are multiplied by (see [`ExpertDataParallel::new`]).
    factor: f64,
}

impl ExpertDataParallel {
    /// The wrapper of `module` (whose optimizer is `opt`) on this rank of `mesh` (which has
    /// expert parallelism), the parameters named `experts` reduced apart. The experts' factor
    /// after their replicas' average is `1 / E`, or 1 when the mesh's averages add without
    /// dividing (reference mode: the replicas' sum is then the sum over all ranks, as the other
    /// parameters'); it is measured with one scalar average over each group.
    pub fn new(
        mesh: &LayoutMesh,
        module: &dyn Module,
        experts: &[String],
        opt: &AdamW,
    ) -> Result<Self> {
        let (Some(ep), Some(replicas)) = (mesh.ep_group(), mesh.expert_replica_group()) else {
            meshgrad_tensor::bail!(
                "expert data parallelism: layout {} has no expert-parallel group",
                mesh.layout()
            );
        };
        let (mine, dense): (Vec<_>, Vec<_>) = module
            .named_parameters()
            .into_iter()
            .partition(|(n, _)| experts.contains(n));
        let params: Vec<Var> = mine.iter().map(|(_, v)| v.clone()).collect();
        // The factor after the replicas' average: `1 / E` where an average divides; where it
        // adds without dividing (reference mode's tree sums) the replicas' sum is already the
        // sum over all ranks, and the factor is 1. Measured on the groups themselves.
        let avg_of_one = |g: &dyn Communicator| all_reduce_scalar(g, 1.0, ReduceOp::Avg);
        let factor = avg_of_one(mesh.dp_group().as_ref())?
            / (avg_of_one(replicas.as_ref())? * ep.world_size() as f64);
        let (dense, experts) = match mesh.layout().zero() {
            Some(stage) => {
                let mut config = ShardConfig::new(stage);
                config.ignored = experts.to_vec();
                let sdp = ShardedDataParallel::new(
                    module,
                    opt.param_groups().to_vec(),
                    *opt.config(),
                    mesh.shard_topology()?,
                    config,
                )?;
                // The experts at the same stage over their replicas (nothing to shard over one:
                // ZeRO-1 keeps them whole without ZeRO-3's gathers).
                let stage = if replicas.world_size() > 1 {
                    stage
                } else {
                    ZeroStage::One
                };
                let mut config = ShardConfig::new(stage);
                config.ignored = dense.iter().map(|(n, _)| n.clone()).collect();
                config.sometimes_unused = true;
                let esdp = ShardedDataParallel::new(
                    module,
                    opt.param_groups().to_vec(),
                    *opt.config(),
                    ShardTopology::flat(replicas),
                    config,
                )?;
                (DataParallel::Sharded(sdp), ExpertReduce::Sharded(esdp))
            }
            None => (
                DataParallel::Ddp(Ddp::new(dense, mesh.dp_group(), DdpConfig::default())?),
                if replicas.world_size() > 1 {
                    ExpertReduce::Ddp(Ddp::new(
                        mine,
                        replicas,
                        crate::strategy::sometimes_unused(),
                    )?)
                } else {
                    ExpertReduce::Local
                },
            ),
        };
        Ok(ExpertDataParallel {
            dense,
            experts,
            params,
            factor,
            ep,
        })
    }

    /// The dense parameters' wrapper ([`DataParallel::Ddp`] or [`DataParallel::Sharded`]).
    pub fn dense(&self) -> &DataParallel {
        &self.dense
    }

    /// The experts' sharded wrapper under a sharding entry (ZeRO over the expert-replica group,
    /// see the [module docs](self)); `None` without one.
    pub fn experts_sharded(&self) -> Option<&ShardedDataParallel> {
        match &self.experts {
            ExpertReduce::Sharded(s) => Some(s),
            _ => None,
        }
    }

    /// Both sharded wrappers, under a sharding entry.
    fn both(&self) -> Option<(&ShardedDataParallel, &ShardedDataParallel)> {
        Some((self.dense.sharded()?, self.experts_sharded()?))
    }

    pub(crate) fn set_sync(&self, on: bool) {
        self.dense.set_sync(on);
        match &self.experts {
            ExpertReduce::Local => {}
            ExpertReduce::Ddp(d) => d.set_sync(on),
            ExpertReduce::Sharded(s) => s.set_sync(on),
        }
    }

    pub(crate) fn zero_grad(&self, opt: &AdamW) {
        self.dense.zero_grad(opt);
        if let ExpertReduce::Sharded(s) = &self.experts {
            s.zero_grad();
        }
    }

    /// Completes both reductions and applies the experts' factor (to their reduced shards under
    /// a sharding entry, to their whole gradients otherwise).
    pub(crate) fn finish(&self) -> Result<()> {
        self.dense.finish()?;
        match &self.experts {
            ExpertReduce::Local => {}
            ExpertReduce::Ddp(d) => d.finish()?,
            ExpertReduce::Sharded(s) => {
                s.finish()?;
                if self.factor != 1.0 {
                    s.scale_grads(self.factor)?;
                }
                return Ok(());
            }
        }
        let f = self.factor;
        if f == 1.0 {
            return Ok(());
        }
        no_grad(|| {
            for p in &self.params {
                if let Some(g) = p.grad() {
                    g.copy_from(&g.mul_scalar(f)?)?;
                }
            }
            Ok(())
        })
    }

    /// ZeRO-3: gathers the full parameters of both wrappers (every rank takes part).
    pub(crate) fn summon_full_params(&self) -> Result<()> {
        self.dense.summon_full_params()?;
        match self.experts_sharded() {
            Some(s) => s.summon_full_params(),
            None => Ok(()),
        }
    }

    fn apart(&self) -> ApartParams<'_> {
        ApartParams {
            params: &self.params,
            group: self.ep.as_ref(),
        }
    }

    /// This rank's checkpoint pieces under a sharding entry: its segments of the dense
    /// parameters and of the experts, both under their global names, and of their optimizers'
    /// state ([`ShardedDataParallel::local_pieces`]); the global step counter is left to the
    /// dense optimizer's, which steps with the experts' (one tensor, written once). `None`
    /// without (the module's parameters and the run's optimizer are then the whole state).
    pub(crate) fn sharded_pieces(&self) -> Result<Option<Vec<Piece>>> {
        let Some((sdp, esdp)) = self.both() else {
            return Ok(None);
        };
        let mut pieces = sdp.local_pieces()?;
        let global = |p: &Piece| {
            matches!(
                p.role,
                Role::Optimizer {
                    state: StateRole::Global,
                    ..
                }
            )
        };
        pieces.extend(esdp.local_pieces()?.into_iter().filter(|p| !global(p)));
        Ok(Some(pieces))
    }

    /// Loads `ck` (saved under any layout) under a sharding entry: the dense segments and the
    /// experts' segments, with their optimizers' state, each through its wrapper by global
    /// names. `false` without (nothing loaded: the module and the run's optimizer take the
    /// checkpoint then). Local, except that a summoned ZeRO-3 wrapper gathers again.
    pub(crate) fn load_sharded(&self, ck: &Checkpoint) -> Result<bool> {
        let Some((sdp, esdp)) = self.both() else {
            return Ok(false);
        };
        // Neither part holds every tensor of the checkpoint: not strict.
        sdp.load_pieces(ck, false)?;
        esdp.load_pieces(ck, false)?;
        Ok(true)
    }

    /// The experts' squares summed over their shards (the replica group), then over the
    /// expert-parallel group and the pipeline: every element once.
    fn expert_sq_sum(&self, grads: &PipelineGrads) -> Result<f64> {
        let local = match self.experts_sharded() {
            Some(s) => s.grad_sq_sum_without(&|_| false)?,
            None => grad_sq_sum(&self.params)?,
        };
        let ep = all_reduce_scalar(self.ep.as_ref(), local, ReduceOp::Sum)?;
        all_reduce_scalar(grads.pipeline_group(), ep, ReduceOp::Sum)
    }

    pub(crate) fn grad_norm(&self, grads: &PipelineGrads) -> Result<f64> {
        match self.dense.sharded() {
            Some(sdp) => Ok((sharded_sq_sum(sdp, grads)? + self.expert_sq_sum(grads)?).sqrt()),
            None => grads.grad_norm(Some(self.apart())),
        }
    }

    pub(crate) fn exact_grad_sq_sum(&self, grads: &PipelineGrads) -> Result<ExactSum> {
        match self.both() {
            Some((sdp, esdp)) => {
                let mut local = sdp.exact_grad_sq_sum_without(&|n| grads.is_left_out_of_norm(n))?;
                // The experts' exact sum over their shards, then over the ep group (integer
                // words: any order is exact).
                let words = esdp.exact_grad_sq_sum_without(&|_| false)?.to_words();
                let n = words.len();
                let summed = self
                    .ep
                    .all_reduce(&Tensor::from_vec(words, n, Device::Cpu)?, ReduceOp::Sum)?
                    .wait()?;
                local.merge(&ExactSum::from_words(&summed.to_vec::<f64>()?)?);
                grads.exact_sum_over_pipeline(&local)
            }
            None => grads.exact_grad_sq_sum(Some(self.apart())),
        }
    }

    pub(crate) fn clip_grads_with_norm(
        &self,
        grads: &PipelineGrads,
        max_norm: f64,
        norm: f64,
    ) -> Result<()> {
        match self.both() {
            Some((sdp, esdp)) => {
                sdp.clip_grads_with_norm(max_norm, norm)?;
                esdp.clip_grads_with_norm(max_norm, norm)
            }
            None => clip_grads_with_norm(grads.params(), max_norm, norm),
        }
    }

    pub(crate) fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()> {
        match self.both() {
            Some((sdp, esdp)) => {
                sdp.step(lr)?;
                esdp.step(lr)
            }
            None => opt.step(lr),
        }
    }

    pub(crate) fn unscaled_grad_norm(&self, grads: &PipelineGrads, scale: f64) -> Result<f64> {
        match self.both() {
            Some((sdp, esdp)) => {
                if scale != 1.0 {
                    sdp.scale_grads(1.0 / scale)?;
                    esdp.scale_grads(1.0 / scale)?;
                }
                Ok((sharded_sq_sum(sdp, grads)? + self.expert_sq_sum(grads)?).sqrt())
            }
            None => Ok(self.grad_norm(grads)? / scale),
        }
    }

    pub(crate) fn step_scaled(&self, opt: &mut AdamW, step: ScaledStep) -> Result<()> {
        match self.both() {
            Some((_, esdp)) => {
                self.dense.step_scaled(opt, step)?;
                if step.max_norm > 0.0 {
                    esdp.clip_grads_with_norm(step.max_norm, step.norm)?;
                }
                esdp.step(step.lr)
            }
            None => {
                let coef = meshgrad_nn::optim::clip_coef(step.max_norm, step.norm);
                opt.step_scaled(step.lr, coef / step.scale)
            }
        }
    }
}

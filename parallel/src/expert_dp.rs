//! Data parallelism under expert parallelism: [`ExpertDataParallel`], the wrapper
//! [`DataParallel::for_layout`] picks when the layout has `ep=E`.
//!
//! A rank holds every parameter but the experts whole (or its shard of them), and its block of
//! the experts. The two kinds are reduced apart, as torchtitan does (its experts live on a mesh
//! of their own):
//!
//! * the **dense** parameters (router, attention, norms, embeddings) over the whole
//!   data-parallel group, by [`Ddp`] or, under `zero1/zero2/fsdp/hsdp`, by the sharded wrapper
//!   ([`ShardedDataParallel`], told to leave the experts alone: [`ShardConfig::ignored`]);
//! * the **experts** by [`Ddp`] over the `D / E` ranks that hold the same ones
//!   ([`LayoutMesh::expert_replica_group`]), whole on every one of them (they are already split
//!   `E` ways); under a sharded wrapper they get an AdamW of their own (the run's optimizer is
//!   then unused, as the wrapper steps its shards).
//!
//! The gradient norm adds the experts' squares over the expert-parallel group to the dense ones
//! ([`ApartParams`]). A checkpoint under a sharded dense wrapper holds the dense parameters'
//! segments and the rank's experts whole under their global names, with their AdamW's state
//! ([`DataParallel::local_pieces`]), so it loads under any other layout.

use std::sync::{Arc, Mutex};

use meshgrad_autograd::{no_grad, Var};
use meshgrad_nn::optim::{clip_grads_with_norm, grad_sq_sum, AdamW, Optimizer, ParamGroup};
use meshgrad_nn::Module;
use meshgrad_tensor::exact_sum::ExactSum;
use meshgrad_tensor::Result;

use crate::checkpoint::{
    pieces_of_optimizer, pieces_of_parameters, Checkpoint, Piece, Role, StateRole,
};
use crate::comm::{all_reduce_scalar, Communicator};
use crate::pipeline::{ApartParams, PipelineGrads};
use crate::strategy::{sharded_sq_sum, DataParallel, ScaledStep};
use crate::zero::{ShardConfig, ShardedDataParallel};
use crate::{Ddp, DdpConfig, LayoutMesh, ReduceOp};

/// Data parallelism under expert parallelism (`ep=E` over `D` data-parallel ranks; see the
/// [module docs](self)). The experts' scaling: the loss is averaged over the `D` ranks, and an
/// expert's gradient on a rank already sums the contributions of the tokens of its `E`
/// expert-parallel ranks (the all-to-all's backward brings them), so summing over the `D / E`
/// replicas and dividing by `D` (their average times `1 / E`) gives one device's gradient.
pub struct ExpertDataParallel {
    /// The dense parameters' wrapper: [`DataParallel::Ddp`] or [`DataParallel::Sharded`].
    dense: DataParallel,
    experts: Option<Ddp>,
    /// This rank's experts, by their global names.
    named: Vec<(String, Var)>,
    params: Vec<Var>,
    ep: Arc<dyn Communicator>,
    /// What the experts' averaged gradients are multiplied by (see [`ExpertDataParallel::new`]).
    factor: f64,
    /// Under a sharded dense wrapper: the experts' optimizer.
    opt: Option<Mutex<AdamW>>,
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
        let params = mine.iter().map(|(_, v)| v.clone()).collect();
        // The factor after the replicas' average: `1 / E` where an average divides; where it
        // adds without dividing (reference mode's tree sums) the replicas' sum is already the
        // sum over all ranks, and the factor is 1. Measured on the groups themselves.
        let avg_of_one = |g: &dyn Communicator| all_reduce_scalar(g, 1.0, ReduceOp::Avg);
        let factor = avg_of_one(mesh.dp_group().as_ref())?
            / (avg_of_one(replicas.as_ref())? * ep.world_size() as f64);
        let (dense, own_opt) = match mesh.layout().zero() {
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
                let groups: Vec<ParamGroup> = opt
                    .param_groups()
                    .iter()
                    .map(|g| ParamGroup {
                        params: g
                            .params
                            .iter()
                            .filter(|(n, _)| experts.contains(n))
                            .cloned()
                            .collect(),
                        ..g.clone()
                    })
                    .filter(|g| !g.params.is_empty())
                    .collect();
                let own = AdamW::new(groups, *opt.config())?;
                (DataParallel::Sharded(sdp), Some(Mutex::new(own)))
            }
            None => (
                DataParallel::Ddp(Ddp::new(dense, mesh.dp_group(), DdpConfig::default())?),
                None,
            ),
        };
        let experts = if replicas.world_size() > 1 {
            Some(Ddp::new(
                mine.clone(),
                replicas,
                crate::strategy::sometimes_unused(),
            )?)
        } else {
            None
        };
        Ok(ExpertDataParallel {
            dense,
            experts,
            named: mine,
            params,
            factor,
            ep,
            opt: own_opt,
        })
    }

    /// The dense parameters' wrapper ([`DataParallel::Ddp`] or [`DataParallel::Sharded`]).
    pub fn dense(&self) -> &DataParallel {
        &self.dense
    }

    fn sharded(&self) -> Option<&ShardedDataParallel> {
        self.dense.sharded()
    }

    fn own_opt(&self) -> Option<std::sync::MutexGuard<'_, AdamW>> {
        self.opt
            .as_ref()
            .map(|o| o.lock().unwrap_or_else(|e| e.into_inner()))
    }

    pub(crate) fn set_sync(&self, on: bool) {
        self.dense.set_sync(on);
        if let Some(e) = &self.experts {
            e.set_sync(on);
        }
    }

    pub(crate) fn zero_grad(&self, opt: &AdamW) {
        self.dense.zero_grad(opt);
        if let Some(o) = self.own_opt() {
            o.zero_grad();
        }
    }

    pub(crate) fn finish(&self) -> Result<()> {
        self.dense.finish()?;
        if let Some(e) = &self.experts {
            e.finish()?;
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

    fn apart(&self) -> ApartParams<'_> {
        ApartParams {
            params: &self.params,
            group: self.ep.as_ref(),
        }
    }

    /// This rank's checkpoint pieces under a sharded dense wrapper: its segments of the dense
    /// parameters and of their optimizer state ([`ShardedDataParallel::local_pieces`]), and its
    /// experts whole with their AdamW's state (whose global step counter is left to the dense
    /// optimizer's, which steps with it: one tensor, written once). `None` under [`Ddp`] (the
    /// module's parameters and the run's optimizer are then the whole state).
    pub(crate) fn sharded_pieces(&self) -> Result<Option<Vec<Piece>>> {
        let (Some(sdp), Some(own)) = (self.sharded(), self.own_opt()) else {
            return Ok(None);
        };
        let mut pieces = sdp.local_pieces()?;
        pieces.extend(pieces_of_parameters(&self.named));
        let global = |p: &Piece| {
            matches!(
                p.role,
                Role::Optimizer {
                    state: StateRole::Global,
                    ..
                }
            )
        };
        pieces.extend(
            pieces_of_optimizer(&*own)?
                .into_iter()
                .filter(|p| !global(p)),
        );
        Ok(Some(pieces))
    }

    /// Loads `ck` (saved under any layout) under a sharded dense wrapper: the dense segments and
    /// their optimizer state through it, this rank's experts and their AdamW's state by their
    /// global names. `false` under [`Ddp`] (nothing loaded: the module and the run's optimizer
    /// take the checkpoint then). Local.
    pub(crate) fn load_sharded(&self, ck: &Checkpoint) -> Result<bool> {
        let (Some(sdp), Some(mut own)) = (self.sharded(), self.own_opt()) else {
            return Ok(false);
        };
        // Neither part holds every tensor of the checkpoint: not strict.
        sdp.load_pieces(ck, false)?;
        ck.load_parameters(&self.named, false)?;
        ck.load_optimizer(&mut *own, false)?;
        Ok(true)
    }

    /// The experts' squares summed over the expert-parallel group and the pipeline.
    fn expert_sq_sum(&self, grads: &PipelineGrads) -> Result<f64> {
        let local = grad_sq_sum(&self.params)?;
        let ep = all_reduce_scalar(self.ep.as_ref(), local, ReduceOp::Sum)?;
        all_reduce_scalar(grads.pipeline_group(), ep, ReduceOp::Sum)
    }

    pub(crate) fn grad_norm(&self, grads: &PipelineGrads) -> Result<f64> {
        match self.sharded() {
            Some(sdp) => Ok((sharded_sq_sum(sdp, grads)? + self.expert_sq_sum(grads)?).sqrt()),
            None => grads.grad_norm(Some(self.apart())),
        }
    }

    pub(crate) fn exact_grad_sq_sum(&self, grads: &PipelineGrads) -> Result<ExactSum> {
        match self.sharded() {
            Some(sdp) => {
                let mut local = sdp.exact_grad_sq_sum_without(&|n| grads.is_left_out_of_norm(n))?;
                local.merge(&crate::pipeline::exact_sq_sum_over(
                    &self.params,
                    self.ep.as_ref(),
                )?);
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
        match self.sharded() {
            Some(sdp) => {
                sdp.clip_grads_with_norm(max_norm, norm)?;
                clip_grads_with_norm(&self.params, max_norm, norm)
            }
            None => clip_grads_with_norm(grads.params(), max_norm, norm),
        }
    }

    pub(crate) fn step(&self, opt: &mut AdamW, lr: f64) -> Result<()> {
        match (self.sharded(), self.own_opt()) {
            (Some(sdp), Some(mut own)) => {
                sdp.step(lr)?;
                own.step(lr)
            }
            _ => opt.step(lr),
        }
    }

    pub(crate) fn unscaled_grad_norm(&self, grads: &PipelineGrads, scale: f64) -> Result<f64> {
        match self.sharded() {
            Some(sdp) => {
                if scale != 1.0 {
                    sdp.scale_grads(1.0 / scale)?;
                }
                let experts = self.expert_sq_sum(grads)? / (scale * scale);
                Ok((sharded_sq_sum(sdp, grads)? + experts).sqrt())
            }
            None => Ok(self.grad_norm(grads)? / scale),
        }
    }

    pub(crate) fn step_scaled(&self, opt: &mut AdamW, step: ScaledStep) -> Result<()> {
        match (self.sharded(), self.own_opt()) {
            (Some(_), Some(mut own)) => {
                self.dense.step_scaled(opt, step)?;
                let coef = meshgrad_nn::optim::clip_coef(step.max_norm, step.norm);
                own.step_scaled(step.lr, coef / step.scale)
            }
            _ => {
                let coef = meshgrad_nn::optim::clip_coef(step.max_norm, step.norm);
                opt.step_scaled(step.lr, coef / step.scale)
            }
        }
    }
}

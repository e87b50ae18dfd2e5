//! Helpers shared by the lockstep tests that train under a layout: the data-parallel wrapper a
//! rank's model gets (DDP, ZeRO or nothing) and its step, the full (gathered) weights, and the
//! comparison of a run with the single-device one.
#![allow(dead_code)]

use meshgrad_autograd::Var;
use meshgrad_nn::optim::{
    clip_grad_norm, AdamW, AdamWConfig, Optimizer, ParamGroup, Sgd, SgdConfig,
};
use meshgrad_nn::Module;
use meshgrad_parallel::zero::{ShardConfig, ShardedDataParallel};
use meshgrad_parallel::{Ddp, DdpConfig, LayoutMesh};
use meshgrad_tensor::Result;

/// AdamW (default hyper-parameters) or SGD with momentum 0.9.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptKind {
    /// `AdamWConfig::default()`.
    AdamW,
    /// `SgdConfig { momentum: 0.9 }`.
    Sgd,
}

/// A rank's model under the data-parallel part of its layout: DDP over the data-parallel group
/// (several data-parallel ranks, no sharding), ZeRO over the mesh's shard topology (a sharded
/// layout, which then owns the optimizer), or nothing; with the run's optimizer otherwise.
pub struct DataParallel {
    ddp: Option<Ddp>,
    sdp: Option<ShardedDataParallel>,
    opt: Option<Box<dyn Optimizer>>,
}

impl DataParallel {
    /// Wraps `model`, whose optimizer groups are `groups`, for `mesh`'s layout.
    pub fn new(
        model: &dyn Module,
        mesh: &LayoutMesh,
        groups: Vec<ParamGroup>,
        kind: OptKind,
    ) -> Result<Self> {
        if let Some(stage) = mesh.layout().zero() {
            let (topo, config) = (mesh.shard_topology()?, ShardConfig::new(stage));
            let sdp = match kind {
                OptKind::AdamW => {
                    ShardedDataParallel::new(model, groups, AdamWConfig::default(), topo, config)?
                }
                OptKind::Sgd => ShardedDataParallel::new(
                    model,
                    groups,
                    SgdConfig { momentum: 0.9 },
                    topo,
                    config,
                )?,
            };
            return Ok(DataParallel {
                ddp: None,
                sdp: Some(sdp),
                opt: None,
            });
        }
        let ddp = if mesh.dp_degree() > 1 {
            Some(Ddp::new(
                model.named_parameters(),
                mesh.dp_group(),
                DdpConfig::default(),
            )?)
        } else {
            None
        };
        let opt: Box<dyn Optimizer> = match kind {
            OptKind::AdamW => Box::new(AdamW::new(groups, AdamWConfig::default())?),
            OptKind::Sgd => Box::new(Sgd::new(groups, SgdConfig { momentum: 0.9 })?),
        };
        Ok(DataParallel {
            ddp,
            sdp: None,
            opt: Some(opt),
        })
    }

    /// The sharded wrapper, under a ZeRO layout.
    pub fn sharded(&self) -> Option<&ShardedDataParallel> {
        self.sdp.as_ref()
    }

    /// The optimizer, without ZeRO (ZeRO's wrapper owns it otherwise).
    pub fn optimizer(&self) -> Option<&dyn Optimizer> {
        self.opt.as_deref()
    }

    /// The optimizer, mutably, without ZeRO.
    pub fn optimizer_mut(&mut self) -> Option<&mut (dyn Optimizer + 'static)> {
        self.opt.as_deref_mut()
    }

    /// Clears the gradients before a step.
    pub fn zero_grad(&self) {
        if let Some(z) = &self.sdp {
            z.zero_grad();
        }
        if let Some(o) = &self.opt {
            o.zero_grad();
        }
    }

    /// After the backward: completes the gradient reduction, clips the global norm to `clip`
    /// (across every mesh dimension) and steps with learning rate `lr`.
    pub fn step(&mut self, params: &[Var], clip: Option<f64>, lr: f64) -> Result<()> {
        if let Some(d) = &self.ddp {
            d.finish()?;
        }
        if let Some(z) = &self.sdp {
            z.finish()?;
            if let Some(c) = clip {
                z.clip_grad_norm(c)?;
            }
            return z.step(lr);
        }
        if let Some(c) = clip {
            clip_grad_norm(params, c)?;
        }
        self.opt
            .as_mut()
            .expect("an optimizer without ZeRO")
            .step(lr)
    }

    /// ZeRO-3: gathers the full parameters into the model (a no-op otherwise).
    pub fn summon_full_params(&self) -> Result<()> {
        match &self.sdp {
            Some(z) => z.summon_full_params(),
            None => Ok(()),
        }
    }
}

/// Every parameter, full (split ones gathered over their group: a collective).
pub fn full_weights(model: &dyn Module) -> Result<Vec<(String, Vec<f32>)>> {
    model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            let t = match p.placement() {
                Some(pl) => pl.gather(p.tensor())?,
                None => p.tensor().clone(),
            };
            Ok((n, t.to_vec::<f32>()?))
        })
        .collect()
}

/// What a lockstep run gives: the loss of every step and the final full weights by name.
pub struct RunOut {
    /// Per-step losses.
    pub losses: Vec<f64>,
    /// Final weights (split parameters gathered), by name.
    pub weights: Vec<(String, Vec<f32>)>,
}

/// Asserts every step's loss within `tol` relative and every weight within `tol` relative in the
/// L2 norm (`||a - b|| <= tol * ||b||`), names and sizes equal; prints the worst figures.
pub fn assert_close(what: &str, got: &RunOut, want: &RunOut, tol: f64) {
    assert_eq!(got.losses.len(), want.losses.len(), "{what}: step count");
    let mut worst_loss = 0f64;
    for (i, (a, b)) in got.losses.iter().zip(&want.losses).enumerate() {
        let rel = (a - b).abs() / b.abs();
        worst_loss = worst_loss.max(rel);
        assert!(rel <= tol, "{what}: step {i} loss {a} vs {b} (rel {rel:e})");
    }
    assert_eq!(got.weights.len(), want.weights.len());
    let mut worst = 0f64;
    for ((name, a), (wname, b)) in got.weights.iter().zip(&want.weights) {
        assert_eq!(name, wname);
        assert_eq!(a.len(), b.len(), "{what}: {name} has {} elements", a.len());
        let (mut d2, mut b2) = (0f64, 0f64);
        for (&x, &y) in a.iter().zip(b) {
            d2 += ((x - y) as f64).powi(2);
            b2 += (y as f64).powi(2);
        }
        let rel = (d2 / b2.max(1e-30)).sqrt();
        worst = worst.max(rel);
        assert!(
            rel <= tol,
            "{what}: {name} differs by {rel:e} relative (L2)"
        );
    }
    println!(
        "{what}: losses within {worst_loss:.1e}, final weights within {worst:.1e} relative; \
         losses {:?}",
        got.losses
    );
}

//! [`LayoutMesh`]: one rank's [`DeviceMesh`] for a [`ParallelLayout`], and the process groups
//! each strategy takes from it.
//!
//! The mesh has the dimensions `["pp", "dp_replicate", "dp_shard", "cp", "tp"]` (see
//! [`crate::layout::MESH_DIMS`]), every one present even at size 1, laid out row-major with `tp`
//! fastest: tensor-parallel ranks are adjacent (as in Megatron-LM), then the context-parallel
//! ring, then the shard group, then the replicas, then the pipeline stages. For `dp=2,tp=2` over 4
//! ranks the tensor-parallel groups are `[0,1]` and `[2,3]` and the data-parallel groups `[0,2]`
//! and `[1,3]`. For `dp=2,cp=2` the context-parallel groups are `[0,1]` and `[2,3]`, the rows
//! split over `[0,2]` (and `[1,3]`), and gradients average over all four ranks.

use std::sync::Arc;

use meshgrad_tensor::Result;

use crate::comm::Communicator;
use crate::layout::{ParallelLayout, MESH_DIMS};
use crate::mesh::DeviceMesh;
use crate::zero::ShardTopology;

/// One rank's mesh for a [`ParallelLayout`] (built by [`ParallelLayout::mesh`]).
pub struct LayoutMesh {
    layout: ParallelLayout,
    mesh: DeviceMesh,
    dp: Arc<dyn Communicator>,
    /// Under expert parallelism: the expert-parallel group and the group of the ranks that hold
    /// the same experts.
    ep: Option<(Arc<dyn Communicator>, Arc<dyn Communicator>)>,
}

impl std::fmt::Debug for LayoutMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LayoutMesh({}, {:?})", self.layout, self.mesh)
    }
}

impl LayoutMesh {
    /// See [`ParallelLayout::mesh`].
    pub(crate) fn new(layout: ParallelLayout, world: Arc<dyn Communicator>) -> Result<Self> {
        if world.world_size() != layout.world_size() {
            meshgrad_tensor::bail!(
                "layout {layout}: its degrees multiply to {} ranks, but the world has {}",
                layout.world_size(),
                world.world_size()
            );
        }
        let mesh = DeviceMesh::new(world, &MESH_DIMS, &layout.mesh_shape())?;
        // The data-parallel group, created here so that every rank creates the mesh's groups in
        // the same order. When one of the two dimensions has size 1 the other's group already
        // has the same members in the same order. Context-parallel ranks fold into it (they
        // average their gradients with the data-parallel ranks').
        let dp = if layout.cp() > 1 {
            if layout.data_parallel_degree() == 1 {
                mesh.group("cp")?
            } else {
                mesh.group_over(&["dp_replicate", "dp_shard", "cp"])?
            }
        } else if layout.dp_replicate() == 1 {
            mesh.group("dp_shard")?
        } else if layout.dp_shard() == 1 {
            mesh.group("dp_replicate")?
        } else {
            mesh.group_over(&["dp_replicate", "dp_shard"])?
        };
        // Expert parallelism: E consecutive data-parallel ranks hold every expert once; the
        // ranks E apart hold the same experts.
        let ep = if layout.ep() > 1 {
            let (e, d, me) = (layout.ep(), dp.world_size(), dp.rank());
            let block = me / e * e;
            let ep_ranks: Vec<usize> = (block..block + e).collect();
            let same: Vec<usize> = (me % e..d).step_by(e).collect();
            Some((
                dp.new_group(&ep_ranks, "ep")?,
                dp.new_group(&same, "ep_replicate")?,
            ))
        } else {
            None
        };
        Ok(LayoutMesh {
            layout,
            mesh,
            dp,
            ep,
        })
    }

    /// Under expert parallelism (`ep=E`), this rank's expert-parallel group: E consecutive
    /// ranks of [`Self::dp_group`] (rank `r` of it holds the `r`-th block of every layer's
    /// experts). `None` without expert parallelism.
    pub fn ep_group(&self) -> Option<Arc<dyn Communicator>> {
        self.ep.as_ref().map(|(g, _)| g.clone())
    }

    /// Under expert parallelism, the ranks of [`Self::dp_group`] that hold the same experts as
    /// this one (every E-th): the group expert gradients are reduced over. `None` without.
    pub fn expert_replica_group(&self) -> Option<Arc<dyn Communicator>> {
        self.ep.as_ref().map(|(_, g)| g.clone())
    }

    /// The layout.
    pub fn layout(&self) -> &ParallelLayout {
        &self.layout
    }

    /// The underlying mesh (dimensions `["pp", "dp_replicate", "dp_shard", "cp", "tp"]`).
    pub fn device_mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// This rank in the world.
    pub fn rank(&self) -> usize {
        self.mesh.rank()
    }

    /// The data-parallel ranks of this rank: `dp_replicate x dp_shard` flattened (replicate
    /// slowest), times `cp` under context parallelism: the ranks that average their gradients
    /// (DDP's group; losses are averaged over it too). Its ranks read different rows, or
    /// different chunks of the same rows ([`Self::batch_rank`] says which rows).
    pub fn dp_group(&self) -> Arc<dyn Communicator> {
        self.dp.clone()
    }

    /// This rank's index in [`Self::dp_group`].
    pub fn dp_rank(&self) -> usize {
        self.dp.rank()
    }

    /// Number of ranks of [`Self::dp_group`] (`dp_replicate * dp_shard * cp`).
    pub fn dp_degree(&self) -> usize {
        self.dp.world_size()
    }

    /// Which rows of the global batch this rank reads: its index among the `dp_replicate x
    /// dp_shard` ranks (replicate slowest); the ranks of a context-parallel group share it.
    pub fn batch_rank(&self) -> usize {
        self.dim_coord("dp_replicate") * self.layout.dp_shard() + self.dim_coord("dp_shard")
    }

    /// Number of ranks the global batch's rows are split over (`dp_replicate * dp_shard`).
    pub fn batch_degree(&self) -> usize {
        self.layout.data_parallel_degree()
    }

    /// The context-parallel ranks of this rank (the ring of ring attention).
    pub fn cp_group(&self) -> Arc<dyn Communicator> {
        self.dim_group("cp")
    }

    /// The tensor-parallel ranks of this rank (adjacent world ranks).
    pub fn tp_group(&self) -> Arc<dyn Communicator> {
        self.dim_group("tp")
    }

    /// This rank's index in its tensor-parallel group.
    pub fn tp_rank(&self) -> usize {
        self.dim_coord("tp")
    }

    /// The tensor-parallel degree.
    pub fn tp_degree(&self) -> usize {
        self.layout.tp()
    }

    /// The pipeline-parallel ranks of this rank (one per stage).
    pub fn pp_group(&self) -> Arc<dyn Communicator> {
        self.dim_group("pp")
    }

    /// The groups of sharded data parallelism: sharding over `dp_shard` (times `cp` under
    /// context parallelism: the context-parallel ranks hold different shards, as they average
    /// their gradients with the data-parallel ranks'), replicated over `dp_replicate` (hybrid)
    /// when that is above 1, else flat ([`ShardTopology::flat`] over the shard group).
    pub fn shard_topology(&self) -> Result<ShardTopology> {
        let t = if self.layout.dp_replicate() == 1 {
            ShardTopology::flat(self.dp.clone())
        } else {
            ShardTopology {
                dp: self.dp.clone(),
                shard: if self.layout.cp() > 1 {
                    self.mesh.group_over(&["dp_shard", "cp"])?
                } else {
                    self.mesh.group("dp_shard")?
                },
                replicate: Some(self.mesh.group("dp_replicate")?),
            }
        };
        t.validate()?;
        Ok(t)
    }

    fn dim_group(&self, name: &str) -> Arc<dyn Communicator> {
        self.mesh
            .group(name)
            .expect("a layout mesh has every dimension")
    }

    fn dim_coord(&self, name: &str) -> usize {
        self.mesh
            .coord(name)
            .expect("a layout mesh has every dimension")
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use meshgrad_tensor::{DType, Device, Tensor};

    use super::*;
    use crate::comm::{run_ranks, ReduceOp, RunOptions};

    /// What one rank sees of its layout mesh.
    #[derive(Debug)]
    struct Seen {
        coords: Vec<usize>,
        dp: Vec<usize>,
        dp_rank: usize,
        tp: Vec<usize>,
        tp_rank: usize,
        pp: Vec<usize>,
        shard: Vec<usize>,
        replicate: Option<Vec<usize>>,
        topo_dp: Vec<usize>,
        dp_sum: f64,
    }

    fn seen(spec: &str) -> Vec<Seen> {
        let layout: ParallelLayout = spec.parse().unwrap();
        let opts = RunOptions::with_timeout(Duration::from_secs(10));
        run_ranks(layout.world_size(), &opts, |ctx| {
            let m = layout.mesh(ctx.comm.clone())?;
            let topo = m.shard_topology()?;
            assert_eq!(m.dp_degree(), layout.data_parallel_degree());
            assert_eq!(m.tp_degree(), layout.tp());
            // The groups work: sum 10^rank over the data-parallel group.
            let x = Tensor::full(10f64.powi(ctx.rank as i32), 1, DType::F64, Device::Cpu)?;
            let dp_sum = m.dp_group().all_reduce(&x, ReduceOp::Sum)?.wait()?;
            Ok(Seen {
                coords: m.device_mesh().coords().to_vec(),
                dp: m.dp_group().ranks().to_vec(),
                dp_rank: m.dp_rank(),
                tp: m.tp_group().ranks().to_vec(),
                tp_rank: m.tp_rank(),
                pp: m.pp_group().ranks().to_vec(),
                shard: topo.shard.ranks().to_vec(),
                replicate: topo.replicate.as_ref().map(|r| r.ranks().to_vec()),
                topo_dp: topo.dp.ranks().to_vec(),
                dp_sum: dp_sum.to_vec::<f64>()?[0],
            })
        })
        .unwrap()
    }

    #[test]
    fn dp2_tp2_groups() {
        let s = seen("dp=2,tp=2");
        let dp: Vec<_> = s.iter().map(|x| x.dp.clone()).collect();
        let tp: Vec<_> = s.iter().map(|x| x.tp.clone()).collect();
        assert_eq!(dp, [vec![0, 2], vec![1, 3], vec![0, 2], vec![1, 3]]);
        assert_eq!(tp, [vec![0, 1], vec![0, 1], vec![2, 3], vec![2, 3]]);
        let dp_rank: Vec<_> = s.iter().map(|x| x.dp_rank).collect();
        let tp_rank: Vec<_> = s.iter().map(|x| x.tp_rank).collect();
        assert_eq!(dp_rank, [0, 0, 1, 1]);
        assert_eq!(tp_rank, [0, 1, 0, 1]);
        assert_eq!(s[3].coords, [0, 1, 0, 0, 1]);
        assert_eq!(s[2].pp, [2]);
        // Not sharded (DDP's layout), but the topology is still well formed: shards of one rank,
        // replicated over the data-parallel group.
        assert_eq!(s[1].shard, [1]);
        assert_eq!(s[1].replicate.as_deref(), Some(&[1, 3][..]));
        assert_eq!(s[0].dp_sum, 101.0);
        assert_eq!(s[1].dp_sum, 1010.0);
    }

    #[test]
    fn hsdp2x2_tp2_groups() {
        let s = seen("hsdp=2x2,tp=2");
        assert_eq!(s.len(), 8);
        // Rank 5 = (pp 0, replicate 1, shard 0, tp 1).
        let r5 = &s[5];
        assert_eq!(r5.coords, [0, 1, 0, 0, 1]);
        assert_eq!(r5.tp, [4, 5]);
        assert_eq!(r5.tp_rank, 1);
        assert_eq!(r5.dp, [1, 3, 5, 7]);
        assert_eq!(r5.dp_rank, 2);
        assert_eq!(r5.shard, [5, 7]);
        assert_eq!(r5.replicate.as_deref(), Some(&[1, 5][..]));
        assert_eq!(r5.topo_dp, r5.dp);
        assert_eq!(s[0].dp, [0, 2, 4, 6]);
        assert_eq!(s[0].shard, [0, 2]);
        assert_eq!(s[0].replicate.as_deref(), Some(&[0, 4][..]));
        assert_eq!(s[0].dp_sum, 1.0 + 1e2 + 1e4 + 1e6);
        let dp_rank: Vec<_> = s.iter().map(|x| x.dp_rank).collect();
        assert_eq!(dp_rank, [0, 0, 1, 1, 2, 2, 3, 3]);
    }

    #[test]
    fn plain_layouts_use_every_rank() {
        for spec in ["dp=4", "fsdp=4", "zero1=4"] {
            let s = seen(spec);
            for (r, x) in s.iter().enumerate() {
                assert_eq!(x.dp, [0, 1, 2, 3], "{spec}");
                assert_eq!(x.dp_rank, r);
                assert_eq!(x.tp, [r]);
            }
            if spec != "dp=4" {
                assert_eq!(s[2].shard, [0, 1, 2, 3]);
                assert_eq!(s[2].replicate, None);
            }
        }
        let s = seen("dp=2,zero2=2");
        assert_eq!(s[3].shard, [2, 3]);
        assert_eq!(s[3].replicate.as_deref(), Some(&[1, 3][..]));
    }

    #[test]
    fn cp_ranks_share_rows_and_fold_into_the_gradient_group() {
        let layout: ParallelLayout = "dp=2,cp=2".parse().unwrap();
        let opts = RunOptions::with_timeout(Duration::from_secs(10));
        let seen = run_ranks(4, &opts, |ctx| {
            let m = layout.mesh(ctx.comm.clone())?;
            Ok((
                m.cp_group().ranks().to_vec(),
                m.dp_group().ranks().to_vec(),
                m.batch_rank(),
                m.batch_degree(),
            ))
        })
        .unwrap();
        assert_eq!(seen[0], (vec![0, 1], vec![0, 1, 2, 3], 0, 2));
        assert_eq!(seen[1], (vec![0, 1], vec![0, 1, 2, 3], 0, 2));
        assert_eq!(seen[2], (vec![2, 3], vec![0, 1, 2, 3], 1, 2));
        assert_eq!(seen[3].2, 1);
    }

    #[test]
    fn ep_groups_divide_the_data_parallel_ranks() {
        let layout: ParallelLayout = "dp=4,ep=2".parse().unwrap();
        let opts = RunOptions::with_timeout(Duration::from_secs(10));
        let seen = run_ranks(4, &opts, |ctx| {
            let m = layout.mesh(ctx.comm.clone())?;
            Ok((
                m.ep_group().unwrap().ranks().to_vec(),
                m.expert_replica_group().unwrap().ranks().to_vec(),
                m.dp_group().ranks().to_vec(),
            ))
        })
        .unwrap();
        assert_eq!(seen[0], (vec![0, 1], vec![0, 2], vec![0, 1, 2, 3]));
        assert_eq!(seen[1], (vec![0, 1], vec![1, 3], vec![0, 1, 2, 3]));
        assert_eq!(seen[2], (vec![2, 3], vec![0, 2], vec![0, 1, 2, 3]));
        assert_eq!(seen[3].0, vec![2, 3]);
    }

    #[test]
    fn world_of_the_wrong_size_is_refused() {
        let layout: ParallelLayout = "dp=2,tp=2".parse().unwrap();
        let opts = RunOptions::with_timeout(Duration::from_secs(10));
        let e = run_ranks(2, &opts, |ctx| layout.mesh(ctx.comm.clone()).map(|_| ()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layout dp=2,tp=2: its degrees multiply to 4 ranks, but the world has 2"),
            "{e}"
        );
    }
}

//! [`ShardTopology`]: the process groups sharded data parallelism communicates over.

use std::sync::Arc;

use meshgrad_tensor::Result;

use crate::comm::Communicator;
use crate::mesh::DeviceMesh;

/// The groups of sharded data parallelism:
///
/// * `dp`: every data-parallel rank (each processes its own rows of the global batch);
/// * `shard`: the ranks that split the parameters, gradients and optimizer state between them
///   (reduce-scatter and all-gather run here);
/// * `replicate`: the ranks holding the same shard (hybrid sharding all-reduces the gradient
///   shards across them); absent when every data-parallel rank is in one shard group.
///
/// Plain ZeRO over N ranks is `dp = shard` (N ranks) with no replicate group; hybrid sharding
/// (`hsdp=RxS`) is a `[dp_replicate = R, dp_shard = S]` mesh.
#[derive(Clone)]
pub struct ShardTopology {
    /// All data-parallel ranks.
    pub dp: Arc<dyn Communicator>,
    /// The shard group.
    pub shard: Arc<dyn Communicator>,
    /// The replicate group (hybrid sharding with more than one replica).
    pub replicate: Option<Arc<dyn Communicator>>,
}

impl std::fmt::Debug for ShardTopology {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ShardTopology(dp {}, shard {}, replicate {})",
            self.dp.describe(),
            self.shard.describe(),
            self.replicate
                .as_ref()
                .map_or("-".to_string(), |r| r.describe())
        )
    }
}

impl ShardTopology {
    /// Sharding over all ranks of `comm` (ZeRO-1/2/3 without replication).
    pub fn flat(comm: Arc<dyn Communicator>) -> Self {
        ShardTopology {
            dp: comm.clone(),
            shard: comm,
            replicate: None,
        }
    }

    /// Hybrid sharding over a mesh with dimensions `replicate_dim` and `shard_dim` (the data
    /// parallel ranks are both dimensions together). A replicate dimension of size 1 is plain
    /// sharding.
    pub fn hybrid(mesh: &DeviceMesh, replicate_dim: &str, shard_dim: &str) -> Result<Self> {
        let dp = mesh.group_over(&[replicate_dim, shard_dim])?;
        let shard = mesh.group(shard_dim)?;
        let replicate = if mesh.size(replicate_dim)? > 1 {
            Some(mesh.group(replicate_dim)?)
        } else {
            None
        };
        let t = ShardTopology {
            dp,
            shard,
            replicate,
        };
        t.validate()?;
        Ok(t)
    }

    /// Hybrid sharding over a mesh with dimensions named `dp_replicate` and `dp_shard`.
    pub fn from_mesh(mesh: &DeviceMesh) -> Result<Self> {
        Self::hybrid(mesh, "dp_replicate", "dp_shard")
    }

    /// Number of ranks in the shard group (the shard degree).
    pub fn shard_degree(&self) -> usize {
        self.shard.world_size()
    }

    /// Number of replicas (1 without hybrid sharding).
    pub fn replicate_degree(&self) -> usize {
        self.replicate.as_ref().map_or(1, |r| r.world_size())
    }

    /// Checks that the group sizes agree: `dp = shard * replicate`.
    pub fn validate(&self) -> Result<()> {
        let (d, s, r) = (
            self.dp.world_size(),
            self.shard_degree(),
            self.replicate_degree(),
        );
        if d != s * r {
            meshgrad_tensor::bail!(
                "shard topology: {d} data-parallel ranks {} are not {s} shard ranks {} times {r} \
                 replicas",
                self.dp.describe(),
                self.shard.describe()
            );
        }
        Ok(())
    }
}

//! Tensor, sequence, context and expert parallelism over a [`Communicator`]: the [`Collectives`] view
//! that the layers of `meshgrad_nn::tp` and `meshgrad_nn::cp` communicate through,
//! [`tensor_parallel`] to make the [`TensorParallel`] a model is built with (see
//! `meshgrad_nn::tp` for plans and styles) and [`context_parallel`] its [`ContextParallel`], [`expert_parallel`] its [`ExpertParallel`].

use std::sync::Arc;

use meshgrad_autograd::distributed::Collectives;
use meshgrad_nn::cp::ContextParallel;
use meshgrad_nn::moe::ExpertParallel;
use meshgrad_nn::tp::TensorParallel;
use meshgrad_tensor::{Result, Tensor};

use crate::comm::{Communicator, P2pOp, P2pWork, ReduceOp};

/// A communicator seen as the [`Collectives`] tensor parallelism needs (each call launches the
/// collective and waits for it).
pub struct CommCollectives {
    comm: Arc<dyn Communicator>,
    name: String,
}

impl CommCollectives {
    /// The collectives of `comm`, named `name` (the mesh dimension) in messages.
    pub fn new(comm: Arc<dyn Communicator>, name: &str) -> Self {
        CommCollectives {
            comm,
            name: name.to_string(),
        }
    }
}

impl Collectives for CommCollectives {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.world_size()
    }
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.comm.all_reduce(t, ReduceOp::Sum)?.wait()
    }
    fn all_reduce_max(&self, t: &Tensor) -> Result<Tensor> {
        self.comm.all_reduce(t, ReduceOp::Max)?.wait()
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.comm.all_gather(t)?.wait()
    }
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.comm.reduce_scatter(t, ReduceOp::Sum)?.wait()
    }
    /// One send to the next rank and one receive from the previous, posted together as one
    /// [`Communicator::batch_p2p`] (so it cannot deadlock when sends rendezvous).
    fn ring_shift(&self, t: &Tensor) -> Result<Tensor> {
        let w = self.comm.world_size();
        if w == 1 {
            return Ok(t.clone());
        }
        let me = self.comm.rank();
        let ops = vec![
            P2pOp::Send {
                tensor: t.clone(),
                peer: (me + 1) % w,
            },
            P2pOp::Recv {
                peer: (me + w - 1) % w,
            },
        ];
        // The receive first, then the send (as the pipeline executor waits): a rendezvous send
        // completes only once the peer has taken the message.
        let mut works = self.comm.batch_p2p(ops)?.into_iter();
        let (Some(P2pWork::Send(sent)), Some(P2pWork::Recv(recv))) = (works.next(), works.next())
        else {
            meshgrad_tensor::bail!(
                "ring_shift on {}: batch_p2p did not return a send and a receive",
                self.describe()
            );
        };
        let received = recv.wait()?;
        sent.wait()?;
        Ok(received)
    }
    fn all_to_all(
        &self,
        t: &Tensor,
        send_splits: &[usize],
        recv_splits: &[usize],
    ) -> Result<Tensor> {
        self.comm.all_to_all(t, send_splits, recv_splits)?.wait()
    }
    fn describe(&self) -> String {
        format!("{}{}", self.name, self.comm.describe())
    }
}

/// Expert parallelism over `group` (this rank's expert-parallel group,
/// [`crate::LayoutMesh::ep_group`]): the ranks a mixture of experts' experts are sharded over.
pub fn expert_parallel(group: Arc<dyn Communicator>) -> ExpertParallel {
    ExpertParallel::new(Arc::new(CommCollectives::new(group, "ep")))
}

/// Context parallelism over `group` (this rank's `cp` group of the mesh): the ring of ring
/// attention.
pub fn context_parallel(group: Arc<dyn Communicator>) -> ContextParallel {
    ContextParallel::new(Arc::new(CommCollectives::new(group, "cp")))
}

/// Tensor parallelism over `group` (this rank's `tp` group of the mesh), with or without
/// sequence parallelism.
pub fn tensor_parallel(group: Arc<dyn Communicator>, sequence_parallel: bool) -> TensorParallel {
    TensorParallel::new(Arc::new(CommCollectives::new(group, "tp")))
        .sequence_parallel(sequence_parallel)
}

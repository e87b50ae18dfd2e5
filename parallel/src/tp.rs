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
use crate::pipeline::trace::{record_opt, SpanKind, Timeline};

/// A communicator seen as the [`Collectives`] tensor parallelism needs (each call launches the
/// collective and waits for it).
pub struct CommCollectives {
    comm: Arc<dyn Communicator>,
    name: String,
    /// Where [`Collectives::traced`] transfers are recorded (`--trace`), if anywhere.
    timeline: Option<Timeline>,
}

impl CommCollectives {
    /// The collectives of `comm`, named `name` (the mesh dimension) in messages.
    pub fn new(comm: Arc<dyn Communicator>, name: &str) -> Self {
        CommCollectives {
            comm,
            name: name.to_string(),
            timeline: None,
        }
    }

    /// The same collectives, recording the transfers the layers trace (ring hops, all-to-alls)
    /// as [`SpanKind::Collective`] spans of `timeline` when one is given.
    pub fn with_timeline(mut self, timeline: Option<Timeline>) -> Self {
        self.timeline = timeline;
        self
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
    fn traced(
        &self,
        label: &dyn Fn() -> String,
        f: &mut dyn FnMut() -> Result<Tensor>,
    ) -> Result<Tensor> {
        record_opt(self.timeline.as_ref(), SpanKind::Collective, label, f)
    }
}

/// Expert parallelism over `group` (this rank's expert-parallel group,
/// [`crate::LayoutMesh::ep_group`]): the ranks a mixture of experts' experts are sharded over.
pub fn expert_parallel(group: Arc<dyn Communicator>) -> ExpertParallel {
    expert_parallel_traced(group, None)
}

/// [`expert_parallel`] whose all-to-alls are recorded in `timeline` (`--trace`) when given.
pub fn expert_parallel_traced(
    group: Arc<dyn Communicator>,
    timeline: Option<Timeline>,
) -> ExpertParallel {
    ExpertParallel::new(Arc::new(
        CommCollectives::new(group, "ep").with_timeline(timeline),
    ))
}

/// Context parallelism over `group` (this rank's `cp` group of the mesh): the ring of ring
/// attention.
pub fn context_parallel(group: Arc<dyn Communicator>) -> ContextParallel {
    context_parallel_traced(group, None)
}

/// [`context_parallel`] whose ring hops are recorded in `timeline` (`--trace`) when given.
pub fn context_parallel_traced(
    group: Arc<dyn Communicator>,
    timeline: Option<Timeline>,
) -> ContextParallel {
    ContextParallel::new(Arc::new(
        CommCollectives::new(group, "cp").with_timeline(timeline),
    ))
}

/// Tensor parallelism over `group` (this rank's `tp` group of the mesh), with or without
/// sequence parallelism.
pub fn tensor_parallel(group: Arc<dyn Communicator>, sequence_parallel: bool) -> TensorParallel {
    TensorParallel::new(Arc::new(CommCollectives::new(group, "tp")))
        .sequence_parallel(sequence_parallel)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use meshgrad_autograd::distributed::all_to_all_rows;
    use meshgrad_autograd::Var;
    use meshgrad_tensor::{Device, Tensor};

    use super::*;
    use crate::comm::{run_ranks, RunOptions};

    /// Three ranks with uneven (and zero) splits: rank `r` sends `send[r][j]` rows to rank `j`,
    /// its row `i` holding the value `100 r + i`. Forward: each rank receives its blocks in
    /// source order; backward with the upstream gradient `1000 + value`, each row's gradient
    /// returns to the row it came from (`1000 + 100 r + i` on rank `r`'s row `i`).
    #[test]
    fn all_to_all_rows_moves_rows_and_their_gradients_back() {
        let send = [[1usize, 0, 2], [2, 1, 0], [0, 3, 1]];
        let opts = RunOptions::with_timeout(Duration::from_secs(10));
        let seen = run_ranks(3, &opts, |ctx| {
            let r = ctx.rank;
            let group: Arc<dyn Collectives> =
                Arc::new(CommCollectives::new(ctx.comm.clone(), "ep"));
            let n: usize = send[r].iter().sum();
            let vals: Vec<f64> = (0..n).flat_map(|i| [(100 * r + i) as f64; 2]).collect();
            let x = Var::leaf(Tensor::from_vec(vals, (n, 2), Device::Cpu)?);
            let recv: Vec<usize> = (0..3).map(|src| send[src][r]).collect();
            let y = all_to_all_rows(&x, &send[r], &recv, &group)?;
            let got = y.tensor().to_vec_f64()?;
            let upstream = y.tensor().add_scalar(1000.0)?;
            y.backward_with(upstream)?;
            Ok((got, x.grad().unwrap().to_vec_f64()?))
        })
        .unwrap();
        // The rows rank j receives, from ranks 0, 1, 2 in order (first column of each).
        let want: [Vec<f64>; 3] = [
            vec![0.0, 100.0, 101.0],
            vec![102.0, 200.0, 201.0, 202.0],
            vec![1.0, 2.0, 203.0],
        ];
        for (j, (got, grad)) in seen.iter().enumerate() {
            let first: Vec<f64> = got.iter().step_by(2).copied().collect();
            assert_eq!(first, want[j], "rank {j} received");
            let n: usize = send[j].iter().sum();
            let back: Vec<f64> = (0..n)
                .flat_map(|i| [(1000 + 100 * j + i) as f64; 2])
                .collect();
            assert_eq!(grad, &back, "rank {j}'s gradients");
        }
    }
}

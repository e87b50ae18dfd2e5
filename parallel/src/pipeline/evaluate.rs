//! Forward-only passes through a pipeline (validation): one batch goes through the virtual
//! stages in order, with no gradients and no schedule to follow.

use meshgrad_autograd::{no_grad, Var};
use meshgrad_nn::ModelStage;
use meshgrad_tensor::Result;

use crate::comm::{all_reduce_scalar, Communicator, ReduceOp};

/// Runs `batch` forward through the pipeline and returns the output of the stage with the head
/// (a scalar loss) on every rank of `pp`. `chunks[c]` is this rank's chunk `c`, virtual stage
/// `c * P + p` of `P * chunks.len()` (the layout of [`super::Schedule`]). Each virtual stage
/// receives its input from the rank before it, runs under [`no_grad`] and sends its output on;
/// the loss is shared with an all-reduce (the other ranks add zero, so it is exact). Every rank
/// of `pp` must call it with the same number of chunks. The stages are run as they are: call
/// [`meshgrad_nn::Module::set_training`]`(false)` first for evaluation.
pub fn forward_only<S: ModelStage>(
    chunks: &[S],
    pp: &dyn Communicator,
    batch: &S::Batch,
) -> Result<f64> {
    let (rank, world) = (pp.rank(), pp.world_size());
    let v = chunks.len();
    if v == 0 {
        meshgrad_tensor::bail!("pipeline forward: rank {rank} holds no stage");
    }
    let total = world * v;
    let mut loss = 0.0;
    no_grad(|| -> Result<()> {
        // A hidden state handed from one chunk to the next on this rank (only with one rank).
        let mut local: Option<Var> = None;
        for (c, stage) in chunks.iter().enumerate() {
            let s = c * world + rank;
            let input = if s == 0 {
                None
            } else if world == 1 {
                local.take()
            } else {
                Some(Var::constant(pp.recv((s - 1) % world)?.wait()?))
            };
            let out = stage.forward_stage(batch, input.as_ref())?;
            if s + 1 == total {
                loss = out.tensor().item()?;
            } else if world == 1 {
                local = Some(out);
            } else {
                pp.send(out.tensor(), (s + 1) % world)?.wait()?;
            }
        }
        Ok(())
    })?;
    all_reduce_scalar(pp, loss, ReduceOp::Sum)
}

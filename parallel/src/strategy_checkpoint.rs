//! A rank's part of a distributed checkpoint under its [`DataParallel`] wrapper: which pieces
//! it saves and how it loads a checkpoint saved under any layout (see [`crate::checkpoint`]).
//!
//! * without sharding (one rank, [`Ddp`](crate::Ddp), expert parallelism with `dp`): the
//!   module's parameters (whole or tensor-parallel parts, an expert-parallel rank's experts by
//!   their global names) and the run's optimizer state;
//! * ZeRO-1/2/3 ([`ShardedDataParallel`](crate::ShardedDataParallel)): the wrapper's segments
//!   of the parameters and of its optimizer's state;
//! * expert parallelism with `zero1/zero2/fsdp/hsdp`: the dense segments as above, and the
//!   rank's segments of its experts (sharded over the ranks holding the same experts) with
//!   their optimizer's state, under their global names
//!   ([`ExpertDataParallel`](crate::ExpertDataParallel)).

use meshgrad_nn::optim::Optimizer;
use meshgrad_nn::Module;
use meshgrad_tensor::Result;

use crate::checkpoint::{pieces_of_module, pieces_of_optimizer, Checkpoint, Piece};
use crate::strategy::DataParallel;

impl DataParallel {
    /// This rank's pieces of a checkpoint of `model` trained with `opt` under this wrapper: the
    /// module's parameters and `opt`'s state without sharding; the wrapper's segments under
    /// ZeRO; under expert parallelism with ZeRO, the dense segments and the experts' segments
    /// with their optimizers' state. Local: nothing is gathered.
    pub fn local_pieces(&self, model: &dyn Module, opt: &dyn Optimizer) -> Result<Vec<Piece>> {
        if let DataParallel::Experts(e) = self {
            if let Some(pieces) = e.sharded_pieces()? {
                return Ok(pieces);
            }
        }
        match self.sharded() {
            Some(sdp) => sdp.local_pieces(),
            None => {
                let mut pieces = pieces_of_module(model)?;
                pieces.extend(pieces_of_optimizer(opt)?);
                Ok(pieces)
            }
        }
    }

    /// Loads `ck`, saved under any layout, into this rank's `model` and `opt` (or the wrapper's
    /// shards and optimizers) under the current one. With `strict`, every parameter and
    /// optimizer state of the checkpoint must be this rank's (a pipeline stage or an
    /// expert-parallel rank, holding some of them, passes `false`). Local, except that ZeRO-3
    /// may gather (see [`ShardedDataParallel::load_pieces`](crate::ShardedDataParallel::load_pieces)).
    pub fn load_pieces(
        &self,
        ck: &Checkpoint,
        model: &dyn Module,
        opt: &mut dyn Optimizer,
        strict: bool,
    ) -> Result<()> {
        if let DataParallel::Experts(e) = self {
            if e.load_sharded(ck)? {
                return Ok(());
            }
        }
        match self.sharded() {
            Some(sdp) => sdp.load_pieces(ck, strict),
            None => {
                ck.load_into_module(model, strict)?;
                ck.load_optimizer(opt, strict)
            }
        }
    }
}

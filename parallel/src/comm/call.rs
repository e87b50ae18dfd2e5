//! What a rank called, as backends match it across ranks and name it in errors: the kind of
//! collective and the tensor it was given, shown as `all_reduce(sum, f32 [4])`.

use meshgrad_tensor::{DType, Shape};

use super::ReduceOp;

/// What a rank called, for matching across ranks.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Kind {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast(usize),
    Barrier,
}

impl Kind {
    /// The call's name in messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all_reduce",
            Kind::ReduceScatter(_) => "reduce_scatter",
            Kind::AllGather => "all_gather",
            Kind::Broadcast(_) => "broadcast",
            Kind::Barrier => "barrier",
        }
    }
}

/// One rank's call: what it launched and with which tensor.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Call {
    pub(crate) kind: Kind,
    /// Dtype and shape of the tensor passed (none for a barrier).
    pub(crate) tensor: Option<(DType, Shape)>,
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut args = Vec::new();
        match &self.kind {
            Kind::AllReduce(op) | Kind::ReduceScatter(op) => args.push(op.to_string()),
            Kind::Broadcast(root) => args.push(format!("root {root}")),
            Kind::AllGather | Kind::Barrier => {}
        }
        if let Some((dt, shape)) = &self.tensor {
            args.push(format!("{dt} {shape}"));
        }
        write!(f, "{}({})", self.kind.name(), args.join(", "))
    }
}

/// The argument checks every backend makes before launching, as the message of its
/// [`CommErrorKind::Invalid`](meshgrad_tensor::CommErrorKind::Invalid) error.
pub(crate) mod checks {
    use meshgrad_tensor::{DType, Shape};

    use crate::comm::{reduce, ReduceOp};

    /// `peer` must be another rank of a group of `world` in which this rank is `me`; `call` and
    /// `role` (`destination`, `source`) name it in the message.
    pub(crate) fn peer(
        call: &str,
        peer: usize,
        me: usize,
        world: usize,
        role: &str,
    ) -> Result<(), String> {
        if peer >= world {
            return Err(format!(
                "{role} {peer} is not a rank of this group of {world}"
            ));
        }
        if peer == me {
            return Err(format!("a rank cannot {call} to or from itself"));
        }
        Ok(())
    }

    /// `op` must be defined for `dtype` (`Avg` needs a float).
    pub(crate) fn reduce_op(op: ReduceOp, dtype: DType) -> Result<(), String> {
        if reduce::supports(op, dtype) {
            Ok(())
        } else {
            Err(format!("{op} needs a float dtype, got {dtype}"))
        }
    }

    /// A reduce-scatter's tensor: a leading dimension divisible by the group size, and `op`
    /// defined for its dtype.
    pub(crate) fn reduce_scatter(
        shape: &Shape,
        dtype: DType,
        op: ReduceOp,
        world: usize,
    ) -> Result<(), String> {
        if shape
            .dims()
            .first()
            .is_none_or(|d| !d.is_multiple_of(world))
        {
            return Err(format!(
                "the leading dimension of shape {shape} must be divisible by the group size \
                 {world}"
            ));
        }
        reduce_op(op, dtype)
    }

    /// A broadcast's root must be a rank of the group.
    pub(crate) fn root(root: usize, world: usize) -> Result<(), String> {
        if root < world {
            Ok(())
        } else {
            Err(format!(
                "root {root} is not a rank of this group of {world}"
            ))
        }
    }
}

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

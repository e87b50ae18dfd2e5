//! What a rank called, as backends match it across ranks and name it in errors: the kind of
//! collective and the tensor it was given, shown as `all_reduce(sum, f32 [4])`.
//!
//! Most collectives match when the members' calls are equal. An all-to-all matches pairwise:
//! its split sizes differ from rank to rank, and ranks `a` and `b` agree when `a` sends `b` as
//! many rows as `b` expects from `a` (both ways) and their rows have the same trailing shape and
//! dtype ([`Call::pair`], [`disagreement`]).

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
    /// An all-to-all with this rank's split sizes: rows of dimension 0 sent to, and expected
    /// from, each group rank.
    AllToAll {
        send: Vec<usize>,
        recv: Vec<usize>,
    },
}

impl Kind {
    /// An all-to-all's kind, after its argument checks ([`checks::all_to_all`]; the message of
    /// the first that fails).
    pub(crate) fn all_to_all(
        shape: &Shape,
        send: &[usize],
        recv: &[usize],
        world: usize,
    ) -> Result<Kind, String> {
        checks::all_to_all(shape, send, recv, world)?;
        Ok(Kind::AllToAll {
            send: send.to_vec(),
            recv: recv.to_vec(),
        })
    }

    /// The call's name in messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Kind::AllReduce(_) => "all_reduce",
            Kind::ReduceScatter(_) => "reduce_scatter",
            Kind::AllGather => "all_gather",
            Kind::Broadcast(_) => "broadcast",
            Kind::Barrier => "barrier",
            Kind::AllToAll { .. } => "all_to_all",
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
            Kind::AllToAll { send, recv } => {
                args.push(format!("send {send:?}"));
                args.push(format!("recv {recv:?}"));
            }
            Kind::AllGather | Kind::Barrier => {}
        }
        if let Some((dt, shape)) = &self.tensor {
            args.push(format!("{dt} {shape}"));
        }
        write!(f, "{}({})", self.kind.name(), args.join(", "))
    }
}

impl Call {
    /// What group ranks `me` (this call's rank) and `peer` must agree on, as a message names
    /// it; `members` are the group's global ranks. For an all-to-all: the dtype, the rows'
    /// trailing shape and how many rows each sends the other, the same text on both ranks when
    /// they agree, e.g. `all_to_all(f32 [*, 4]: 3 rows from rank 0 to rank 1, 0 rows from rank
    /// 1 to rank 0)` (global ranks, the lower group rank first). For any other call: the whole
    /// call (every member makes the same one).
    pub(crate) fn pair(&self, me: usize, peer: usize, members: &[usize]) -> String {
        let Kind::AllToAll { send, recv } = &self.kind else {
            return self.to_string();
        };
        let rows = |v: &[usize]| v.get(peer).copied().unwrap_or(0);
        // (lower, higher, rows lower -> higher, rows higher -> lower)
        let (a, b, ab, ba) = if me <= peer {
            (me, peer, rows(send), rows(recv))
        } else {
            (peer, me, rows(recv), rows(send))
        };
        let tensor = match &self.tensor {
            Some((dt, shape)) => {
                let mut dims = vec!["*".to_string()];
                dims.extend(shape.dims().iter().skip(1).map(|d| d.to_string()));
                format!("{dt} [{}]", dims.join(", "))
            }
            None => "no tensor".to_string(),
        };
        let (ga, gb) = (members[a], members[b]);
        format!(
            "all_to_all({tensor}: {ab} rows from rank {ga} to rank {gb}, {ba} rows from rank \
             {gb} to rank {ga})"
        )
    }
}

/// Whether `mine` (made by group rank `me`) and `theirs` (by group rank `them`) fail to match;
/// if so, the two calls as the [`Mismatch`](meshgrad_tensor::CommErrorKind::Mismatch) error
/// names them (pair views for two all-to-alls, see [`Call::pair`]; whole calls otherwise).
pub(crate) fn disagreement(
    mine: &Call,
    me: usize,
    theirs: &Call,
    them: usize,
    members: &[usize],
) -> Option<[String; 2]> {
    match (&mine.kind, &theirs.kind) {
        (Kind::AllToAll { send, recv }, Kind::AllToAll { send: s2, recv: r2 }) => {
            let trailing = |c: &Call| {
                c.tensor
                    .as_ref()
                    .map(|(d, s)| (*d, s.dims().get(1..).map(<[usize]>::to_vec)))
            };
            let agree = trailing(mine) == trailing(theirs)
                && send.get(them) == r2.get(me)
                && recv.get(them) == s2.get(me);
            (!agree).then(|| [mine.pair(me, them, members), theirs.pair(them, me, members)])
        }
        _ => (mine != theirs).then(|| [mine.to_string(), theirs.to_string()]),
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

    /// [`all_to_all`]'s checks, then the splits in elements (rows times the trailing
    /// dimensions' product), as backends that count elements take them: `(result shape, send
    /// counts, receive counts)`.
    #[cfg(any(feature = "mpi", feature = "nccl"))]
    pub(crate) fn all_to_all_elements(
        shape: &Shape,
        send: &[usize],
        recv: &[usize],
        world: usize,
    ) -> Result<AllToAllElements, String> {
        let dims = all_to_all(shape, send, recv, world)?;
        let row: usize = dims[1..].iter().product();
        let elems = |splits: &[usize]| splits.iter().map(|&n| n * row).collect();
        Ok((dims, elems(send), elems(recv)))
    }

    /// What [`all_to_all_elements`] returns.
    #[cfg(any(feature = "mpi", feature = "nccl"))]
    pub(crate) type AllToAllElements = (Vec<usize>, Vec<usize>, Vec<usize>);

    /// An all-to-all's arguments: a tensor of at least one dimension, one send and one receive
    /// split per rank of a group of `world`, send splits that add up to the leading dimension,
    /// and a result whose element count fits in memory. Returns the result's shape (the received
    /// rows, then the input's trailing dimensions).
    pub(crate) fn all_to_all(
        shape: &Shape,
        send: &[usize],
        recv: &[usize],
        world: usize,
    ) -> Result<Vec<usize>, String> {
        let Some((&rows, rest)) = shape.dims().split_first() else {
            return Err(
                "needs a tensor of at least one dimension (its rows are split), got a \
                        0-d tensor"
                    .into(),
            );
        };
        for (name, splits) in [("send_splits", send), ("recv_splits", recv)] {
            if splits.len() != world {
                return Err(format!(
                    "{name} has {} entries but the group has {world} ranks",
                    splits.len()
                ));
            }
        }
        let sent = send.iter().try_fold(0usize, |a, &b| a.checked_add(b));
        if sent != Some(rows) {
            return Err(format!(
                "send_splits {send:?} add up to {} rows but the tensor of shape {shape} has \
                 {rows}",
                sent.map_or("more than usize::MAX".to_string(), |s| s.to_string())
            ));
        }
        let received = recv.iter().try_fold(0usize, |a, &b| a.checked_add(b));
        let elems =
            received.and_then(|r| rest.iter().try_fold(r, |a, &d| a.checked_mul(d)).map(|_| r));
        match elems {
            Some(r) => Ok(std::iter::once(r).chain(rest.iter().copied()).collect()),
            None => Err(format!(
                "recv_splits {recv:?} ask for more elements than fit in memory"
            )),
        }
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

#[cfg(test)]
mod tests {
    use meshgrad_tensor::{DType, Shape};

    use super::*;

    fn a2a(send: &[usize], recv: &[usize], dims: &[usize]) -> Call {
        Call {
            kind: Kind::AllToAll {
                send: send.to_vec(),
                recv: recv.to_vec(),
            },
            tensor: Some((DType::F32, Shape::new(dims.to_vec()))),
        }
    }

    #[test]
    fn all_to_all_checks_and_result_shape() {
        let s = |d: &[usize]| Shape::new(d.to_vec());
        assert_eq!(
            checks::all_to_all(&s(&[3, 2, 5]), &[1, 0, 2], &[4, 0, 0], 3),
            Ok(vec![4, 2, 5])
        );
        assert_eq!(checks::all_to_all(&s(&[0]), &[0], &[0], 1), Ok(vec![0]));
        let err = |shape: &[usize], send: &[usize], recv: &[usize]| {
            checks::all_to_all(&s(shape), send, recv, 2).unwrap_err()
        };
        assert!(err(&[], &[0, 0], &[0, 0]).contains("0-d tensor"));
        assert_eq!(
            err(&[2], &[1, 1, 0], &[1, 1]),
            "send_splits has 3 entries but the group has 2 ranks"
        );
        assert_eq!(
            err(&[2], &[1, 1], &[2]),
            "recv_splits has 1 entries but the group has 2 ranks"
        );
        assert_eq!(
            err(&[2, 4], &[1, 2], &[1, 1]),
            "send_splits [1, 2] add up to 3 rows but the tensor of shape [2, 4] has 2"
        );
        assert!(err(&[2], &[usize::MAX, 3], &[1, 1]).contains("more than usize::MAX"));
        assert!(err(&[2, 1 << 40], &[1, 1], &[1 << 40, 1]).contains("fit in memory"));
    }

    #[test]
    fn all_to_all_calls_match_pair_by_pair() {
        let members = [4, 7, 9];
        // Rank 0 sends rank 1 two rows and expects none back; rank 1 agrees.
        let r0 = a2a(&[1, 2, 0], &[1, 0, 3], &[3, 8]);
        let r1 = a2a(&[0, 0, 5], &[2, 0, 1], &[1, 8]);
        assert_eq!(disagreement(&r0, 0, &r1, 1, &members), None);
        assert_eq!(
            r0.pair(0, 1, &members),
            "all_to_all(f32 [*, 8]: 2 rows from rank 4 to rank 7, 0 rows from rank 7 to rank 4)"
        );
        assert_eq!(r0.pair(0, 1, &members), r1.pair(1, 0, &members));
        // Rank 2 expects 2 rows from rank 1, which sends it 5.
        let r2 = a2a(&[3, 2, 0], &[0, 2, 0], &[5, 8]);
        let [a, b] = disagreement(&r1, 1, &r2, 2, &members).unwrap();
        assert!(a.contains("5 rows from rank 7 to rank 9"), "{a}");
        assert!(b.contains("2 rows from rank 7 to rank 9"), "{b}");
        // Another trailing shape or dtype, or another collective.
        let wide = a2a(&[1, 2, 0], &[1, 0, 3], &[3, 9]);
        assert!(disagreement(&wide, 0, &r1, 1, &members).is_some());
        let mut half = r0.clone();
        half.tensor = Some((DType::BF16, Shape::new(vec![3, 8])));
        let [a, _] = disagreement(&half, 0, &r1, 1, &members).unwrap();
        assert!(a.starts_with("all_to_all(bf16 [*, 8]: "), "{a}");
        let gather = Call {
            kind: Kind::AllGather,
            tensor: Some((DType::F32, Shape::new(vec![3, 8]))),
        };
        assert_eq!(
            disagreement(&r0, 0, &gather, 1, &members),
            Some([
                "all_to_all(send [1, 2, 0], recv [1, 0, 3], f32 [3, 8])".to_string(),
                "all_gather(f32 [3, 8])".to_string()
            ])
        );
        assert_eq!(disagreement(&gather, 0, &gather.clone(), 1, &members), None);
    }
}

//! The error type of tensor operations. Messages name the op, shapes, dtypes and devices involved.

use crate::{DType, Device, Shape};

/// Errors from tensor operations.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    /// Two shapes that must agree (or broadcast) do not.
    #[error("{op}: shape mismatch: {lhs} vs {rhs}")]
    ShapeMismatch {
        /// The operation.
        op: &'static str,
        /// Left operand's shape.
        lhs: Shape,
        /// Right operand's shape.
        rhs: Shape,
    },
    /// An operand has a dtype the op does not accept, or two dtypes disagree.
    #[error("{op}: dtype mismatch: {lhs:?} vs {rhs:?}")]
    DTypeMismatch {
        /// The operation.
        op: &'static str,
        /// Left operand's dtype.
        lhs: DType,
        /// Right operand's dtype.
        rhs: DType,
    },
    /// The op does not support this dtype.
    #[error("{op}: unsupported dtype {dtype:?}")]
    UnsupportedDType {
        /// The operation.
        op: &'static str,
        /// The dtype.
        dtype: DType,
    },
    /// Operands live on different devices.
    #[error("{op}: device mismatch: {lhs} vs {rhs}")]
    DeviceMismatch {
        /// The operation.
        op: &'static str,
        /// Left operand's device.
        lhs: Device,
        /// Right operand's device.
        rhs: Device,
    },
    /// A dimension index is out of range for the rank.
    #[error("{op}: dimension {dim} out of range for a tensor of shape {shape}")]
    DimOutOfRange {
        /// The operation.
        op: &'static str,
        /// The requested dimension.
        dim: isize,
        /// The tensor's shape.
        shape: Shape,
    },
    /// The storage was released (see [`crate::Tensor::release_storage`]), not re-materialised,
    /// and has no materialiser.
    #[error(
        "{op}: the tensor's storage is released (freed by release_storage, as ZeRO-3 / FSDP does \
         with parameters between uses) and nothing materialises it: put data back with \
         materialize_from, or run the model while the ShardedDataParallel wrapper that sharded it \
         is alive (or call its summon_full_params() before dropping it)"
    )]
    Released {
        /// The operation.
        op: &'static str,
    },
    /// The CUDA backend was requested in a build without the `cuda` feature.
    #[error(
        "device {0} requested but meshgrad was built without CUDA (rebuild with `--features cuda`)"
    )]
    CudaNotBuilt(Device),
    /// The backend exists but this op is not implemented on it.
    #[error("{op} is not implemented on {device}")]
    NotImplemented {
        /// The operation.
        op: &'static str,
        /// The device.
        device: Device,
    },
    /// A CUDA driver, library or kernel call failed on a device.
    #[error("{device}: {message}")]
    Cuda {
        /// The device.
        device: Device,
        /// What failed and the driver's error.
        message: String,
    },
    /// A communication operation failed (a collective, a message, a group): which rank, group,
    /// call and sequence number, and why (see [`CommError`]).
    #[error("{0}")]
    Comm(Box<CommError>),
    /// Any other invalid argument, described in full.
    #[error("{0}")]
    Msg(String),
}

/// A failed communication operation, as every communicator backend reports it. Displays as
/// `rank 0: all_reduce #17 on group [0,1,2,3]: rank 3 did not join within 5s (it is at
/// all_reduce #16)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommError {
    /// The global rank that reports the error.
    pub rank: usize,
    /// The members of the group the call was made on, as global ranks in group order.
    pub group: Vec<usize>,
    /// The call: `all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`, `barrier`, `send`,
    /// `recv`, `new_group`, ...
    pub call: &'static str,
    /// The call's sequence number: the n-th collective on this group for collectives (counted
    /// from 0), the n-th message to or from `peer` for `send` and `recv`; `None` for failures
    /// before a number was given (invalid arguments).
    pub seq: Option<u64>,
    /// For `send` and `recv`: the global rank of the other side.
    pub peer: Option<usize>,
    /// What went wrong.
    pub kind: CommErrorKind,
}

/// Why a communication operation failed (see [`CommError`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommErrorKind {
    /// The watchdog: the operation did not complete within `after`. `missing` are the global
    /// ranks that did not join (did not send, for a receive; did not receive, for a send); it is
    /// empty when every member joined but no result came. `detail` says what the backend knows
    /// of the missing ranks (e.g. `it is at all_reduce #16`).
    Timeout {
        /// Global ranks that did not take part in time.
        missing: Vec<usize>,
        /// The timeout.
        after: std::time::Duration,
        /// What the missing ranks were doing, if known.
        detail: Option<String>,
    },
    /// Another rank failed (panicked, returned an error, or timed out) and this operation was
    /// aborted because of it.
    PeerFailed {
        /// The global rank that failed.
        rank: usize,
        /// Its reason.
        reason: String,
    },
    /// Members exited (returned) without joining the operation.
    PeerExited {
        /// Their global ranks.
        ranks: Vec<usize>,
    },
    /// Two members made different calls at the same position of the group's sequence.
    Mismatch {
        /// The global rank that made `calls[0]`.
        rank: usize,
        /// The other global rank, that made `calls[1]`.
        other: usize,
        /// The two calls, e.g. `all_reduce(sum, f32 [4])` and `all_gather(f32 [4])`.
        calls: [String; 2],
    },
    /// An invalid argument (a rank outside the group, a shape the call cannot take, ...).
    Invalid(String),
    /// An error from the backend's library (an MPI error code and its text, ...) or any other
    /// failure, described in full.
    Backend(String),
}

impl Error {
    /// An [`Error::ShapeMismatch`] of `op` between the shapes `lhs` and `rhs`.
    pub fn shape_mismatch(op: &'static str, lhs: &Shape, rhs: &Shape) -> Error {
        Error::ShapeMismatch {
            op,
            lhs: lhs.clone(),
            rhs: rhs.clone(),
        }
    }

    /// An [`Error::Comm`] from these facts (no peer; see [`CommError::with_peer`]).
    pub fn comm(
        rank: usize,
        group: &[usize],
        call: &'static str,
        seq: Option<u64>,
        kind: CommErrorKind,
    ) -> Error {
        Error::Comm(Box::new(CommError {
            rank,
            group: group.to_vec(),
            call,
            seq,
            peer: None,
            kind,
        }))
    }
}

impl CommError {
    /// The same error with `peer` set (for `send` and `recv`).
    pub fn with_peer(mut self, peer: usize) -> Self {
        self.peer = Some(peer);
        self
    }
}

/// `rank 3` or `ranks 2, 3`.
fn rank_list(ranks: &[usize]) -> String {
    let parts: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    if ranks.len() == 1 {
        format!("rank {}", parts[0])
    } else {
        format!("ranks {}", parts.join(", "))
    }
}

/// `2s`, `1.5s`, `250ms`.
fn duration(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

impl std::fmt::Display for CommError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {}: {}", self.rank, self.call)?;
        if let Some(s) = self.seq {
            write!(f, " #{s}")?;
        }
        if let Some(p) = self.peer {
            let dir = if self.call == "send" { "to" } else { "from" };
            write!(f, " {dir} rank {p}")?;
        }
        let group: Vec<String> = self.group.iter().map(|r| r.to_string()).collect();
        write!(f, " on group [{}]: ", group.join(","))?;
        match &self.kind {
            CommErrorKind::Timeout {
                missing,
                after,
                detail,
            } => {
                if missing.is_empty() {
                    write!(f, "no result within {}", duration(*after))?;
                } else {
                    let verb = match self.call {
                        "recv" => "did not send",
                        "send" => "did not receive",
                        _ => "did not join",
                    };
                    write!(
                        f,
                        "{} {verb} within {}",
                        rank_list(missing),
                        duration(*after)
                    )?;
                }
                if let Some(d) = detail {
                    write!(f, " ({d})")?;
                }
                Ok(())
            }
            CommErrorKind::PeerFailed { rank, reason } => {
                write!(f, "aborted: rank {rank} failed: {reason}")
            }
            CommErrorKind::PeerExited { ranks } => {
                write!(f, "{} exited without joining", rank_list(ranks))
            }
            CommErrorKind::Mismatch { rank, other, calls } => write!(
                f,
                "mismatched collectives: rank {rank} called {} but rank {other} called {}",
                calls[0], calls[1]
            ),
            CommErrorKind::Invalid(m) | CommErrorKind::Backend(m) => f.write_str(m),
        }
    }
}

impl Error {
    /// The communication error, if this is one.
    pub fn as_comm(&self) -> Option<&CommError> {
        match self {
            Error::Comm(c) => Some(c),
            _ => None,
        }
    }
}

impl Error {
    /// An error with a free-form message.
    pub fn msg(s: impl Into<String>) -> Self {
        Error::Msg(s.into())
    }
}

impl From<meshgrad_kernels::KernelError> for Error {
    fn from(e: meshgrad_kernels::KernelError) -> Self {
        Error::Msg(e.0)
    }
}

/// Result with the tensor [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with an [`Error::Msg`] built from a format string.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err($crate::Error::Msg(format!($($arg)*)))
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn comm_error_display_and_fields() {
        let e = Error::comm(
            0,
            &[0, 1, 2, 3],
            "all_reduce",
            Some(17),
            CommErrorKind::Timeout {
                missing: vec![3],
                after: Duration::from_secs(5),
                detail: Some("it is at all_reduce #16".into()),
            },
        );
        assert_eq!(
            e.to_string(),
            "rank 0: all_reduce #17 on group [0,1,2,3]: rank 3 did not join within 5s \
             (it is at all_reduce #16)"
        );
        let c = e.as_comm().expect("a comm error");
        assert_eq!((c.rank, c.call, c.seq), (0, "all_reduce", Some(17)));
        let Error::Comm(b) = e else {
            panic!("not Comm")
        };
        let r = CommError {
            peer: Some(3),
            call: "recv",
            seq: Some(2),
            ..*b
        }
        .with_peer(3);
        assert_eq!(
            r.to_string(),
            "rank 0: recv #2 from rank 3 on group [0,1,2,3]: rank 3 did not send within 5s \
             (it is at all_reduce #16)"
        );
        let m = Error::comm(
            1,
            &[1, 2],
            "broadcast",
            Some(0),
            CommErrorKind::PeerExited { ranks: vec![2] },
        );
        assert_eq!(
            m.to_string(),
            "rank 1: broadcast #0 on group [1,2]: rank 2 exited without joining"
        );
    }
}

//! What the NCCL backend exchanges through the job's [`TcpStore`] rather than through NCCL
//! itself (compiled in every build, so it is tested without a GPU):
//!
//! * **Unique ids.** A NCCL communicator is created from a 128-byte unique id made by one
//!   member: [`exchange_id`] has the creator store it under a key every member derives alike
//!   ([`group_key`]) and the others read it.
//! * **Message headers.** A NCCL receive must know the element count and type in advance, so
//!   every send first publishes a [`MessageHeader`] (dtype and shape, a fixed 64-byte record)
//!   under [`header_key`] (group, sender, receiver, message number); the receiver reads it,
//!   allocates the output, then posts the NCCL receive. The payload alone travels over NCCL, so
//!   messages between a pair of ranks match in order however they are batched.

use meshgrad_tensor::{DType, Error, Result};

use super::store::TcpStore;

/// The size of a NCCL unique id (`ncclUniqueId`) in bytes.
pub const ID_BYTES: usize = 128;

/// The key of a group's unique id and of its messages' headers: the world is `world`, a
/// sub-group is its parent's key, the tag, its members (ranks of the parent) and how many
/// groups with the same members and tag this rank made before on the parent (the trait's rule:
/// the n-th such call of every member joins the same group).
pub fn group_key(parent: &str, tag: &str, members: &[usize], nth: u64) -> String {
    let m: Vec<String> = members.iter().map(|r| r.to_string()).collect();
    format!("{parent}/{tag}[{}]#{nth}", m.join(","))
}

/// The store key of group `key`'s unique id.
pub fn id_key(key: &str) -> String {
    format!("nccl/{key}/id")
}

/// Shares a group's unique id: the creator (the group's rank 0) makes it with `create` and
/// stores it under [`id_key`]`(key)`; every other member waits for it (up to the store's
/// timeout) and returns the same 128 bytes.
pub fn exchange_id(
    store: &TcpStore,
    key: &str,
    creator: bool,
    create: impl FnOnce() -> Result<[u8; ID_BYTES]>,
) -> Result<[u8; ID_BYTES]> {
    let k = id_key(key);
    if creator {
        let id = create()?;
        store.set(&k, &id)?;
        Ok(id)
    } else {
        let v = store.get(&k)?;
        <[u8; ID_BYTES]>::try_from(v.as_slice()).map_err(|_| {
            Error::msg(format!(
                "rank {}: the NCCL unique id under {k:?} has {} bytes, not {ID_BYTES}",
                store.rank(),
                v.len()
            ))
        })
    }
}

/// The store key of the header of message `seq` (counted from 0) from group rank `src` to group
/// rank `dst` on group `key`.
pub fn header_key(key: &str, src: usize, dst: usize, seq: u64) -> String {
    format!("nccl/{key}/msg/{src}-{dst}/{seq}")
}

/// The dtype and shape of a point-to-point message, as the receiver needs them to post its NCCL
/// receive. Encoded in [`MessageHeader::BYTES`] bytes: the magic `MGH1`, the dtype code, the
/// number of dimensions, two zero bytes, then [`MessageHeader::MAX_DIMS`] dimensions as u64
/// little-endian (unused ones 0).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageHeader {
    /// The element type.
    pub dtype: DType,
    /// The shape.
    pub dims: Vec<usize>,
}

const MAGIC: &[u8; 4] = b"MGH1";

/// The dtype codes of the header (the same numbering as the MPI backend's messages).
const DTYPES: [DType; 7] = [
    DType::F64,
    DType::F32,
    DType::BF16,
    DType::F16,
    DType::U8,
    DType::U32,
    DType::I64,
];

impl MessageHeader {
    /// The encoded size.
    pub const BYTES: usize = 64;
    /// The most dimensions a message may have.
    pub const MAX_DIMS: usize = 7;

    /// The encoded header; an error for a tensor of more than [`MessageHeader::MAX_DIMS`]
    /// dimensions.
    pub fn encode(&self) -> Result<[u8; Self::BYTES]> {
        if self.dims.len() > Self::MAX_DIMS {
            return Err(Error::msg(format!(
                "send: a tensor of {} dimensions {:?}: the NCCL backend sends at most {}",
                self.dims.len(),
                self.dims,
                Self::MAX_DIMS
            )));
        }
        let mut b = [0u8; Self::BYTES];
        b[..4].copy_from_slice(MAGIC);
        b[4] = DTYPES
            .iter()
            .position(|&d| d == self.dtype)
            .expect("every dtype has a code") as u8;
        b[5] = self.dims.len() as u8;
        for (i, &d) in self.dims.iter().enumerate() {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&(d as u64).to_le_bytes());
        }
        Ok(b)
    }

    /// Reads an encoded header; an error (naming what is wrong) for anything else.
    pub fn decode(b: &[u8]) -> Result<MessageHeader> {
        let bad = |why: &str| Error::msg(format!("recv: a malformed message header: {why}"));
        if b.len() != Self::BYTES {
            return Err(bad(&format!("{} bytes, not {}", b.len(), Self::BYTES)));
        }
        if &b[..4] != MAGIC {
            return Err(bad("no MGH1 magic"));
        }
        let dtype = *DTYPES
            .get(b[4] as usize)
            .ok_or_else(|| bad(&format!("unknown dtype code {}", b[4])))?;
        let ndim = b[5] as usize;
        if ndim > Self::MAX_DIMS {
            return Err(bad(&format!("{ndim} dimensions")));
        }
        let dims = (0..ndim)
            .map(|i| {
                let v = u64::from_le_bytes(b[8 + 8 * i..16 + 8 * i].try_into().expect("8 bytes"));
                usize::try_from(v).map_err(|_| bad(&format!("dimension {v} does not fit")))
            })
            .collect::<Result<Vec<usize>>>()?;
        Ok(MessageHeader { dtype, dims })
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.dims.iter().product()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        for (dtype, dims) in [
            (DType::F32, vec![]),
            (DType::BF16, vec![3, 4]),
            (DType::F16, vec![1, 2, 3, 4, 5, 6, 7]),
            (DType::I64, vec![0]),
            (DType::F64, vec![1 << 40]),
            (DType::U8, vec![5]),
            (DType::U32, vec![2, 1]),
        ] {
            let h = MessageHeader { dtype, dims };
            let b = h.encode().unwrap();
            assert_eq!(&b[..4], b"MGH1");
            assert_eq!(MessageHeader::decode(&b).unwrap(), h);
        }
        let eight = MessageHeader {
            dtype: DType::F32,
            dims: vec![1; 8],
        };
        assert!(eight
            .encode()
            .unwrap_err()
            .to_string()
            .contains("at most 7"));
        let good = MessageHeader {
            dtype: DType::F32,
            dims: vec![2],
        }
        .encode()
        .unwrap();
        let msg = |b: &[u8]| MessageHeader::decode(b).unwrap_err().to_string();
        assert!(msg(&good[..10]).contains("10 bytes, not 64"));
        let mut b = good;
        b[0] = b'X';
        assert!(msg(&b).contains("magic"));
        let mut b = good;
        b[4] = 9;
        assert!(msg(&b).contains("unknown dtype code 9"));
        let mut b = good;
        b[5] = 8;
        assert!(msg(&b).contains("8 dimensions"));
    }

    #[test]
    fn keys_distinguish_groups_and_messages() {
        let a = group_key("world", "tp", &[0, 1], 0);
        assert_eq!(a, "world/tp[0,1]#0");
        assert_ne!(a, group_key("world", "dp", &[0, 1], 0));
        assert_ne!(a, group_key("world", "tp", &[0, 1], 1));
        assert_ne!(a, group_key("world", "tp", &[1, 0], 0));
        assert_eq!(id_key(&a), "nccl/world/tp[0,1]#0/id");
        assert_eq!(header_key("world", 1, 0, 5), "nccl/world/msg/1-0/5");
    }

    /// Four ranks as threads share a fake id through a real store on a free port: every rank
    /// gets the creator's 128 bytes; a sub-group's id is its own.
    #[test]
    fn unique_ids_travel_through_the_store() {
        let timeout = Duration::from_secs(10);
        let server = Arc::new(TcpStore::serve(0, 4, timeout).unwrap());
        let port = server.port();
        let fake = |seed: u8| -> [u8; ID_BYTES] { std::array::from_fn(|i| seed ^ i as u8) };
        let ids: Vec<([u8; ID_BYTES], Option<[u8; ID_BYTES]>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|rank| {
                    let server = server.clone();
                    s.spawn(move || {
                        let store = if rank == 0 {
                            server
                        } else {
                            Arc::new(
                                TcpStore::connect("127.0.0.1", port, rank, 4, timeout).unwrap(),
                            )
                        };
                        let world =
                            exchange_id(&store, "world", rank == 0, || Ok(fake(7))).unwrap();
                        // Ranks 2 and 3 form a group; its rank 0 (global 2) creates the id.
                        let sub = (rank >= 2).then(|| {
                            let key = group_key("world", "pair", &[2, 3], 0);
                            exchange_id(&store, &key, rank == 2, || Ok(fake(42))).unwrap()
                        });
                        store.barrier("done").unwrap();
                        (world, sub)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (world, sub)) in ids.iter().enumerate() {
            assert_eq!(world, &fake(7), "rank {rank}");
            assert_eq!(sub.is_some(), rank >= 2);
            if let Some(sub) = sub {
                assert_eq!(sub, &fake(42), "rank {rank}");
            }
        }
    }

    #[test]
    fn a_missing_or_bad_id_is_an_error() {
        let store = TcpStore::serve(0, 1, Duration::from_millis(100)).unwrap();
        let e = exchange_id(&store, "nobody", false, || unreachable!()).unwrap_err();
        assert!(e.to_string().contains("not set within"), "{e}");
        store.set(&id_key("short"), &[1, 2, 3]).unwrap();
        let e = exchange_id(&store, "short", false, || unreachable!()).unwrap_err();
        assert!(e.to_string().contains("has 3 bytes, not 128"), "{e}");
        let e = exchange_id(&store, "fails", true, || Err(Error::msg("no NCCL"))).unwrap_err();
        assert_eq!(e.to_string(), "no NCCL");
    }
}

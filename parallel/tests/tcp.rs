//! The TCP backend over real sockets on the loopback interface (its ranks are threads here, each
//! with its own connections, as processes would have): every collective gives the in-process
//! backend's bits for every dtype, reduce op and group size (uneven blocks included), sub-groups
//! progress independently, messages arrive in order, and mismatches, timeouts and exited peers
//! fail with typed errors. All-to-all: uneven and empty splits on 1 to 4 ranks (and a
//! sub-group) against the expected rows, pairs of ranks that disagree, bad arguments.

use crate::a2a;

use std::sync::Arc;
use std::time::{Duration, Instant};

use meshgrad_parallel::comm::tcp::{run_loopback_ranks, TcpCommunicator};
use meshgrad_parallel::comm::{run_ranks, P2pOp, P2pWork, ReduceOp, RunOptions};
use meshgrad_parallel::Communicator;
use meshgrad_tensor::{CommErrorKind, DType, Device, Error, Random, Result, Tensor};

/// Runs `f` on every rank of a TCP world of `w` ranks (threads of this process, each connected
/// over loopback TCP) and returns the ranks' results in rank order.
fn tcp_world<T: Send>(
    w: usize,
    timeout: Duration,
    f: impl Fn(Arc<TcpCommunicator>) -> T + Sync,
) -> Vec<T> {
    run_loopback_ranks(w, timeout, |comm| Ok(f(comm))).unwrap()
}

/// Rank r's input: distinct random values with a spread of magnitudes, so sums in another
/// order would round differently.
fn input(rank: usize, salt: usize, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let off = ((rank * 131 + salt) * (n + 1)) as u64;
    let t = Random::new(7)
        .offset(off)
        .dtype(DType::F64)
        .normal(shape.to_vec(), 0.0, 3.0)?;
    let scale = Random::new(8)
        .offset(off)
        .dtype(DType::F64)
        .normal(shape.to_vec(), 0.0, 2.0)?
        .exp()?;
    let t = t.mul(&scale)?;
    if dtype.is_float() {
        t.to_dtype(dtype)
    } else {
        t.mul_scalar(1000.0)?.to_dtype(dtype)
    }
}

/// A result as compared: shape, dtype, bytes.
type Bits = (Vec<usize>, DType, Vec<u8>);

fn bits(t: &Tensor) -> Bits {
    (
        t.dims().to_vec(),
        t.dtype(),
        t.to_cpu_storage().unwrap().as_bytes().to_vec(),
    )
}

/// Every collective on `comm` and on two sub-groups, launched before any wait (so several are
/// in flight at once); the results' shapes, dtypes and bytes.
fn every_collective(comm: &dyn Communicator) -> Result<Vec<Bits>> {
    let (r, w) = (comm.rank(), comm.world_size());
    let mut works = Vec::new();
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16, DType::I64] {
        let ops: &[ReduceOp] = if dtype.is_float() {
            &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
        } else {
            &[ReduceOp::Sum, ReduceOp::Max]
        };
        for (k, &op) in ops.iter().enumerate() {
            // 15 elements: uneven blocks over 2 and 4 ranks; a 0-d tensor; an empty one.
            for (s, shape) in [vec![5, 3], vec![], vec![0]].iter().enumerate() {
                works.push(comm.all_reduce(&input(r, 10 * k + s, shape, dtype)?, op)?);
            }
            let rs = input(r, 100 + k, &[2 * w, 3], dtype)?;
            works.push(comm.reduce_scatter(&rs, op)?);
        }
        works.push(comm.all_gather(&input(r, 200, &[2, 3], dtype)?)?);
        works.push(comm.all_gather(&input(r, 201, &[], dtype)?)?);
        works.push(comm.broadcast(&input(r, 300, &[4, 2], dtype)?, w - 1)?);
    }
    let mut out: Vec<_> = Vec::new();
    for work in works {
        out.push(bits(&work.wait()?));
    }
    comm.barrier()?.wait()?;
    if w >= 2 {
        // Two groups in opposite orders on alternate ranks: they must not wait for each other.
        let evens: Vec<usize> = (0..w).step_by(2).collect();
        let odds: Vec<usize> = (1..w).step_by(2).collect();
        let all: Vec<usize> = (0..w).rev().collect();
        let mine = if r % 2 == 0 { &evens } else { &odds };
        let sub = comm.new_group(mine, "parity")?;
        let rev = comm.new_group(&all, "reversed")?;
        let x = input(r, 400, &[7], DType::F32)?;
        let (a, b) = if r % 2 == 0 {
            let a = sub.all_reduce(&x, ReduceOp::Sum)?;
            (a, rev.all_reduce(&x, ReduceOp::Sum)?)
        } else {
            let b = rev.all_reduce(&x, ReduceOp::Sum)?;
            (sub.all_reduce(&x, ReduceOp::Sum)?, b)
        };
        out.push(bits(&a.wait()?));
        out.push(bits(&b.wait()?));
        out.push(bits(&rev.all_gather(&x)?.wait()?));
    }
    Ok(out)
}

#[test]
fn collectives_give_the_in_process_backends_bits() {
    let timeout = Duration::from_secs(30);
    for w in [1, 2, 3, 4] {
        let threads = run_ranks(w, &RunOptions::with_timeout(timeout), |ctx| {
            every_collective(ctx.comm.as_ref())
        })
        .unwrap();
        let tcp = tcp_world(w, timeout, |c| every_collective(c.as_ref()).unwrap());
        assert_eq!(threads.len(), tcp.len());
        for (rank, (a, b)) in threads.iter().zip(&tcp).enumerate() {
            assert_eq!(a.len(), b.len());
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_eq!(x, y, "world {w}, rank {rank}, result {i}");
            }
        }
        // And the sums are real: the all-reduce of ranks' values differs from rank 0's own.
        if w > 1 {
            assert_ne!(
                tcp[0][0].2,
                bits(&input(0, 0, &[5, 3], DType::F32).unwrap()).2
            );
        }
    }
}

#[test]
fn messages_arrive_in_order_and_large_exchanges_do_not_deadlock() {
    let w = 3;
    let got = tcp_world(w, Duration::from_secs(30), |c| {
        let (r, w) = (c.rank(), c.world_size());
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        for k in 0..5 {
            let t = Tensor::from_vec(vec![(r * 10 + k) as f32; k + 1], k + 1, Device::Cpu)?;
            let _ = c.send(&t, next)?;
        }
        let mut seen = Vec::new();
        for _ in 0..5 {
            seen.push(c.recv(prev)?.wait()?.to_vec::<f32>()?);
        }
        // Both neighbours send 16 MiB to each other at once, in one batch.
        let big = Tensor::full(r as f64, 4 << 20, DType::F32, Device::Cpu)?;
        let works = c.batch_p2p(vec![
            P2pOp::Send {
                tensor: big,
                peer: next,
            },
            P2pOp::Recv { peer: prev },
        ])?;
        let mut received = None;
        for wk in works {
            match wk {
                P2pWork::Send(s) => s.wait()?,
                P2pWork::Recv(rv) => received = Some(rv.wait()?),
            }
        }
        let received = received.expect("a receive");
        Ok::<_, Error>((seen, received.to_vec::<f32>()?))
    });
    for (r, res) in got.into_iter().enumerate() {
        let (seen, big) = res.unwrap();
        let prev = (r + w - 1) % w;
        for (k, v) in seen.iter().enumerate() {
            assert_eq!(
                v,
                &vec![(prev * 10 + k) as f32; k + 1],
                "rank {r} message {k}"
            );
        }
        assert_eq!(big.len(), 4 << 20);
        assert!(big.iter().all(|&x| x == prev as f32));
    }
}

fn comm_kind(e: &Error) -> &CommErrorKind {
    match e {
        Error::Comm(c) => &c.kind,
        e => panic!("not a communication error: {e}"),
    }
}

#[test]
fn mismatched_collectives_name_both_calls() {
    let got = tcp_world(2, Duration::from_secs(30), |c| {
        let x = Tensor::from_vec(vec![1f32, 2.0], 2, Device::Cpu).unwrap();
        let w = if c.rank() == 0 {
            c.all_reduce(&x, ReduceOp::Sum).unwrap()
        } else {
            c.all_gather(&x).unwrap()
        };
        w.wait().unwrap_err()
    });
    for (r, e) in got.iter().enumerate() {
        match comm_kind(e) {
            CommErrorKind::Mismatch { rank, other, calls } => {
                assert_eq!((*rank, *other), (r, 1 - r));
                let both = calls.join(" | ");
                assert!(both.contains("all_reduce(sum, f32 [2])"), "{both}");
                assert!(both.contains("all_gather(f32 [2])"), "{both}");
            }
            k => panic!("rank {r}: {k:?}"),
        }
        assert!(e.to_string().contains("all_"), "{e}");
    }
}

#[test]
fn a_rank_that_does_not_join_is_named_after_the_timeout() {
    let timeout = Duration::from_millis(600);
    let got = tcp_world(3, timeout, |c| {
        let x = Tensor::from_vec(vec![1f32; 4], 4, Device::Cpu).unwrap();
        if c.rank() == 2 {
            // Stays connected but never joins, until the others have timed out.
            std::thread::sleep(timeout * 5);
            return None;
        }
        let t0 = Instant::now();
        let e = c.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap_err();
        Some((e, t0.elapsed()))
    });
    for (r, res) in got.into_iter().take(2).enumerate() {
        let (e, took) = res.unwrap();
        match comm_kind(&e) {
            CommErrorKind::Timeout { missing, .. } => assert_eq!(missing, &vec![2], "rank {r}"),
            k => panic!("rank {r}: {k:?}"),
        }
        assert!(took >= timeout && took < timeout * 5, "rank {r}: {took:?}");
        let text = e.to_string();
        assert!(text.contains("all_reduce #0"), "{text}");
    }
}

#[test]
fn an_exited_peer_fails_the_waiters_at_once() {
    let timeout = Duration::from_secs(30);
    let got = tcp_world(2, timeout, |c| {
        if c.rank() == 1 {
            drop(c); // closes its connections
            return None;
        }
        let t0 = Instant::now();
        let e = c.recv(1).unwrap().wait().unwrap_err();
        let took = t0.elapsed();
        // Writes to it fail too, once the kernel knows the connection is gone.
        let x = Tensor::zeros(1 << 18, DType::F32, Device::Cpu).unwrap();
        let sent = (0..100).find_map(|_| c.send(&x, 1).err());
        Some((e, took, sent))
    });
    let (e, took, sent) = got.into_iter().next().unwrap().unwrap();
    assert_eq!(
        comm_kind(&e),
        &CommErrorKind::PeerExited { ranks: vec![1] },
        "{e}"
    );
    assert!(took < Duration::from_secs(10), "{took:?}");
    let sent = sent.expect("a send to an exited rank fails");
    assert_eq!(
        comm_kind(&sent),
        &CommErrorKind::PeerExited { ranks: vec![1] },
        "{sent}"
    );
}

#[test]
fn invalid_arguments_are_refused_at_launch() {
    let got = tcp_world(2, Duration::from_secs(30), |c| {
        let x = Tensor::from_vec(vec![1i64, 2, 3], 3, Device::Cpu).unwrap();
        let errs = [
            c.all_reduce(&x, ReduceOp::Avg).unwrap_err(),
            c.reduce_scatter(&x, ReduceOp::Sum).unwrap_err(),
            c.broadcast(&x, 2).unwrap_err(),
            c.send(&x, c.rank()).unwrap_err(),
            c.recv(5).unwrap_err(),
            c.new_group(&[0, 0], "dup").unwrap_err(),
        ];
        errs.iter()
            .map(|e| matches!(comm_kind(e), CommErrorKind::Invalid(_)))
            .collect::<Vec<_>>()
    });
    for r in got {
        assert!(r.iter().all(|&ok| ok), "{r:?}");
    }
}

#[test]
fn results_are_charged_to_the_waiting_thread_s_tracker() {
    use meshgrad_tensor::alloc::{with_tracker, MemoryTracker};
    let got = tcp_world(2, Duration::from_secs(30), |c| {
        let tracker = MemoryTracker::new();
        with_tracker(tracker.clone(), || {
            let x = Tensor::from_vec(vec![1f32; 1000], 1000, Device::Cpu).unwrap();
            let at = || tracker.stats().current;
            let before = at();
            let y = c.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
            let reduced = at() - before;
            // Rank 0 sends to rank 1, which receives.
            let received = if c.rank() == 0 {
                let _ = c.send(&x, 1).unwrap();
                None
            } else {
                let before = at();
                let z = c.recv(0).unwrap().wait().unwrap();
                Some((at() - before, z))
            };
            drop(y);
            (reduced, received.map(|(n, _)| n))
        })
    });
    assert_eq!(got, vec![(4000, None), (4000, Some(4000))]);
}

#[test]
fn all_to_all_moves_uneven_and_empty_blocks_on_1_to_4_ranks() {
    let dtypes = [DType::F32, DType::BF16, DType::I64];
    for w in [1, 2, 3, 4] {
        let ran = tcp_world(w, Duration::from_secs(30), |c| {
            let n = a2a::check(c.as_ref(), &dtypes, Device::Cpu);
            // Between other collectives, and on a sub-group of the odd ranks in reverse order.
            let x = Tensor::ones(2, DType::F32, Device::Cpu).unwrap();
            let ar = c.all_reduce(&x, ReduceOp::Sum).unwrap();
            let odds: Vec<usize> = (1..w).step_by(2).rev().collect();
            if c.rank() % 2 == 1 {
                let g = c.new_group(&odds, "odds").unwrap();
                a2a::check(g.as_ref(), &[DType::F32], Device::Cpu);
            }
            assert_eq!(
                ar.wait().unwrap().to_vec::<f32>().unwrap(),
                vec![w as f32; 2]
            );
            n
        });
        assert_eq!(ran, vec![27; w]);
    }
}

#[test]
fn all_to_all_ranks_that_disagree_fail_naming_each_other() {
    // Rank 1 expects 2 rows from rank 0, which sends it 1; rank 2 agrees with both.
    let got = tcp_world(3, Duration::from_secs(30), |c| {
        let x = Tensor::zeros((3, 2), DType::F32, Device::Cpu).unwrap();
        let recv = if c.rank() == 1 { [2, 1, 1] } else { [1, 1, 1] };
        c.all_to_all(&x, &[1, 1, 1], &recv).unwrap().wait()
    });
    for (r, res) in got.iter().enumerate().take(2) {
        let e = res.as_ref().unwrap_err();
        match comm_kind(e) {
            CommErrorKind::Mismatch { rank, other, calls } => {
                assert_eq!((*rank, *other), (r, 1 - r), "{e}");
                let both = calls.join(" | ");
                assert!(both.contains("1 rows from rank 0 to rank 1"), "{both}");
                assert!(both.contains("2 rows from rank 0 to rank 1"), "{both}");
            }
            k => panic!("rank {r}: {k:?}"),
        }
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("rank {r}: all_to_all #0 on group [0,1,2]: ")),
            "{text}"
        );
        assert_eq!(text.lines().count(), 1, "{text}");
    }
    assert_eq!(
        got[2].as_ref().unwrap().dims(),
        &[3, 2],
        "rank 2 agreed with both"
    );
    // Another trailing shape, and another collective.
    for bad in ["shape", "call"] {
        let got = tcp_world(2, Duration::from_secs(30), |c| {
            let cols = if bad == "shape" && c.rank() == 1 {
                3
            } else {
                2
            };
            let x = Tensor::zeros((2, cols), DType::F32, Device::Cpu).unwrap();
            if bad == "call" && c.rank() == 1 {
                return c.all_gather(&x).unwrap().wait().unwrap_err();
            }
            c.all_to_all(&x, &[1, 1], &[1, 1])
                .unwrap()
                .wait()
                .unwrap_err()
        });
        for (r, e) in got.iter().enumerate() {
            let CommErrorKind::Mismatch { rank, other, calls } = comm_kind(e) else {
                panic!("{bad}, rank {r}: {e}")
            };
            assert_eq!((*rank, *other), (r, 1 - r), "{e}");
            let both = calls.join(" | ");
            let want = if bad == "shape" {
                "f32 [*, 3]"
            } else {
                "all_gather(f32 [2, 2])"
            };
            assert!(
                both.contains(want) && both.contains("all_to_all(f32 [*, 2]"),
                "{both}"
            );
        }
    }
}

#[test]
fn all_to_all_bad_arguments_are_refused_at_launch() {
    let got = tcp_world(2, Duration::from_secs(30), |c| {
        let x = Tensor::zeros((3, 2), DType::F32, Device::Cpu).unwrap();
        let scalar = Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap();
        let errs = [
            c.all_to_all(&x, &[1, 1, 1], &[1, 2]).unwrap_err(),
            c.all_to_all(&x, &[1, 2], &[3]).unwrap_err(),
            c.all_to_all(&x, &[1, 1], &[1, 2]).unwrap_err(),
            c.all_to_all(&scalar, &[1, 0], &[1, 0]).unwrap_err(),
        ];
        errs.iter()
            .map(|e| {
                let one_line = e.to_string().lines().count() == 1;
                matches!(comm_kind(e), CommErrorKind::Invalid(_)) && one_line
            })
            .collect::<Vec<_>>()
    });
    for r in got {
        assert!(r.iter().all(|&ok| ok), "{r:?}");
    }
}

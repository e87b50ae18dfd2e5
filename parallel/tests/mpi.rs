//! The MPI backend on real processes: run as `mpirun -np 4 <this test binary>` (a harness-less
//! test: MPI is initialised once per process). With 1 rank (plain `cargo test --features mpi`)
//! it checks what one rank can. `MESHGRAD_MPI_TEST_PANIC=R` makes rank R panic while its peers
//! wait in an all-reduce: the job must end with a non-zero status (the panic hook aborts it).
//! `MESHGRAD_MPI_TEST_STALL=R` (R > 0) tests the watchdog with a 2 s timeout: after one all-reduce
//! that every rank joins, rank R sleeps instead of joining the next, rank R - 1 waits for a
//! message R never sends, and the other ranks wait in the all-reduce. Every waiting rank must
//! fail with a typed timeout naming R (and the all-reduce's waiters also R - 1, which answers
//! that it is still at the first all-reduce), print `watchdog ok: <error>` and end the job with
//! `abort` (non-zero status). `MESHGRAD_MPI_TEST_STALL_GROUP=R` does the same with a group
//! creation: every other rank calls `new_group` over the world, and must fail naming R.
//! Every `checks` also runs the shared all-to-all cases (uneven and empty splits, f32, bf16,
//! i64) against the expected rows; on 4 ranks one uneven all-to-all is also checked against its
//! result written out by hand.
#![cfg(feature = "mpi")]

mod a2a;

use half::bf16;
use meshgrad_parallel::comm::mpi::{abort, finalize, MpiCommunicator};
use meshgrad_parallel::comm::{P2pOp, P2pWork};
use meshgrad_parallel::{Communicator, DeviceMesh, ReduceOp};
use meshgrad_tensor::{CommErrorKind, Device, Error, Tensor};

fn t(v: Vec<f32>, dims: &[usize]) -> Tensor {
    Tensor::from_vec(v, dims.to_vec(), Device::Cpu).unwrap()
}

fn checks(comm: &dyn Communicator) {
    let (r, w) = (comm.rank(), comm.world_size());
    let rf = r as f32;
    // all_reduce: sum, avg, max on f32/f64/i64/bf16/f16.
    let x = t(vec![rf, 1.0, 2.0 * rf], &[3]);
    let s = comm.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
    let tri = (w * (w - 1) / 2) as f32;
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![tri, w as f32, 2.0 * tri]);
    let a = comm.all_reduce(&x, ReduceOp::Avg).unwrap().wait().unwrap();
    assert_eq!(a.to_vec::<f32>().unwrap()[1], 1.0);
    let m = comm.all_reduce(&x, ReduceOp::Max).unwrap().wait().unwrap();
    assert_eq!(
        m.to_vec::<f32>().unwrap(),
        vec![(w - 1) as f32, 1.0, 2.0 * (w - 1) as f32]
    );
    let nan = t(vec![if r == 0 { f32::NAN } else { 1.0 }], &[1]);
    let m = comm
        .all_reduce(&nan, ReduceOp::Max)
        .unwrap()
        .wait()
        .unwrap();
    assert!(m.to_vec::<f32>().unwrap()[0].is_nan(), "max propagates NaN");
    let d = Tensor::from_vec(vec![r as f64 + 0.5; 5], 5, Device::Cpu).unwrap();
    let s = comm.all_reduce(&d, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(
        s.to_vec::<f64>().unwrap(),
        vec![tri as f64 + 0.5 * w as f64; 5]
    );
    let i = Tensor::from_vec(vec![r as i64, -3], 2, Device::Cpu).unwrap();
    let s = comm.all_reduce(&i, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(s.to_vec::<i64>().unwrap(), vec![tri as i64, -3 * w as i64]);
    assert!(
        comm.all_reduce(&i, ReduceOp::Avg).is_err(),
        "avg of integers"
    );
    let b = x.to_dtype(meshgrad_tensor::DType::BF16).unwrap();
    let s = comm.all_reduce(&b, ReduceOp::Sum).unwrap().wait().unwrap();
    assert_eq!(s.dtype(), meshgrad_tensor::DType::BF16);
    let want: Vec<bf16> = [tri, w as f32, 2.0 * tri]
        .iter()
        .map(|&v| bf16::from_f32(v))
        .collect();
    assert_eq!(s.to_vec::<bf16>().unwrap(), want);
    let h = x.to_dtype(meshgrad_tensor::DType::F16).unwrap();
    let s = comm.all_reduce(&h, ReduceOp::Avg).unwrap().wait().unwrap();
    assert_eq!(s.to_vec_f32().unwrap()[1], 1.0);
    // bf16 sum of a large buffer (exact values).
    let big = t(vec![rf + 1.0; 100_000], &[100_000])
        .to_dtype(meshgrad_tensor::DType::BF16)
        .unwrap();
    let s = comm
        .all_reduce(&big, ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert!(s
        .to_vec_f32()
        .unwrap()
        .iter()
        .all(|&v| v == (tri + w as f32)));
    // reduce_scatter: rows [r*n/w, (r+1)*n/w) of the sum.
    let rows: Vec<f32> = (0..2 * w * 3).map(|k| k as f32 + rf).collect();
    let rs = comm
        .reduce_scatter(&t(rows, &[2 * w, 3]), ReduceOp::Sum)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(rs.dims(), &[2, 3]);
    let want: Vec<f32> = (0..6).map(|k| (w * (r * 6 + k)) as f32 + tri).collect();
    assert_eq!(rs.to_vec::<f32>().unwrap(), want);
    // all_gather: concatenation in rank order (0-d gathers to [w]).
    let g = comm
        .all_gather(&t(vec![rf, -rf], &[1, 2]))
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(g.dims(), &[w, 2]);
    let want: Vec<f32> = (0..w).flat_map(|k| [k as f32, -(k as f32)]).collect();
    assert_eq!(g.to_vec::<f32>().unwrap(), want);
    let z = Tensor::from_vec(vec![rf], Vec::<usize>::new(), Device::Cpu).unwrap();
    assert_eq!(comm.all_gather(&z).unwrap().wait().unwrap().dims(), &[w]);
    // broadcast from the last rank.
    let bc = comm
        .broadcast(&t(vec![rf; 4], &[2, 2]), w - 1)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(bc.to_vec::<f32>().unwrap(), vec![(w - 1) as f32; 4]);
    comm.barrier().unwrap().wait().unwrap();
    let dtypes = [
        meshgrad_tensor::DType::F32,
        meshgrad_tensor::DType::BF16,
        meshgrad_tensor::DType::I64,
    ];
    assert_eq!(a2a::check(comm, &dtypes, Device::Cpu), 27);
    // A bad argument fails at once, on this rank only.
    let e = comm
        .all_to_all(&t(vec![1.0; 2], &[2]), &vec![0; w + 1], &vec![0; w])
        .unwrap_err();
    assert!(
        matches!(&e, Error::Comm(c) if matches!(c.kind, CommErrorKind::Invalid(_))),
        "{e}"
    );
    if w > 1 {
        // p2p: a ring in both directions at once, several messages in flight, mixed dtypes.
        let (next, prev) = ((r + 1) % w, (r + w - 1) % w);
        let sends: Vec<_> = (0..3)
            .map(|k| {
                comm.send(&t(vec![rf * 10.0 + k as f32; 1000], &[10, 100]), next)
                    .unwrap()
            })
            .collect();
        let back = comm
            .send(
                &Tensor::from_vec(vec![r as u32; 3], 3, Device::Cpu).unwrap(),
                prev,
            )
            .unwrap();
        for k in 0..3 {
            let m = comm.recv(prev).unwrap().wait().unwrap();
            assert_eq!(m.dims(), &[10, 100]);
            assert_eq!(
                m.to_vec::<f32>().unwrap()[999],
                prev as f32 * 10.0 + k as f32
            );
        }
        let m = comm.recv(next).unwrap().wait().unwrap();
        assert_eq!(m.to_vec::<u32>().unwrap(), vec![next as u32; 3]);
        for s in sends {
            s.wait().unwrap();
        }
        back.wait().unwrap();
        // batch_p2p: both directions of the ring in one batch, one message large enough to be
        // sent by rendezvous; receives are posted before the sends in the list.
        let n = 1 << 18;
        let works = comm
            .batch_p2p(vec![
                P2pOp::Recv { peer: prev },
                P2pOp::Recv { peer: next },
                P2pOp::Send {
                    tensor: t(vec![rf; n], &[n]),
                    peer: next,
                },
                P2pOp::Send {
                    tensor: t(vec![-rf; 2], &[2]),
                    peer: prev,
                },
            ])
            .unwrap();
        let mut got = Vec::new();
        for wk in works {
            match wk {
                P2pWork::Recv(wk) => got.push(wk.wait().unwrap().to_vec::<f32>().unwrap()),
                P2pWork::Send(wk) => wk.wait().unwrap(),
            }
        }
        assert_eq!(got[0], vec![prev as f32; n]);
        assert_eq!(got[1], vec![-(next as f32); 2]);
    }
}

fn main() {
    let world = MpiCommunicator::world().expect("MPI init");
    let (r, w) = (world.rank(), world.world_size());
    if let Some(bad) = std::env::var("MESHGRAD_MPI_TEST_PANIC")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        if r == bad {
            std::thread::sleep(std::time::Duration::from_millis(300));
            panic!("rank {r}: a deliberate panic");
        }
        let x = t(vec![1.0], &[1]);
        let _ = world.all_reduce(&x, ReduceOp::Sum).unwrap().wait();
        unreachable!("the all-reduce cannot complete without rank {bad}");
    }
    if let Some(stalled) = std::env::var("MESHGRAD_MPI_TEST_STALL")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        stall(world.as_ref(), stalled, false);
    }
    if let Some(stalled) = std::env::var("MESHGRAD_MPI_TEST_STALL_GROUP")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        stall(world.as_ref(), stalled, true);
    }
    checks(world.as_ref());
    // Sub-groups from a 2-D mesh (every rank creates its groups in the same order).
    if w == 4 {
        let mesh = DeviceMesh::new(world.clone(), &["dp", "tp"], &[2, 2]).unwrap();
        for name in ["dp", "tp"] {
            let g = mesh.group(name).unwrap();
            assert_eq!(g.world_size(), 2);
            checks(g.as_ref());
            let s = g
                .all_reduce(&t(vec![r as f32], &[1]), ReduceOp::Sum)
                .unwrap()
                .wait()
                .unwrap();
            let want: f32 = g.ranks().iter().map(|&k| k as f32).sum();
            assert_eq!(
                s.to_vec::<f32>().unwrap(),
                vec![want],
                "{name} group {}",
                g.describe()
            );
        }
        uneven_all_to_all_by_hand(world.as_ref());
        // A group of 3 ranks made by its members only; rank 3 does not take part.
        if r < 3 {
            let g = world.new_group(&[2, 0, 1], "three").unwrap();
            assert_eq!(g.rank(), (r + 1) % 3);
            checks(g.as_ref());
        }
        world.barrier().unwrap().wait().unwrap();
    }
    finalize();
    if r == 0 {
        println!("mpi test: all checks passed on {w} ranks");
    }
}

/// One all-to-all on 4 ranks with uneven splits (zeros included), its result written out by
/// hand. Row `k` of the block rank `s` sends rank `d` is `[v, -v]` with `v = 100 s + 10 d + k`.
/// Rows sent (rank `s`'s row lists the rows for ranks 0..3):
///
/// ```text
/// rank 0: 1 0 2 1   rank 1: 0 3 0 1   rank 2: 2 1 0 0   rank 3: 0 0 1 2
/// ```
fn uneven_all_to_all_by_hand(world: &dyn Communicator) {
    let r = world.rank();
    let (send, sent, recv, want): ([usize; 4], &[f32], [usize; 4], &[f32]) = match r {
        0 => (
            [1, 0, 2, 1],
            &[0., 20., 21., 30.],
            [1, 0, 2, 0],
            &[0., 200., 201.],
        ),
        1 => (
            [0, 3, 0, 1],
            &[110., 111., 112., 130.],
            [0, 3, 1, 0],
            &[110., 111., 112., 210.],
        ),
        2 => (
            [2, 1, 0, 0],
            &[200., 201., 210.],
            [2, 0, 0, 1],
            &[20., 21., 320.],
        ),
        _ => (
            [0, 0, 1, 2],
            &[320., 330., 331.],
            [1, 1, 0, 2],
            &[30., 130., 330., 331.],
        ),
    };
    let rows = |v: &[f32]| -> Tensor {
        let flat: Vec<f32> = v.iter().flat_map(|&x| [x, -x]).collect();
        t(flat, &[v.len(), 2])
    };
    let got = world
        .all_to_all(&rows(sent), &send, &recv)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(got.dims(), &[want.len(), 2], "rank {r}");
    assert_eq!(
        got.to_vec::<f32>().unwrap(),
        rows(want).to_vec::<f32>().unwrap(),
        "rank {r}"
    );
    // The receive splits follow from the send splits.
    assert_eq!(
        meshgrad_parallel::comm::all_to_all_splits(world, &send).unwrap(),
        recv.to_vec(),
        "rank {r}"
    );
}

/// The watchdog test (see the crate docs): never returns.
fn stall(world: &MpiCommunicator, stalled: usize, group: bool) -> ! {
    assert!(
        stalled > 0 && stalled < world.world_size(),
        "a rank above 0"
    );
    let timeout = std::time::Duration::from_secs(2);
    world.set_timeout(timeout);
    let r = world.rank();
    let x = t(vec![1.0], &[1]);
    world.all_reduce(&x, ReduceOp::Sum).unwrap().wait().unwrap();
    if r == stalled {
        std::thread::sleep(std::time::Duration::from_secs(60));
        unreachable!("rank {r}: the job should have been aborted while this rank slept");
    }
    if group {
        let all: Vec<usize> = (0..world.world_size()).collect();
        let e = world.new_group(&all, "stall").unwrap_err();
        let Error::Comm(c) = &e else {
            panic!("rank {r}: not a communication error: {e}");
        };
        assert_eq!((c.rank, c.call, c.seq), (r, "new_group", Some(0)), "{e}");
        assert!(
            matches!(&c.kind, CommErrorKind::Timeout { missing, .. } if missing == &vec![stalled]),
            "{e}"
        );
        report(&e);
        abort(1)
    }
    let waiter = stalled - 1;
    let e = if r == waiter {
        world.recv(stalled).unwrap().wait().unwrap_err()
    } else {
        world
            .all_reduce(&x, ReduceOp::Sum)
            .unwrap()
            .wait()
            .unwrap_err()
    };
    let Error::Comm(c) = &e else {
        panic!("rank {r}: not a communication error: {e}");
    };
    assert_eq!(c.rank, r);
    assert_eq!(c.group, world.ranks().to_vec());
    let CommErrorKind::Timeout { missing, after, .. } = &c.kind else {
        panic!("rank {r}: not a timeout: {e}");
    };
    assert_eq!(*after, timeout);
    if r == waiter {
        assert_eq!(
            (c.call, c.seq, c.peer),
            ("recv", Some(0), Some(stalled)),
            "{e}"
        );
        assert_eq!(missing, &vec![stalled], "{e}");
    } else {
        assert_eq!((c.call, c.seq), ("all_reduce", Some(1)), "{e}");
        assert_eq!(missing, &vec![waiter, stalled], "{e}");
    }
    report(&e);
    // A later call fails at once: the backend stopped.
    let later = world.barrier().unwrap().wait().unwrap_err();
    assert!(later.to_string().contains("watchdog"), "{later}");
    abort(1)
}

/// Prints `watchdog ok: <error>` in one write, so that the lines of several ranks do not
/// interleave in mpirun's output.
fn report(e: &Error) {
    use std::io::Write;
    let line = format!("watchdog ok: {e}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

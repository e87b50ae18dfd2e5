//! Collectives of the in-process backend: values against direct computations in the documented
//! order, every float dtype, sub-groups, mismatches, timeouts, failures, determinism, accounting.
//! All-to-all: uneven and empty splits on 1 to 4 ranks and a sub-group, pairs of ranks that
//! disagree, bad arguments.

use crate::a2a;

use std::time::{Duration, Instant};

use half::{bf16, f16};
use meshgrad_parallel::comm::{run_ranks, run_ranks_each, ReduceOp, RunOptions};
use meshgrad_tensor::{DType, Device, Random, Result, Tensor};

fn opts() -> RunOptions {
    RunOptions::with_timeout(Duration::from_secs(5))
}

/// Rank r's test input: distinct random values per rank, with a spread of magnitudes.
fn input(rank: usize, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let t = Random::new(7)
        .offset((rank * n) as u64)
        .dtype(DType::F64)
        .normal(shape.to_vec(), 0.0, 3.0)?;
    let scale = Random::new(8)
        .offset((rank * n) as u64)
        .dtype(DType::F64)
        .normal(shape.to_vec(), 0.0, 2.0)?
        .exp()?;
    t.mul(&scale)?.to_dtype(dtype)
}

/// The documented reduction, computed directly: rank order, f32 accumulation for half types.
fn expected(inputs: &[Tensor], op: ReduceOp) -> Result<Vec<f64>> {
    let dtype = inputs[0].dtype();
    let vals: Vec<Vec<f64>> = inputs
        .iter()
        .map(|t| t.to_vec_f64())
        .collect::<Result<_>>()?;
    let n = vals[0].len();
    let w = inputs.len();
    let out = (0..n)
        .map(|i| match op {
            ReduceOp::Max => vals.iter().map(|v| v[i]).fold(f64::NEG_INFINITY, f64::max),
            _ => match dtype {
                DType::F64 => {
                    let s = vals
                        .iter()
                        .fold(None, |a: Option<f64>, v| Some(a.map_or(v[i], |a| a + v[i])));
                    let s = s.unwrap_or(0.0);
                    if op == ReduceOp::Avg {
                        s / w as f64
                    } else {
                        s
                    }
                }
                DType::F32 | DType::BF16 | DType::F16 => {
                    let mut s = vals[0][i] as f32;
                    for v in &vals[1..] {
                        s += v[i] as f32;
                    }
                    if op == ReduceOp::Avg {
                        s /= w as f32;
                    }
                    match dtype {
                        DType::BF16 => bf16::from_f32(s).to_f64(),
                        DType::F16 => f16::from_f32(s).to_f64(),
                        _ => s as f64,
                    }
                }
                _ => vals.iter().map(|v| v[i]).sum(),
            },
        })
        .collect();
    Ok(out)
}

fn bits(t: &Tensor) -> Vec<u8> {
    t.to_cpu_storage().unwrap().as_bytes().to_vec()
}

#[test]
fn all_reduce_matches_direct_order_all_dtypes() {
    for world in [1, 2, 3, 4] {
        for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
                let shape = [5, 7];
                let inputs: Vec<Tensor> = (0..world)
                    .map(|r| input(r, &shape, dtype).unwrap())
                    .collect();
                let want = expected(&inputs, op).unwrap();
                let got = run_ranks(world, &opts(), |ctx| {
                    let x = input(ctx.rank, &shape, dtype)?;
                    let out = ctx.comm.all_reduce(&x, op)?.wait()?;
                    assert_eq!(out.dims(), &shape);
                    assert_eq!(out.dtype(), dtype);
                    assert!(!out.same_storage(&x));
                    Ok(bits(&out))
                })
                .unwrap();
                for g in &got[1..] {
                    assert_eq!(
                        g, &got[0],
                        "ranks got different bits ({world}, {dtype}, {op})"
                    );
                }
                let out = decode(&got[0], dtype);
                assert_eq!(out, want, "world {world}, {dtype}, {op}");
            }
        }
    }
}

fn decode(bytes: &[u8], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
            .collect(),
        DType::F64 => bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        DType::BF16 => bytes
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        DType::F16 => bytes
            .chunks_exact(2)
            .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f64())
            .collect(),
        _ => unreachable!(),
    }
}

#[test]
fn integer_all_reduce_sum_max_and_avg_refused() {
    let r = run_ranks(3, &opts(), |ctx| {
        let x = Tensor::from_vec(
            vec![ctx.rank as i64 + 1, 10 - ctx.rank as i64],
            2,
            Device::Cpu,
        )?;
        let s = ctx
            .comm
            .all_reduce(&x, ReduceOp::Sum)?
            .wait()?
            .to_vec::<i64>()?;
        let m = ctx
            .comm
            .all_reduce(&x, ReduceOp::Max)?
            .wait()?
            .to_vec::<i64>()?;
        let avg = ctx
            .comm
            .all_reduce(&x, ReduceOp::Avg)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        Ok((s, m, avg))
    })
    .unwrap();
    for (s, m, avg) in r {
        assert_eq!(s, vec![6, 27]);
        assert_eq!(m, vec![3, 10]);
        assert!(avg.contains("avg needs a float dtype"), "{avg}");
    }
}

#[test]
fn reduce_scatter_all_gather_broadcast() {
    for world in [2, 4] {
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            let shape = [world * 3, 2];
            let inputs: Vec<Tensor> = (0..world)
                .map(|r| input(r, &shape, dtype).unwrap())
                .collect();
            let full = expected(&inputs, ReduceOp::Sum).unwrap();
            let gathered: Vec<f64> = inputs
                .iter()
                .flat_map(|t| t.to_vec_f64().unwrap())
                .collect();
            let root_vals = inputs[world - 1].to_vec_f64().unwrap();
            let res = run_ranks(world, &opts(), |ctx| {
                let x = input(ctx.rank, &shape, dtype)?;
                // Launch all three before waiting on any: handles are independent.
                let rs = ctx.comm.reduce_scatter(&x, ReduceOp::Sum)?;
                let ag = ctx.comm.all_gather(&x)?;
                let bc = ctx.comm.broadcast(&x, world - 1)?;
                let bc = bc.wait()?;
                let ag = ag.wait()?;
                let rs = rs.wait()?;
                assert_eq!(rs.dims(), &[3, 2]);
                assert_eq!(ag.dims(), &[world * world * 3, 2]);
                assert_eq!(bc.dims(), &shape);
                Ok((rs.to_vec_f64()?, ag.to_vec_f64()?, bc.to_vec_f64()?))
            })
            .unwrap();
            for (r, (rs, ag, bc)) in res.into_iter().enumerate() {
                assert_eq!(
                    rs,
                    full[r * 6..(r + 1) * 6].to_vec(),
                    "reduce_scatter rank {r}"
                );
                assert_eq!(ag, gathered);
                assert_eq!(bc, root_vals);
            }
        }
    }
}

#[test]
fn reduce_scatter_avg_flat_and_bad_shapes() {
    let r = run_ranks(2, &opts(), |ctx| {
        let x = Tensor::from_vec(vec![1f32, 2., 3., 4.], 4, Device::Cpu)?;
        let y = x.mul_scalar(ctx.rank as f64 + 1.0)?;
        let out = ctx
            .comm
            .reduce_scatter(&y, ReduceOp::Avg)?
            .wait()?
            .to_vec::<f32>()?;
        let bad = Tensor::zeros(3, DType::F32, Device::Cpu)?;
        let e = ctx
            .comm
            .reduce_scatter(&bad, ReduceOp::Sum)
            .unwrap_err()
            .to_string();
        let scalar = Tensor::scalar(ctx.rank as f64, DType::F32, Device::Cpu)?;
        let g = ctx.comm.all_gather(&scalar)?.wait()?;
        Ok((out, e, g.dims().to_vec(), g.to_vec::<f32>()?))
    })
    .unwrap();
    assert_eq!(r[0].0, vec![1.5, 3.0]);
    assert_eq!(r[1].0, vec![4.5, 6.0]);
    assert!(
        r[0].1.contains("divisible by the group size 2"),
        "{}",
        r[0].1
    );
    assert_eq!(r[0].2, vec![2]);
    assert_eq!(r[1].3, vec![0.0, 1.0]);
}

#[test]
fn send_recv_ring_in_order() {
    let world = 4;
    let r = run_ranks(world, &opts(), |ctx| {
        let next = (ctx.rank + 1) % world;
        let prev = (ctx.rank + world - 1) % world;
        // Two messages each way, received out of launch order on purpose.
        for k in 0..2 {
            let t = Tensor::full((ctx.rank * 10 + k) as f64, 2, DType::F32, Device::Cpu)?;
            ctx.comm.send(&t, next)?.wait()?;
        }
        let a = ctx.comm.recv(prev)?;
        let b = ctx.comm.recv(prev)?;
        let b = b.wait()?.to_vec::<f32>()?;
        let a = a.wait()?.to_vec::<f32>()?;
        let self_send = ctx
            .comm
            .send(&Tensor::zeros(1, DType::F32, Device::Cpu)?, ctx.rank);
        Ok((a, b, self_send.is_err()))
    })
    .unwrap();
    for (rank, (a, b, self_err)) in r.into_iter().enumerate() {
        let prev = (rank + world - 1) % world;
        assert_eq!(a, vec![(prev * 10) as f32; 2]);
        assert_eq!(b, vec![(prev * 10 + 1) as f32; 2]);
        assert!(self_err);
    }
}

#[test]
fn rendezvous_sends_catch_a_send_before_receive_deadlock() {
    // Both ranks send first, then receive: fine with buffered sends, a deadlock on a real backend.
    let exchange = |ctx: meshgrad_parallel::RankCtx| -> Result<Vec<f32>> {
        let peer = 1 - ctx.rank;
        let t = Tensor::full(ctx.rank as f64, 3, DType::F32, Device::Cpu)?;
        ctx.comm.send(&t, peer)?.wait()?;
        ctx.comm.recv(peer)?.wait()?.to_vec::<f32>()
    };
    let got = run_ranks(2, &opts(), exchange).unwrap();
    assert_eq!(got[1], vec![0.0; 3]);
    let short = RunOptions::with_timeout(Duration::from_millis(300)).rendezvous();
    let start = Instant::now();
    let e = run_ranks(2, &short, exchange).unwrap_err().to_string();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    assert!(e.contains("send #0 to rank"), "{e}");
    assert!(e.contains("did not receive within"), "{e}");
    // Matched in order (rank 0 sends while rank 1 receives, then the other way), it completes.
    let got = run_ranks(2, &short, |ctx| {
        let peer = 1 - ctx.rank;
        let t = Tensor::full(ctx.rank as f64 + 1.0, 2, DType::F32, Device::Cpu)?;
        if ctx.rank == 0 {
            ctx.comm.send(&t, peer)?.wait()?;
            ctx.comm.recv(peer)?.wait()?.to_vec::<f32>()
        } else {
            let r = ctx.comm.recv(peer)?.wait()?.to_vec::<f32>()?;
            ctx.comm.send(&t, peer)?.wait()?;
            Ok(r)
        }
    })
    .unwrap();
    assert_eq!(got, vec![vec![2.0; 2], vec![1.0; 2]]);
}

#[test]
fn barrier_and_completion() {
    let r = run_ranks(3, &opts(), |ctx| {
        if ctx.rank == 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        let t0 = Instant::now();
        ctx.comm.barrier()?.wait()?;
        let waited = t0.elapsed();
        let x = Tensor::ones(4, DType::F32, Device::Cpu)?;
        let w = ctx.comm.all_reduce(&x, ReduceOp::Sum)?;
        ctx.comm.barrier()?.wait()?;
        // Everyone joined the all_reduce before the barrier completed.
        let done = w.is_completed();
        w.wait()?;
        Ok((waited, done))
    })
    .unwrap();
    assert!(
        r[1].0 >= Duration::from_millis(50),
        "barrier did not wait: {:?}",
        r[1].0
    );
    assert!(r.iter().all(|x| x.1));
}

#[test]
fn sub_groups_are_independent() {
    let r = run_ranks(4, &opts(), |ctx| {
        let evens = ctx.rank % 2 == 0;
        let members: Vec<usize> = if evens { vec![0, 2] } else { vec![3, 1] };
        let g = ctx.comm.new_group(&members, "pairs")?;
        // Same members, different tag: a different group with its own sequence numbers.
        let g2 = ctx.comm.new_group(&members, "other")?;
        assert_eq!(g.world_size(), 2);
        assert_eq!(g.ranks(), &members[..]);
        let x = Tensor::full(ctx.rank as f64, 1, DType::F32, Device::Cpu)?;
        // The odd group runs two collectives on g2 before g; the even group the other way round.
        let (a, b) = if evens {
            let a = g.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            let b = g2.all_gather(&x)?.wait()?;
            (a, b)
        } else {
            let b = g2.all_gather(&x)?.wait()?;
            let a = g.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            (a, b)
        };
        let bc = g.broadcast(&x, 0)?.wait()?.to_vec::<f32>()?;
        let not_member = ctx.comm.new_group(&[(ctx.rank + 1) % 4], "x").is_err();
        Ok((
            g.rank(),
            a.to_vec::<f32>()?,
            b.to_vec::<f32>()?,
            bc,
            g.describe(),
            not_member,
        ))
    })
    .unwrap();
    assert_eq!(r[0].0, 0);
    assert_eq!(r[3].0, 0);
    assert_eq!(r[1].0, 1);
    assert_eq!(r[0].1, vec![2.0]);
    assert_eq!(r[1].1, vec![4.0]);
    assert_eq!(r[3].2, vec![3.0, 1.0]);
    assert_eq!(r[1].3, vec![3.0]);
    assert_eq!(r[2].3, vec![0.0]);
    assert_eq!(r[1].4, "[3,1]");
    assert!(r.iter().all(|x| x.5));
}

#[test]
fn mismatch_names_both_calls() {
    let r = run_ranks_each(2, &opts(), |ctx| {
        let x = Tensor::zeros((2, 3), DType::F32, Device::Cpu)?;
        if ctx.rank == 0 {
            ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()
        } else {
            ctx.comm.all_gather(&x)?.wait()
        }
    })
    .unwrap();
    for (rank, e) in r.iter().enumerate() {
        let e = e.as_ref().unwrap_err().to_string();
        assert!(e.starts_with(&format!("rank {rank}: ")), "{e}");
        assert!(e.contains("#0 on group [0,1]"), "{e}");
        assert!(e.contains("all_reduce(sum, f32 [2, 3])"), "{e}");
        assert!(e.contains("all_gather(f32 [2, 3])"), "{e}");
    }
    let r = run_ranks_each(2, &opts(), |ctx| {
        let x = Tensor::zeros(2 + ctx.rank, DType::F32, Device::Cpu)?;
        ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()
    })
    .unwrap();
    let e = r[1].as_ref().unwrap_err().to_string();
    assert!(
        e.contains("mismatched") && e.contains("f32 [2]") && e.contains("f32 [3]"),
        "{e}"
    );
}

#[test]
fn determinism_two_runs_bitwise_equal() {
    let run = || {
        run_ranks(4, &opts(), |ctx| {
            let x = input(ctx.rank, &[1000], DType::F32)?;
            let a = ctx.comm.all_reduce(&x, ReduceOp::Avg)?.wait()?;
            let b = ctx.comm.reduce_scatter(&x, ReduceOp::Sum)?.wait()?;
            Ok((bits(&a), bits(&b)))
        })
        .unwrap()
    };
    assert_eq!(run(), run());
}

#[test]
fn missing_peer_times_out_naming_rank_and_call() {
    let t0 = Instant::now();
    let r = run_ranks_each(
        3,
        &RunOptions::with_timeout(Duration::from_millis(300)),
        |ctx| {
            let x = Tensor::ones(2, DType::F32, Device::Cpu)?;
            ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            if ctx.rank == 1 {
                // Busy elsewhere for longer than the timeout; it joins late.
                std::thread::sleep(Duration::from_millis(900));
            }
            ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()
        },
    )
    .unwrap();
    // Rank 0 either times out itself or is aborted by rank 2 timing out first; either way the
    // message names the call, the group and the missing rank.
    for rank in [0, 2] {
        let e = r[rank].as_ref().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("rank {rank}: all_reduce #1 on group [0,1,2]: ")),
            "{e}"
        );
        assert!(e.ends_with("rank 1 did not join within 300ms"), "{e}");
    }
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn failed_or_panicked_or_exited_peer_fails_fast() {
    // A long timeout: the peers must fail because of the failure, not the timeout.
    let long = RunOptions::with_timeout(Duration::from_secs(30));
    for mode in ["error", "panic", "exit"] {
        let t0 = Instant::now();
        let r = run_ranks_each(4, &long, |ctx| {
            let x = Tensor::ones(2, DType::F32, Device::Cpu)?;
            ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            if ctx.rank == 2 {
                match mode {
                    "error" => meshgrad_tensor::bail!("out of data"),
                    "panic" => panic!("boom"),
                    _ => return Ok(()),
                }
            }
            ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            Ok(())
        })
        .unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{mode}: {:?}",
            t0.elapsed()
        );
        for rank in [0, 1, 3] {
            let e = r[rank].as_ref().unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("rank {rank}: all_reduce #1 on group [0,1,2,3]: ")),
                "{mode}: {e}"
            );
            match mode {
                "error" => assert!(e.ends_with("aborted: rank 2 failed: out of data"), "{e}"),
                "panic" => assert!(e.contains("rank 2 failed: rank 2 panicked: boom"), "{e}"),
                _ => assert!(e.ends_with("rank 2 exited without joining"), "{e}"),
            }
        }
    }
    let e = run_ranks(3, &long, |ctx| {
        if ctx.rank == 1 {
            meshgrad_tensor::bail!("bad input");
        }
        ctx.comm.barrier()?.wait()
    })
    .unwrap_err()
    .to_string();
    assert_eq!(e, "rank 1: bad input");
}

#[test]
fn results_are_charged_to_the_receiving_rank() {
    let r = run_ranks(2, &opts(), |ctx| {
        let before = ctx.tracker.stats().current;
        let x = Tensor::zeros(1000, DType::F32, Device::Cpu)?;
        let after_input = ctx.tracker.stats().current;
        let y = ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
        let after = ctx.tracker.stats().current;
        drop(y);
        Ok((after_input - before, after - after_input))
    })
    .unwrap();
    for (input, result) in r {
        assert_eq!(input, 4000);
        assert_eq!(result, 4000);
    }
}

#[test]
fn world_of_one_and_zero() {
    let r = run_ranks(1, &opts(), |ctx| {
        let x = Tensor::from_vec(vec![1f32, 2.], 2, Device::Cpu)?;
        let a = ctx.comm.all_reduce(&x, ReduceOp::Avg)?.wait()?;
        Ok(bits(&a) == bits(&x))
    })
    .unwrap();
    assert!(r[0]);
    assert!(run_ranks(0, &opts(), |_| Ok(())).is_err());
}

#[test]
fn watchdog_a_rank_that_stops_calling_collectives_is_named_by_every_survivor() {
    // Rank 2 stops calling collectives (stuck in its own work, not failed, not exited) and
    // returns only after the others gave up; ranks 0 and 1 (all_reduce) and rank 3 (a receive
    // from rank 2) fail within the timeout, naming rank 2, the call and its number (a survivor
    // may instead be aborted by the first one to time out, whose message names rank 2 too).
    let t0 = Instant::now();
    let r = run_ranks_each(
        4,
        &RunOptions::with_timeout(Duration::from_millis(400)),
        |ctx| {
            let x = Tensor::ones(2, DType::F32, Device::Cpu)?;
            for _ in 0..3 {
                ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()?;
            }
            match ctx.rank {
                2 => {
                    std::thread::sleep(Duration::from_millis(1500));
                    Ok(())
                }
                3 => ctx.comm.recv(2)?.wait().map(|_| ()),
                _ => ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait().map(|_| ()),
            }
        },
    );
    let r = r.unwrap();
    let elapsed = t0.elapsed();
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    // Rank 3 waits in its receive, so it is missing from the collective too.
    let names_rank_2 = |e: &str| {
        e.contains("ranks 2, 3 did not join within 400ms")
            || e.contains("rank 2 did not send within 400ms")
    };
    for rank in [0, 1] {
        let e = r[rank].as_ref().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("rank {rank}: all_reduce #3 on group [0,1,2,3]: ")),
            "{e}"
        );
        assert!(names_rank_2(&e), "{e}");
    }
    let e = r[3].as_ref().unwrap_err().to_string();
    assert!(
        e.starts_with("rank 3: recv #0 from rank 2 on group [0,1,2,3]: "),
        "{e}"
    );
    assert!(names_rank_2(&e), "{e}");
}

#[test]
fn errors_are_typed_with_rank_group_call_and_sequence() {
    use meshgrad_tensor::{CommErrorKind, Error};
    // A timeout on a sub-group and on a receive, a mismatch, and an invalid argument.
    let r = run_ranks_each(
        4,
        &RunOptions::with_timeout(Duration::from_millis(300)),
        |ctx| -> Result<Option<Error>> {
            let x = Tensor::ones(2, DType::F32, Device::Cpu)?;
            let bad = ctx.comm.broadcast(&x, 9).unwrap_err();
            if ctx.rank % 2 == 1 {
                let g = ctx.comm.new_group(&[3, 1], "pair")?;
                g.all_reduce(&x, ReduceOp::Sum)?.wait()?;
                if ctx.rank == 1 {
                    // Rank 3 stops: rank 1's next all-reduce on the pair times out.
                    return Ok(g.all_reduce(&x, ReduceOp::Sum)?.wait().err());
                }
            } else if ctx.rank == 0 {
                return Ok(ctx.comm.recv(2)?.wait().err());
            }
            // Ranks 2 and 3 stay (without calling) until their peers have timed out.
            std::thread::sleep(Duration::from_millis(900));
            Ok(Some(bad))
        },
    )
    .unwrap();
    let comm = |rank: usize| match r[rank].as_ref() {
        Ok(Some(Error::Comm(c))) => c.as_ref().clone(),
        e => panic!("rank {rank}: not a typed communication error: {e:?}"),
    };
    let c = comm(1);
    assert_eq!(
        (c.rank, c.group.clone(), c.call, c.seq),
        (1, vec![3, 1], "all_reduce", Some(1))
    );
    assert_eq!(
        c.kind,
        CommErrorKind::Timeout {
            missing: vec![3],
            after: Duration::from_millis(300),
            detail: None
        }
    );
    let c = comm(0);
    assert_eq!(
        (c.call, c.seq, c.peer, c.group.len()),
        ("recv", Some(0), Some(2), 4)
    );
    assert!(matches!(&c.kind, CommErrorKind::Timeout { missing, .. } if missing == &vec![2]));
    for rank in [2, 3] {
        let c = comm(rank);
        assert_eq!((c.rank, c.call, c.seq), (rank, "broadcast", None));
        assert!(
            matches!(&c.kind, CommErrorKind::Invalid(m) if m.contains("root 9")),
            "{c}"
        );
    }
    // A mismatch names both ranks and calls.
    let r = run_ranks_each(2, &opts(), |ctx| {
        let x = Tensor::ones(2, DType::F32, Device::Cpu)?;
        if ctx.rank == 0 {
            ctx.comm.all_reduce(&x, ReduceOp::Sum)?.wait()
        } else {
            ctx.comm.all_gather(&x)?.wait()
        }
    })
    .unwrap();
    for (rank, res) in r.iter().enumerate() {
        let Err(Error::Comm(c)) = res else {
            panic!("rank {rank}: {res:?}")
        };
        let call = ["all_reduce", "all_gather"][rank];
        assert_eq!((c.rank, c.call, c.seq), (rank, call, Some(0)));
        let CommErrorKind::Mismatch {
            rank: a,
            other: b,
            calls,
        } = &c.kind
        else {
            panic!("{c}")
        };
        assert_eq!([*a, *b].iter().sum::<usize>(), 1, "{c}");
        assert!(calls.iter().any(|k| k.starts_with("all_reduce(sum")), "{c}");
        assert!(calls.iter().any(|k| k.starts_with("all_gather(")), "{c}");
    }
}

#[test]
fn all_to_all_moves_uneven_and_empty_blocks_on_1_to_4_ranks() {
    for world in [1, 2, 3, 4] {
        let ran = run_ranks(world, &opts(), |ctx| {
            Ok(a2a::check(
                ctx.comm.as_ref(),
                &[DType::F32, DType::BF16, DType::I64],
                Device::Cpu,
            ))
        })
        .unwrap();
        assert_eq!(ran, vec![27; world]);
    }
    // On a sub-group (group ranks, not global ones): ranks 3 and 1 of 4, and rank 2 alone.
    run_ranks(4, &opts(), |ctx| {
        let members: &[usize] = match ctx.rank {
            3 | 1 => &[3, 1],
            2 => &[2],
            _ => return Ok(()),
        };
        let g = ctx.comm.new_group(members, "a2a")?;
        a2a::check(g.as_ref(), &[DType::F32], Device::Cpu);
        Ok(())
    })
    .unwrap();
}

#[test]
fn all_to_all_ranks_that_disagree_fail_naming_both() {
    use meshgrad_tensor::{CommErrorKind, Error};
    // Rank 1 expects 2 rows from rank 0, which sends it 1.
    let r = run_ranks_each(3, &opts(), |ctx| {
        let x = Tensor::zeros((3, 2), DType::F32, Device::Cpu)?;
        let recv = if ctx.rank == 1 { [2, 1, 1] } else { [1, 1, 1] };
        ctx.comm.all_to_all(&x, &[1, 1, 1], &recv)?.wait()
    })
    .unwrap();
    for (rank, res) in r.iter().enumerate() {
        let Err(Error::Comm(c)) = res else {
            panic!("rank {rank}: {res:?}")
        };
        assert_eq!(
            (c.rank, c.call, c.seq),
            (rank, "all_to_all", Some(0)),
            "{c}"
        );
        let CommErrorKind::Mismatch {
            rank: a,
            other: b,
            calls,
        } = &c.kind
        else {
            panic!("{c}")
        };
        let mut pair = [*a, *b];
        pair.sort();
        assert_eq!(pair, [0, 1], "{c}");
        let text = c.to_string();
        assert!(
            text.contains("1 rows from rank 0 to rank 1")
                && text.contains("2 rows from rank 0 to rank 1"),
            "{text}"
        );
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            calls
                .iter()
                .all(|k| k.starts_with("all_to_all(f32 [*, 2]: ")),
            "{c}"
        );
    }
    // Rows of another trailing shape or dtype, and a different collective.
    for bad in ["shape", "dtype", "call"] {
        let r = run_ranks_each(2, &opts(), |ctx| {
            let x = match (bad, ctx.rank) {
                ("shape", 1) => Tensor::zeros((2, 3), DType::F32, Device::Cpu)?,
                ("dtype", 1) => Tensor::zeros((2, 2), DType::BF16, Device::Cpu)?,
                _ => Tensor::zeros((2, 2), DType::F32, Device::Cpu)?,
            };
            if bad == "call" && ctx.rank == 1 {
                return ctx.comm.all_gather(&x)?.wait();
            }
            ctx.comm.all_to_all(&x, &[1, 1], &[1, 1])?.wait()
        })
        .unwrap();
        for (rank, res) in r.iter().enumerate() {
            let e = res.as_ref().unwrap_err().to_string();
            assert!(e.starts_with(&format!("rank {rank}: ")), "{bad}: {e}");
            assert!(e.contains("mismatched collectives: rank "), "{bad}: {e}");
            let want = match bad {
                "shape" => "f32 [*, 3]",
                "dtype" => "bf16 [*, 2]",
                _ => "all_gather(f32 [2, 2])",
            };
            assert!(e.contains(want) && e.contains("all_to_all("), "{bad}: {e}");
        }
    }
}

#[test]
fn all_to_all_bad_arguments_fail_at_once_in_one_line() {
    use meshgrad_tensor::{CommErrorKind, Error};
    let r = run_ranks(2, &opts(), |ctx| {
        let x = Tensor::zeros((3, 2), DType::F32, Device::Cpu)?;
        let scalar = Tensor::scalar(1.0, DType::F32, Device::Cpu)?;
        let errs = [
            ctx.comm.all_to_all(&x, &[1, 1, 1], &[1, 2]).unwrap_err(),
            ctx.comm.all_to_all(&x, &[1, 2], &[3]).unwrap_err(),
            ctx.comm.all_to_all(&x, &[1, 1], &[1, 2]).unwrap_err(),
            ctx.comm.all_to_all(&scalar, &[1, 0], &[1, 0]).unwrap_err(),
            meshgrad_parallel::comm::all_to_all_splits(ctx.comm.as_ref(), &[1]).unwrap_err(),
        ];
        // Nothing was launched: a valid all-to-all after them is collective #0 on both ranks.
        // Rank 0 keeps one row and sends rank 1 two; rank 1 sends rank 0 one and keeps two.
        let recv = if ctx.rank == 0 { [1, 1] } else { [2, 2] };
        let ok = ctx.comm.all_to_all(&x, &[1, 2], &recv)?.wait()?;
        Ok((errs, ok.dims().to_vec()))
    });
    let r = r.unwrap();
    assert_eq!(r[0].1, vec![2, 2]);
    assert_eq!(r[1].1, vec![4, 2]);
    for (rank, (errs, _)) in r.iter().enumerate() {
        let texts: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        for (e, t) in errs.iter().zip(&texts) {
            let Error::Comm(c) = e else { panic!("{t}") };
            assert!(matches!(c.kind, CommErrorKind::Invalid(_)), "{t}");
            assert_eq!((c.rank, c.call, c.seq), (rank, "all_to_all", None), "{t}");
            assert_eq!(t.lines().count(), 1, "{t}");
        }
        assert!(
            texts[0].ends_with("send_splits has 3 entries but the group has 2 ranks"),
            "{}",
            texts[0]
        );
        assert!(
            texts[1].ends_with("recv_splits has 1 entries but the group has 2 ranks"),
            "{}",
            texts[1]
        );
        assert!(
            texts[2].ends_with(
                "send_splits [1, 1] add up to 2 rows but the tensor of shape [3, 2] has 3"
            ),
            "{}",
            texts[2]
        );
        assert!(texts[3].contains("0-d tensor"), "{}", texts[3]);
        assert!(
            texts[4].ends_with("send_splits has 1 entries but the group has 2 ranks"),
            "{}",
            texts[4]
        );
    }
}

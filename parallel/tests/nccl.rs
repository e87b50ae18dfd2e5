//! The NCCL backend on a GPU (feature `nccl`), world size 1: every collective, a sub-group, a
//! barrier and CPU tensors staged through the device, each checked against the in-process
//! backend's result for the same inputs; dtypes f32, bf16, f16, f64 and i64. Only a world of
//! one runs on a one-GPU machine (NCCL refuses two ranks of one communicator on one GPU), so
//! sends and receives (which need a peer) are not run here.
//!
//! Without a GPU (or the NCCL library) the test prints why and passes, unless
//! MESHGRAD_REQUIRE_CUDA=1, which makes that a failure. On the GPU machine, put a `libnccl.so`
//! on LD_LIBRARY_PATH (cudarc opens that name, pip's NCCL ships `libnccl.so.2`).
//! All-to-all (a world of one: one `ncclSend` and `ncclRecv` to itself per case, in a group) runs
//! the shared cases, uneven and empty blocks, against the expected rows.
#![cfg(feature = "nccl")]

mod a2a;

use std::sync::Arc;
use std::time::Duration;

use meshgrad_parallel::comm::nccl::{nccl_library_present, NcclCommunicator};
use meshgrad_parallel::comm::store::TcpStore;
use meshgrad_parallel::comm::{
    all_reduce_scalar, run_ranks, Communicator, RankEnv, ReduceOp, RunOptions,
};
use meshgrad_tensor::{cuda_device_count, DType, Device, Tensor};

/// Why NCCL cannot run here, if it cannot.
fn skip_reason() -> Option<String> {
    if cuda_device_count() == 0 {
        return Some("no CUDA device".into());
    }
    nccl_library_present().err().map(|e| e.to_string())
}

/// Every collective on `t` (on whatever device), results on the host, in a fixed order.
fn collectives(comm: &dyn Communicator, t: &Tensor) -> Vec<(String, Vec<f64>, Vec<usize>)> {
    let mut out = Vec::new();
    let mut push = |name: &str, r: Tensor| {
        let dims = r.dims().to_vec();
        let v = r.to_device(Device::Cpu).unwrap().to_vec_f64().unwrap();
        out.push((name.to_string(), v, dims));
    };
    let float = t.dtype().is_float();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max] {
        if op == ReduceOp::Avg && !float {
            assert!(comm.all_reduce(t, op).is_err(), "avg on {:?}", t.dtype());
            continue;
        }
        push(
            &format!("all_reduce {op}"),
            comm.all_reduce(t, op).unwrap().wait().unwrap(),
        );
        push(
            &format!("reduce_scatter {op}"),
            comm.reduce_scatter(t, op).unwrap().wait().unwrap(),
        );
    }
    push("all_gather", comm.all_gather(t).unwrap().wait().unwrap());
    push("broadcast", comm.broadcast(t, 0).unwrap().wait().unwrap());
    comm.barrier().unwrap().wait().unwrap();
    out
}

fn input(dtype: DType, device: Device) -> Tensor {
    let v: Vec<f64> = (0..24).map(|i| (i as f64 - 7.0) * 0.75).collect();
    let t = Tensor::from_vec(v, (4, 6), Device::Cpu).unwrap();
    let t = if dtype == DType::I64 {
        Tensor::from_vec(
            (0..24).map(|i| i as i64 - 7).collect::<Vec<_>>(),
            (4, 6),
            Device::Cpu,
        )
        .unwrap()
    } else {
        t.to_dtype(dtype).unwrap()
    };
    t.to_device(device).unwrap()
}

#[test]
fn nccl_world_of_one_matches_the_in_process_backend() {
    if let Some(why) = skip_reason() {
        assert!(
            std::env::var("MESHGRAD_REQUIRE_CUDA").as_deref() != Ok("1"),
            "MESHGRAD_REQUIRE_CUDA=1 but NCCL cannot run here: {why}"
        );
        println!("skipped: {why}");
        return;
    }
    let timeout = Duration::from_secs(60);
    let store = Arc::new(TcpStore::serve(0, 1, timeout).unwrap());
    let mut env = RankEnv::single();
    env.master_addr = Some("127.0.0.1".into());
    env.master_port = Some(store.port());
    let nccl = NcclCommunicator::world(&env, store, timeout).unwrap();
    assert_eq!((nccl.rank(), nccl.world_size()), (0, 1));
    let gpu = nccl.device();
    let dtypes = [DType::F32, DType::BF16, DType::F16, DType::F64, DType::I64];
    let want: Vec<_> = run_ranks(1, &RunOptions::default(), |ctx| {
        Ok(dtypes
            .iter()
            .map(|&d| collectives(&*ctx.comm, &input(d, Device::Cpu)))
            .collect::<Vec<_>>())
    })
    .unwrap()
    .remove(0);
    for (d, want) in dtypes.iter().zip(&want) {
        // Device tensors (stream-ordered results) and host tensors (staged through the GPU).
        for device in [gpu, Device::Cpu] {
            let got = collectives(&*nccl, &input(*d, device));
            assert_eq!(&got, want, "{d:?} on {device}");
        }
    }
    // A sub-group of one (its own unique id through the store) and a scalar on the host.
    let sub = nccl.new_group(&[0], "solo").unwrap();
    let got = collectives(&*sub, &input(DType::F32, gpu));
    assert_eq!(got, want[0]);
    assert_eq!(all_reduce_scalar(&*nccl, 2.5, ReduceOp::Sum).unwrap(), 2.5);
    // Results are usable right away (the compute stream waits for the collective), and an
    // operation in flight completes.
    let w = nccl
        .all_reduce(&input(DType::F32, gpu), ReduceOp::Sum)
        .unwrap();
    let r = w.wait().unwrap();
    let doubled = r.add(&r).unwrap().to_vec_f64().unwrap();
    let base = input(DType::F32, Device::Cpu).to_vec_f64().unwrap();
    assert_eq!(doubled, base.iter().map(|x| 2.0 * x).collect::<Vec<_>>());
    // A bad argument fails at once, naming the call.
    let e = nccl.broadcast(&input(DType::F32, gpu), 3).unwrap_err();
    assert!(e.to_string().contains("broadcast"), "{e}");
    // All-to-all on device tensors and on host tensors, and a bad split list.
    let a2a_dtypes = [DType::F32, DType::BF16, DType::I64];
    for device in [gpu, Device::Cpu] {
        assert_eq!(a2a::check(&*nccl, &a2a_dtypes, device), 27, "{device}");
    }
    assert_eq!(a2a::check(&*sub, &[DType::F32], gpu), 9);
    let e = nccl
        .all_to_all(&input(DType::F32, gpu), &[3], &[4])
        .unwrap_err();
    assert!(
        e.to_string()
            .ends_with("send_splits [3] add up to 3 rows but the tensor of shape [4, 6] has 4"),
        "{e}"
    );
}

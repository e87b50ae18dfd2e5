//! Releasable storage, allocator accounting (per tracker, per tag, peaks), devices and error
//! messages.

mod common;

use common::*;
use meshgrad_tensor::alloc::{self, MemoryTag, MemoryTracker};
use meshgrad_tensor::{test_device, DType, Device, Result, Tensor};

fn released_storage_errors_and_materialize_brings_it_back(device: Device) -> Result<()> {
    let t = tensor_on(device, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F32);
    let view = t.t().unwrap(); // created before release; shares the storage
    assert!(t.is_materialized());
    t.release_storage();
    assert!(!t.is_materialized());
    assert!(!view.is_materialized(), "views share the released state");
    // Metadata survives; ops fail with a message naming the release.
    assert_eq!(t.dims(), &[2, 3]);
    assert_eq!(t.dtype(), DType::F32);
    for (what, r) in [
        ("add", t.add(&t).map(|_| ())),
        ("exp", t.exp().map(|_| ())),
        ("sum", t.sum(&[0], false).map(|_| ())),
        ("matmul", view.matmul(&t).map(|_| ())),
        ("contiguous of a view", view.contiguous().map(|_| ())),
        ("to_vec", t.to_vec::<f32>().map(|_| ())),
        ("to_dtype", t.to_dtype(DType::F64).map(|_| ())),
        (
            "copy_from",
            t.copy_from(&Tensor::zeros((2, 3), DType::F32, device).unwrap()),
        ),
    ] {
        let e = r.expect_err(what).to_string();
        assert!(e.contains("released"), "{what}: {e}");
    }
    // An op whose other operand is released fails too.
    let live = Tensor::ones((2, 3), DType::F32, device).unwrap();
    assert!(live.add(&t).unwrap_err().to_string().contains("released"));
    // Releasing twice is fine.
    t.release_storage();
    // Re-materialise from a non-contiguous source (copied in logical order); the old view sees
    // the new values.
    let src = tensor_on(
        device,
        &[10.0, 20.0, 30.0, 40.0, 50.0, 60.0],
        &[3, 2],
        DType::F32,
    )
    .t()
    .unwrap();
    assert!(!src.is_contiguous());
    t.materialize_from(&src).unwrap();
    assert!(t.is_materialized() && view.is_materialized());
    check(
        &t,
        &[2, 3],
        &[10.0, 30.0, 50.0, 20.0, 40.0, 60.0],
        0.0,
        0.0,
        "materialised values",
    );
    check(
        &view,
        &[3, 2],
        &[10.0, 20.0, 30.0, 40.0, 50.0, 60.0],
        0.0,
        0.0,
        "old view after materialise",
    );
    assert!(!t.same_storage(&src));
    // The source is copied: changing it later does not change the tensor.
    src.fill_(0.0).unwrap();
    check(
        &t,
        &[2, 3],
        &[10.0, 30.0, 50.0, 20.0, 40.0, 60.0],
        0.0,
        0.0,
        "independent of the source",
    );
    // Live storage can be replaced too.
    t.materialize_from(&Tensor::zeros((2, 3), DType::F32, device).unwrap())
        .unwrap();
    assert_eq!(vals(&view), vec![0.0; 6]);
    // Errors: wrong dtype, wrong element count, a partial view as destination.
    assert!(t
        .materialize_from(&Tensor::zeros((2, 3), DType::F64, device).unwrap())
        .is_err());
    assert!(t
        .materialize_from(&Tensor::zeros(5, DType::F32, device).unwrap())
        .is_err());
    assert!(t
        .narrow(0, 1, 1)
        .unwrap()
        .materialize_from(&Tensor::zeros((1, 3), DType::F32, device).unwrap())
        .is_err());
    assert!(
        view.materialize_from(&Tensor::zeros((3, 2), DType::F32, device).unwrap())
            .is_err(),
        "a transposed destination"
    );
    Ok(())
}
test_device!(released_storage_errors_and_materialize_brings_it_back);

fn a_materializer_runs_when_a_released_storage_is_used(device: Device) -> Result<()> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    let t = tensor_on(device, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F32);
    let saved = t.deep_clone().unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let (t2, runs2, saved2) = (t.clone(), runs.clone(), saved.clone());
    assert!(!t.has_materializer());
    t.set_materializer(Some(Arc::new(move || {
        runs2.fetch_add(1, Ordering::SeqCst);
        t2.materialize_from(&saved2)
    })));
    assert!(t.has_materializer());
    t.release_storage();
    // Metadata and views need no data: the materialiser does not run.
    let view = t.t().unwrap();
    assert_eq!((t.dims(), view.dims()), (&[2, 3][..], &[3, 2][..]));
    assert!(!t.is_materialized());
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // A read materialises first, then proceeds; a second read finds the data present.
    assert_eq!(
        vals(&view.contiguous().unwrap()),
        vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]
    );
    assert_eq!(vals(&t), vals(&saved));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // A write too.
    t.release_storage();
    t.fill_(7.0).unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(vals(&t), vec![7.0; 6]);
    // The storage an op is using cannot be released under it: try_release_storage says so
    // (here from inside the materialiser of the op's other operand).
    let live = Tensor::ones((2, 3), DType::F32, device).unwrap();
    let (live2, seen) = (live.clone(), Arc::new(AtomicUsize::new(0)));
    let (t3, saved3, seen2) = (t.clone(), saved.clone(), seen.clone());
    t.set_materializer(Some(Arc::new(move || {
        seen2.store(live2.try_release_storage() as usize + 1, Ordering::SeqCst);
        t3.materialize_from(&saved3)
    })));
    t.release_storage();
    assert_eq!(
        vals(&live.add(&t).unwrap()),
        vec![2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    );
    assert_eq!(seen.load(Ordering::SeqCst), 1, "in use: not released");
    assert!(live.is_materialized());
    assert!(t.try_release_storage() && !t.is_materialized());
    // Inside a rayon task a materialiser must not run (it may wait for other ranks): an error;
    // ensure_materialized() on the calling thread first is the way.
    t.release_storage();
    let e = rayon::join(|| t.exp().map(drop), || ())
        .0
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rayon task") && e.contains("ensure_materialized"),
        "{e}"
    );
    t.ensure_materialized().unwrap();
    assert!(t.is_materialized());
    rayon::join(|| t.exp().unwrap(), || ());
    t.release_storage();
    // A failing materialiser's error comes back from the op; one that does not materialise is
    // an error too; without one, the error says what to do.
    t.set_materializer(Some(Arc::new(|| meshgrad_tensor::bail!("no shards here"))));
    let e = t.exp().unwrap_err().to_string();
    assert!(e.contains("no shards here"), "{e}");
    t.set_materializer(Some(Arc::new(|| Ok(()))));
    let e = t.exp().unwrap_err().to_string();
    assert!(e.contains("still released"), "{e}");
    assert!(t.set_materializer(None).is_some());
    let e = t.exp().unwrap_err().to_string();
    assert!(
        e.contains("released")
            && e.contains("materialize_from")
            && e.contains("summon_full_params"),
        "{e}"
    );
    Ok(())
}
test_device!(a_materializer_runs_when_a_released_storage_is_used);

// CPU-only: CPU byte accounting (memory_stats of Device::Cpu).
#[test]
fn tracker_counts_current_and_peak_bytes() {
    let tr = MemoryTracker::new();
    alloc::with_tracker(tr.clone(), || {
        let base = tr.stats().current;
        assert_eq!(base, 0);
        let a = Tensor::zeros(1000, DType::F32, Device::Cpu).unwrap();
        assert_eq!(tr.stats().current, 4000);
        assert_eq!(
            alloc::memory_stats(Device::Cpu).current,
            4000,
            "memory_stats reads the installed tracker"
        );
        // Views allocate nothing.
        let v = a
            .reshape((10, 100))
            .unwrap()
            .t()
            .unwrap()
            .narrow(0, 0, 5)
            .unwrap();
        assert_eq!(tr.stats().current, 4000);
        // A copy does.
        let c = v.contiguous().unwrap();
        assert_eq!(tr.stats().current, 4000 + 5 * 10 * 4);
        drop(c);
        let b = Tensor::zeros((10, 10), DType::F64, Device::Cpu).unwrap();
        assert_eq!(tr.stats().current, 4800);
        assert_eq!(tr.stats().peak, 4800);
        drop(a);
        assert_eq!(tr.stats().current, 4800, "the view keeps the storage alive");
        drop(v);
        assert_eq!(tr.stats().current, 800);
        drop(b);
        assert_eq!(tr.stats().current, 0);
        assert_eq!(tr.stats().peak, 4800, "peak stays");
        tr.reset_peak();
        assert_eq!(tr.stats().peak, 0);
        let h = Tensor::zeros(10, DType::BF16, Device::Cpu).unwrap();
        assert_eq!(tr.stats().current, 20);
        alloc::reset_peak(Device::Cpu);
        assert_eq!(tr.stats().peak, 20);
        drop(h);
    });
    assert_eq!(tr.stats().current, 0);
}

// CPU-only: CPU byte accounting (memory_stats of Device::Cpu).
#[test]
fn views_keep_storage_alive() {
    let tr = MemoryTracker::new();
    alloc::with_tracker(tr.clone(), || {
        let a = Tensor::zeros(1000, DType::F32, Device::Cpu).unwrap();
        let v = a.narrow(0, 0, 10).unwrap();
        drop(a);
        assert_eq!(tr.stats().current, 4000, "a view keeps its storage alive");
        drop(v);
        assert_eq!(tr.stats().current, 0);
    });
}

// CPU-only: CPU byte accounting (memory_stats of Device::Cpu).
#[test]
fn release_and_materialize_are_accounted() {
    let tr = MemoryTracker::new();
    alloc::with_tracker(tr.clone(), || {
        let p = alloc::with_tag(MemoryTag::Params, || {
            Tensor::zeros(256, DType::F32, Device::Cpu).unwrap()
        });
        assert_eq!(tr.stats().current_of(MemoryTag::Params), 1024);
        p.release_storage();
        assert_eq!(tr.stats().current, 0, "release frees the bytes");
        assert_eq!(tr.stats().peak, 1024);
        let src = Tensor::ones(256, DType::F32, Device::Cpu).unwrap();
        assert_eq!(tr.stats().current, 1024);
        alloc::with_tag(MemoryTag::Params, || p.materialize_from(&src)).unwrap();
        assert_eq!(tr.stats().current, 2048);
        assert_eq!(tr.stats().current_of(MemoryTag::Params), 1024);
        drop(src);
        drop(p);
        assert_eq!(tr.stats().current, 0);
    });
}

// CPU-only: CPU byte accounting (memory_stats of Device::Cpu).
#[test]
fn tags_are_counted_separately() {
    let tr = MemoryTracker::new();
    alloc::with_tracker(tr.clone(), || {
        let p = alloc::with_tag(MemoryTag::Params, || {
            Tensor::zeros(100, DType::F32, Device::Cpu).unwrap()
        });
        let g = alloc::with_tag(MemoryTag::Grads, || {
            // Nested tags restore on exit.
            let inner = alloc::with_tag(MemoryTag::OptimizerState, || {
                Tensor::zeros(10, DType::F64, Device::Cpu).unwrap()
            });
            let g = Tensor::zeros(100, DType::F32, Device::Cpu).unwrap();
            (g, inner)
        });
        let other = Tensor::zeros(3, DType::U8, Device::Cpu).unwrap();
        let s = tr.stats();
        assert_eq!(s.current_of(MemoryTag::Params), 400);
        assert_eq!(s.current_of(MemoryTag::Grads), 400);
        assert_eq!(s.current_of(MemoryTag::OptimizerState), 80);
        assert_eq!(s.current_of(MemoryTag::Other), 3);
        assert_eq!(s.current_of(MemoryTag::Activations), 0);
        assert_eq!(s.current, 883);
        drop(p);
        let s = tr.stats();
        assert_eq!(s.current_of(MemoryTag::Params), 0);
        assert_eq!(s.peak_of(MemoryTag::Params), 400);
        // The refund goes to the tag charged at allocation, whatever the tag at drop time.
        alloc::with_tag(MemoryTag::Activations, || drop(g));
        let s = tr.stats();
        assert_eq!(s.current_of(MemoryTag::Grads), 0);
        assert_eq!(s.current_of(MemoryTag::OptimizerState), 0);
        assert_eq!(s.current_of(MemoryTag::Activations), 0);
        drop(other);
        assert_eq!(tr.stats().current, 0);
    });
}

// CPU-only: CPU byte accounting (memory_stats of Device::Cpu).
#[test]
fn trackers_are_per_thread_and_restored() {
    let outer = MemoryTracker::new();
    let inner = MemoryTracker::new();
    alloc::with_tracker(outer.clone(), || {
        let a = Tensor::zeros(10, DType::F32, Device::Cpu).unwrap();
        let b = alloc::with_tracker(inner.clone(), || {
            Tensor::zeros(20, DType::F32, Device::Cpu).unwrap()
        });
        let c = Tensor::zeros(30, DType::F32, Device::Cpu).unwrap();
        assert_eq!(outer.stats().current, 160);
        assert_eq!(inner.stats().current, 80);
        // Another thread charges its own (global) tracker, not ours.
        std::thread::spawn(|| {
            let _x = Tensor::zeros(1000, DType::F32, Device::Cpu).unwrap();
        })
        .join()
        .unwrap();
        assert_eq!(outer.stats().current, 160);
        // Freed on this thread after the inner scope ended: refunded to the tracker charged.
        drop(b);
        assert_eq!(inner.stats().current, 0);
        drop((a, c));
    });
    assert_eq!(outer.stats().current, 0);
    // A tensor moved to another thread refunds the tracker it was charged to.
    let t = alloc::with_tracker(outer.clone(), || {
        Tensor::zeros(50, DType::F32, Device::Cpu).unwrap()
    });
    assert_eq!(outer.stats().current, 200);
    std::thread::spawn(move || drop(t)).join().unwrap();
    assert_eq!(outer.stats().current, 0);
}

// CPU-only: validation errors raised before any backend runs: device-independent.
#[test]
fn errors_name_shapes_dtypes_and_devices() {
    let a = Tensor::zeros((2, 3), DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros(4, DType::F32, Device::Cpu).unwrap();
    let e = a.add(&b).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("[2, 3]") && e.contains("[4]"),
        "{e}"
    );
    let e = a
        .mul(&Tensor::zeros((3, 3), DType::F32, Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("mul") && e.contains("[2, 3]") && e.contains("[3, 3]"),
        "{e}"
    );
    let e = a
        .matmul(&Tensor::zeros((2, 3), DType::F32, Device::Cpu).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("matmul") && e.contains("[2, 3]"), "{e}");
    let e = a.softmax(2).unwrap_err().to_string();
    assert!(e.contains("[2, 3]"), "{e}");
}

#[cfg(not(feature = "cuda"))]
// CPU-only: about builds without the cuda feature.
#[test]
fn cuda_without_the_feature_is_a_clear_error() {
    let d: Device = "cuda:0".parse().unwrap();
    assert_eq!(d, Device::Cuda(0));
    assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
    assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
    assert!("tpu".parse::<Device>().is_err());
    for r in [
        Tensor::zeros(3, DType::F32, Device::Cuda(0)).map(|_| ()),
        Tensor::from_vec(vec![1f32], 1, Device::Cuda(0)).map(|_| ()),
        Tensor::ones(3, DType::F32, Device::Cuda(1)).map(|_| ()),
        meshgrad_tensor::Random::new(0)
            .device(Device::Cuda(0))
            .uniform(3, 0.0, 1.0)
            .map(|_| ()),
        Tensor::zeros(3, DType::F32, Device::Cpu)
            .unwrap()
            .to_device(Device::Cuda(0))
            .map(|_| ()),
    ] {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("built without CUDA"), "{e}");
    }
}

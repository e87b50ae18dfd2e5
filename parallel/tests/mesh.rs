//! DeviceMesh: coordinates, the groups along each dimension and over flattened dimensions.

use std::time::Duration;

use meshgrad_parallel::comm::{run_ranks, ReduceOp, RunOptions};
use meshgrad_parallel::DeviceMesh;
use meshgrad_tensor::{DType, Device, Tensor};

fn opts() -> RunOptions {
    RunOptions::with_timeout(Duration::from_secs(5))
}

#[test]
fn coordinates_and_groups_2x2() {
    let r = run_ranks(4, &opts(), |ctx| {
        let mesh = DeviceMesh::new(ctx.comm.clone(), &["dp_replicate", "dp_shard"], &[2, 2])?;
        let rep = mesh.group("dp_replicate")?;
        let shard = mesh.group("dp_shard")?;
        let all = mesh.group_over(&["dp_replicate", "dp_shard"])?;
        let again = mesh.group_over(&["dp_replicate", "dp_shard"])?;
        assert!(std::sync::Arc::ptr_eq(&all, &again));
        let x = Tensor::full(10f64.powi(ctx.rank as i32), 1, DType::F64, Device::Cpu)?;
        // Interleave collectives on the three groups: they are independent.
        let a = shard.all_reduce(&x, ReduceOp::Sum)?;
        let b = rep.all_reduce(&x, ReduceOp::Sum)?;
        let c = all.all_gather(&x)?;
        Ok((
            mesh.coords().to_vec(),
            rep.ranks().to_vec(),
            shard.ranks().to_vec(),
            shard.rank(),
            a.wait()?.to_vec::<f64>()?[0],
            b.wait()?.to_vec::<f64>()?[0],
            c.wait()?.to_vec::<f64>()?,
        ))
    })
    .unwrap();
    let coords: Vec<Vec<usize>> = r.iter().map(|x| x.0.clone()).collect();
    assert_eq!(coords, vec![vec![0, 0], vec![0, 1], vec![1, 0], vec![1, 1]]);
    assert_eq!(r[1].1, vec![1, 3]);
    assert_eq!(r[2].2, vec![2, 3]);
    assert_eq!(r[3].3, 1);
    assert_eq!(r[0].4, 11.0);
    assert_eq!(r[2].4, 1100.0);
    assert_eq!(r[0].5, 101.0);
    assert_eq!(r[3].5, 1010.0);
    assert_eq!(r[3].6, vec![1.0, 10.0, 100.0, 1000.0]);
}

#[test]
fn three_dims_flattened_and_rank_of() {
    let r = run_ranks(8, &opts(), |ctx| {
        let mesh = DeviceMesh::new(ctx.comm.clone(), &["pp", "dp", "tp"], &[2, 2, 2])?;
        let c = mesh.coords().to_vec();
        assert_eq!(mesh.rank_of(&c)?, ctx.rank);
        assert_eq!(mesh.coords_of(ctx.rank)?, c);
        // "tp" then "pp": tp varies slowest in the flattened group.
        let g = mesh.group_over(&["tp", "pp"])?;
        Ok((
            g.ranks().to_vec(),
            g.rank(),
            mesh.size("dp")?,
            mesh.coord("tp")?,
        ))
    })
    .unwrap();
    assert_eq!(r[0].0, vec![0, 4, 1, 5]);
    assert_eq!(r[5].0, vec![0, 4, 1, 5]);
    assert_eq!(r[5].1, 3);
    assert_eq!(r[3].0, vec![2, 6, 3, 7]);
    assert_eq!(r[3].2, 2);
    assert_eq!(r[3].3, 1);
}

#[test]
fn bad_meshes_are_refused() {
    let r = run_ranks(4, &opts(), |ctx| {
        let e1 = DeviceMesh::new(ctx.comm.clone(), &["a", "b"], &[2, 3]).unwrap_err();
        let e2 = DeviceMesh::new(ctx.comm.clone(), &["a", "a"], &[2, 2]).unwrap_err();
        let e3 = DeviceMesh::new(ctx.comm.clone(), &["a"], &[0]).unwrap_err();
        let mesh = DeviceMesh::new(ctx.comm.clone(), &["dp"], &[4])?;
        let e4 = mesh.group("tp").unwrap_err();
        let e5 = mesh.rank_of(&[4]).unwrap_err();
        Ok([e1, e2, e3, e4, e5].map(|e| e.to_string()))
    })
    .unwrap();
    assert!(
        r[0][0].contains("multiply to 6, not the world size 4"),
        "{}",
        r[0][0]
    );
    assert!(r[0][1].contains("distinct"), "{}", r[0][1]);
    assert!(r[0][2].contains("at least 1"), "{}", r[0][2]);
    assert!(r[0][3].contains("no dimension named 'tp'"), "{}", r[0][3]);
    assert!(r[0][4].contains("outside the mesh"), "{}", r[0][4]);
}

//! Host-side tests (no GPU): every launch the required ops can make is built by the pure
//! functions of `args.rs` with fake pointers and checked against the kernel's parsed
//! declaration; plus the op-code, dtype and dispatch choices.

use meshgrad_kernels::cuda::{unary_op, GatherArgs, StridedArgs};
use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use super::args::{self, Launch};
use super::copy::cast_kernel;
use super::indexing::gather_args;
use super::reduce::{use_cols, use_lastdim};
use super::{acc_dtype, basic_sfx, float_sfx, mover, Mover};
use crate::backend::api::ReduceDims;
use crate::cuda_backend::signature::check_args;
use crate::DType;

/// Fake device pointers (never dereferenced).
const P: [u64; 5] = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000];

/// The kernel suffixes of the basic kernels' element types (the float ones and f64).
const BASIC: [&str; 4] = ["f32", "bf16", "f16", "f64"];

/// Checks one launch's arguments against its kernel's declaration; returns its entry name.
fn ok(l: Launch) -> String {
    if let Err(e) = check_args(l.file, &l.entry, l.args.sizes()) {
        panic!("{e}");
    }
    assert!(
        l.block.0 > 0 && l.block.0 <= 1024 && l.block.0.is_multiple_of(32),
        "{}",
        l.entry
    );
    assert!(l.grid.0 >= 1, "{}", l.entry);
    l.entry
}

fn strided() -> StridedArgs {
    StridedArgs {
        numel: 6,
        ndim: 2,
        ..Default::default()
    }
}

#[test]
fn memory_launches_match_their_kernels() {
    ok(args::fill_f64(P[0], 10, 1.5));
    ok(args::fill_i64(P[0], 10, -1));
    ok(args::arange_i64(P[0], 10, -3));
    ok(args::randint(P[0], 10, 7, 3, -5, 10));
    for sfx in BASIC {
        ok(args::arange_float(sfx, P[0], 10, 4));
    }
    for sfx in ["f32", "bf16", "f16", "f64"] {
        ok(args::uniform(sfx, P[0], 10, 1, 2, -1.0, 2.0));
        ok(args::normal(sfx, P[0], 10, 1, 2, 0.0, 1.0));
    }
}

#[test]
fn cast_launches_match_for_every_dtype_pair() {
    let all = [
        DType::F64,
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::U8,
        DType::U32,
        DType::I64,
    ];
    let mut kernels = 0;
    for from in all {
        for to in all {
            let (a, b) = cast_kernel(from, to);
            assert_eq!(
                ok(args::cast(a, b, P[0], P[1], 5)),
                format!("cast_{a}_to_{b}")
            );
            kernels += 1;
        }
    }
    // Every pair of the seven dtypes, each checked against its parsed declaration by `ok`.
    assert_eq!(kernels, 49);
}

#[test]
fn elementwise_launches_match_their_kernels() {
    let ops = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Tanh,
        UnaryOp::Relu,
        UnaryOp::GeluTanh,
        UnaryOp::GeluErf,
        UnaryOp::Abs,
        UnaryOp::Recip,
        UnaryOp::Square,
        UnaryOp::Sigmoid,
        UnaryOp::PowScalar(3.0),
        UnaryOp::AddScalar(1.0),
        UnaryOp::MulScalar(2.0),
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Silu,
        UnaryOp::Clamp(-1.0, 1.0),
    ];
    for sfx in BASIC {
        for op in ops {
            ok(args::unary(sfx, P[0], P[1], 7, op));
        }
        for op in [BinaryOp::Add, BinaryOp::Div, BinaryOp::Minimum] {
            ok(args::binary(sfx, op, strided(), P[0], P[1], P[2]));
            ok(args::binary_contig(sfx, op, P[0], P[1], P[2], 6));
        }
        ok(args::compare(sfx, CmpOp::Le, strided(), P[0], P[1], P[2]));
        ok(args::where_cond(sfx, strided(), P[0], P[1], P[2], P[3]));
        ok(args::copy_strided(sfx, strided(), P[0], P[1]));
    }
}

#[test]
fn op_codes_follow_the_kernels() {
    // The codes are in the enum's order (elementwise.cu's OP_* list).
    assert_eq!(args::unary_code(UnaryOp::Neg), (unary_op::NEG, 0.0, 0.0));
    assert_eq!(
        args::unary_code(UnaryOp::PowScalar(2.5)),
        (unary_op::POW, 2.5, 0.0)
    );
    assert_eq!(
        args::unary_code(UnaryOp::AddScalar(-1.0)),
        (unary_op::ADD_SCALAR, -1.0, 0.0)
    );
    assert_eq!(
        args::unary_code(UnaryOp::Clamp(-2.0, 3.0)),
        (unary_op::CLAMP, -2.0, 3.0)
    );
    assert_eq!(args::unary_code(UnaryOp::Silu).0, 17);
    assert_eq!(args::binary_code(BinaryOp::Minimum), 5);
    assert_eq!(args::cmp_code(CmpOp::Ge), 5);
    // The op code, then the f64 parameters, travel in the launch.
    let l = args::unary("f32", P[0], P[1], 3, UnaryOp::Clamp(-2.0, 3.0));
    assert_eq!(l.entry, "unary_f32");
    assert_eq!(l.args.sizes(), &[8, 8, 8, 4, 8, 8]);
}

/// The reduction shape `[outer, red, inner]`.
fn dims(outer: usize, red: usize, inner: usize) -> ReduceDims {
    ReduceDims { outer, red, inner }
}

#[test]
fn reduce_launches_match_their_kernels() {
    for sfx in BASIC {
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::ArgMax] {
            ok(args::reduce_strided(op, sfx, P[0], P[1], dims(3, 4, 5)));
            ok(args::reduce_lastdim(op, sfx, P[0], P[1], 3, 500));
        }
        ok(args::reduce_cols(sfx, P[0], P[1], dims(2, 8192, 768)));
    }
    // Column tiles: one block of 32 warps per 32 outputs; only long sums of few outputs.
    let l = args::reduce_cols("bf16", P[0], P[1], dims(2, 8192, 770));
    assert_eq!(
        (l.entry.as_str(), l.grid.0, l.block.0),
        ("sum_cols_bf16", 2 * 25, 1024)
    );
    assert!(use_cols(ReduceOp::Sum, 1, 8192, 768));
    assert!(!use_cols(ReduceOp::Max, 1, 8192, 768));
    assert!(!use_cols(ReduceOp::Sum, 1, 100, 768));
    assert!(!use_cols(ReduceOp::Sum, 1, 8192, 1));
    assert!(!use_cols(ReduceOp::Sum, 1, 8192, 50_304 * 2));
    // One block per row, whole warps no larger than the row needs.
    let l = args::reduce_lastdim(ReduceOp::Sum, "f32", P[0], P[1], 1000, 70);
    assert_eq!(
        (l.entry.as_str(), l.grid.0, l.block.0),
        ("sum_lastdim_f32", 1000, 96)
    );
    assert_eq!(args::lastdim_block(1), 32);
    assert_eq!(args::lastdim_block(100_000), 256);
    assert!(use_lastdim(1024, 1) && !use_lastdim(1024, 2) && !use_lastdim(8, 1));
    // The strided kernels run one thread per output element.
    let l = args::reduce_strided(ReduceOp::ArgMax, "bf16", P[0], P[1], dims(2, 9, 300));
    assert_eq!((l.entry.as_str(), l.grid.0), ("argmax_strided_bf16", 3));
}

#[test]
fn indexing_launches_match_their_kernels() {
    let g = gather_args("gather", &[4, 5], &[4, 2], 1).unwrap();
    for sfx in BASIC {
        ok(args::embedding_fwd(sfx, [P[0], P[1], P[2], P[3]], 3, 10, 8));
        ok(args::embedding_bwd(
            true,
            sfx,
            [P[0], P[1], P[2], P[3]],
            3,
            10,
            8,
        ));
        ok(args::embedding_bwd(
            false,
            sfx,
            [P[0], P[1], P[2], P[3]],
            3,
            10,
            8,
        ));
    }
    for sfx in BASIC {
        ok(args::gather(sfx, false, g, [P[0], P[1], P[2], P[3]], 8));
        ok(args::gather(sfx, true, g, [P[0], P[1], P[2], P[3]], 4));
        for backward in [false, true] {
            ok(args::index_select(
                sfx,
                backward,
                [P[0], P[1], P[2], P[3]],
                [2, 5, 3, 4],
            ));
        }
    }
    // The deterministic embedding backward runs one warp per (id range, 32 columns): GPT-2's
    // table (50,257 x 768, 24 tiles) in ranges of 295 ids, 171 x 24 warps in blocks of 8.
    assert_eq!(args::embedding_bwd_range(50_257, 768), 295);
    assert_eq!(args::embedding_bwd_range(50, 768), 1);
    let l = args::embedding_bwd(true, "f32", [P[0], P[1], P[2], 0], 8192, 50_257, 768);
    assert_eq!(
        (l.entry.as_str(), l.grid.0, l.block.0),
        ("embedding_bwd_det_f32", 171 * 24 / 8, 256)
    );
    let l = args::embedding_bwd(true, "f32", [P[0], P[1], P[2], 0], 10_000, 50, 768);
    assert_eq!(l.grid.0, 50 * 24 / 8);
}

#[test]
fn gather_args_fill_dims_and_reject_bad_shapes() {
    let g = gather_args("gather", &[4, 5, 6], &[2, 3, 6], 1).unwrap();
    assert_eq!((g.ndim, g.dim), (3, 1));
    assert_eq!(&g.x_dims[..3], &[4, 5, 6]);
    assert_eq!(&g.index_dims[..3], &[2, 3, 6]);
    assert_eq!(g.x_dims[3], 0);
    let bad: [(&[usize], &[usize], usize); 4] = [
        (&[4, 5], &[4], 0),    // ranks differ
        (&[4, 5], &[5, 5], 1), // larger off dim
        (&[4, 5], &[4, 5], 2), // dim out of range
        (&[1; 9], &[1; 9], 0), // more than 8 dims
    ];
    for (x, i, d) in bad {
        let e = gather_args("gather", x, i, d).unwrap_err().to_string();
        assert!(e.starts_with("gather:"), "{e}");
    }
    let _: GatherArgs = g;
}

#[test]
fn dtypes_pick_their_kernels() {
    assert_eq!(float_sfx("t", DType::BF16).unwrap(), "bf16");
    for d in [DType::F64, DType::U8, DType::U32, DType::I64] {
        assert!(float_sfx("t", d).is_err());
    }
    assert_eq!(basic_sfx("t", DType::F64).unwrap(), "f64");
    assert_eq!(basic_sfx("t", DType::F16).unwrap(), "f16");
    for d in [DType::U8, DType::U32, DType::I64] {
        assert!(basic_sfx("t", d).is_err());
    }
    assert_eq!(acc_dtype(DType::F64), DType::F64);
    assert_eq!(acc_dtype(DType::BF16), DType::F32);
    assert_eq!(
        mover(DType::U32),
        Mover::Kernel {
            sfx: "f32",
            words: 1
        }
    );
    assert_eq!(
        mover(DType::F16),
        Mover::Kernel {
            sfx: "f16",
            words: 1
        }
    );
    assert_eq!(
        mover(DType::I64),
        Mover::Kernel {
            sfx: "f32",
            words: 2
        }
    );
    assert_eq!(
        mover(DType::F64),
        Mover::Kernel {
            sfx: "f32",
            words: 2
        }
    );
    assert_eq!(mover(DType::U8), Mover::Host);
}

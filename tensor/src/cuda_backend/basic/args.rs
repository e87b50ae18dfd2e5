//! The argument lists of every launch of the required ops, each built by a small pure function
//! (device pointers are plain `u64`s), so the tests can check every list against the kernel's
//! parsed declaration without a GPU (see `tests.rs`). Parameter orders and types follow the
//! `extern "C"` declarations of `kernels/cuda/*.cu` exactly.

use meshgrad_kernels::cuda::{binary_op, cmp_op, unary_op, GatherArgs, StridedArgs};
use meshgrad_kernels::ops::{BinaryOp, CmpOp, ReduceOp, UnaryOp};

use crate::backend::api::ReduceDims;
use crate::cuda_backend::{grid_for, kernel_args, KernelArgs, KernelLaunch, BLOCK};

/// One kernel launch of a basic op, with raw arguments.
pub(crate) type Launch = KernelLaunch<KernelArgs>;

impl Launch {
    /// A launch of `threads` threads in 1-D blocks of [`BLOCK`] (the kernels loop with a grid
    /// stride, so any grid covers them).
    fn threads(file: &'static str, entry: String, threads: usize, args: KernelArgs) -> Self {
        Launch {
            file,
            entry,
            grid: grid_for(threads, BLOCK),
            block: (BLOCK, 1, 1),
            shared: 0,
            args,
        }
    }
}

const EW: &str = "elementwise.cu";
const CAST: &str = "cast.cu";
const RANDOM: &str = "random.cu";
const REDUCE: &str = "reduce.cu";
const EMBEDDING: &str = "embedding.cu";
const GATHER: &str = "gather.cu";
const INDEX_SELECT: &str = "index_select.cu";

/// `unary_<t>`'s op code and its two f64 parameters (`a`, `b`; 0 when unused).
pub(crate) fn unary_code(op: UnaryOp) -> (i32, f64, f64) {
    use unary_op as u;
    match op {
        UnaryOp::Neg => (u::NEG, 0.0, 0.0),
        UnaryOp::Exp => (u::EXP, 0.0, 0.0),
        UnaryOp::Log => (u::LOG, 0.0, 0.0),
        UnaryOp::Sqrt => (u::SQRT, 0.0, 0.0),
        UnaryOp::Tanh => (u::TANH, 0.0, 0.0),
        UnaryOp::Relu => (u::RELU, 0.0, 0.0),
        UnaryOp::GeluTanh => (u::GELU_TANH, 0.0, 0.0),
        UnaryOp::GeluErf => (u::GELU_ERF, 0.0, 0.0),
        UnaryOp::Abs => (u::ABS, 0.0, 0.0),
        UnaryOp::Recip => (u::RECIP, 0.0, 0.0),
        UnaryOp::Square => (u::SQUARE, 0.0, 0.0),
        UnaryOp::Sigmoid => (u::SIGMOID, 0.0, 0.0),
        UnaryOp::PowScalar(p) => (u::POW, p, 0.0),
        UnaryOp::AddScalar(c) => (u::ADD_SCALAR, c, 0.0),
        UnaryOp::MulScalar(c) => (u::MUL_SCALAR, c, 0.0),
        UnaryOp::Sin => (u::SIN, 0.0, 0.0),
        UnaryOp::Cos => (u::COS, 0.0, 0.0),
        UnaryOp::Silu => (u::SILU, 0.0, 0.0),
        UnaryOp::Clamp(lo, hi) => (u::CLAMP, lo, hi),
    }
}

/// `binary_<t>`'s op code.
pub(crate) fn binary_code(op: BinaryOp) -> i32 {
    match op {
        BinaryOp::Add => binary_op::ADD,
        BinaryOp::Sub => binary_op::SUB,
        BinaryOp::Mul => binary_op::MUL,
        BinaryOp::Div => binary_op::DIV,
        BinaryOp::Maximum => binary_op::MAXIMUM,
        BinaryOp::Minimum => binary_op::MINIMUM,
    }
}

/// `compare_<t>`'s op code.
pub(crate) fn cmp_code(op: CmpOp) -> i32 {
    match op {
        CmpOp::Eq => cmp_op::EQ,
        CmpOp::Ne => cmp_op::NE,
        CmpOp::Lt => cmp_op::LT,
        CmpOp::Le => cmp_op::LE,
        CmpOp::Gt => cmp_op::GT,
        CmpOp::Ge => cmp_op::GE,
    }
}

/// `fill_f64(double *out, i64 n, double value)`.
pub(crate) fn fill_f64(out: u64, n: usize, value: f64) -> Launch {
    let a = kernel_args![out, n as i64, value];
    Launch::threads(EW, "fill_f64".into(), n, a)
}

/// `fill_i64(i64 *out, i64 n, i64 value)`.
pub(crate) fn fill_i64(out: u64, n: usize, value: i64) -> Launch {
    let a = kernel_args![out, n as i64, value];
    Launch::threads(EW, "fill_i64".into(), n, a)
}

/// `arange_<t>(T *out, i64 n, double start, double step)` with step 1 (f32, bf16, f16).
pub(crate) fn arange_float(sfx: &str, out: u64, n: usize, start: i64) -> Launch {
    let a = kernel_args![out, n as i64, start as f64, 1.0f64];
    Launch::threads(EW, format!("arange_{sfx}"), n, a)
}

/// `arange_i64(i64 *out, i64 n, i64 start, i64 step)` with step 1.
pub(crate) fn arange_i64(out: u64, n: usize, start: i64) -> Launch {
    let a = kernel_args![out, n as i64, start, 1i64];
    Launch::threads(EW, "arange_i64".into(), n, a)
}

/// `uniform_<t>(T *out, i64 n, u64 seed, u64 start, double low, double width)`.
pub(crate) fn uniform(
    sfx: &str,
    out: u64,
    n: usize,
    seed: u64,
    start: u64,
    low: f64,
    width: f64,
) -> Launch {
    let a = kernel_args![out, n as i64, seed, start, low, width];
    Launch::threads(RANDOM, format!("uniform_{sfx}"), n, a)
}

/// `normal_<t>(T *out, i64 n, u64 seed, u64 start, double mean, double std)`.
pub(crate) fn normal(
    sfx: &str,
    out: u64,
    n: usize,
    seed: u64,
    start: u64,
    mean: f64,
    std: f64,
) -> Launch {
    let a = kernel_args![out, n as i64, seed, start, mean, std];
    Launch::threads(RANDOM, format!("normal_{sfx}"), n, a)
}

/// `randint_i64(i64 *out, i64 n, u64 seed, u64 start, i64 low, u64 width)`.
pub(crate) fn randint(out: u64, n: usize, seed: u64, start: u64, low: i64, width: u64) -> Launch {
    let a = kernel_args![out, n as i64, seed, start, low, width];
    Launch::threads(RANDOM, "randint_i64".into(), n, a)
}

/// `cast_<a>_to_<b>(const S *x, D *out, i64 n)`.
pub(crate) fn cast(from: &str, to: &str, x: u64, out: u64, n: usize) -> Launch {
    let a = kernel_args![x, out, n as i64];
    Launch::threads(CAST, format!("cast_{from}_to_{to}"), n, a)
}

/// `copy_strided_<t>(StridedArgs s, const T *x, T *out)`.
pub(crate) fn copy_strided(sfx: &str, s: StridedArgs, x: u64, out: u64) -> Launch {
    let a = kernel_args![s, x, out];
    Launch::threads(EW, format!("copy_strided_{sfx}"), s.numel as usize, a)
}

/// `unary_<t>(const T *x, T *out, i64 n, int op, double a, double b)`.
pub(crate) fn unary(sfx: &str, x: u64, out: u64, n: usize, op: UnaryOp) -> Launch {
    let (code, pa, pb) = unary_code(op);
    let a = kernel_args![x, out, n as i64, code, pa, pb];
    Launch::threads(EW, format!("unary_{sfx}"), n, a)
}

/// `binary_<t>(int op, StridedArgs s, const T *a, const T *b, T *out)`.
pub(crate) fn binary(sfx: &str, op: BinaryOp, s: StridedArgs, x: u64, y: u64, out: u64) -> Launch {
    let a = kernel_args![binary_code(op), s, x, y, out];
    Launch::threads(EW, format!("binary_{sfx}"), s.numel as usize, a)
}

/// `binary_contig_<t>(int op, const T *a, const T *b, T *out, i64 n)`.
pub(crate) fn binary_contig(sfx: &str, op: BinaryOp, x: u64, y: u64, out: u64, n: usize) -> Launch {
    let a = kernel_args![binary_code(op), x, y, out, n as i64];
    Launch::threads(EW, format!("binary_contig_{sfx}"), n, a)
}

/// `compare_<t>(int op, StridedArgs s, const T *a, const T *b, u8 *out)`.
pub(crate) fn compare(sfx: &str, op: CmpOp, s: StridedArgs, x: u64, y: u64, out: u64) -> Launch {
    let a = kernel_args![cmp_code(op), s, x, y, out];
    Launch::threads(EW, format!("compare_{sfx}"), s.numel as usize, a)
}

/// `where_<t>(StridedArgs s, const u8 *c, const T *t, const T *f, T *out)`.
pub(crate) fn where_cond(sfx: &str, s: StridedArgs, c: u64, t: u64, f: u64, out: u64) -> Launch {
    let a = kernel_args![s, c, t, f, out];
    Launch::threads(EW, format!("where_{sfx}"), s.numel as usize, a)
}

/// The name of a reduction in the kernels' entry names.
fn reduce_name(op: ReduceOp) -> &'static str {
    match op {
        ReduceOp::Sum => "sum",
        ReduceOp::Max => "max",
        ReduceOp::ArgMax => "argmax",
    }
}

/// `<op>_strided_<t>(const T *x, T *out, i64 outer, i64 red, i64 inner)` (argmax: `i64 *out`):
/// one thread per output element.
pub(crate) fn reduce_strided(op: ReduceOp, sfx: &str, x: u64, out: u64, d: ReduceDims) -> Launch {
    let entry = format!("{}_strided_{sfx}", reduce_name(op));
    Launch::threads(REDUCE, entry, d.outer * d.inner, reduce_args(x, out, d))
}

/// The arguments `(x, out, outer, red, inner)` of the reductions over the middle dim of
/// `[outer, red, inner]`.
fn reduce_args(x: u64, out: u64, d: ReduceDims) -> KernelArgs {
    kernel_args![x, out, d.outer as i64, d.red as i64, d.inner as i64]
}

/// Threads per block of a `_lastdim` reduction of rows of `red` elements: a multiple of 32 (the
/// block reductions need whole warps), at most [`BLOCK`], no more than the row needs.
pub(crate) fn lastdim_block(red: usize) -> u32 {
    (red.div_ceil(32) * 32).clamp(32, BLOCK as usize) as u32
}

/// `<op>_lastdim_<t>(const T *x, T *out, i64 rows, i64 red)`: one block per row (the kernel
/// loops over rows with a grid stride).
pub(crate) fn reduce_lastdim(
    op: ReduceOp,
    sfx: &str,
    x: u64,
    out: u64,
    rows: usize,
    red: usize,
) -> Launch {
    let a = kernel_args![x, out, rows as i64, red as i64];
    Launch {
        file: REDUCE,
        entry: format!("{}_lastdim_{sfx}", reduce_name(op)),
        grid: (rows.clamp(1, i32::MAX as usize) as u32, 1, 1),
        block: (lastdim_block(red), 1, 1),
        shared: 0,
        args: a,
    }
}

/// Threads per block of `sum_cols_<t>`: 32 warps, each summing every 32nd row of its tile.
pub(crate) const COLS_BLOCK: u32 = 1024;

/// `sum_cols_<t>(const T *x, T *out, i64 outer, i64 red, i64 inner)`: one block of
/// [`COLS_BLOCK`] threads per tile of 32 adjacent outputs (the kernel loops over the
/// `outer x ceil(inner / 32)` tiles with a grid stride).
pub(crate) fn reduce_cols(sfx: &str, x: u64, out: u64, d: ReduceDims) -> Launch {
    let a = reduce_args(x, out, d);
    let tiles = d.outer.saturating_mul(d.inner.div_ceil(32));
    Launch {
        file: REDUCE,
        entry: format!("sum_cols_{sfx}"),
        grid: (tiles.clamp(1, i32::MAX as usize) as u32, 1, 1),
        block: (COLS_BLOCK, 1, 1),
        shared: 0,
        args: a,
    }
}

/// `embedding_fwd_<t>(const i64 *ids, const T *weight, T *out, i64 n, i64 vocab, i64 dim,
/// u64 *bad)`: one thread per output element.
/// `[ids, w, out, bad]`.
pub(crate) fn embedding_fwd(
    sfx: &str,
    [ids, w, out, bad]: [u64; 4],
    n: usize,
    vocab: usize,
    dim: usize,
) -> Launch {
    let a = kernel_args![ids, w, out, n as i64, vocab as i64, dim as i64, bad];
    Launch::threads(EMBEDDING, format!("embedding_fwd_{sfx}"), n * dim, a)
}

/// The warps `embedding_bwd_det_<t>` aims at: enough to fill a large GPU several times over.
pub(crate) const EMBEDDING_BWD_WARPS: usize = 4096;

/// Ids per warp of `embedding_bwd_det_<t>` for a table of `vocab` rows of `dim` columns: the
/// smallest range that gives at most [`EMBEDDING_BWD_WARPS`] (range, 32-column tile) warps.
pub(crate) fn embedding_bwd_range(vocab: usize, dim: usize) -> usize {
    vocab
        .saturating_mul(dim.div_ceil(32))
        .div_ceil(EMBEDDING_BWD_WARPS)
        .max(1)
}

/// `embedding_bwd_det_<t>(const i64 *ids, const T *dout, A *dweight, i64 n, i64 vocab, i64 dim,
/// i64 range, u64 *bad)`: one warp per (range of ids, tile of 32 columns), each scanning the
/// positions in increasing order (the CPU's order, deterministic), blocks of [`BLOCK`] threads;
/// or `embedding_bwd_atomic_<t>(..., i64 dim, u64 *bad)`: one thread per element, atomicAdd
/// (not deterministic).
/// `[ids, dout, dw, bad]`.
pub(crate) fn embedding_bwd(
    deterministic: bool,
    sfx: &str,
    [ids, dout, dw, bad]: [u64; 4],
    n: usize,
    vocab: usize,
    dim: usize,
) -> Launch {
    let a = kernel_args![ids, dout, dw, n as i64, vocab as i64, dim as i64];
    if deterministic {
        let range = embedding_bwd_range(vocab, dim);
        let warps = vocab.div_ceil(range).saturating_mul(dim.div_ceil(32));
        let a = a.arg(range as i64).arg(bad);
        Launch::threads(EMBEDDING, format!("embedding_bwd_det_{sfx}"), warps * 32, a)
    } else {
        let a = a.arg(bad);
        Launch::threads(EMBEDDING, format!("embedding_bwd_atomic_{sfx}"), n * dim, a)
    }
}

/// `gather_<t>(GatherArgs g, const T *x, const i64 *index, T *out, u64 *bad)`, or with
/// `backward` `gather_bwd_<t>(GatherArgs g, const T *dout, const i64 *index, A *dx, u64 *bad)`:
/// one thread per output element, or per (outer, inner) pair of the index for the backward
/// (`threads` of them). `[x or dout, index, out or dx, bad]`.
pub(crate) fn gather(
    sfx: &str,
    backward: bool,
    g: GatherArgs,
    [x, index, out, bad]: [u64; 4],
    threads: usize,
) -> Launch {
    let a = kernel_args![g, x, index, out, bad];
    let entry = if backward { "gather_bwd" } else { "gather" };
    Launch::threads(GATHER, format!("{entry}_{sfx}"), threads, a)
}

/// `index_select_<t>(const T *x, const i64 *ids, T *out, i64 outer, i64 xn, i64 inner, i64 m,
/// u64 *bad)`: one thread per output element; or with `backward`
/// `index_select_bwd_<t>(const T *dout, const i64 *ids, A *dx, ...)` (the same parameters): one
/// thread per (outer, inner) pair. `[x or dout, ids, out or dx, bad]`, `[outer, xn, inner, m]`.
pub(crate) fn index_select(
    sfx: &str,
    backward: bool,
    [x, ids, out, bad]: [u64; 4],
    [outer, xn, inner, m]: [usize; 4],
) -> Launch {
    let a = kernel_args![
        x,
        ids,
        out,
        outer as i64,
        xn as i64,
        inner as i64,
        m as i64,
        bad
    ];
    let (entry, threads) = if backward {
        ("index_select_bwd", outer * inner)
    } else {
        ("index_select", outer * m * inner)
    };
    Launch::threads(INDEX_SELECT, format!("{entry}_{sfx}"), threads, a)
}

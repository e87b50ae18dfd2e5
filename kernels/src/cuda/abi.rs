//! Host-side mirrors of what the CUDA kernels take: op codes and `#[repr(C)]` argument structs
//! (passed by value as kernel parameters). Field order and types match the structs in
//! `kernels/cuda/*.cu`; the size assertions below pin the layouts.

/// Unary op codes of `unary_<t>` (elementwise.cu), in the order of the CPU's `UnaryOp`.
pub mod unary_op {
    /// -x
    pub const NEG: i32 = 0;
    /// e^x
    pub const EXP: i32 = 1;
    /// ln x
    pub const LOG: i32 = 2;
    /// sqrt x
    pub const SQRT: i32 = 3;
    /// tanh x
    pub const TANH: i32 = 4;
    /// max(x, 0)
    pub const RELU: i32 = 5;
    /// GELU, tanh form
    pub const GELU_TANH: i32 = 6;
    /// GELU, erf form
    pub const GELU_ERF: i32 = 7;
    /// |x|
    pub const ABS: i32 = 8;
    /// 1 / x
    pub const RECIP: i32 = 9;
    /// x^2
    pub const SQUARE: i32 = 10;
    /// sigmoid
    pub const SIGMOID: i32 = 11;
    /// x^a (parameter a)
    pub const POW: i32 = 12;
    /// x + a
    pub const ADD_SCALAR: i32 = 13;
    /// x * a
    pub const MUL_SCALAR: i32 = 14;
    /// sin x
    pub const SIN: i32 = 15;
    /// cos x
    pub const COS: i32 = 16;
    /// SiLU
    pub const SILU: i32 = 17;
    /// clamp to [a, b]
    pub const CLAMP: i32 = 18;
}

/// Binary op codes of `binary_<t>` / `binary_contig_<t>` (elementwise.cu), as the CPU's
/// `BinaryOp`.
pub mod binary_op {
    /// a + b
    pub const ADD: i32 = 0;
    /// a - b
    pub const SUB: i32 = 1;
    /// a * b
    pub const MUL: i32 = 2;
    /// a / b
    pub const DIV: i32 = 3;
    /// max(a, b), NaN-ignoring
    pub const MAXIMUM: i32 = 4;
    /// min(a, b), NaN-ignoring
    pub const MINIMUM: i32 = 5;
}

/// Comparison codes of `compare_<t>` (elementwise.cu), as the CPU's `CmpOp`.
pub mod cmp_op {
    /// a == b
    pub const EQ: i32 = 0;
    /// a != b
    pub const NE: i32 = 1;
    /// a < b
    pub const LT: i32 = 2;
    /// a <= b
    pub const LE: i32 = 3;
    /// a > b
    pub const GT: i32 = 4;
    /// a >= b
    pub const GE: i32 = 5;
}

/// Unary-backward codes of `unary_bwd_<t>` (unary_backward.cu), as the CPU's `UnaryGrad`.
pub mod unary_grad {
    /// SiLU derivative
    pub const SILU: i32 = 0;
    /// Clamp derivative (gradient passes inside `[a, b]`)
    pub const CLAMP: i32 = 1;
}

/// The most dimensions a strided kernel handles.
pub const MAX_DIMS: usize = 8;

/// `StridedArgs` of elementwise.cu: the contiguous output's `shape` (first `ndim` entries used)
/// and, for up to three inputs, their element offsets and strides (0 to broadcast).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StridedArgs {
    /// Output shape.
    pub shape: [i64; MAX_DIMS],
    /// Per input, one stride per output dimension.
    pub strides: [[i64; MAX_DIMS]; 3],
    /// Per input, the element offset of its first element.
    pub offsets: [i64; 3],
    /// Number of output elements (the product of `shape`).
    pub numel: i64,
    /// Number of dimensions used.
    pub ndim: i32,
    /// Padding (keeps the struct a multiple of 8 bytes).
    pub pad_: i32,
}

/// `GatherArgs` of gather.cu: the dims of the input and of the index (same rank), and the
/// gathered dimension.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GatherArgs {
    /// Input dims (first `ndim` used).
    pub x_dims: [i64; MAX_DIMS],
    /// Index (and output) dims (first `ndim` used).
    pub index_dims: [i64; MAX_DIMS],
    /// Rank.
    pub ndim: i32,
    /// The gathered dimension.
    pub dim: i32,
}

/// `HeadLayout` of attention.cu, as the CPU's `attention::HeadLayout`: element `c` of row `t` of
/// batch-head `bh = b * heads + h` is at `offset + b * batch_stride + h * head_stride +
/// t * row_stride + c`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeadLayout {
    /// Offset of batch-head 0's row 0.
    pub offset: i64,
    /// Stride between batch entries.
    pub batch_stride: i64,
    /// Stride between heads of one batch entry.
    pub head_stride: i64,
    /// Stride between rows.
    pub row_stride: i64,
}

/// `AttnParams` of attention.cu: sizes, masks and the layouts of every operand of one call.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttnParams {
    /// q, k, v, out, dout, dq, dk, dv (the forward uses the first four).
    pub layouts: [HeadLayout; 8],
    /// batch * heads
    pub batch_heads: i64,
    /// Query positions.
    pub seq_q: i64,
    /// Key positions.
    pub seq_k: i64,
    /// Heads per batch entry of the operand layouts.
    pub heads: i32,
    /// Heads per batch entry for indexing the key padding mask (`[batch, seq_k]`).
    pub mask_heads: i32,
    /// Causal mask, aligned bottom-right (query `i` sees keys `j <= i + seq_k - seq_q`).
    pub causal: i32,
    /// Score scale.
    pub scale: f32,
}

const _: () = assert!(std::mem::size_of::<StridedArgs>() == 8 * (8 + 24 + 3 + 1) + 8);
const _: () = assert!(std::mem::size_of::<GatherArgs>() == 8 * 16 + 8);
const _: () = assert!(std::mem::size_of::<AttnParams>() == 8 * 4 * 8 + 8 * 3 + 16);

// SAFETY: plain `#[repr(C)]` structs of integers and floats with no padding the device could
// misread (sizes asserted above); the kernels declare the same fields in the same order.
unsafe impl cudarc::driver::DeviceRepr for StridedArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for GatherArgs {}
// SAFETY: as above.
unsafe impl cudarc::driver::DeviceRepr for AttnParams {}

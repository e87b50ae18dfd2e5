//! Device-neutral op descriptors: what an op computes, independent of where it runs. The tensor
//! ops build these and hand them to whichever backend holds the operands; every backend's kernels
//! (the CPU ones in [`crate::cpu`], later the CUDA ones) read the same types.

/// A unary elementwise function.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryOp {
    /// -x
    Neg,
    /// e^x
    Exp,
    /// ln x
    Log,
    /// sqrt x
    Sqrt,
    /// tanh x
    Tanh,
    /// max(x, 0)
    Relu,
    /// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    GeluTanh,
    /// GELU, exact: 0.5 x (1 + erf(x / sqrt 2))
    GeluErf,
    /// |x|
    Abs,
    /// 1 / x
    Recip,
    /// x^2
    Square,
    /// 1 / (1 + e^-x)
    Sigmoid,
    /// x^p
    PowScalar(f64),
    /// x + c
    AddScalar(f64),
    /// x * c
    MulScalar(f64),
    /// sin x
    Sin,
    /// cos x
    Cos,
    /// SiLU (swish): x * sigmoid(x) = x / (1 + e^-x)
    Silu,
    /// min(max(x, lo), hi): `Clamp(lo, hi)` with `lo <= hi`; an infinite bound is no bound.
    /// NaN passes through.
    Clamp(f64, f64),
}

/// A binary elementwise function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BinaryOp {
    /// a + b
    Add,
    /// a - b
    Sub,
    /// a * b
    Mul,
    /// a / b
    Div,
    /// max(a, b)
    Maximum,
    /// min(a, b)
    Minimum,
}

/// A comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpOp {
    /// a == b
    Eq,
    /// a != b
    Ne,
    /// a < b
    Lt,
    /// a <= b
    Le,
    /// a > b
    Gt,
    /// a >= b
    Ge,
}

/// A reduction over one dimension of a contiguous buffer viewed as `[outer, reduce, inner]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum of the reduced elements.
    Sum,
    /// Largest reduced element (NaN propagates).
    Max,
    /// Index (as i64) of the first largest reduced element (the first NaN, if any).
    ArgMax,
}

/// Which derivative a fused unary backward (`dx = dy * f'(x)`, the CPU's
/// [`unary_backward`](crate::cpu::unary_backward::unary_backward)) applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum UnaryGrad {
    /// SiLU: `silu'(x) = s (1 + x (1 - s))` with `s = sigmoid(x)`.
    Silu,
    /// Clamp to `[lo, hi]` (an infinite bound is no bound): the gradient passes where
    /// `lo <= x <= hi` (bounds included, as PyTorch does) and is 0 elsewhere, NaN `x` included.
    Clamp(f64, f64),
}

/// Where a batch of matrices lives in a flat buffer: element offset and strides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixLayout {
    /// Offset of batch 0's element (0, 0).
    pub offset: usize,
    /// Stride between consecutive matrices of the batch (0 broadcasts one matrix to all).
    pub batch_stride: usize,
    /// Stride between rows.
    pub row_stride: usize,
    /// Stride between columns.
    pub col_stride: usize,
}

/// Sizes of one attention call. `q` is `[batch_heads, seq_q, head_dim]`, `k` and `v` are
/// `[batch_heads, seq_k, head_dim]` (contiguous for the CPU's
/// [`attention_forward`](crate::cpu::attention::attention_forward) and
/// [`attention_backward`](crate::cpu::attention::attention_backward); any
/// [`HeadLayout`](crate::cpu::attention::HeadLayout) for the `_strided` versions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// batch * heads
    pub batch_heads: usize,
    /// Query positions.
    pub seq_q: usize,
    /// Key/value positions.
    pub seq_k: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Causal masking, aligned bottom-right: query `i` sees keys `j <= i + (seq_k - seq_q)`
    /// (requires `seq_k >= seq_q`). Masked key blocks are skipped, not computed.
    pub causal: bool,
    /// Score scale, usually `1/sqrt(head_dim)`.
    pub scale: f64,
}

/// Where the additive score bias of one attention call lives in its buffer. With
/// [`ScoreMask::heads`](crate::cpu::attention::ScoreMask::heads) heads per batch entry, the bias
/// of query `i`, key `j` of batch-head `bh = b * heads + h` is `data[offset + b * batch_stride + h * head_stride + i * row_stride +
/// j * col_stride]`. A zero stride broadcasts the bias over that dimension (a `[H, Tq, Tk]` bias
/// has `batch_stride = 0`, a `[B, 1, 1, Tk]` one `head_stride = row_stride = 0`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BiasLayout {
    /// Offset of the bias of batch 0, head 0, query 0, key 0.
    pub offset: usize,
    /// Stride between batch entries (0 to broadcast).
    pub batch_stride: usize,
    /// Stride between heads (0 to broadcast).
    pub head_stride: usize,
    /// Stride between query rows (0 to broadcast).
    pub row_stride: usize,
    /// Stride between keys (0 to broadcast).
    pub col_stride: usize,
}

impl BiasLayout {
    /// The layout of a contiguous `[batch, heads, seq_q, seq_k]` bias.
    pub fn contiguous(heads: usize, seq_q: usize, seq_k: usize) -> Self {
        BiasLayout {
            offset: 0,
            batch_stride: heads * seq_q * seq_k,
            head_stride: seq_q * seq_k,
            row_stride: seq_k,
            col_stride: 1,
        }
    }
}

/// Hyper-parameters of one AdamW step (`step` counts from 1).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Denominator epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// 1-based step number (for bias correction).
    pub step: u64,
}

// elementwise.cu: unary maps, broadcasting binary ops, comparisons, where, strided copies, fill,
// arange (dtype casts: cast.cu).
//
// CPU references (kernels/src/cpu/elementwise.rs): `unary` (UnaryOp, op codes below in the
// enum's order), `binary` (BinaryOp), `compare` (CmpOp), `where_cond`, with `View` strides.
// Layout: the output is contiguous row-major over `shape`; every input is a strided view
// (`offset` + Σ coord_k · stride_k, stride 0 to broadcast), passed in `StridedArgs` (up to 8
// dims, mirrored by `cuda::StridedArgs` in Rust).
// Precision: f32, bf16 and f16 are computed in f32, f64 in f64 (`Acc<T>`). Exp/tanh/sigmoid use
// CUDA's expf/tanhf (exp/tanh for f64; within a few ulp; the CPU f32 path uses the crate's
// vectorised exp), so results agree to rounding, not bit for bit.

// Unary op codes (kernels/src/cpu/elementwise.rs, UnaryOp, in declaration order).
#define OP_NEG 0
#define OP_EXP 1
#define OP_LOG 2
#define OP_SQRT 3
#define OP_TANH 4
#define OP_RELU 5
#define OP_GELU_TANH 6
#define OP_GELU_ERF 7
#define OP_ABS 8
#define OP_RECIP 9
#define OP_SQUARE 10
#define OP_SIGMOID 11
#define OP_POW 12
#define OP_ADD_SCALAR 13
#define OP_MUL_SCALAR 14
#define OP_SIN 15
#define OP_COS 16
#define OP_SILU 17
#define OP_CLAMP 18

#define SQRT_2_OVER_PI 0.7978845608028654
#define GELU_CUBIC 0.044715
#define FRAC_1_SQRT_2 0.7071067811865476

// `a` and `b` are the op's f64 parameters (PowScalar p; AddScalar/MulScalar c; Clamp lo, hi),
// rounded to the compute type C as the CPU's `T::from_f64` does (f32 for f32, bf16 and f16).
// `pow_kind`: 2 when the f64 exponent is exactly 2 (x * x), 1 when exactly 1 (copy), else 0.
template <typename C>
__device__ __forceinline__ C unary_op(int op, C v, C a, C b, int pow_kind) {
    const C one = (C)1;
    switch (op) {
    case OP_NEG: return -v;
    case OP_EXP: return mg_exp(v);
    case OP_LOG: return mg_log(v);
    case OP_SQRT: return mg_sqrt(v);
    case OP_TANH: return mg_tanh(v);
    case OP_RELU: return v < (C)0 ? (C)0 : v; // NaN passes through
    case OP_GELU_TANH: {
        // 0.5 x (1 + tanh u) == x * sigmoid(2u), as the CPU evaluates it.
        const C c2 = (C)(-2.0 * SQRT_2_OVER_PI), k = (C)GELU_CUBIC;
        return v / (one + mg_exp(c2 * (v + k * v * v * v)));
    }
    case OP_GELU_ERF: return (C)0.5 * v * (one + mg_erf(v * (C)FRAC_1_SQRT_2));
    case OP_ABS: return mg_abs(v);
    case OP_RECIP: return one / v;
    case OP_SQUARE: return v * v;
    case OP_SIGMOID: return one / (one + mg_exp(-v));
    case OP_POW: return pow_kind == 2 ? v * v : (pow_kind == 1 ? v : mg_pow(v, a));
    case OP_ADD_SCALAR: return v + a;
    case OP_MUL_SCALAR: return v * a;
    case OP_SIN: return mg_sin(v);
    case OP_COS: return mg_cos(v);
    case OP_SILU: return v / (one + mg_exp(-v));
    case OP_CLAMP: return v < a ? a : (v > b ? b : v); // NaN passes through
    default: return (C)MG_NAN;
    }
}

template <typename T>
__device__ void unary_impl(const T *x, T *out, i64 n, int op, double a, double b) {
    typedef typename Acc<T>::type C;
    const C ca = (C)a, cb = (C)b;
    const int pow_kind = a == 2.0 ? 2 : (a == 1.0 ? 1 : 0); // decided on the f64 value, as the CPU
    MG_GRID_STRIDE(i, n) { store(out, i, unary_op<C>(op, load(x, i), ca, cb, pow_kind)); }
}

// ---- strided (broadcasting) maps ----
#define MG_MAX_DIMS 8
// Shape of the contiguous output and, for up to 3 inputs, their element offsets and strides.
// Mirrored by `StridedArgs` in kernels/src/cuda/mod.rs (#[repr(C)], 296 bytes).
struct StridedArgs {
    i64 shape[MG_MAX_DIMS];
    i64 strides[3][MG_MAX_DIMS];
    i64 offsets[3];
    i64 numel;
    int ndim;
    int pad_;
};

// Element offsets of output element `i` in inputs 0..NIN.
template <int NIN>
__device__ __forceinline__ void strided_offsets(const StridedArgs &s, i64 i, i64 *off) {
#pragma unroll
    for (int k = 0; k < NIN; ++k) off[k] = s.offsets[k];
    for (int d = s.ndim - 1; d >= 0; --d) {
        const i64 c = i % s.shape[d];
        i /= s.shape[d];
#pragma unroll
        for (int k = 0; k < NIN; ++k) off[k] += c * s.strides[k][d];
    }
}

#define OP_ADD 0
#define OP_SUB 1
#define OP_MUL 2
#define OP_DIV 3
#define OP_MAXIMUM 4
#define OP_MINIMUM 5

// Maximum / Minimum: a NaN operand yields the other one (fmax/fmin, as Float::max/min).
template <typename C>
__device__ __forceinline__ C binary_op(int op, C a, C b) {
    switch (op) {
    case OP_ADD: return a + b;
    case OP_SUB: return a - b;
    case OP_MUL: return a * b;
    case OP_DIV: return a / b;
    case OP_MAXIMUM: return mg_max(a, b);
    case OP_MINIMUM: return mg_min(a, b);
    default: return (C)MG_NAN;
    }
}

template <typename T>
__device__ void binary_impl(int op, StridedArgs s, const T *a, const T *b, T *out) {
    MG_GRID_STRIDE(i, s.numel) {
        i64 off[2];
        strided_offsets<2>(s, i, off);
        store(out, i, binary_op<typename Acc<T>::type>(op, load(a, off[0]), load(b, off[1])));
    }
}

// Contiguous, same-shape fast path.
template <typename T>
__device__ void binary_contig_impl(int op, const T *a, const T *b, T *out, i64 n) {
    MG_GRID_STRIDE(i, n) { store(out, i, binary_op<typename Acc<T>::type>(op, load(a, i), load(b, i))); }
}

#define CMP_EQ 0
#define CMP_NE 1
#define CMP_LT 2
#define CMP_LE 3
#define CMP_GT 4
#define CMP_GE 5

// IEEE: every comparison with NaN is false except Ne.
template <typename C>
__device__ __forceinline__ u8 cmp_op(int op, C a, C b) {
    switch (op) {
    case CMP_EQ: return a == b;
    case CMP_NE: return a != b;
    case CMP_LT: return a < b;
    case CMP_LE: return a <= b;
    case CMP_GT: return a > b;
    case CMP_GE: return a >= b;
    default: return 0;
    }
}

template <typename T>
__device__ void compare_impl(int op, StridedArgs s, const T *a, const T *b, u8 *out) {
    MG_GRID_STRIDE(i, s.numel) {
        i64 off[2];
        strided_offsets<2>(s, i, off);
        out[i] = cmp_op<typename Acc<T>::type>(op, load(a, off[0]), load(b, off[1]));
    }
}

// Input 0 is the u8 condition, 1 on_true, 2 on_false. Copies elements without conversion.
template <typename T>
__device__ void where_impl(StridedArgs s, const u8 *cond, const T *t, const T *f, T *out) {
    MG_GRID_STRIDE(i, s.numel) {
        i64 off[3];
        strided_offsets<3>(s, i, off);
        out[i] = cond[off[0]] != 0 ? t[off[1]] : f[off[2]];
    }
}

// Strided copy into a contiguous output (`contiguous()` of a view).
template <typename T>
__device__ void copy_strided_impl(StridedArgs s, const T *x, T *out) {
    MG_GRID_STRIDE(i, s.numel) {
        i64 off[1];
        strided_offsets<1>(s, i, off);
        out[i] = x[off[0]];
    }
}

// out[i] = value rounded once from f64.
template <typename T>
__device__ void fill_impl(T *out, i64 n, double value) {
    const T v = from_double<T>(value);
    MG_GRID_STRIDE(i, n) { out[i] = v; }
}

// out[i] = start + i * step, computed in f64 (no fused multiply-add) and rounded once.
template <typename T>
__device__ void arange_impl(T *out, i64 n, double start, double step) {
    MG_GRID_STRIDE(i, n) { out[i] = from_double<T>(__dadd_rn(start, __dmul_rn((double)i, step))); }
}

#define EW_ENTRIES(sfx, T)                                                                       \
    extern "C" __global__ void unary_##sfx(const T *x, T *out, i64 n, int op, double a, double b) { \
        unary_impl<T>(x, out, n, op, a, b);                                                      \
    }                                                                                            \
    extern "C" __global__ void binary_##sfx(int op, StridedArgs s, const T *a, const T *b, T *out) { \
        binary_impl<T>(op, s, a, b, out);                                                        \
    }                                                                                            \
    extern "C" __global__ void binary_contig_##sfx(int op, const T *a, const T *b, T *out, i64 n) { \
        binary_contig_impl<T>(op, a, b, out, n);                                                 \
    }                                                                                            \
    extern "C" __global__ void compare_##sfx(int op, StridedArgs s, const T *a, const T *b, u8 *out) { \
        compare_impl<T>(op, s, a, b, out);                                                       \
    }                                                                                            \
    extern "C" __global__ void where_##sfx(StridedArgs s, const u8 *c, const T *t, const T *f, T *out) { \
        where_impl<T>(s, c, t, f, out);                                                          \
    }                                                                                            \
    extern "C" __global__ void copy_strided_##sfx(StridedArgs s, const T *x, T *out) {           \
        copy_strided_impl<T>(s, x, out);                                                         \
    }                                                                                            \
    extern "C" __global__ void fill_##sfx(T *out, i64 n, double value) { fill_impl<T>(out, n, value); } \
    extern "C" __global__ void arange_##sfx(T *out, i64 n, double start, double step) {         \
        arange_impl<T>(out, n, start, step);                                                     \
    }
MG_FOR_BASIC_TYPES(EW_ENTRIES)

// Integer fills (index buffers, masks) and ranges.
extern "C" __global__ void fill_i64(i64 *out, i64 n, i64 value) {
    MG_GRID_STRIDE(i, n) { out[i] = value; }
}
extern "C" __global__ void fill_u8(u8 *out, i64 n, int value) {
    MG_GRID_STRIDE(i, n) { out[i] = (u8)value; }
}
extern "C" __global__ void arange_i64(i64 *out, i64 n, i64 start, i64 step) {
    MG_GRID_STRIDE(i, n) { out[i] = start + i * step; }
}

// cast.cu: dtype conversions `cast_<from>_to_<to>` between every pair of f64, f32, bf16, f16, u8,
// u32 and i64, contiguous `[n]` to contiguous `[n]`.
//
// CPU reference: the tensor crate's `cast` (tensor/src/cpu_backend/cast.rs): float to float
// rounds once (through f64, where every f32/bf16/f16 value is exact), integers go through f64 as
// `as f64`, and to an integer type as Rust's saturating `as` from f64.

// ---- casts: one rounding from the source value (through f32 only where that is exact) ----
__device__ __forceinline__ double to_double(float v) { return (double)v; }
__device__ __forceinline__ double to_double(double v) { return v; }
__device__ __forceinline__ double to_double(__nv_bfloat16 v) { return (double)__bfloat162float(v); }
__device__ __forceinline__ double to_double(__half v) { return (double)__half2float(v); }
__device__ __forceinline__ double to_double(u8 v) { return (double)v; }
__device__ __forceinline__ double to_double(u32 v) { return (double)v; }
__device__ __forceinline__ double to_double(i64 v) { return (double)v; }

// The value `v` (the source value, exact in f64 or rounded as `as f64`) as D: rounded once to a
// float type; to the integer types u8, u32 and i64 as Rust's saturating `as` from f64 (the
// CPU's `cast`): truncation toward zero, NaN -> 0, out-of-range values clamped to the type's
// range (so u8 keeps 0 for negatives and 255 above).
template <typename D> __device__ __forceinline__ D cast_value(double v) { return from_double<D>(v); }
template <> __device__ __forceinline__ u8 cast_value<u8>(double v) {
    if (!(v > 0.0)) return 0; // NaN and non-positive values
    if (v >= 255.0) return 255;
    return (u8)v;
}
template <> __device__ __forceinline__ u32 cast_value<u32>(double v) {
    if (!(v > 0.0)) return 0;
    if (v >= 4294967295.0) return 4294967295u;
    return (u32)v;
}
template <> __device__ __forceinline__ i64 cast_value<i64>(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775808.0) return (i64)0x7fffffffffffffffLL; // 2^63 and above
    if (v <= -9223372036854775808.0) return (i64)(-0x7fffffffffffffffLL - 1);
    return (i64)v;
}

template <typename S, typename D>
__device__ void cast_impl(const S *x, D *out, i64 n) {
    // Every f32/bf16/f16 value is exact in f64, so going through f64 rounds exactly once.
    MG_GRID_STRIDE(i, n) { out[i] = cast_value<D>(to_double(x[i])); }
}

#define CAST_ENTRY(sname, S, dname, D)                                                          \
    extern "C" __global__ void cast_##sname##_to_##dname(const S *x, D *out, i64 n) { cast_impl<S, D>(x, out, n); }
#define CAST_FROM(sname, S)                                                                     \
    CAST_ENTRY(sname, S, f64, double) CAST_ENTRY(sname, S, f32, float)                          \
    CAST_ENTRY(sname, S, bf16, __nv_bfloat16) CAST_ENTRY(sname, S, f16, __half)
#define CAST_TO_INTS(sname, S)                                                                  \
    CAST_ENTRY(sname, S, u8, u8) CAST_ENTRY(sname, S, u32, u32) CAST_ENTRY(sname, S, i64, i64)
CAST_FROM(f64, double)
CAST_FROM(f32, float)
CAST_FROM(bf16, __nv_bfloat16)
CAST_FROM(f16, __half)
CAST_FROM(u8, u8)
CAST_FROM(u32, u32)
CAST_FROM(i64, i64)
CAST_TO_INTS(f64, double)
CAST_TO_INTS(f32, float)
CAST_TO_INTS(bf16, __nv_bfloat16)
CAST_TO_INTS(f16, __half)
CAST_TO_INTS(u8, u8)
CAST_TO_INTS(u32, u32)
CAST_TO_INTS(i64, i64)

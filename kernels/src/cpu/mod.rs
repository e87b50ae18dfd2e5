//! CPU kernels. All take plain slices; "contiguous" means row-major with no gaps.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
mod fastmath;
pub mod gather;
pub mod layer_norm;
pub mod logsumexp;
pub mod matmul;
pub mod reduce;
pub mod rms_norm;
pub mod rotary;
pub mod sgd;
pub mod softmax;
pub mod strided;
pub mod swiglu;
#[cfg(test)]
mod testutil;
pub(crate) mod tile_gemm;
pub mod unary_backward;
pub(crate) mod vecops;

pub use vecops::set_simd_enabled;

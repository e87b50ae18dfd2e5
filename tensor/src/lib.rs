//! meshgrad tensors: dtypes, shapes and strided layouts, devices, releasable storage with
//! allocator accounting, counter-based random numbers, and the ops, dispatched to a backend by
//! storage variant.
//!
//! ```
//! use meshgrad_tensor::{DType, Device, Tensor};
//! let a = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (2, 3), Device::Cpu)?;
//! let b = a.t()?; // a view, no copy
//! let c = a.matmul(&b)?; // [2, 2]
//! assert_eq!(c.to_vec::<f32>()?, vec![14., 32., 32., 77.]);
//! assert_eq!(a.sum(&[1], false)?.to_vec::<f32>()?, vec![6., 15.]);
//! assert_eq!(a.to_dtype(DType::BF16)?.dtype(), DType::BF16);
//! // Tensors print their values (Display and Debug alike; see `Tensor::fmt_named`).
//! assert_eq!(
//!     format!("{a}"),
//!     "Tensor([[1.0000, 2.0000, 3.0000],\n        [4.0000, 5.0000, 6.0000]], \
//!      shape=[2, 3], dtype=f32, device=cpu)"
//! );
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```
//!
//! # Operators
//!
//! `+ - * /` and unary `-` work on tensors, owned or borrowed, and with `f64` scalars on either
//! side. Each returns `Result<Tensor>`: a broadcasting, dtype or device error is an `Err`, never
//! a panic. They are implemented on `Result<Tensor>` too (with a `Tensor` or `&Tensor` on the
//! other side), so a chain needs a single `?` at its end, and the first error met is the one it
//! returns:
//!
//! ```
//! use meshgrad_tensor::{DType, Device, Tensor};
//! let a = Tensor::from_vec(vec![1f32, 2., 3.], 3, Device::Cpu)?;
//! let b = Tensor::from_vec(vec![10f32], 1, Device::Cpu)?;
//! let y = (&a * &b + &a - &b)?; // a*b + a - b, b broadcast
//! assert_eq!(y.to_vec::<f32>()?, vec![1., 12., 23.]);
//! let z = ((1.0 - &a)? * 2.0 / &b)?;
//! assert_eq!(z.to_vec::<f32>()?, vec![0.0, -0.2, -0.4]);
//! let two = Tensor::zeros(2, DType::F32, Device::Cpu)?;
//! let e = (&a * &two + &a - &b).unwrap_err(); // [3] and [2] do not broadcast
//! assert_eq!(e.to_string(), "mul: shape mismatch: [3] vs [2]");
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```
//!
//! | form | computes |
//! |---|---|
//! | `&a + &b`, `a + &b`, `&a + b`, `a + b`, and the same with `-`, `*`, `/` | [`Tensor::add`], [`Tensor::sub`], [`Tensor::mul`], [`Tensor::div`] (broadcasting) |
//! | `r + &b`, `r + b`, `&a + r`, `a + r` (any of the four ops) with `r: Result<Tensor>` | the same, or `r`'s error |
//! | `&a + c`, `c + &a` with `c: f64` | [`Tensor::add_scalar`] |
//! | `&a - c` / `c - &a` | [`Tensor::add_scalar`] of `-c` / [`Tensor::neg`], then adding `c` (equal in IEEE arithmetic to `c - a`) |
//! | `&a * c`, `c * &a` | [`Tensor::mul_scalar`] |
//! | `&a / c` / `c / &a` | [`Tensor::div`] by / of a 0-d tensor holding `c` in `a`'s dtype (exact division for f32 and f64; for bf16 and f16, `c` is first rounded to that dtype) |
//! | `-&a`, `-a` | [`Tensor::neg`] |
//!
//! Owned operands are consumed, as usual in Rust; borrow (`&a`) to keep them. Rust's orphan
//! rules allow no operator between two `Result`s, nor between a `Result` and an `f64` (none of
//! those types belongs to this crate): put a `?` there, as in `((&a * &b)? * 2.0)?` or
//! `((&a * &b)? + (&a / &b))?`. With `std::ops::Add` (etc.) imported, `a.add(&b)` on an owned `a`
//! resolves to the operator, which consumes `a`; the operators never need that import.

pub mod alloc;
mod backend;
mod cpu_backend;
#[cfg(feature = "cuda")]
mod cuda_backend;
mod device;
mod display;
mod dtype;
mod error;
pub mod exact_sum;
mod layout;
mod ops;
pub mod pool;
pub mod profile;
mod random;
mod shape;
mod shape_spec;
pub mod storage;
mod tensor;
pub mod testing;
pub mod tree_sum;

#[cfg(feature = "cuda")]
pub use cuda_backend::{
    cuda_compute_stream, cuda_device_count, cuda_memory_stats, cuda_synchronize, CudaBuffer,
    CudaMemoryStats, CudaStorage,
};
pub use device::Device;
pub use dtype::{DType, WithDType};
pub use error::{CommError, CommErrorKind, Error, Result};
pub use layout::Layout;
pub use ops::{
    compute_dtype, AdamWStep, AttentionGrads, AttentionMask, AttentionOutput, GeluKind,
    LayerNormOutput, LinearGrads, RmsNormOutput,
};
pub use random::Random;
pub use shape::Shape;
pub use shape_spec::{IntoShapeSpec, ShapeSpec, SpecDim};
pub use tensor::{Tensor, TensorId};
pub use testing::test_devices;

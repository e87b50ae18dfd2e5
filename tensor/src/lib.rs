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

pub mod alloc;
mod backend;
mod cpu_backend;
mod device;
mod display;
mod dtype;
mod error;
mod layout;
mod ops;
pub mod pool;
pub mod profile;
mod random;
mod shape;
mod shape_spec;
pub mod storage;
mod tensor;

pub use device::Device;
pub use dtype::{DType, WithDType};
pub use error::{Error, Result};
pub use layout::Layout;
pub use ops::{AdamWStep, AttentionOutput, GeluKind, LayerNormOutput, LinearGrads};
pub use random::Random;
pub use shape::Shape;
pub use shape_spec::{IntoShapeSpec, ShapeSpec, SpecDim};
pub use tensor::{Tensor, TensorId};

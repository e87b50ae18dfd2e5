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
//! # Ok::<(), meshgrad_tensor::Error>(())
//! ```

pub mod alloc;
mod backend;
mod cpu_backend;
mod device;
mod dtype;
mod error;
mod layout;
mod ops;
pub mod pool;
pub mod profile;
mod shape;
pub mod storage;
mod tensor;

pub use device::Device;
pub use dtype::{DType, WithDType};
pub use error::{Error, Result};
pub use layout::Layout;
pub use ops::{
    AdamWStep, AttentionGrads, AttentionMask, AttentionOutput, GeluKind, LayerNormOutput,
    LinearGrads, RmsNormOutput,
};
pub use shape::Shape;
pub use tensor::{Tensor, TensorId};

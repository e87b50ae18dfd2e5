//! Device-parameterised tests: [`test_devices`] lists the devices a test should run on, and
//! [`test_device!`](crate::test_device) turns one `fn name(device: Device) -> Result<()>` into a
//! test per device kind (the CPU always; CUDA when this crate is built with the `cuda` feature).
//!
//! ```
//! use meshgrad_tensor::{DType, Device, Result, Tensor};
//!
//! fn zeros_are_zero(device: Device) -> Result<()> {
//!     let z = Tensor::zeros(3, DType::F32, device)?;
//!     assert_eq!(z.to_vec::<f32>()?, vec![0.0; 3]);
//!     Ok(())
//! }
//! meshgrad_tensor::test_device!(zeros_are_zero);
//! # fn main() { zeros_are_zero(Device::Cpu).unwrap(); }
//! ```

use crate::Device;

/// The devices present in this build and on this machine: the CPU always, then CUDA device 0
/// when this crate is built with the `cuda` feature and a GPU is visible.
pub fn test_devices() -> Vec<Device> {
    #[allow(unused_mut)]
    let mut devices = vec![Device::Cpu];
    #[cfg(feature = "cuda")]
    if crate::cuda_device_count() > 0 {
        devices.push(Device::Cuda(0));
    }
    devices
}

/// The CUDA devices among [`test_devices`].
pub fn cuda_test_devices() -> Vec<Device> {
    test_devices()
        .into_iter()
        .filter(|d| matches!(d, Device::Cuda(_)))
        .collect()
}

/// Emits its input only when this crate is built with the `cuda` feature (so the CUDA tests that
/// [`test_device!`](crate::test_device) generates exist exactly in CUDA builds).
#[cfg(feature = "cuda")]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_cuda {
    ($($t:tt)*) => { $($t)* };
}

/// Emits its input only when this crate is built with the `cuda` feature.
#[cfg(not(feature = "cuda"))]
#[doc(hidden)]
#[macro_export]
macro_rules! __if_cuda {
    ($($t:tt)*) => {};
}

/// Generates tests of `fn $name(device: Device) -> Result<()>` (any error type that is `Debug`)
/// in a module `$name` beside it: `$name::cpu` always, and with the `cuda` feature `$name::cuda`,
/// which runs the function on every CUDA device [`test_devices`] lists. Without one it prints
/// why and passes (skips), unless `MESHGRAD_REQUIRE_CUDA=1` asks for a GPU, then it fails: set it
/// on the GPU machine so a CUDA test cannot pass silently. The idea is candle's `test_device!`.
#[macro_export]
macro_rules! test_device {
    ($name:ident) => {
        mod $name {
            #[test]
            pub(super) fn cpu() -> ::std::result::Result<(), ::std::string::String> {
                super::$name($crate::Device::Cpu).map_err(|e| format!("{e:?}"))
            }
            $crate::__if_cuda! {
                #[test]
                fn cuda() -> ::std::result::Result<(), ::std::string::String> {
                    let devices = $crate::testing::cuda_test_devices();
                    if devices.is_empty() {
                        if ::std::env::var("MESHGRAD_REQUIRE_CUDA").as_deref() == Ok("1") {
                            return Err("no CUDA device to test on (MESHGRAD_REQUIRE_CUDA=1)".into());
                        }
                        eprintln!(
                            "skipped {}::cuda: no CUDA device (set MESHGRAD_REQUIRE_CUDA=1 to fail instead)",
                            stringify!($name)
                        );
                        return Ok(());
                    }
                    for d in devices {
                        super::$name(d).map_err(|e| format!("{d}: {e:?}"))?;
                    }
                    Ok(())
                }
            }
        }
    };
}

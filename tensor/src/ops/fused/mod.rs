//! Fused ops, one folder per op: everything about an op in one place.
//!
//! A fused op (one that a backend may compute in one kernel rather than as a chain of basic ops)
//! is an **argument struct** generic over its operand type, `Args<T>`: its operands as `T` and
//! its shapes and scalars as plain fields (an op that updates operands in place, as the
//! optimizer steps do, takes them as a second type parameter, `Args<T, W>`). The tensor op
//! builds it over `&Tensor`; the one generic runner, [`run`], locks the operands' storages,
//! checks they share a device and hands the same struct over that backend's operands
//! (`Args<In<'_, S>, InMut<'_, S>>`) to the op's path for that device. [`FusedOp`] lists the
//! paths:
//!
//! - `cpu`: the CPU path (resolves dtypes, calls `meshgrad_kernels::cpu`), required (it may
//!   answer `Ok(None)`, "not provided", as the linear layer's GELU epilogue does);
//! - `cuda` (with `--features cuda`): the CUDA path (launches the op's kernels of
//!   `kernels/cuda/*.cu`); its default, and its answer `Ok(None)` for what it does not cover,
//!   means "not provided";
//! - `fallback`: the op composed of basic tensor ops, which [`run`] takes when the backend's path
//!   answers `Ok(None)` (and in tests, when fused paths are declined to check the composition).
//!
//! So a backend can arrive one fused kernel at a time, and nothing outside an op's folder names
//! the op except its callers. Adding a fused op `foo` takes:
//! 1. `ops/fused/foo/mod.rs`: the argument struct `Foo<T>` (`#[derive(FusedArgs)]`: its operands
//!    are the fields of type `T` and `Option<T>`), its [`FusedOp`] impl (name, result types,
//!    `finish`, and `fused_paths!(forward)` naming the three paths; `fused_op!` writes it for an
//!    op returning one tensor, two, a tensor and an optional one, or nothing) and the public
//!    `Tensor::foo` (checks shapes and dtypes, makes operands contiguous, calls [`run`]);
//! 2. `ops/fused/foo/cpu.rs` over the CPU kernel `kernels/src/cpu/foo.rs`;
//! 3. `ops/fused/foo/cuda.rs` over the kernel `kernels/cuda/foo.cu` (optional);
//! 4. `ops/fused/foo/fallback.rs`: the composition and the test that it agrees with the fused
//!    paths;
//! 5. the autograd rule in `autograd/` and the op's tests in `tensor/tests/foo.rs`.
//!
//! Ops here: `adamw` (an AdamW step, in place), `attention` (scaled dot-product attention, on
//! q, k, v or a fused qkv), `cross_entropy` (cross-entropy), `embedding` (embedding lookup),
//! `gelu` (GELU's backward), `layer_norm` (layer norm), `linear` (the linear layer and its GELU
//! epilogue), `logsumexp` (log-sum-exp), `rms_norm` (RMSNorm), `rotary` (rotary embedding),
//! `sgd` (an SGD-with-momentum step, in place), `softmax` (softmax and log-softmax), `swiglu`
//! (SwiGLU), each forward and (where it has one) backward, and `unary_backward` (the SiLU and
//! clamp backward).

pub(crate) mod adamw;
pub(crate) mod attention;
pub(crate) mod cross_entropy;
pub(crate) mod embedding;
pub(crate) mod gelu;
pub(crate) mod layer_norm;
pub(crate) mod linear;
pub(crate) mod logsumexp;
pub(crate) mod rms_norm;
pub(crate) mod rotary;
pub(crate) mod sgd;
pub(crate) mod softmax;
pub(crate) mod swiglu;
pub(crate) mod unary_backward;

pub use attention::{AttentionGrads, AttentionMask, AttentionOutput};
pub use layer_norm::LayerNormOutput;
pub use linear::LinearGrads;
pub use rms_norm::RmsNormOutput;

use crate::backend::{self, api::In, Variant};
#[cfg(feature = "cuda")]
use crate::cuda_backend::CudaStorage;
use crate::storage::{CpuStorage, Storage};
use crate::{Device, Layout, Result, Tensor};

/// A CPU operand: a CPU storage with the layout of the view being read.
pub(crate) type CpuIn<'a> = In<'a, CpuStorage>;

/// A CPU operand written in place: a CPU storage with the layout of the view written.
pub(crate) type CpuMut<'a> = InMut<'a, CpuStorage>;

/// A CUDA operand: a CUDA storage with the layout of the view being read.
#[cfg(feature = "cuda")]
pub(crate) type CudaIn<'a> = In<'a, CudaStorage>;

/// A CUDA operand written in place: a CUDA storage with the layout of the view written.
#[cfg(feature = "cuda")]
pub(crate) type CudaMut<'a> = InMut<'a, CudaStorage>;

/// An operand written in place: a backend storage with the layout of the view written.
pub(crate) type InMut<'a, S> = (&'a mut S, &'a Layout);

/// An argument struct over `&Tensor` operands, seen over operands of other types. Derived
/// (`#[derive(FusedArgs)]` of `meshgrad-derive`) for a struct `Foo<T>` or `Foo<T, W>`: fields
/// of type `T` are operands read, `Option<T>` optional operands read, fields of type `W`
/// operands written in place, fields of type `Part<T>` (itself `FusedArgs`: attention's
/// `Mask`, the `Linear` inside `LinearGelu`) parts mapped by their own `map`; the other fields
/// are copied.
pub(crate) trait FusedArgs {
    /// The argument struct with operands read of type `T` and operands written of type `W`
    /// (`Self` is `Args<&Tensor, &Tensor>`).
    type Args<T, W>;

    /// The same arguments with each operand read `t` replaced by `read(t)` and each operand
    /// written `t` by `write(t)`, the operands visited in one fixed order (the runner relies on
    /// it: it calls `map` to list the operands and again to hand them out).
    fn map<'s, T, W>(
        &'s self,
        read: impl FnMut(&'s Tensor) -> T,
        write: impl FnMut(&'s Tensor) -> W,
    ) -> Self::Args<T, W>;
}

/// A fused op, implemented by its argument struct over `&Tensor` operands. See the module
/// documentation.
pub(crate) trait FusedOp: FusedArgs {
    /// The op's name in errors.
    const NAME: &'static str;
    /// What a backend path returns, in storages of that backend.
    type Out<S>;
    /// What the op returns.
    type Output;

    /// The op's results as tensors, from the storages a backend path returned.
    fn finish<S: Variant>(&self, out: Self::Out<S>) -> Self::Output;

    /// The CPU path; `Ok(None)`: not provided (for these operands), take the fallback.
    fn cpu(args: &mut Self::Args<CpuIn<'_>, CpuMut<'_>>) -> Result<Option<Self::Out<CpuStorage>>>;

    /// The CUDA path; `Ok(None)`: not provided (for these operands), take the fallback.
    #[cfg(feature = "cuda")]
    fn cuda(
        _args: &mut Self::Args<CudaIn<'_>, CudaMut<'_>>,
    ) -> Result<Option<Self::Out<CudaStorage>>> {
        Ok(None)
    }

    /// The op composed of basic tensor ops, on any device.
    fn fallback(&self) -> Result<Self::Output>;
}

/// `(rows, cols)` of a tensor whose last dim is its rows (normalised, or a softmax's).
fn rows_cols(t: &Tensor) -> (usize, usize) {
    let cols = *t.dims().last().unwrap_or(&1);
    let rows = t.elem_count().checked_div(cols).unwrap_or(0);
    (rows, cols)
}

/// The `cpu`, `cuda` and `fallback` methods of a [`FusedOp`] impl: `fused_paths!(forward)` calls
/// `cpu::forward`, `cuda::forward` (with `--features cuda`) and `fallback::forward` of the op's
/// folder. `cpu::forward` returns the results, or an `Option` of them where it may answer "not
/// provided".
macro_rules! fused_paths {
    ($path:ident) => {
        fn cpu(
            args: &mut Self::Args<$crate::ops::fused::CpuIn<'_>, $crate::ops::fused::CpuMut<'_>>,
        ) -> $crate::Result<Option<Self::Out<$crate::storage::CpuStorage>>> {
            cpu::$path(args).map(Into::into)
        }

        #[cfg(feature = "cuda")]
        fn cuda(
            args: &mut Self::Args<$crate::ops::fused::CudaIn<'_>, $crate::ops::fused::CudaMut<'_>>,
        ) -> $crate::Result<Option<Self::Out<$crate::cuda_backend::CudaStorage>>> {
            cuda::$path(args)
        }

        fn fallback(&self) -> $crate::Result<Self::Output> {
            fallback::$path(self)
        }
    };
}
pub(crate) use fused_paths;

/// The [`FusedOp`] impl of an op `$args<&Tensor>` named `$name` with the paths `$path` of its
/// folder (see [`fused_paths`]), by what it returns:
/// - one tensor of dims `$dims` (an expression of the arguments `$a`):
///   `fused_op!(Softmax, "softmax", forward, |a| a.x.shape())`;
/// - two tensors: `fused_op!(Op, "op", forward, |a| (S, S) => (dims0, dims1))`;
/// - a tensor and an optional one: `fused_op!(Op, "op", backward, |a| (S, Option<S>) =>
///   (dims0, dims1))`;
/// - nothing (an op on operands written in place, `$args<&Tensor, &Tensor>`):
///   `fused_op!(Op<_, _>, "op", step, in_place)`.
macro_rules! fused_op {
    ($args:ident<_, _>, $name:literal, $path:ident, in_place) => {
        impl $crate::ops::fused::FusedOp for $args<&$crate::Tensor, &$crate::Tensor> {
            const NAME: &'static str = $name;
            type Out<S> = ();
            type Output = ();

            fn finish<S: $crate::backend::Variant>(&self, (): ()) {}

            $crate::ops::fused::fused_paths!($path);
        }
    };
    ($args:ident, $name:literal, $path:ident, |$a:ident| (S, S) => ($d0:expr, $d1:expr)) => {
        impl $crate::ops::fused::FusedOp for $args<&$crate::Tensor> {
            const NAME: &'static str = $name;
            type Out<S> = (S, S);
            type Output = ($crate::Tensor, $crate::Tensor);

            fn finish<S: $crate::backend::Variant>(&self, (y0, y1): (S, S)) -> Self::Output {
                let $a = self;
                (
                    $crate::Tensor::from_storage(y0.wrap(), $d0),
                    $crate::Tensor::from_storage(y1.wrap(), $d1),
                )
            }

            $crate::ops::fused::fused_paths!($path);
        }
    };
    ($args:ident, $name:literal, $path:ident, |$a:ident| (S, Option<S>) => ($d0:expr, $d1:expr)) => {
        impl $crate::ops::fused::FusedOp for $args<&$crate::Tensor> {
            const NAME: &'static str = $name;
            type Out<S> = (S, Option<S>);
            type Output = ($crate::Tensor, Option<$crate::Tensor>);

            fn finish<S: $crate::backend::Variant>(
                &self,
                (y0, y1): (S, Option<S>),
            ) -> Self::Output {
                let $a = self;
                (
                    $crate::Tensor::from_storage(y0.wrap(), $d0),
                    y1.map(|y| $crate::Tensor::from_storage(y.wrap(), $d1)),
                )
            }

            $crate::ops::fused::fused_paths!($path);
        }
    };
    ($args:ident, $name:literal, $path:ident, |$a:ident| $dims:expr) => {
        impl $crate::ops::fused::FusedOp for $args<&$crate::Tensor> {
            const NAME: &'static str = $name;
            type Out<S> = S;
            type Output = $crate::Tensor;

            fn finish<S: $crate::backend::Variant>(&self, y: S) -> $crate::Tensor {
                let $a = self;
                $crate::Tensor::from_storage(y.wrap(), $dims)
            }

            $crate::ops::fused::fused_paths!($path);
        }
    };
}
pub(crate) use fused_op;

/// Runs a fused op: checks its operands share one device ([`crate::Error::DeviceMismatch`]
/// naming the op otherwise), runs that device's path and, where the path is not provided, the
/// composed fallback. The operands read are locked for reading, then those written for writing
/// (each in the order `map` visits them).
pub(crate) fn run<O: FusedOp>(op: &O) -> Result<O::Output> {
    let (mut reads, mut writes) = (Vec::new(), Vec::new());
    op.map(|t| reads.push(t), |t| writes.push(t));
    let read_guards = reads
        .iter()
        .map(|t| t.read_storage(O::NAME))
        .collect::<Result<Vec<_>>>()?;
    let mut write_guards = writes
        .iter()
        .map(|t| t.write_storage(O::NAME))
        .collect::<Result<Vec<_>>>()?;
    let storages: Vec<&Storage> = read_guards.iter().map(|g| &**g).collect();
    let device = {
        let written = write_guards.iter().map(|g| &**g);
        let all: Vec<&Storage> = storages.iter().copied().chain(written).collect();
        backend::device_of(O::NAME, &all)?
    };
    let mut written: Vec<&mut Storage> = write_guards.iter_mut().map(|g| &mut **g).collect();
    let done = if backend::declined() {
        None
    } else {
        let ops = Operands {
            reads: (&storages, &reads),
            writes: (&mut written, &writes),
        };
        match device {
            Device::Cpu => O::cpu(&mut ops.of(op))?.map(|o| op.finish(o)),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => O::cuda(&mut ops.of(op))?.map(|o| op.finish(o)),
            #[cfg(not(feature = "cuda"))]
            device @ Device::Cuda(_) => return Err(crate::Error::CudaNotBuilt(device)),
        }
    };
    drop(written);
    drop(storages);
    drop(write_guards);
    drop(read_guards);
    match done {
        Some(out) => Ok(out),
        None => op.fallback(),
    }
}

/// The locked storages of a fused op's operands, with the tensors they belong to (for their
/// layouts): those read, and those written.
struct Operands<'a, 'g> {
    reads: (&'a [&'g Storage], &'a [&'g Tensor]),
    writes: (&'a mut [&'g mut Storage], &'a [&'g Tensor]),
}

impl<'a> Operands<'a, '_> {
    /// The op's arguments over backend `S`'s operands: the `i`-th operand read (written) that
    /// `map` visits is the `i`-th storage read (written), whose backend the runner has
    /// checked, with the layout of its tensor.
    fn of<O: FusedOp, S: Variant>(self, op: &O) -> O::Args<In<'a, S>, InMut<'a, S>> {
        let mut reads = self.reads.0.iter().zip(self.reads.1);
        let mut writes = self.writes.0.iter_mut().zip(self.writes.1);
        op.map(
            |_| {
                let (s, t) = reads.next().expect("map visits the operands read in order");
                (S::of(s), t.layout())
            },
            |_| {
                let (s, t) = writes
                    .next()
                    .expect("map visits the operands written in order");
                (S::of_mut(s), t.layout())
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fused op whose output says which path ran.
    struct Probe<'a>(&'a Tensor);

    impl FusedArgs for Probe<'_> {
        type Args<T, W> = T;

        fn map<'s, T, W>(
            &'s self,
            mut read: impl FnMut(&'s Tensor) -> T,
            _write: impl FnMut(&'s Tensor) -> W,
        ) -> T {
            read(self.0)
        }
    }

    impl FusedOp for Probe<'_> {
        const NAME: &'static str = "probe";
        type Out<S> = ();
        type Output = &'static str;

        fn finish<S: Variant>(&self, _out: ()) -> &'static str {
            "fused"
        }
        fn cpu(_args: &mut CpuIn<'_>) -> Result<Option<()>> {
            Ok(Some(()))
        }
        fn fallback(&self) -> Result<&'static str> {
            Ok("composed")
        }
    }

    #[test]
    fn declining_reaches_the_runner() {
        // The switch makes the runner take the composition, so the comparisons of the
        // `fallback.rs` tests do run it.
        let x = Tensor::zeros((2, 3), crate::DType::F32, Device::Cpu).unwrap();
        assert_eq!(run(&Probe(&x)).unwrap(), "fused");
        let declined = backend::with_fused_declined(|| run(&Probe(&x)).unwrap());
        assert_eq!(declined, "composed");
    }
}

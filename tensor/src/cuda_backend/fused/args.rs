//! Kernel launches as plain data: [`Launch`] names the entry point, the grid, the block, the
//! dynamic shared memory and the parameter list ([`Arg`]) of one launch. The fused ops build
//! their launches with small pure functions (testable without a GPU: the tests compare each
//! parameter list with the kernel's `extern "C"` signature), then [`Launch::run`] issues them.

use meshgrad_kernels::cuda::AttnParams;

use super::super::{DeviceContext, KernelArgs, KernelLaunch};
use crate::{DType, Error, Result};

/// One kernel parameter, by value, as the kernel declares it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Arg {
    /// A device pointer (`T *`, `const T *`); 0 is `nullptr`.
    Ptr(u64),
    /// `i64` (`long long`).
    I64(i64),
    /// `int`.
    I32(i32),
    /// `float`.
    F32(f32),
    /// `double`.
    F64(f64),
    /// The `AttnParams` struct of attention.cu, by value (boxed: it is 304 bytes).
    Attn(Box<AttnParams>),
}

/// The kind of an [`Arg`] (what a test compares with the kernel's parameter types).
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A pointer.
    P,
    /// `i64`.
    I64,
    /// `int`.
    I32,
    /// `float`.
    F32,
    /// `double`.
    F64,
    /// `AttnParams`.
    Attn,
}

#[cfg(test)]
impl Arg {
    /// The parameter's kind.
    pub fn kind(&self) -> Kind {
        match self {
            Arg::Ptr(_) => Kind::P,
            Arg::I64(_) => Kind::I64,
            Arg::I32(_) => Kind::I32,
            Arg::F32(_) => Kind::F32,
            Arg::F64(_) => Kind::F64,
            Arg::Attn(_) => Kind::Attn,
        }
    }

    /// The parameter's size in bytes, as the kernel's parameter buffer holds it.
    pub fn size(&self) -> usize {
        match self {
            Arg::Ptr(_) | Arg::I64(_) | Arg::F64(_) => 8,
            Arg::I32(_) | Arg::F32(_) => 4,
            Arg::Attn(_) => std::mem::size_of::<AttnParams>(),
        }
    }
}

/// An `i64` parameter from a size or index (sizes of buffers never exceed `i64::MAX`).
pub(crate) fn i64_of(n: usize) -> Arg {
    Arg::I64(n as i64)
}

/// One launch of a fused op's kernel, with typed parameters.
pub(crate) type Launch = KernelLaunch<Vec<Arg>>;

/// Kernel arguments written short: `args![ptr x, i64 n, i32 flag, f32 eps, f64 theta, size len]`
/// is `[Arg::Ptr(x), Arg::I64(n), Arg::I32(flag), Arg::F32(eps), Arg::F64(theta), i64_of(len)]`.
macro_rules! args {
    (@size $v:expr) => {
        $crate::cuda_backend::fused::args::i64_of($v)
    };
    (@ptr $v:expr) => {
        $crate::cuda_backend::fused::args::Arg::Ptr($v)
    };
    (@i64 $v:expr) => {
        $crate::cuda_backend::fused::args::Arg::I64($v)
    };
    (@i32 $v:expr) => {
        $crate::cuda_backend::fused::args::Arg::I32($v)
    };
    (@f32 $v:expr) => {
        $crate::cuda_backend::fused::args::Arg::F32($v)
    };
    (@f64 $v:expr) => {
        $crate::cuda_backend::fused::args::Arg::F64($v)
    };
    ($($kind:ident $v:expr),* $(,)?) => {
        [$($crate::cuda_backend::fused::args::args!(@$kind $v)),*]
    };
}
pub(crate) use args;

impl Launch {
    /// The parameters' kinds, in order.
    #[cfg(test)]
    pub fn kinds(&self) -> Vec<Kind> {
        self.args.iter().map(Arg::kind).collect()
    }

    /// The parameters' sizes in bytes, in order (for checking a launch against the kernel's
    /// parameter list).
    #[cfg(test)]
    pub fn sizes(&self) -> Vec<usize> {
        self.args.iter().map(Arg::size).collect()
    }

    /// The parameters as the raw launch takes them.
    pub fn kernel_args(&self) -> KernelArgs {
        self.args.iter().fold(KernelArgs::new(), |a, x| match x {
            Arg::Ptr(p) => a.arg(*p),
            Arg::I64(v) => a.arg(*v),
            Arg::I32(v) => a.arg(*v),
            Arg::F32(v) => a.arg(*v),
            Arg::F64(v) => a.arg(*v),
            Arg::Attn(p) => a.arg(**p),
        })
    }

    /// Issues the launch on `ctx`'s compute stream. `what` describes the call (op, shapes,
    /// dtypes) for the error message. The caller promises what [`DeviceContext::launch`] needs:
    /// every pointer a live buffer of this device, large enough for what the kernel touches.
    ///
    /// A kernel fault (an illegal address, say) is reported by whatever waits on the stream
    /// next. With `MESHGRAD_CUDA_SYNC_LAUNCHES=1` in the environment every fused launch waits
    /// for its kernel, so a fault is reported here, naming the op (slow: for debugging).
    pub fn run(&self, ctx: &DeviceContext, what: impl FnOnce() -> String) -> Result<()> {
        let describe = |what: String| {
            format!(
                "{what} ({} grid {:?}, block {:?})",
                self.entry, self.grid, self.block
            )
        };
        let launched = ctx.launch(
            self.file,
            &self.entry,
            self.grid,
            self.block,
            self.shared,
            self.kernel_args(),
        );
        match launched.and_then(|()| {
            if sync_launches() {
                ctx.synchronize()
            } else {
                Ok(())
            }
        }) {
            Ok(()) => Ok(()),
            Err(e) => Err(annotate(e, &describe(what()))),
        }
    }
}

/// Whether `MESHGRAD_CUDA_SYNC_LAUNCHES=1` asks every fused launch to wait for its kernel (read
/// once).
fn sync_launches() -> bool {
    static SYNC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SYNC.get_or_init(|| std::env::var("MESHGRAD_CUDA_SYNC_LAUNCHES").is_ok_and(|v| v == "1"))
}

/// `e` with `what` in front of its message (CUDA and message errors; other variants, which
/// carry their own op, are kept as they are).
pub(crate) fn annotate(e: Error, what: &str) -> Error {
    match e {
        Error::Cuda { device, message } => Error::Cuda {
            device,
            message: format!("{what}: {message}"),
        },
        Error::Msg(m) => Error::Msg(format!("{what}: {m}")),
        other => other,
    }
}

/// The entry-name suffix of a float dtype the kernels are instantiated for (`None` for f64 and
/// the integer dtypes: not provided on CUDA).
pub(crate) fn sfx(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("f32"),
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        _ => None,
    }
}

/// Threads per block of the row kernels (one block per row; a multiple of 32, at most 1024)
/// and of the 1-D elementwise kernels.
pub(crate) const THREADS: u32 = 256;

/// The most blocks a grid-stride launch uses along x (more rows or elements are looped over).
pub(crate) const MAX_BLOCKS: usize = 1 << 20;

/// The grid of a kernel with one block per row, grid-stride over `rows` (at least one block).
pub(crate) fn row_grid(rows: usize) -> (u32, u32, u32) {
    (rows.clamp(1, MAX_BLOCKS) as u32, 1, 1)
}

/// The grid of a grid-stride elementwise kernel over `n` elements in blocks of [`THREADS`].
pub(crate) fn flat_grid(n: usize) -> (u32, u32, u32) {
    (
        n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32,
        1,
        1,
    )
}

/// A 1-D block of [`THREADS`] threads.
pub(crate) const BLOCK_1D: (u32, u32, u32) = (THREADS, 1, 1);

/// Asserts that `l` launches `entry` with parameters of `kinds` (as the kernel declares them),
/// and [`assert_known`] (a test helper).
#[cfg(test)]
pub(crate) fn assert_launch(l: &Launch, entry: &str, kinds: &[Kind]) {
    assert_eq!(l.entry, entry);
    assert_eq!(l.kinds(), kinds, "the parameters of {entry}");
    assert_known(l);
}

/// Asserts that `l` names an entry point its source file defines, with a block and grid the
/// kernels accept (a test helper).
#[cfg(test)]
pub(crate) fn assert_known(l: &Launch) {
    let src = meshgrad_kernels::cuda::source(l.file)
        .unwrap_or_else(|| panic!("no kernel source {}", l.file));
    assert!(
        src.entries.contains(&l.entry.as_str()),
        "{} does not define {}",
        l.file,
        l.entry
    );
    assert!(
        l.block.0.is_multiple_of(32) && l.block.0 <= 1024,
        "block {:?}",
        l.block
    );
    assert!(l.grid.0 >= 1 && l.grid.1 >= 1 && l.grid.1 <= 65535 && l.grid.2 == 1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_and_cap() {
        assert_eq!(row_grid(0), (1, 1, 1));
        assert_eq!(row_grid(7), (7, 1, 1));
        assert_eq!(row_grid(usize::MAX).0 as usize, MAX_BLOCKS);
        assert_eq!(flat_grid(0), (1, 1, 1));
        assert_eq!(flat_grid(256), (1, 1, 1));
        assert_eq!(flat_grid(257), (2, 1, 1));
        assert_eq!(flat_grid(1 << 40).0 as usize, MAX_BLOCKS);
    }

    #[test]
    fn sizes_follow_the_c_types() {
        let l = Launch {
            file: "softmax.cu",
            entry: "x".into(),
            grid: (1, 1, 1),
            block: BLOCK_1D,
            shared: 0,
            args: vec![
                Arg::Ptr(1),
                Arg::I64(2),
                Arg::I32(3),
                Arg::F32(4.0),
                Arg::F64(5.0),
                Arg::Attn(Box::default()),
            ],
        };
        assert_eq!(l.sizes(), vec![8, 8, 4, 4, 8, 8 * 4 * 8 + 8 * 3 + 16]);
        assert_eq!(
            l.kinds(),
            vec![
                Kind::P,
                Kind::I64,
                Kind::I32,
                Kind::F32,
                Kind::F64,
                Kind::Attn
            ]
        );
        assert_eq!(sfx(DType::BF16), Some("bf16"));
        assert_eq!(sfx(DType::F64), None);
        let e = annotate(Error::Msg("boom".into()), "softmax [2, 3] f32");
        assert_eq!(
            e.to_string(),
            Error::Msg("softmax [2, 3] f32: boom".into()).to_string()
        );
    }
}

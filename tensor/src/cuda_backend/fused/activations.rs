//! The launch of activations.cu's elementwise kernels ([`act_launch`]), which the CUDA paths of
//! `ops/fused/gelu/`, `ops/fused/swiglu/` and `ops/fused/unary_backward/` build on.

use super::args::{flat_grid, Arg, Launch, BLOCK_1D};

/// A grid-stride launch of `entry` of activations.cu over `n` elements.
pub(crate) fn act_launch(entry: String, n: usize, args: Vec<Arg>) -> Launch {
    Launch {
        file: "activations.cu",
        entry,
        grid: flat_grid(n),
        block: BLOCK_1D,
        shared: 0,
        args,
    }
}

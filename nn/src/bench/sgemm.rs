//! The sgemm ceiling: a plain sgemm's rate on the training step's own linear-layer shapes.

use std::time::Instant;

use meshgrad_kernels::cpu::matmul::matmul;
use meshgrad_kernels::ops::MatrixLayout;

use crate::GptConfig;

/// The gemm shapes `(m, n, k, b_transposed, count)` of one training step's linear layers
/// (forward `x Wᵀ`, input gradient `dy W`, weight gradient `dyᵀ x`) and the tied head.
fn step_gemms(cfg: &GptConfig, batch: usize) -> Vec<(usize, usize, usize, bool, usize)> {
    let rows = batch * cfg.block_size;
    let c = cfg.n_embd;
    let mut linears = vec![(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]
        .into_iter()
        .map(|(i, o)| (i, o, cfg.n_layer))
        .collect::<Vec<_>>();
    linears.push((c, cfg.vocab_size, 1));
    let mut out = Vec::new();
    for (inf, outf, count) in linears {
        out.push((rows, outf, inf, true, count)); // forward: [rows, in] x [in, out] (W read transposed)
        out.push((rows, inf, outf, false, count)); // dx: [rows, out] x [out, in]
        out.push((outf, inf, rows, false, count)); // dW: [out, rows] x [rows, in] (dyᵀ strided)
    }
    out
}

/// A dense row-major layout with the given strides.
fn layout(row_stride: usize, col_stride: usize) -> MatrixLayout {
    MatrixLayout {
        offset: 0,
        batch_stride: 0,
        row_stride,
        col_stride,
    }
}

/// The FLOP-weighted sgemm rate (GFLOP/s) over the step's linear-layer shapes: each shape timed
/// alone (best of 5 after a warm-up) through the same kernel the ops use.
pub fn sgemm_ceiling(cfg: &GptConfig, batch: usize) -> f64 {
    let (mut flops, mut secs) = (0.0, 0.0);
    for (m, n, k, bt, count) in step_gemms(cfg, batch) {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i % 97) as f32 - 48.0) * 1e-2)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i % 89) as f32 - 44.0) * 1e-2)
            .collect();
        let mut c = vec![0f32; m * n];
        let al = layout(k, 1);
        let bl = if bt { layout(1, k) } else { layout(n, 1) };
        let cl = layout(n, 1);
        let mut run = || matmul(1, m, n, k, &a, al, &b, bl, &mut c, cl, false);
        run();
        let best = (0..5)
            .map(|_| {
                let t = Instant::now();
                run();
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        let f = 2.0 * (m * n * k) as f64 * count as f64;
        flops += f;
        secs += best * count as f64;
    }
    flops / secs / 1e9
}

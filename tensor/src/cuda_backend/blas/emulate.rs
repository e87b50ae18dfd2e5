//! A host emulator of cuBLASLt's column-major strided-batched GEMM, reading exactly the
//! [`Gemm`] the mapping produces (transposes, sizes, leading dimensions, batch strides, the
//! bias epilogue), and tests running the backend's mapping through it against a naive
//! row-major product of the logical operands, over many random layouts: row- and column-major,
//! padded, offset, broadcast and interleaved batches, unit dimensions with junk strides, and
//! layouts that must be copied first (copied here on the host the way `ops.rs` copies them on
//! the device).

use meshgrad_kernels::ops::MatrixLayout;

use super::layout::{extent, gemm, lhs_operand, packed_copy, rhs_operand, Gemm, Operand};

/// The flat index (relative to the operand's first element) of element `(p, q)` of `op(X)`
/// in matrix `b` of the batch, from cuBLAS's definitions: the stored column-major `X` has
/// `X(r, c)` at `r + c·ld`, and `op(X)(p, q)` is `X(p, q)`, or `X(q, p)` when transposed.
fn index(o: &Operand, b: usize, p: usize, q: usize) -> i64 {
    let (r, c) = if o.trans { (q, p) } else { (p, q) };
    assert!(
        (r as u64) < o.rows && (c as u64) < o.cols,
        "({r}, {c}) outside {o:?}"
    );
    b as i64 * o.batch_stride + r as i64 + c as i64 * o.ld
}

/// Rows and columns of `op(X)`.
fn op_dims(o: &Operand) -> (u64, u64) {
    if o.trans {
        (o.cols, o.rows)
    } else {
        (o.rows, o.cols)
    }
}

/// cuBLASLt's rules for one operand: `op(X)` must be `rows×cols` and the leading dimension at
/// least the stored rows (and at least 1).
fn check_operand(name: &str, o: &Operand, rows: u64, cols: u64) {
    assert_eq!(op_dims(o), (rows, cols), "{name}: op dims of {o:?}");
    assert!(o.ld >= o.rows.max(1) as i64, "{name}: ld < rows in {o:?}");
}

/// `D[b] = op(A[b]) · op(B[b]) (+ bias[i] on row i of D)` as cuBLASLt computes it, with
/// alpha 1 and beta 0, each operand read from `buffer[offset + index]`. `d` must be large
/// enough for the D layout.
fn lt_gemm(g: &Gemm, a: (&[f64], usize), b: (&[f64], usize), bias: Option<&[f64]>, d: &mut [f64]) {
    assert!(g.batch >= 1);
    check_operand("A", &g.a, g.m, g.k);
    check_operand("B", &g.b, g.k, g.n);
    check_operand("D", &g.d, g.m, g.n);
    assert!(!g.d.trans, "D is never transposed");
    if let Some(bias) = bias {
        assert_eq!(
            bias.len() as u64,
            g.m,
            "the bias has one entry per row of D"
        );
    }
    let at = |(buf, off): (&[f64], usize), idx: i64| -> f64 {
        let i = off as i64 + idx;
        assert!(
            i >= 0 && (i as usize) < buf.len(),
            "index {i} out of a buffer of {}",
            buf.len()
        );
        buf[i as usize]
    };
    for bt in 0..g.batch as usize {
        for i in 0..g.m as usize {
            for j in 0..g.n as usize {
                let mut s = 0.0;
                for l in 0..g.k as usize {
                    s += at(a, index(&g.a, bt, i, l)) * at(b, index(&g.b, bt, l, j));
                }
                if let Some(bias) = bias {
                    s += bias[i];
                }
                let di = index(&g.d, bt, i, j);
                d[usize::try_from(di).expect("D index >= 0")] = s;
            }
        }
    }
}

/// Element `(i, j)` of matrix `b` of a layout.
fn at(buf: &[f64], l: &MatrixLayout, b: usize, i: usize, j: usize) -> f64 {
    buf[l.offset + b * l.batch_stride + i * l.row_stride + j * l.col_stride]
}

/// The naive row-major `[batch, m, n]` product of the logical operands (plus a bias per
/// column).
fn naive(
    a: (&[f64], &MatrixLayout),
    b: (&[f64], &MatrixLayout),
    bias: Option<&[f64]>,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; batch * m * n];
    for bt in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut s: f64 = (0..k)
                    .map(|l| at(a.0, a.1, bt, i, l) * at(b.0, b.1, bt, l, j))
                    .sum();
                if let Some(bias) = bias {
                    s += bias[j];
                }
                out[(bt * m + i) * n + j] = s;
            }
        }
    }
    out
}

/// The host version of `ops.rs`'s `pack`: the contiguous copy of a view and its layout.
fn host_pack(
    buf: &[f64],
    l: &MatrixLayout,
    batch: usize,
    rows: usize,
    cols: usize,
) -> (Vec<f64>, MatrixLayout) {
    let c = packed_copy(l, batch, rows, cols);
    let mut out = Vec::new();
    let (nb, r, cc) = match c.dims[..] {
        [r, cc] => (1, r, cc),
        [nb, r, cc] => (nb, r, cc),
        _ => unreachable!("2 or 3 dims"),
    };
    let (sb, sr, sc) = match c.strides[..] {
        [sr, sc] => (0, sr, sc),
        [sb, sr, sc] => (sb, sr, sc),
        _ => unreachable!("2 or 3 strides"),
    };
    for b in 0..nb {
        for i in 0..r {
            for j in 0..cc {
                out.push(buf[c.offset + b * sb + i * sr + j * sc]);
            }
        }
    }
    (out, c.packed)
}

/// What one emulated product went through.
#[derive(Default, Debug)]
struct Seen {
    copies: usize,
    in_place: usize,
    trans: [[usize; 2]; 2],
    broadcast_in_place: usize,
}

/// The backend's path on the host: copy what cannot be read in place, map, run the emulator;
/// returns the output buffer (`[batch, m, n]` row-major).
#[allow(clippy::too_many_arguments)]
fn backend_product(
    a: (&[f64], MatrixLayout),
    b: (&[f64], MatrixLayout),
    bias: Option<&[f64]>,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    seen: &mut Seen,
) -> Vec<f64> {
    let (a_buf, al) = match lhs_operand(&a.1, batch, m, k) {
        Some(_) => (a.0.to_vec(), a.1),
        None => {
            seen.copies += 1;
            host_pack(a.0, &a.1, batch, m, k)
        }
    };
    let (b_buf, bl) = match rhs_operand(&b.1, batch, k, n) {
        Some(_) => (b.0.to_vec(), b.1),
        None => {
            seen.copies += 1;
            host_pack(b.0, &b.1, batch, k, n)
        }
    };
    let lhs = lhs_operand(&al, batch, m, k).expect("packed lhs maps");
    let rhs = rhs_operand(&bl, batch, k, n).expect("packed rhs maps");
    let g = gemm(lhs, rhs, batch, m, n, k).expect("sizes fit");
    seen.in_place += 1;
    seen.trans[g.a.trans as usize][g.b.trans as usize] += 1;
    if batch > 1 && (g.a.batch_stride == 0 || g.b.batch_stride == 0) {
        seen.broadcast_in_place += 1;
    }
    let mut d = vec![f64::NAN; batch * m * n];
    // cuBLASLt's A is the logical right operand, its B the logical left one.
    lt_gemm(&g, (&b_buf, bl.offset), (&a_buf, al.offset), bias, &mut d);
    d
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Small integers, so every sum is exact in f64.
    fn values(&mut self, len: usize) -> Vec<f64> {
        (0..len).map(|_| self.below(9) as f64 - 4.0).collect()
    }
}

/// A random layout of `batch` matrices of `rows×cols`, and a buffer holding it.
fn random_operand(
    rng: &mut Rng,
    batch: usize,
    rows: usize,
    cols: usize,
) -> (Vec<f64>, MatrixLayout) {
    let pad = rng.below(3);
    let (row_stride, col_stride) = match rng.below(8) {
        // Row-major, rows possibly padded.
        0 | 1 => (cols + pad, 1),
        // Column-major (a transposed view), columns possibly padded.
        2 | 3 => (1, rows + pad),
        // Two non-unit strides: copied.
        4 => (2 * cols + pad, 2),
        // Overlapping rows (a sliding window): copied unless a dimension is 1.
        5 => (1, 1),
        // A stride-0 (broadcast) row or column.
        6 => {
            if rng.below(2) == 0 {
                (0, 1)
            } else {
                (1, 0)
            }
        }
        // Junk strides on unit dimensions, sensible ones elsewhere.
        _ => {
            let junk = [0, 1, 3, 1000][rng.below(4)];
            (
                if rows == 1 { junk } else { cols + pad },
                if cols == 1 { junk } else { 1 },
            )
        }
    };
    let span = (rows - 1) * row_stride + (cols - 1) * col_stride + 1;
    let batch_stride = match rng.below(5) {
        0 => 0,                   // broadcast over the batch
        1 => span,                // packed
        2 => span + rng.below(4), // gaps between matrices
        3 => 1 + rng.below(span), // interleaved (e.g. heads of a [t, h·d] buffer)
        _ => span * 2,
    };
    let l = MatrixLayout {
        offset: rng.below(5),
        batch_stride,
        row_stride,
        col_stride,
    };
    let len = extent(&l, batch, rows, cols).expect("small") + rng.below(3);
    (rng.values(len), l)
}

#[test]
fn the_mapping_computes_the_row_major_product_for_random_layouts() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut seen = Seen::default();
    for case in 0..4000 {
        let batch = 1 + rng.below(4);
        let (m, n, k) = (1 + rng.below(6), 1 + rng.below(6), 1 + rng.below(6));
        let (a, al) = random_operand(&mut rng, batch, m, k);
        let (b, bl) = random_operand(&mut rng, batch, k, n);
        let want = naive((&a, &al), (&b, &bl), None, batch, m, n, k);
        let got = backend_product((&a, al), (&b, bl), None, batch, m, n, k, &mut seen);
        assert_eq!(
            got, want,
            "case {case}: batch {batch}, [{m}, {k}] x [{k}, {n}], lhs {al:?}, rhs {bl:?}"
        );
    }
    // Every path was taken.
    assert!(seen.copies > 500, "{seen:?}");
    assert!(seen.broadcast_in_place > 200, "{seen:?}");
    for ta in 0..2 {
        for tb in 0..2 {
            assert!(
                seen.trans[ta][tb] > 100,
                "transposes {ta}{tb} rarely seen: {seen:?}"
            );
        }
    }
}

#[test]
fn larger_products_with_padded_and_offset_layouts() {
    let mut rng = Rng(12345);
    let mut seen = Seen::default();
    for _ in 0..60 {
        let batch = 1 + rng.below(3);
        let (m, n, k) = (1 + rng.below(40), 1 + rng.below(40), 1 + rng.below(40));
        let (a, al) = random_operand(&mut rng, batch, m, k);
        let (b, bl) = random_operand(&mut rng, batch, k, n);
        let want = naive((&a, &al), (&b, &bl), None, batch, m, n, k);
        let got = backend_product((&a, al), (&b, bl), None, batch, m, n, k, &mut seen);
        assert_eq!(
            got, want,
            "batch {batch}, [{m}, {k}] x [{k}, {n}], {al:?}, {bl:?}"
        );
    }
}

#[test]
fn the_bias_epilogue_adds_the_bias_to_every_output_row() {
    let mut rng = Rng(777);
    let mut seen = Seen::default();
    for case in 0..1500 {
        let (m, n, k) = (1 + rng.below(7), 1 + rng.below(7), 1 + rng.below(7));
        let (x, xl) = random_operand(&mut rng, 1, m, k);
        // As `Tensor::linear` passes it: wᵀ read through the strides of w [n, k].
        let (w, wl) = if rng.below(2) == 0 {
            let w = rng.values(n * k + 2);
            (
                w,
                MatrixLayout {
                    offset: rng.below(3),
                    batch_stride: 0,
                    row_stride: 1,
                    col_stride: k,
                },
            )
        } else {
            random_operand(&mut rng, 1, k, n)
        };
        let bias = rng.values(n);
        let want = naive((&x, &xl), (&w, &wl), Some(&bias), 1, m, n, k);
        let got = backend_product((&x, xl), (&w, wl), Some(&bias), 1, m, n, k, &mut seen);
        assert_eq!(
            got, want,
            "case {case}: [{m}, {k}] x [{k}, {n}], {xl:?}, {wl:?}"
        );
    }
}

#[test]
fn the_shapes_of_a_transformer_step_map_in_place() {
    // (batch, m, n, k, lhs layout, rhs layout) as the tensor layer passes them.
    let (b, t, h, d) = (2usize, 5usize, 3usize, 4usize);
    let c = h * d;
    let row = |r: usize, c: usize| MatrixLayout {
        offset: 0,
        batch_stride: r * c,
        row_stride: c,
        col_stride: 1,
    };
    let cases = [
        // Linear forward: x [B·T, C] · Wᵀ with W [3C, C].
        (
            1,
            b * t,
            3 * c,
            c,
            row(b * t, c),
            MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: 1,
                col_stride: c,
            },
        ),
        // dx = dy · W: dy [B·T, 3C], W [3C, C].
        (1, b * t, c, 3 * c, row(b * t, 3 * c), row(3 * c, c)),
        // dW = dyᵀ · x: dyᵀ is a transposed view of dy [B·T, 3C].
        (
            1,
            3 * c,
            c,
            b * t,
            MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: 1,
                col_stride: 3 * c,
            },
            row(b * t, c),
        ),
        // Scores q · kᵀ per head, q and k read out of a [B, T, H, D] buffer: batch over B·H
        // is not one stride, so take one batch entry's heads: batch H, stride D.
        (
            h,
            t,
            t,
            d,
            MatrixLayout {
                offset: 0,
                batch_stride: d,
                row_stride: c,
                col_stride: 1,
            },
            MatrixLayout {
                offset: c * t,
                batch_stride: d,
                row_stride: 1,
                col_stride: c,
            },
        ),
    ];
    let mut rng = Rng(99);
    for (batch, m, n, k, al, bl) in cases {
        assert!(
            lhs_operand(&al, batch, m, k).is_some(),
            "lhs {al:?} in place"
        );
        assert!(
            rhs_operand(&bl, batch, k, n).is_some(),
            "rhs {bl:?} in place"
        );
        let a = rng.values(extent(&al, batch, m, k).unwrap());
        let bb = rng.values(extent(&bl, batch, k, n).unwrap());
        let mut seen = Seen::default();
        let got = backend_product((&a, al), (&bb, bl), None, batch, m, n, k, &mut seen);
        assert_eq!(seen.copies, 0);
        assert_eq!(got, naive((&a, &al), (&bb, &bl), None, batch, m, n, k));
    }
}

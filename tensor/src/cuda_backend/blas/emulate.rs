//! A host emulator of cuBLASLt's column-major strided-batched GEMM, reading exactly the
//! [`Gemm`] the mapping produces (transposes, sizes, leading dimensions, batch strides) and the
//! descriptor's epilogue attributes (the `cublasLtEpilogue_t` value, the bias vector, the aux
//! buffer and its leading dimension, interpreted as cuBLASLt documents them), and tests running the backend's mapping through it against a naive
//! row-major product of the logical operands, over many random layouts: row- and column-major,
//! padded, offset, broadcast and interleaved batches, unit dimensions with junk strides, and
//! layouts that must be copied first (copied here on the host the way `ops.rs` copies them on
//! the device).

use cudarc::cublaslt::sys::cublasLtEpilogue_t;
use meshgrad_kernels::ops::MatrixLayout;

use crate::backend::Product;

use super::layout::{
    epilogue_for, extent, gemm, lhs_operand, packed_copy, rhs_operand, Gemm, Operand,
};

/// GELU, tanh approximation (cuBLASLt's GELU epilogue), in f64.
fn gelu_tanh(x: f64) -> f64 {
    const C: f64 = 0.797_884_560_802_865_4; // sqrt(2 / pi)
    0.5 * x * (1.0 + (C * (x + 0.044_715 * x * x * x)).tanh())
}

/// The epilogue attributes of one emulated call: `EPILOGUE`, the vector at `BIAS_POINTER`,
/// and the buffer at `EPILOGUE_AUX_POINTER` with `EPILOGUE_AUX_LD`.
struct EpilogueArgs<'a> {
    epilogue: cublasLtEpilogue_t,
    bias: Option<&'a [f64]>,
    aux: Option<(&'a mut [f64], i64)>,
}

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

/// `D[b] = op(A[b]) · op(B[b])` with the epilogue as cuBLASLt computes it, with alpha 1 and
/// beta 0, each operand read from `buffer[offset + index]`: `BIAS` adds `bias[i]` on row `i`
/// of D; `GELU_AUX` writes the product to the aux matrix (`aux(i, j)` at `i + j·ld`) and its
/// GELU to D; `GELU_AUX_BIAS` adds the bias first. The attributes an epilogue needs must be
/// given, and no others (cuBLASLt ignores them, but the mapping should not set them). `d` must
/// be large enough for the D layout.
fn lt_gemm(g: &Gemm, a: (&[f64], usize), b: (&[f64], usize), ep: EpilogueArgs<'_>, d: &mut [f64]) {
    use cublasLtEpilogue_t::*;
    assert!(g.batch >= 1);
    check_operand("A", &g.a, g.m, g.k);
    check_operand("B", &g.b, g.k, g.n);
    check_operand("D", &g.d, g.m, g.n);
    assert!(!g.d.trans, "D is never transposed");
    let (wants_bias, gelu) = match ep.epilogue {
        CUBLASLT_EPILOGUE_DEFAULT => (false, false),
        CUBLASLT_EPILOGUE_BIAS => (true, false),
        CUBLASLT_EPILOGUE_GELU_AUX => (false, true),
        CUBLASLT_EPILOGUE_GELU_AUX_BIAS => (true, true),
        other => panic!("the mapping never sets epilogue {other:?}"),
    };
    assert_eq!(ep.bias.is_some(), wants_bias, "{:?}: bias", ep.epilogue);
    assert_eq!(ep.aux.is_some(), gelu, "{:?}: aux", ep.epilogue);
    let bias = ep.bias;
    let mut aux = ep.aux;
    if let Some((buf, ld)) = &aux {
        // cuBLASLt's rules for the GELU aux matrix (m×n like D, element type D's).
        assert!(*ld % 8 == 0, "EPILOGUE_AUX_LD {ld} is not a multiple of 8");
        assert!(*ld >= g.m as i64, "EPILOGUE_AUX_LD {ld} < {} rows", g.m);
        assert_eq!(g.batch, 1, "no EPILOGUE_AUX_BATCH_STRIDE is set");
        assert!(
            buf.len() as i64 >= (g.n as i64 - 1) * ld + g.m as i64,
            "the aux buffer is too small"
        );
    }
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
                if let Some((buf, ld)) = aux.as_mut() {
                    buf[i + j * usize::try_from(*ld).expect("ld >= 0")] = s;
                    s = gelu_tanh(s);
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
fn naive(a: &[f64], b: &[f64], p: &Product, bias: Option<&[f64]>) -> Vec<f64> {
    let (batch, m, n, k) = (p.batch, p.m, p.n, p.k);
    let mut out = vec![0.0; batch * m * n];
    for bt in 0..batch {
        for i in 0..m {
            for j in 0..n {
                let mut s: f64 = (0..k)
                    .map(|l| at(a, &p.al, bt, i, l) * at(b, &p.bl, bt, l, j))
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
fn backend_product(
    a: &[f64],
    b: &[f64],
    p: &Product,
    bias: Option<&[f64]>,
    seen: &mut Seen,
) -> Vec<f64> {
    backend_product_gelu(a, b, p, bias, false, seen)
        .expect("no GELU: every product maps")
        .0
}

/// [`backend_product`] with the GELU epilogue when `gelu` (as `ops.rs` maps `linear_gelu`):
/// `(D, aux)`, the aux buffer (`[m, n]` row-major) when GELU was applied; `None` when the
/// mapping refuses the GELU epilogue (the backend then composes the op).
fn backend_product_gelu(
    a: &[f64],
    b: &[f64],
    p: &Product,
    bias: Option<&[f64]>,
    gelu: bool,
    seen: &mut Seen,
) -> Option<(Vec<f64>, Option<Vec<f64>>)> {
    let (batch, m, n, k) = (p.batch, p.m, p.n, p.k);
    let (a_buf, al) = match lhs_operand(&p.al, batch, m, k) {
        Some(_) => (a.to_vec(), p.al),
        None => {
            seen.copies += 1;
            host_pack(a, &p.al, batch, m, k)
        }
    };
    let (b_buf, bl) = match rhs_operand(&p.bl, batch, k, n) {
        Some(_) => (b.to_vec(), p.bl),
        None => {
            seen.copies += 1;
            host_pack(b, &p.bl, batch, k, n)
        }
    };
    let lhs = lhs_operand(&al, batch, m, k).expect("packed lhs maps");
    let rhs = rhs_operand(&bl, batch, k, n).expect("packed rhs maps");
    let g = gemm(lhs, rhs, batch, m, n, k).expect("sizes fit");
    let epilogue = epilogue_for(&g.d, batch, bias.is_some(), gelu)?;
    seen.in_place += 1;
    seen.trans[g.a.trans as usize][g.b.trans as usize] += 1;
    if batch > 1 && (g.a.batch_stride == 0 || g.b.batch_stride == 0) {
        seen.broadcast_in_place += 1;
    }
    let mut d = vec![f64::NAN; batch * m * n];
    // The aux buffer is allocated like the output (`ops.rs`: `CudaStorage::uninit` of `m·n`).
    let mut aux = epilogue.aux_ld().map(|_| vec![f64::NAN; batch * m * n]);
    let ep = EpilogueArgs {
        epilogue: epilogue.lt(),
        bias: bias.filter(|_| epilogue.has_bias()),
        aux: aux.as_deref_mut().zip(epilogue.aux_ld()),
    };
    // cuBLASLt's A is the logical right operand, its B the logical left one.
    lt_gemm(&g, (&b_buf, bl.offset), (&a_buf, al.offset), ep, &mut d);
    Some((d, aux))
}

/// The product of `batch` matrices `[m, k]` read through `al` and `[k, n]` read through `bl`.
fn product(
    al: MatrixLayout,
    bl: MatrixLayout,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Product {
    Product {
        al,
        bl,
        batch,
        m,
        n,
        k,
    }
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

/// Runs `cases` random products (batch up to `max_batch`, sizes up to `max_dim`) through the
/// backend's mapping against the naive product; returns the paths taken.
fn random_products(seed: u64, cases: usize, max_batch: usize, max_dim: usize) -> Seen {
    let mut rng = Rng(seed);
    let mut seen = Seen::default();
    for case in 0..cases {
        let batch = 1 + rng.below(max_batch);
        let dims = [0; 3].map(|_| 1 + rng.below(max_dim));
        let (m, n, k) = (dims[0], dims[1], dims[2]);
        let (a, al) = random_operand(&mut rng, batch, m, k);
        let (b, bl) = random_operand(&mut rng, batch, k, n);
        let p = product(al, bl, batch, m, n, k);
        let want = naive(&a, &b, &p, None);
        let got = backend_product(&a, &b, &p, None, &mut seen);
        assert_eq!(got, want, "case {case}: {p:?}");
    }
    seen
}

#[test]
fn the_mapping_computes_the_row_major_product_for_random_layouts() {
    let seen = random_products(0x9E37_79B9_7F4A_7C15, 4000, 4, 6);
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
    random_products(12345, 60, 3, 40);
}

#[test]
fn the_bias_epilogue_adds_the_bias_to_every_output_row() {
    let mut rng = Rng(777);
    let mut seen = Seen::default();
    for case in 0..1500 {
        let (m, n, k) = (1 + rng.below(7), 1 + rng.below(7), 1 + rng.below(7));
        let ((x, xl), (w, wl)) = random_linear(&mut rng, m, n, k);
        let bias = rng.values(n);
        let p = product(xl, wl, 1, m, n, k);
        let want = naive(&x, &w, &p, Some(&bias));
        let got = backend_product(&x, &w, &p, Some(&bias), &mut seen);
        assert_eq!(
            got, want,
            "case {case}: [{m}, {k}] x [{k}, {n}], {xl:?}, {wl:?}"
        );
    }
}

/// A random linear layer's operands as `Tensor::linear` passes them: `x [m, k]` in a random
/// layout, and `Wᵀ` read through the strides of `w [n, k]` or a random `[k, n]` layout.
fn random_linear(
    rng: &mut Rng,
    m: usize,
    n: usize,
    k: usize,
) -> ((Vec<f64>, MatrixLayout), (Vec<f64>, MatrixLayout)) {
    let x = random_operand(rng, 1, m, k);
    let w = if rng.below(2) == 0 {
        let w = rng.values(n * k + 2);
        let offset = rng.below(3);
        (
            w,
            MatrixLayout {
                offset,
                batch_stride: 0,
                row_stride: 1,
                col_stride: k,
            },
        )
    } else {
        random_operand(rng, 1, k, n)
    };
    (x, w)
}

#[test]
fn the_gelu_epilogue_writes_the_activation_and_the_pre_activation() {
    let mut rng = Rng(4242);
    let mut seen = Seen::default();
    let (mut fused, mut refused, mut with_bias) = (0, 0, 0);
    for case in 0..1500 {
        let (m, k) = (1 + rng.below(7), 1 + rng.below(7));
        // Widths that are multiples of 8 (which cuBLASLt's aux leading dimension needs) and
        // widths that are not.
        let n = if rng.below(2) == 0 {
            8 * (1 + rng.below(3))
        } else {
            1 + rng.below(23)
        };
        let ((x, xl), (w, wl)) = random_linear(&mut rng, m, n, k);
        let bias = (rng.below(2) == 0).then(|| rng.values(n));
        let p = product(xl, wl, 1, m, n, k);
        let pre = naive(&x, &w, &p, bias.as_deref());
        let got = backend_product_gelu(&x, &w, &p, bias.as_deref(), true, &mut seen);
        let what = format!("case {case}: [{m}, {k}] x [{k}, {n}], {xl:?}, {wl:?}");
        let Some((d, aux)) = got else {
            assert!(n % 8 != 0, "{what}: refused");
            refused += 1;
            continue;
        };
        assert!(n % 8 == 0, "{what}: mapped");
        fused += 1;
        with_bias += bias.is_some() as usize;
        assert_eq!(aux.as_ref(), Some(&pre), "{what}: the pre-activation");
        let act: Vec<f64> = pre.iter().map(|&v| gelu_tanh(v)).collect();
        assert_eq!(d, act, "{what}: the activation");
    }
    assert!(
        fused > 400 && refused > 400 && with_bias > 200,
        "{fused} {refused} {with_bias}"
    );
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
        let p = product(al, bl, batch, m, n, k);
        let got = backend_product(&a, &bb, &p, None, &mut seen);
        assert_eq!(seen.copies, 0);
        assert_eq!(got, naive(&a, &bb, &p, None));
    }
}

//! Batched matrix multiplication with arbitrary strides (no transposes are materialised).

use std::any::TypeId;

use rayon::prelude::*;

use super::vecops::SendPtr;
use crate::ops::MatrixLayout;
use crate::Float;

/// Work (m·n·k) above which one product is handed to gemm's own rayon parallelism
/// (the gemm crate's default threading threshold).
const GEMM_PAR_WORK: usize = 48 * 48 * 256;

/// Total work (batch·m·n·k) above which small products of a batch run in parallel over the batch.
const BATCH_PAR_WORK: usize = 1 << 18;

/// Smallest block side along a split dimension.
const SPLIT_MIN: usize = 128;
/// Most blocks one product is split into.
const SPLIT_MAX: usize = 4;

/// How many blocks of rows and of columns a large `m×n` product is split into: the longer side
/// into up to [`SPLIT_MAX`] pieces of at least [`SPLIT_MIN`]. Depends only on the sizes.
fn split_pieces(m: usize, n: usize) -> (usize, usize) {
    let pieces = |d: usize| (d / SPLIT_MIN).clamp(1, SPLIT_MAX);
    if m >= n {
        (pieces(m), 1)
    } else {
        (1, pieces(n))
    }
}

impl MatrixLayout {
    /// One past the largest flat index the layout touches for `batch` matrices of `rows×cols`
    /// (all three at least 1).
    fn extent(&self, batch: usize, rows: usize, cols: usize) -> usize {
        self.offset
            + (batch - 1) * self.batch_stride
            + (rows - 1) * self.row_stride
            + (cols - 1) * self.col_stride
            + 1
    }

    /// The span (max index + 1) of one `rows×cols` matrix relative to its (0, 0).
    fn span(&self, rows: usize, cols: usize) -> usize {
        (rows - 1) * self.row_stride + (cols - 1) * self.col_stride + 1
    }

    /// Whether distinct `(row, col)` pairs of a `rows×cols` matrix map to distinct elements.
    /// Sufficient check: order the two dimensions by stride; the larger stride must exceed the
    /// whole span of the smaller dimension (size-1 dimensions are ignored).
    fn is_injective(&self, rows: usize, cols: usize) -> bool {
        let mut dims = [(self.row_stride, rows), (self.col_stride, cols)];
        dims.sort();
        let [(s1, n1), (s2, n2)] = dims;
        let ok1 = n1 <= 1 || s1 >= 1;
        let ok2 = n2 <= 1 || n1 <= 1 || s2 > (n1 - 1) * s1;
        let ok3 = n2 <= 1 || s2 >= 1;
        ok1 && ok2 && ok3
    }
}

/// For each `b < batch`: `C[b] = A[b] · B[b]` (or `C[b] += A[b] · B[b]` when `accumulate`), with
/// A `m×k`, B `k×n`, C `m×n`, each described by its layout. Uses the `gemm` crate (which takes
/// arbitrary row/column strides) and its own parallelism; `k == 0` gives zeros (or leaves C when
/// accumulating).
///
/// Details of the contract:
/// - Every layout is checked (in release builds too) to stay inside its slice, and one C matrix
///   must not overlap itself (distinct `(row, col)` map to distinct elements); violations panic.
/// - `c_layout.batch_stride == 0` with `batch > 1` sums the products over the batch into the one
///   C matrix, in increasing `b`: `C = [C +] Σ_b A[b] · B[b]` (useful for weight gradients).
/// - Batches are otherwise independent; small products are spread over rayon threads by batch.
///   A large single (or batch-summed) product called from outside rayon is split into blocks of
///   rows or columns by a rule that depends only on the sizes, each block one single-threaded
///   gemm run as a rayon task; called from inside a rayon task (as one of several products
///   running side by side) it runs whole on that thread. The k-blocking of gemm depends only on
///   `k`, so each element of C is summed in the same order either way, for any thread count.
#[allow(clippy::too_many_arguments)]
pub fn matmul<T: Float>(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    a_layout: MatrixLayout,
    b: &[T],
    b_layout: MatrixLayout,
    c: &mut [T],
    c_layout: MatrixLayout,
    accumulate: bool,
) {
    if batch == 0 || m == 0 || n == 0 {
        return;
    }
    let c_extent = c_layout.extent(batch, m, n);
    assert!(
        c_extent <= c.len(),
        "matmul: C layout {c_layout:?} for {batch}x{m}x{n} needs {c_extent} elements, buffer has {}",
        c.len()
    );
    assert!(
        c_layout.is_injective(m, n),
        "matmul: C layout {c_layout:?} overlaps itself for a {m}x{n} matrix"
    );
    if k == 0 {
        if !accumulate {
            let cb = if c_layout.batch_stride == 0 { 1 } else { batch };
            for bi in 0..cb {
                for i in 0..m {
                    for j in 0..n {
                        c[c_layout.offset
                            + bi * c_layout.batch_stride
                            + i * c_layout.row_stride
                            + j * c_layout.col_stride] = T::ZERO;
                    }
                }
            }
        }
        return;
    }
    let a_extent = a_layout.extent(batch, m, k);
    assert!(
        a_extent <= a.len(),
        "matmul: A layout {a_layout:?} for {batch}x{m}x{k} needs {a_extent} elements, buffer has {}",
        a.len()
    );
    let b_extent = b_layout.extent(batch, k, n);
    assert!(
        b_extent <= b.len(),
        "matmul: B layout {b_layout:?} for {batch}x{k}x{n} needs {b_extent} elements, buffer has {}",
        b.len()
    );

    let (mut batch, mut m, mut a_layout, mut c_layout) = (batch, m, a_layout, c_layout);
    // Fold the batch into the rows when B is shared and A's and C's batches continue each
    // other's rows (for example a [batch, m, k] activation times a [k, n] weight).
    if batch > 1
        && b_layout.batch_stride == 0
        && c_layout.batch_stride != 0
        && a_layout.batch_stride == m * a_layout.row_stride
        && c_layout.batch_stride == m * c_layout.row_stride
        && c_layout.is_injective(batch * m, n)
    {
        m *= batch;
        batch = 1;
        a_layout.batch_stride = 0;
        c_layout.batch_stride = 0;
    }

    let work = m * n * k;
    // A product computed inside a rayon task (one of several running side by side) stays on
    // that task's thread: the parallelism is already outside it.
    let nested = rayon::current_thread_index().is_some();
    if (batch == 1 || c_layout.batch_stride == 0) && work >= GEMM_PAR_WORK && !nested {
        // Split C into blocks of rows (or columns) by a rule that depends only on the sizes, and
        // run the blocks as independent single-threaded products: every element of C is summed
        // by exactly one product, in the same order whatever the thread count.
        let (pieces_m, pieces_n) = split_pieces(m, n);
        let (bm, bn) = (m.div_ceil(pieces_m), n.div_ceil(pieces_n));
        let cptr = SendPtr(c.as_mut_ptr());
        (0..pieces_m * pieces_n).into_par_iter().for_each(|t| {
            let (i0, j0) = ((t / pieces_n) * bm, (t % pieces_n) * bn);
            if i0 >= m || j0 >= n {
                return;
            }
            let (mm, nn) = (bm.min(m - i0), bn.min(n - j0));
            for bi in 0..batch {
                let acc = accumulate || (c_layout.batch_stride == 0 && bi > 0);
                // SAFETY: extents of all three layouts were checked above for every batch index;
                // rows i0..i0+mm and columns j0..j0+nn are inside the m×n product. Distinct tasks
                // write disjoint (row, column) blocks of C, which map to disjoint elements because
                // one C matrix is injective (checked above); the batches of one task run in
                // order, so a shared C (batch_stride 0) is never raced. A and B are only read.
                unsafe {
                    gemm_one(
                        mm,
                        nn,
                        k,
                        a.as_ptr().add(
                            a_layout.offset + bi * a_layout.batch_stride + i0 * a_layout.row_stride,
                        ),
                        a_layout,
                        b.as_ptr().add(
                            b_layout.offset + bi * b_layout.batch_stride + j0 * b_layout.col_stride,
                        ),
                        b_layout,
                        cptr.get().add(
                            c_layout.offset
                                + bi * c_layout.batch_stride
                                + i0 * c_layout.row_stride
                                + j0 * c_layout.col_stride,
                        ),
                        c_layout,
                        acc,
                        gemm::Parallelism::None,
                    )
                };
            }
        });
        return;
    }
    if batch == 1 || c_layout.batch_stride == 0 {
        // Sequential over the batch (a reduction when C is shared).
        let par = gemm::Parallelism::None;
        let cptr = c.as_mut_ptr();
        for bi in 0..batch {
            let acc = accumulate || (c_layout.batch_stride == 0 && bi > 0);
            // SAFETY: the extents of all three layouts were checked above to lie inside their
            // slices for every batch index, A and B are shared borrows disjoint from the unique
            // borrow of C, and one C matrix does not overlap itself (checked above).
            unsafe {
                gemm_one(
                    m,
                    n,
                    k,
                    a.as_ptr().add(a_layout.offset + bi * a_layout.batch_stride),
                    a_layout,
                    b.as_ptr().add(b_layout.offset + bi * b_layout.batch_stride),
                    b_layout,
                    cptr.add(c_layout.offset + bi * c_layout.batch_stride),
                    c_layout,
                    acc,
                    par,
                )
            };
        }
        return;
    }

    let disjoint_batches = c_layout.batch_stride >= c_layout.span(m, n);
    let big_single = work >= GEMM_PAR_WORK;
    if disjoint_batches && !big_single && batch * work >= BATCH_PAR_WORK {
        let cptr = SendPtr(c.as_mut_ptr());
        (0..batch).into_par_iter().for_each(|bi| {
            // SAFETY: extents were checked above for every batch index; C matrices of distinct
            // batch indices are disjoint because `batch_stride >= span` of one matrix, so each
            // task writes only its own elements; A and B are only read.
            unsafe {
                gemm_one(
                    m,
                    n,
                    k,
                    a.as_ptr().add(a_layout.offset + bi * a_layout.batch_stride),
                    a_layout,
                    b.as_ptr().add(b_layout.offset + bi * b_layout.batch_stride),
                    b_layout,
                    cptr.get().add(c_layout.offset + bi * c_layout.batch_stride),
                    c_layout,
                    accumulate,
                    gemm::Parallelism::None,
                )
            };
        });
        return;
    }

    let par = if big_single && !nested {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let cptr = c.as_mut_ptr();
    for bi in 0..batch {
        // SAFETY: as in the sequential path above: extents checked, borrows disjoint, one C
        // matrix injective; batches run one after the other so overlapping batches are not raced.
        unsafe {
            gemm_one(
                m,
                n,
                k,
                a.as_ptr().add(a_layout.offset + bi * a_layout.batch_stride),
                a_layout,
                b.as_ptr().add(b_layout.offset + bi * b_layout.batch_stride),
                b_layout,
                cptr.add(c_layout.offset + bi * c_layout.batch_stride),
                c_layout,
                accumulate,
                par,
            )
        };
    }
}

/// One product `C (+)= A · B` through the gemm crate for f32 / f64, or a plain loop for any
/// other [`Float`] type.
///
/// # Safety
/// `a`, `b`, `c` point at element (0, 0) of matrices whose `m×k`, `k×n`, `m×n` elements (at the
/// layouts' row and column strides) are all in bounds of live allocations; `c`'s elements are
/// distinct, not aliased by `a` or `b`, and not accessed by anyone else during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_one<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    a: *const T,
    al: MatrixLayout,
    b: *const T,
    bl: MatrixLayout,
    c: *mut T,
    cl: MatrixLayout,
    accumulate: bool,
    par: gemm::Parallelism,
) {
    let is = |s: usize| s as isize;
    if TypeId::of::<T>() == TypeId::of::<f32>() || TypeId::of::<T>() == TypeId::of::<f64>() {
        // gemm computes dst := alpha·dst + beta·lhs·rhs, reading dst only when `read_dst`.
        let alpha = if accumulate { T::ONE } else { T::ZERO };
        // SAFETY: T is f32 or f64 (checked just above), which gemm supports; pointers and
        // strides describe in-bounds, non-aliasing matrices per this function's contract.
        unsafe {
            gemm::gemm::<T>(
                m,
                n,
                k,
                c,
                is(cl.col_stride),
                is(cl.row_stride),
                accumulate,
                a,
                is(al.col_stride),
                is(al.row_stride),
                b,
                is(bl.col_stride),
                is(bl.row_stride),
                alpha,
                T::ONE,
                false,
                false,
                false,
                par,
            )
        };
        return;
    }
    for i in 0..m {
        for j in 0..n {
            let mut acc = T::ZERO;
            for p in 0..k {
                // SAFETY: i < m, p < k, j < n: in bounds per the contract.
                unsafe {
                    acc += *a.add(i * al.row_stride + p * al.col_stride)
                        * *b.add(p * bl.row_stride + j * bl.col_stride);
                }
            }
            // SAFETY: i < m, j < n: in bounds and exclusively ours per the contract.
            unsafe {
                let dst = c.add(i * cl.row_stride + j * cl.col_stride);
                *dst = if accumulate { *dst + acc } else { acc };
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn float(&mut self) -> f64 {
            (self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
        }
    }

    /// A random layout for `batch` matrices of `rows×cols`: row- or column-major, padded,
    /// offset, and maybe batch-broadcast. Returns the layout and the buffer length it needs.
    fn random_layout(
        rng: &mut Rng,
        batch: usize,
        rows: usize,
        cols: usize,
        allow_bcast: bool,
    ) -> (MatrixLayout, usize) {
        let pad = rng.below(3);
        let (row_stride, col_stride, span) = if rng.below(2) == 0 {
            (cols + pad, 1, rows * (cols + pad))
        } else {
            (1, rows + pad, cols * (rows + pad))
        };
        let offset = rng.below(4);
        let batch_stride = if allow_bcast && rng.below(4) == 0 {
            0
        } else {
            span + rng.below(3)
        };
        let layout = MatrixLayout {
            offset,
            batch_stride,
            row_stride,
            col_stride,
        };
        (layout, offset + batch * batch_stride + span + 2)
    }

    fn idx(l: &MatrixLayout, b: usize, i: usize, j: usize) -> usize {
        l.offset + b * l.batch_stride + i * l.row_stride + j * l.col_stride
    }

    /// Naive f64 reference: triple loop, C batches summed when C is broadcast.
    #[allow(clippy::too_many_arguments)]
    fn reference(
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        a: &[f64],
        al: &MatrixLayout,
        b: &[f64],
        bl: &MatrixLayout,
        c: &mut [f64],
        cl: &MatrixLayout,
        accumulate: bool,
    ) {
        for bi in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let mut s = 0.0;
                    for p in 0..k {
                        s += a[idx(al, bi, i, p)] * b[idx(bl, bi, p, j)];
                    }
                    let d = idx(cl, bi, i, j);
                    let acc = accumulate || (cl.batch_stride == 0 && bi > 0);
                    c[d] = if acc { c[d] + s } else { s };
                }
            }
        }
    }

    fn check_case(
        rng: &mut Rng,
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        accumulate: bool,
        c_bcast: bool,
    ) {
        let (al, alen) = random_layout(rng, batch, m, k, true);
        let (bl, blen) = random_layout(rng, batch, k, n, true);
        let (mut cl, clen) = random_layout(rng, batch, m, n, false);
        if c_bcast {
            cl.batch_stride = 0;
        }
        let a: Vec<f64> = (0..alen).map(|_| rng.float()).collect();
        let b: Vec<f64> = (0..blen).map(|_| rng.float()).collect();
        let c0: Vec<f64> = (0..clen).map(|_| rng.float()).collect();
        let mut want = c0.clone();
        reference(batch, m, n, k, &a, &al, &b, &bl, &mut want, &cl, accumulate);

        let mut got = c0.clone();
        matmul(batch, m, n, k, &a, al, &b, bl, &mut got, cl, accumulate);
        let tol = 1e-12 * (k as f64 + 1.0) * (batch as f64);
        for i in 0..clen {
            assert!(
                (got[i] - want[i]).abs() <= tol,
                "f64 b{batch} m{m} n{n} k{k} acc{accumulate} {al:?} {bl:?} {cl:?} at {i}: {} vs {}",
                got[i],
                want[i]
            );
        }

        let a32: Vec<f32> = a.iter().map(|&v| v as f32).collect();
        let b32: Vec<f32> = b.iter().map(|&v| v as f32).collect();
        let mut got32: Vec<f32> = c0.iter().map(|&v| v as f32).collect();
        let a32d: Vec<f64> = a32.iter().map(|&v| v as f64).collect();
        let b32d: Vec<f64> = b32.iter().map(|&v| v as f64).collect();
        let mut want32: Vec<f64> = got32.iter().map(|&v| v as f64).collect();
        reference(
            batch,
            m,
            n,
            k,
            &a32d,
            &al,
            &b32d,
            &bl,
            &mut want32,
            &cl,
            accumulate,
        );
        matmul(
            batch, m, n, k, &a32, al, &b32, bl, &mut got32, cl, accumulate,
        );
        let tol32 = 2e-6 * ((k * batch) as f64 + 1.0).sqrt() * 4.0;
        for i in 0..clen {
            assert!(
                (got32[i] as f64 - want32[i]).abs() <= tol32,
                "f32 b{batch} m{m} n{n} k{k} at {i}: {} vs {}",
                got32[i],
                want32[i]
            );
        }
    }

    #[test]
    fn random_small_shapes_and_layouts() {
        let mut rng = Rng(0x5eed);
        for case in 0..300 {
            let batch = 1 + rng.below(4);
            let m = 1 + rng.below(9);
            let n = 1 + rng.below(9);
            let k = rng.below(10);
            check_case(&mut rng, batch, m, n, k, case % 2 == 0, case % 7 == 0);
        }
    }

    #[test]
    fn larger_shapes_all_paths() {
        let mut rng = Rng(77);
        // Single big product (gemm's parallelism), batch-parallel small products, odd sizes.
        check_case(&mut rng, 1, 200, 150, 130, false, false);
        check_case(&mut rng, 1, 129, 257, 65, true, false);
        check_case(&mut rng, 64, 17, 33, 31, false, false);
        check_case(&mut rng, 40, 16, 16, 64, true, false);
        check_case(&mut rng, 6, 40, 50, 70, false, true);
        check_case(&mut rng, 3, 1, 300, 200, false, false);
        check_case(&mut rng, 2, 300, 1, 200, true, false);
        // Split into blocks of columns (m < n), and a batch summed into one shared C.
        check_case(&mut rng, 1, 130, 600, 80, false, false);
        check_case(&mut rng, 3, 300, 200, 100, true, true);
        check_case(&mut rng, 2, 517, 131, 90, false, true);
    }

    #[test]
    fn split_and_whole_products_agree_bit_for_bit() {
        // Outside rayon a large product is split into blocks; inside a rayon task it runs whole.
        // Both must give the same bits (and so must any thread count).
        let mut rng = Rng(99);
        for &(m, n, k, bt) in &[(600usize, 200usize, 300usize, false), (130, 700, 257, true)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.float() as f32).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.float() as f32).collect();
            let al = MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: k,
                col_stride: 1,
            };
            let bl = if bt {
                MatrixLayout {
                    offset: 0,
                    batch_stride: 0,
                    row_stride: 1,
                    col_stride: k,
                }
            } else {
                MatrixLayout {
                    offset: 0,
                    batch_stride: 0,
                    row_stride: n,
                    col_stride: 1,
                }
            };
            let cl = MatrixLayout {
                offset: 0,
                batch_stride: 0,
                row_stride: n,
                col_stride: 1,
            };
            let run = || {
                let mut c = vec![0f32; m * n];
                matmul(1, m, n, k, &a, al, &b, bl, &mut c, cl, false);
                c.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let split = run();
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                assert!(
                    pool.install(run) == split,
                    "{m}x{n}x{k} nested, {threads} threads"
                );
            }
        }
    }

    #[test]
    fn folded_batch_with_shared_rhs() {
        // [batch, m, k] row-major activation times a shared [k, n] weight into [batch, m, n].
        let (batch, m, n, k) = (5, 7, 9, 11);
        let mut rng = Rng(3);
        let a: Vec<f64> = (0..batch * m * k).map(|_| rng.float()).collect();
        let b: Vec<f64> = (0..k * n).map(|_| rng.float()).collect();
        let al = MatrixLayout {
            offset: 0,
            batch_stride: m * k,
            row_stride: k,
            col_stride: 1,
        };
        // The weight is stored transposed ([n, k]) as a Linear layer keeps it.
        let bt: Vec<f64> = (0..n * k).map(|idx| b[(idx % k) * n + idx / k]).collect();
        let bl = MatrixLayout {
            offset: 0,
            batch_stride: 0,
            row_stride: 1,
            col_stride: k,
        };
        let cl = MatrixLayout {
            offset: 0,
            batch_stride: m * n,
            row_stride: n,
            col_stride: 1,
        };
        let mut c = vec![0.0; batch * m * n];
        matmul(batch, m, n, k, &a, al, &bt, bl, &mut c, cl, false);
        for bi in 0..batch {
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|p| a[bi * m * k + i * k + p] * b[p * n + j])
                        .sum();
                    assert!((c[bi * m * n + i * n + j] - want).abs() < 1e-12);
                }
            }
        }
    }

    #[test]
    fn k_zero_and_empty() {
        let l = MatrixLayout {
            offset: 0,
            batch_stride: 6,
            row_stride: 3,
            col_stride: 1,
        };
        let mut c = vec![5.0f32; 12];
        matmul(2, 2, 3, 0, &[], l, &[], l, &mut c, l, true);
        assert_eq!(c, vec![5.0; 12]);
        matmul(2, 2, 3, 0, &[], l, &[], l, &mut c, l, false);
        assert_eq!(c, vec![0.0; 12]);
        let mut c = vec![5.0f32; 12];
        matmul(2, 0, 3, 4, &[], l, &[], l, &mut c, l, false);
        matmul(0, 2, 3, 4, &[], l, &[], l, &mut c, l, false);
        assert_eq!(c, vec![5.0; 12]);
    }

    #[test]
    #[should_panic(expected = "needs")]
    fn out_of_bounds_layout_panics() {
        let l = MatrixLayout {
            offset: 0,
            batch_stride: 4,
            row_stride: 2,
            col_stride: 1,
        };
        let a = vec![1.0f32; 4];
        let mut c = vec![0.0f32; 4];
        matmul(2, 2, 2, 2, &a, l, &a, l, &mut c, l, false);
    }

    #[test]
    #[should_panic(expected = "overlaps itself")]
    fn self_overlapping_output_panics() {
        let l = MatrixLayout {
            offset: 0,
            batch_stride: 0,
            row_stride: 2,
            col_stride: 1,
        };
        let cl = MatrixLayout {
            offset: 0,
            batch_stride: 0,
            row_stride: 0,
            col_stride: 1,
        };
        let a = vec![1.0f32; 4];
        let mut c = vec![0.0f32; 4];
        matmul(1, 2, 2, 2, &a, l, &a, l, &mut c, cl, false);
    }
}

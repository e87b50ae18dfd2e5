//! A small register-blocked matrix product for tiles that fit in cache (the products inside
//! fused attention's tiles): every output element sums its terms in increasing index order with
//! fused multiply-adds, so results do not depend on where the register blocks fall. Nothing here
//! is specific to attention.

use crate::Float;

/// Rows of the register block of [`gemm_tile`].
const MR: usize = 4;
/// Columns of the register block of [`gemm_tile`].
const NR: usize = 16;

/// `C (+)= A B` for one small tile: `A(i, p) = a[i * ars + p * acs]` (`m × k`),
/// `B(p, j) = b[p * brs + j]` (`k × n`), `C(i, j) = c[i * crs + j]` (`m × n`). Each element of C
/// starts from its old value when `accumulate` (else 0) and adds its `k` products in increasing
/// `p` with fused multiply-adds, so its value does not depend on where the register blocks fall.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn gemm_tile<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    a: &[T],
    ars: usize,
    acs: usize,
    b: &[T],
    brs: usize,
    c: &mut [T],
    crs: usize,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!((m - 1) * crs + n <= c.len(), "gemm_tile: C out of bounds");
    if k > 0 {
        assert!(
            (m - 1) * ars + (k - 1) * acs < a.len(),
            "gemm_tile: A out of bounds"
        );
        assert!((k - 1) * brs + n <= b.len(), "gemm_tile: B out of bounds");
    }
    let mut i = 0;
    while i + MR <= m {
        // SAFETY: rows i..i+MR < m and all columns < n: in bounds by the asserts above.
        unsafe { block_rows::<T, MR>(i, n, k, a, ars, acs, b, brs, c, crs, accumulate) };
        i += MR;
    }
    while i < m {
        // SAFETY: as above for the single row i < m.
        unsafe { block_rows::<T, 1>(i, n, k, a, ars, acs, b, brs, c, crs, accumulate) };
        i += 1;
    }
}

/// Rows `i0 .. i0 + R` of [`gemm_tile`]: register blocks of `R × NR`, then the leftover columns.
///
/// # Safety
/// Rows `i0 .. i0 + R` are below `m`, and the bounds asserted by [`gemm_tile`] hold.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn block_rows<T: Float, const R: usize>(
    i0: usize,
    n: usize,
    k: usize,
    a: &[T],
    ars: usize,
    acs: usize,
    b: &[T],
    brs: usize,
    c: &mut [T],
    crs: usize,
    accumulate: bool,
) {
    let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
    let mut j = 0;
    while j + NR <= n {
        let mut acc = [[T::ZERO; NR]; R];
        if accumulate {
            for (ii, row) in acc.iter_mut().enumerate() {
                for (jj, v) in row.iter_mut().enumerate() {
                    // SAFETY: row i0 + ii < m, column j + jj < n (caller's contract).
                    *v = unsafe { *cp.add((i0 + ii) * crs + j + jj) };
                }
            }
        }
        for p in 0..k {
            // SAFETY: p < k and j + NR <= n, so the NR elements of B's row p are in bounds.
            let brow: [T; NR] =
                unsafe { std::ptr::read_unaligned(bp.add(p * brs + j) as *const [T; NR]) };
            for (ii, row) in acc.iter_mut().enumerate() {
                // SAFETY: row i0 + ii < m and p < k.
                let av = unsafe { *ap.add((i0 + ii) * ars + p * acs) };
                for (v, &bv) in row.iter_mut().zip(&brow) {
                    *v = av.fma(bv, *v);
                }
            }
        }
        for (ii, row) in acc.iter().enumerate() {
            for (jj, &v) in row.iter().enumerate() {
                // SAFETY: row i0 + ii < m, column j + jj < n.
                unsafe { *cp.add((i0 + ii) * crs + j + jj) = v };
            }
        }
        j += NR;
    }
    for ii in 0..R {
        for jj in j..n {
            // SAFETY: row i0 + ii < m, column jj < n, p < k: all in bounds.
            unsafe {
                let dst = cp.add((i0 + ii) * crs + jj);
                let mut v = if accumulate { *dst } else { T::ZERO };
                for p in 0..k {
                    v = (*ap.add((i0 + ii) * ars + p * acs)).fma(*bp.add(p * brs + jj), v);
                }
                *dst = v;
            }
        }
    }
}

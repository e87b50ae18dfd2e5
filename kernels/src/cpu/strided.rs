//! Strided views: gathering a strided view into a contiguous buffer and back.
//!
//! A view is `(offset, shape, strides)` over a flat buffer, strides in elements (0 broadcasts).
//!
//! Besides the two public copies, this module holds the crate's iteration machinery for strided
//! views: dimension coalescing (dropping unit dimensions and merging dimensions that are laid out
//! back to back in every view) and a walk over the contiguous runs of a row-major output, which the
//! elementwise kernels share.

use rayon::prelude::*;

use super::vecops::simd;
/// Below this many output elements a kernel runs on the calling thread; above it, it splits the
/// work into chunks for rayon.
pub(crate) const PAR_THRESHOLD: usize = 32 * 1024;

/// Length of the chunks a parallel loop over `total` elements is split into: about four chunks per
/// rayon thread, at least 8192 elements, rounded up to a multiple of `align` (at least 1).
pub(crate) fn par_chunk_len(total: usize, align: usize) -> usize {
    let align = align.max(1);
    let threads = rayon::current_num_threads().max(1);
    let target = total.div_ceil(threads * 4).max(8192);
    target.div_ceil(align) * align
}

/// Number of rows per parallel task for a loop over `rows` rows of `row_len` elements each, aiming
/// at about four tasks per thread and at least [`PAR_THRESHOLD`] / 4 elements per task.
pub(crate) fn rows_per_task(rows: usize, row_len: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_threads = rows.div_ceil(threads * 4);
    let by_size = (PAR_THRESHOLD / 4).div_ceil(row_len.max(1));
    by_threads.max(by_size).max(1)
}

/// Contiguous row-major strides of `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut s = 1;
    for d in (0..shape.len()).rev() {
        strides[d] = s;
        s *= shape[d];
    }
    strides
}

/// A shape with `N` stride sets over it, simplified without changing the element order: unit
/// dimensions are dropped and adjacent dimensions `d, d+1` are merged when every view has
/// `stride[d] == stride[d+1] * shape[d+1]`. Always has at least one dimension.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Coalesced<const N: usize> {
    /// The simplified shape.
    pub dims: Vec<usize>,
    /// One stride set per view, each of length `dims.len()`.
    pub strides: [Vec<usize>; N],
}

#[allow(clippy::needless_range_loop)]
impl<const N: usize> Coalesced<N> {
    /// Simplifies `shape` with the stride sets `strides` (each of length `shape.len()`).
    pub fn new(shape: &[usize], strides: [&[usize]; N]) -> Self {
        for s in &strides {
            assert_eq!(
                s.len(),
                shape.len(),
                "strided view: {} strides for a shape of rank {}",
                s.len(),
                shape.len()
            );
        }
        let mut dims: Vec<usize> = Vec::with_capacity(shape.len());
        let mut out: [Vec<usize>; N] = std::array::from_fn(|_| Vec::with_capacity(shape.len()));
        for d in 0..shape.len() {
            let size = shape[d];
            if size == 1 {
                continue;
            }
            if !dims.is_empty() {
                let mergeable = (0..N).all(|v| {
                    let prev = *out[v].last().expect("same length as dims");
                    prev == strides[v][d] * size
                });
                if mergeable {
                    *dims.last_mut().expect("non-empty") *= size;
                    for v in 0..N {
                        *out[v].last_mut().expect("non-empty") = strides[v][d];
                    }
                    continue;
                }
            }
            dims.push(size);
            for v in 0..N {
                out[v].push(strides[v][d]);
            }
        }
        if dims.is_empty() {
            dims.push(1);
            for s in out.iter_mut() {
                s.push(0);
            }
        }
        Coalesced { dims, strides: out }
    }

    /// The innermost stride of view `v`.
    pub fn inner_stride(&self, v: usize) -> usize {
        *self.strides[v].last().expect("at least one dimension")
    }

    /// Visits the row-major element range `lo..hi` as runs along the innermost dimension: calls
    /// `f(pos, len, bases)` where `pos` is the row-major index of the run's first element, `len`
    /// its length and `bases[v]` the flat index of its first element in view `v` (starting from
    /// `offsets[v]`). Consecutive elements of a run are [`Self::inner_stride`] apart.
    #[inline(always)]
    pub fn for_each_run(
        &self,
        offsets: [usize; N],
        lo: usize,
        hi: usize,
        mut f: impl FnMut(usize, usize, [usize; N]),
    ) {
        if lo >= hi {
            return;
        }
        let nd = self.dims.len();
        let inner = self.dims[nd - 1];
        let outer_nd = nd - 1;
        let mut idx = vec![0usize; outer_nd];
        let mut row = lo / inner;
        let mut col = lo % inner;
        for d in (0..outer_nd).rev() {
            idx[d] = row % self.dims[d];
            row /= self.dims[d];
        }
        let mut base = offsets;
        for v in 0..N {
            for d in 0..outer_nd {
                base[v] += idx[d] * self.strides[v][d];
            }
        }
        let mut pos = lo;
        loop {
            let len = (inner - col).min(hi - pos);
            let mut b = base;
            for v in 0..N {
                b[v] += col * self.strides[v][nd - 1];
            }
            f(pos, len, b);
            pos += len;
            if pos >= hi {
                break;
            }
            col = 0;
            // Advance the odometer over the outer dimensions by one row.
            let mut d = outer_nd;
            while d > 0 {
                d -= 1;
                idx[d] += 1;
                for v in 0..N {
                    base[v] += self.strides[v][d];
                }
                if idx[d] < self.dims[d] {
                    break;
                }
                for v in 0..N {
                    base[v] -= self.strides[v][d] * self.dims[d];
                }
                idx[d] = 0;
            }
        }
    }
}

/// Drives an elementwise kernel with `N` strided inputs and a contiguous row-major output over
/// `shape`: calls `run(out_run, bases, inner_strides)` for contiguous runs of the output, where
/// `bases[v]` is the flat index of the run's first element in input `v` and `inner_strides[v]`
/// the step between consecutive elements of the run in input `v`. Runs in parallel chunks when the
/// output is large.
pub(crate) fn map_strided<O: Send, const N: usize>(
    shape: &[usize],
    strides: [&[usize]; N],
    offsets: [usize; N],
    out: &mut [O],
    run: impl Fn(&mut [O], [usize; N], [usize; N]) + Sync,
) {
    let total: usize = shape.iter().product();
    assert_eq!(
        out.len(),
        total,
        "output has {} elements, shape {:?} has {}",
        out.len(),
        shape,
        total
    );
    if total == 0 {
        return;
    }
    let c = Coalesced::new(shape, strides);
    let inner: [usize; N] = std::array::from_fn(|v| c.inner_stride(v));
    let work = |lo: usize, chunk: &mut [O]| {
        simd(
            #[inline(always)]
            || {
                let hi = lo + chunk.len();
                c.for_each_run(
                    offsets,
                    lo,
                    hi,
                    #[inline(always)]
                    |pos, len, bases| {
                        run(&mut chunk[pos - lo..pos - lo + len], bases, inner);
                    },
                );
            },
        )
    };
    if total < PAR_THRESHOLD {
        work(0, out);
    } else {
        let chunk_len = par_chunk_len(total, 64);
        out.par_chunks_mut(chunk_len)
            .enumerate()
            .for_each(|(i, chunk)| work(i * chunk_len, chunk));
    }
}

/// Copies a run of `dst.len()` elements of `src` starting at `base`, `stride` apart.
#[inline]
fn gather_run<T: Copy>(src: &[T], base: usize, stride: usize, dst: &mut [T]) {
    match stride {
        1 => dst.copy_from_slice(&src[base..base + dst.len()]),
        0 => dst.fill(src[base]),
        _ => {
            for (i, d) in dst.iter_mut().enumerate() {
                *d = src[base + i * stride];
            }
        }
    }
}

/// Copies the view `(offset, shape, strides)` of `src` into the contiguous `dst`
/// (row-major over `shape`; `dst.len()` equals the product of `shape`).
pub fn copy_strided<T: Copy + Send + Sync>(
    src: &[T],
    offset: usize,
    shape: &[usize],
    strides: &[usize],
    dst: &mut [T],
) {
    map_strided(
        shape,
        [strides],
        [offset],
        dst,
        #[inline(always)]
        |run, [b], [s]| gather_run(src, b, s, run),
    );
}

/// Writes the contiguous `src` into the view `(offset, shape, strides)` of `dst`
/// (the inverse of [`copy_strided`]; the view must not overlap itself).
///
/// If the view does overlap itself (a 0 stride, for example), the element written last in
/// row-major order wins. Large copies run in parallel only when the outermost dimension splits
/// the view into provably disjoint pieces.
pub fn copy_into_strided<T: Copy + Send + Sync>(
    src: &[T],
    dst: &mut [T],
    offset: usize,
    shape: &[usize],
    strides: &[usize],
) {
    let total: usize = shape.iter().product();
    assert_eq!(
        src.len(),
        total,
        "source has {} elements, shape {:?} has {}",
        src.len(),
        shape,
        total
    );
    if total == 0 {
        return;
    }
    let src_strides = contiguous_strides(shape);
    // View 0 is the strided destination, view 1 the contiguous source.
    let c = Coalesced::new(shape, [strides, &src_strides]);
    let ds = c.inner_stride(0);
    let scatter = |dst: &mut [T], offsets: [usize; 2], c: &Coalesced<2>, lo: usize, hi: usize| {
        c.for_each_run(offsets, lo, hi, |_, len, [bd, bs]| {
            let s = &src[bs..bs + len];
            match ds {
                1 => dst[bd..bd + len].copy_from_slice(s),
                _ => {
                    for (i, &v) in s.iter().enumerate() {
                        dst[bd + i * ds] = v;
                    }
                }
            }
        });
    };
    // Parallel split over the outermost dimension: piece `i` lives in
    // `offset + i * stride0 .. offset + i * stride0 + span`, and the pieces are disjoint when
    // `span <= stride0`, so `dst[offset..].chunks_mut(stride0)` hands each piece its own chunk.
    if total >= PAR_THRESHOLD && c.dims.len() >= 2 {
        let stride0 = c.strides[0][0];
        let span: usize = 1
            + (1..c.dims.len())
                .map(|d| (c.dims[d] - 1) * c.strides[0][d])
                .sum::<usize>();
        if stride0 >= span {
            let n0 = c.dims[0];
            let piece_len = total / n0;
            let rest = Coalesced::<2> {
                dims: c.dims[1..].to_vec(),
                strides: [c.strides[0][1..].to_vec(), c.strides[1][1..].to_vec()],
            };
            let needed = offset + (n0 - 1) * stride0 + span;
            assert!(
                needed <= dst.len(),
                "strided destination view needs {needed} elements, buffer has {}",
                dst.len()
            );
            dst[offset..]
                .par_chunks_mut(stride0)
                .take(n0)
                .enumerate()
                .for_each(|(i, piece)| {
                    scatter(piece, [0, i * piece_len], &rest, 0, piece_len);
                });
            return;
        }
    }
    scatter(dst, [offset, 0], &c, 0, total);
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)]
mod tests {
    use super::*;

    /// Tiny xorshift generator for test inputs.
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
    }

    /// Naive reference: flat index of the row-major element `i` of a view.
    fn view_index(i: usize, offset: usize, shape: &[usize], strides: &[usize]) -> usize {
        let mut rem = i;
        let mut idx = offset;
        for d in (0..shape.len()).rev() {
            idx += (rem % shape[d]) * strides[d];
            rem /= shape[d];
        }
        idx
    }

    /// A random view over a permuted, possibly sliced and broadcast, contiguous buffer.
    fn random_view(
        rng: &mut Rng,
        big: bool,
        allow_broadcast: bool,
    ) -> (Vec<usize>, Vec<usize>, usize, usize) {
        let rank = rng.below(5);
        let shape: Vec<usize> = (0..rank)
            .map(|_| {
                if big {
                    1 + rng.below(40)
                } else {
                    1 + rng.below(6)
                }
            })
            .collect();
        // Parent buffer dims: each view dim padded by a random amount (slicing).
        let parent: Vec<usize> = shape.iter().map(|&s| s + rng.below(3)).collect();
        let mut perm: Vec<usize> = (0..rank).collect();
        for i in (1..rank).rev() {
            let j = rng.below(i + 1);
            perm.swap(i, j);
        }
        // Parent strides in the permuted order.
        let mut pstr = vec![0; rank];
        let mut s = 1;
        for &d in perm.iter().rev() {
            pstr[d] = s;
            s *= parent[d];
        }
        let buffer_len = s.max(1) + 5;
        let offset = rng.below(3);
        let mut strides = pstr;
        if allow_broadcast {
            for st in strides.iter_mut() {
                if rng.below(4) == 0 {
                    *st = 0;
                }
            }
        }
        (shape, strides, offset, buffer_len + offset)
    }

    #[test]
    fn coalesce_merges_contiguous_and_drops_unit_dims() {
        let c = Coalesced::new(&[2, 1, 3, 4], [&[12, 99, 4, 1]]);
        assert_eq!(c.dims, vec![24]);
        assert_eq!(c.strides[0], vec![1]);
        let c = Coalesced::new(&[2, 3, 4], [&[1, 6, 2], &[12, 4, 1]]);
        assert_eq!(c.dims, vec![2, 3, 4]);
        let c = Coalesced::new(&[2, 3, 4], [&[1, 8, 2], &[12, 4, 1]]);
        assert_eq!(c.dims, vec![2, 12]);
        assert_eq!(c.strides, [vec![1, 2], vec![12, 1]]);
        let c = Coalesced::new(&[], [&[]]);
        assert_eq!(c.dims, vec![1]);
        assert_eq!(c.strides[0], vec![0]);
    }

    #[test]
    fn copy_strided_matches_naive() {
        let mut rng = Rng(0x1234_5678);
        for case in 0..400 {
            let (shape, strides, offset, len) = random_view(&mut rng, case % 10 == 0, true);
            let src: Vec<u32> = (0..len as u32).collect();
            let n: usize = shape.iter().product();
            let mut dst = vec![u32::MAX; n];
            copy_strided(&src, offset, &shape, &strides, &mut dst);
            for (i, &d) in dst.iter().enumerate() {
                assert_eq!(
                    d,
                    src[view_index(i, offset, &shape, &strides)],
                    "case {case} {shape:?} {strides:?}"
                );
            }
        }
    }

    #[test]
    fn copy_strided_large_parallel() {
        // Transposed 300x250 view plus a broadcast dim: exercises the parallel path.
        let src: Vec<f32> = (0..300 * 250).map(|i| i as f32).collect();
        let shape = [2, 250, 300];
        let strides = [0, 1, 250];
        let mut dst = vec![0f32; 2 * 250 * 300];
        copy_strided(&src, 0, &shape, &strides, &mut dst);
        for (i, &d) in dst.iter().enumerate() {
            assert_eq!(d, src[view_index(i, 0, &shape, &strides)]);
        }
    }

    #[test]
    fn copy_into_strided_matches_naive() {
        let mut rng = Rng(0x9876_5431);
        for case in 0..400 {
            let (shape, strides, offset, len) = random_view(&mut rng, case % 8 == 0, false);
            let n: usize = shape.iter().product();
            let src: Vec<u32> = (0..n as u32).map(|i| i + 1).collect();
            let mut dst = vec![0u32; len];
            copy_into_strided(&src, &mut dst, offset, &shape, &strides);
            let mut expect = vec![0u32; len];
            for (i, &s) in src.iter().enumerate() {
                expect[view_index(i, offset, &shape, &strides)] = s;
            }
            assert_eq!(dst, expect, "case {case} {shape:?} {strides:?}");
            // And back again.
            let mut back = vec![0u32; n];
            copy_strided(&dst, offset, &shape, &strides, &mut back);
            assert_eq!(back, src);
        }
    }

    #[test]
    fn copy_into_strided_large_parallel() {
        // Write a 200x300 block into the transposed layout of a 310x210 buffer (both paths).
        for (shape, strides) in [
            ([200usize, 300usize], [1usize, 210usize]),
            ([200, 300], [310, 1]),
        ] {
            let n = 200 * 300;
            let src: Vec<u64> = (0..n as u64).map(|i| i * 7 + 1).collect();
            let len = 310 * 210 + 3;
            let mut dst = vec![0u64; len];
            copy_into_strided(&src, &mut dst, 3, &shape, &strides);
            let mut expect = vec![0u64; len];
            for (i, &s) in src.iter().enumerate() {
                expect[view_index(i, 3, &shape, &strides)] = s;
            }
            assert_eq!(dst, expect);
        }
    }

    #[test]
    fn zero_sized_and_scalar() {
        let src = [5.0f64, 6.0];
        let mut dst: [f64; 0] = [];
        copy_strided(&src, 0, &[0, 3], &[3, 1], &mut dst);
        let mut one = [0.0];
        copy_strided(&src, 1, &[], &[], &mut one);
        assert_eq!(one, [6.0]);
        let mut buf = [0.0; 2];
        copy_into_strided(&[7.0], &mut buf, 1, &[], &[]);
        assert_eq!(buf, [0.0, 7.0]);
    }
}

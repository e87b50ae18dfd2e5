//! Host-side index arithmetic of the strided kernels (pure; tested without a GPU): the
//! [`StridedArgs`] of a set of views over one output shape, the merging of dims that every view
//! walks contiguously, 8-byte elements moved as pairs of 4-byte words, and the plan of pitched
//! 2-D copies that writes a contiguous buffer into a strided destination.

use meshgrad_kernels::cuda::{StridedArgs, MAX_DIMS};

use crate::{Error, Layout, Result};

/// One input of a strided kernel: its element offset and one stride per output dim (0 where it
/// broadcasts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct View {
    /// Element offset of the view's first element.
    pub offset: usize,
    /// One stride per output dim.
    pub strides: Vec<usize>,
}

impl View {
    /// The view a layout describes (its dims are the output dims).
    pub fn of(l: &Layout) -> Self {
        View {
            offset: l.offset(),
            strides: l.strides().to_vec(),
        }
    }
}

/// Drops the size-1 dims and merges each dim into the next outer one where every view walks
/// the pair as one dim (`stride[outer] == stride[inner] * dims[inner]`). The element order is
/// unchanged; fewer dims mean less index arithmetic and fit the kernels' limit of 8.
pub(crate) fn coalesce(dims: &[usize], views: &[View]) -> (Vec<usize>, Vec<View>) {
    let mut out_dims: Vec<usize> = Vec::with_capacity(dims.len());
    let mut out: Vec<View> = views
        .iter()
        .map(|v| View {
            offset: v.offset,
            strides: Vec::with_capacity(dims.len()),
        })
        .collect();
    for (d, &size) in dims.iter().enumerate() {
        if size == 1 {
            continue;
        }
        let merge = !out_dims.is_empty()
            && views
                .iter()
                .zip(&out)
                .all(|(v, o)| o.strides.last().copied() == Some(v.strides[d] * size));
        if merge {
            *out_dims.last_mut().expect("merging into a dim") *= size;
            for (v, o) in views.iter().zip(out.iter_mut()) {
                *o.strides.last_mut().expect("merging into a dim") = v.strides[d];
            }
        } else {
            out_dims.push(size);
            for (v, o) in views.iter().zip(out.iter_mut()) {
                o.strides.push(v.strides[d]);
            }
        }
    }
    (out_dims, out)
}

/// The same views with every 8-byte element seen as two 4-byte words: a trailing dim of 2,
/// strides and offsets doubled, and stride `pair_stride[k]` along the new dim for view `k`
/// (1 for data, 0 for a per-element input such as `where`'s u8 condition, whose offsets and
/// strides stay as they are).
pub(crate) fn as_word_pairs(
    dims: &[usize],
    views: &[View],
    pair_stride: &[usize],
) -> (Vec<usize>, Vec<View>) {
    let mut d = dims.to_vec();
    d.push(2);
    let v = views
        .iter()
        .zip(pair_stride)
        .map(|(v, &p)| {
            let scale = if p == 0 { 1 } else { 2 };
            let mut strides: Vec<usize> = v.strides.iter().map(|s| s * scale).collect();
            strides.push(p);
            View {
                offset: v.offset * scale,
                strides,
            }
        })
        .collect();
    (d, v)
}

/// The [`StridedArgs`] of up to three views over the contiguous output `dims` (merged first).
/// More than 8 dims left after merging is an error naming `op` and the shape.
pub(crate) fn strided_args(op: &str, dims: &[usize], views: &[View]) -> Result<StridedArgs> {
    assert!(views.len() <= 3, "{op}: at most three strided inputs");
    let (d, v) = coalesce(dims, views);
    if d.len() > MAX_DIMS {
        return Err(Error::Msg(format!(
            "{op}: the CUDA strided kernels take at most {MAX_DIMS} dims; the views of shape \
             {dims:?} (strides {:?}) still have {} after merging",
            views.iter().map(|v| &v.strides).collect::<Vec<_>>(),
            d.len()
        )));
    }
    let mut s = StridedArgs {
        numel: dims.iter().product::<usize>() as i64,
        ndim: d.len() as i32,
        ..Default::default()
    };
    for (k, &size) in d.iter().enumerate() {
        s.shape[k] = size as i64;
    }
    for (i, view) in v.iter().enumerate() {
        s.offsets[i] = view.offset as i64;
        for (k, &st) in view.strides.iter().enumerate() {
            s.strides[i][k] = st as i64;
        }
    }
    Ok(s)
}

/// How a contiguous source is written into a strided destination with pitched 2-D copies: for
/// every index over `outer_dims`, `height` rows of `run` contiguous elements, the rows `pitch`
/// elements apart in the destination (and `run` apart in the source). All in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PitchPlan {
    /// Contiguous elements per row.
    pub run: usize,
    /// Rows per 2-D copy.
    pub height: usize,
    /// Destination stride between rows.
    pub pitch: usize,
    /// The dims iterated on the host (one 2-D copy each), outermost first.
    pub outer_dims: Vec<usize>,
    /// The destination strides of `outer_dims`.
    pub outer_strides: Vec<usize>,
}

impl PitchPlan {
    /// Number of 2-D copies.
    pub fn copies(&self) -> usize {
        self.outer_dims.iter().product()
    }

    /// The destination element offset (relative to the view's offset) of copy `k`; its source
    /// offset is `k * height * run`.
    pub fn dst_offset(&self, mut k: usize) -> usize {
        let mut off = 0;
        for (&d, &s) in self.outer_dims.iter().zip(&self.outer_strides).rev() {
            off += (k % d) * s;
            k /= d;
        }
        off
    }
}

/// The [`PitchPlan`] of a destination view with `dims` and `strides`.
pub(crate) fn pitch_plan(dims: &[usize], strides: &[usize]) -> PitchPlan {
    let (mut d, v) = coalesce(
        dims,
        &[View {
            offset: 0,
            strides: strides.to_vec(),
        }],
    );
    let mut st = v.into_iter().next().expect("one view").strides;
    let run = if st.last() == Some(&1) {
        st.pop();
        d.pop().expect("a dim per stride")
    } else {
        1
    };
    let (height, pitch) = match (d.pop(), st.pop()) {
        (Some(h), Some(p)) => (h, p),
        _ => (1, run),
    };
    PitchPlan {
        run,
        height,
        pitch,
        outer_dims: d,
        outer_strides: st,
    }
}

/// The order of `l`'s dims by decreasing stride (stable): permuting a destination view and its
/// source by it makes a destination that is a transposed contiguous block contiguous.
pub(crate) fn by_decreasing_stride(l: &Layout) -> Vec<usize> {
    let mut perm: Vec<usize> = (0..l.dims().len()).collect();
    perm.sort_by_key(|&d| std::cmp::Reverse(l.strides()[d]));
    perm
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Shape;

    fn view(offset: usize, strides: &[usize]) -> View {
        View {
            offset,
            strides: strides.to_vec(),
        }
    }

    #[test]
    fn contiguous_views_merge_to_one_dim() {
        let (d, v) = coalesce(&[2, 3, 4], &[view(5, &[12, 4, 1]), view(0, &[12, 4, 1])]);
        assert_eq!(d, vec![24]);
        assert_eq!(v, vec![view(5, &[1]), view(0, &[1])]);
    }

    #[test]
    fn broadcast_and_transposed_views_keep_their_dims() {
        // a: [2, 3] contiguous; b: a row broadcast over dim 0 (stride 0).
        let (d, v) = coalesce(&[2, 1, 3], &[view(0, &[3, 3, 1]), view(7, &[0, 9, 1])]);
        assert_eq!(d, vec![2, 3]);
        assert_eq!(v, vec![view(0, &[3, 1]), view(7, &[0, 1])]);
        // A transpose does not merge.
        let (d, v) = coalesce(&[3, 2], &[view(0, &[1, 3])]);
        assert_eq!((d, v), (vec![3, 2], vec![view(0, &[1, 3])]));
    }

    #[test]
    fn strided_args_fill_the_struct_and_reject_nine_dims() {
        let s = strided_args("t", &[2, 3], &[view(1, &[1, 2]), view(0, &[0, 1])]).unwrap();
        assert_eq!(s.ndim, 2);
        assert_eq!(s.numel, 6);
        assert_eq!(&s.shape[..2], &[2, 3]);
        assert_eq!(&s.strides[0][..2], &[1, 2]);
        assert_eq!(&s.strides[1][..2], &[0, 1]);
        assert_eq!(&s.offsets, &[1, 0, 0]);
        // A scalar: no dims, one element.
        let s = strided_args("t", &[], &[view(3, &[])]).unwrap();
        assert_eq!((s.ndim, s.numel, s.offsets[0]), (0, 1, 3));
        // Nine dims of size 2 with alternating (unmergeable) strides.
        let dims = [2usize; 9];
        let strides: Vec<usize> = (0..9).map(|k| 1 << (2 * (8 - k))).collect();
        let e = strided_args("binary", &dims, &[view(0, &strides)]).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("binary") && e.contains("[2, 2, 2, 2, 2, 2, 2, 2, 2]"),
            "{e}"
        );
        // ... while nine mergeable dims fit.
        let l = Layout::contiguous(Shape::new(dims.to_vec()));
        assert_eq!(strided_args("t", &dims, &[View::of(&l)]).unwrap().ndim, 1);
    }

    #[test]
    fn word_pairs_double_data_views_and_keep_conditions() {
        let (d, v) = as_word_pairs(&[3], &[view(1, &[0]), view(2, &[1])], &[0, 1]);
        assert_eq!(d, vec![3, 2]);
        assert_eq!(v, vec![view(1, &[0, 0]), view(4, &[2, 1])]);
        // A contiguous 8-byte view becomes one contiguous run of words.
        let (d, v) = as_word_pairs(&[4, 5], &[view(3, &[5, 1])], &[1]);
        let (d, v) = coalesce(&d, &v);
        assert_eq!((d, v), (vec![40], vec![view(6, &[1])]));
    }

    #[test]
    fn pitch_plans_of_cat_slices_transposes_and_3d_views() {
        // cat along dim 1: the destination view [2, 3, 4] inside [2, 5, 4] at column 1.
        let p = pitch_plan(&[2, 3, 4], &[20, 4, 1]);
        assert_eq!((p.run, p.height, p.pitch, p.copies()), (12, 2, 20, 1));
        // A transposed destination: single elements, 3 rows, 1 copy per outer index.
        let p = pitch_plan(&[2, 3], &[1, 2]);
        assert_eq!((p.run, p.height, p.pitch), (1, 3, 2));
        assert_eq!((p.outer_dims.clone(), p.copies()), (vec![2], 2));
        assert_eq!((p.dst_offset(0), p.dst_offset(1)), (0, 1));
        // Narrowed along two dims of a [4, 6, 8] buffer: [2, 3, 5] at strides [48, 8, 1].
        let p = pitch_plan(&[2, 3, 5], &[48, 8, 1]);
        assert_eq!((p.run, p.height, p.pitch), (5, 3, 8));
        assert_eq!((p.copies(), p.dst_offset(1)), (2, 48));
        // Contiguous: one run.
        let p = pitch_plan(&[3, 4], &[4, 1]);
        assert_eq!((p.run, p.height, p.copies()), (12, 1, 1));
    }

    /// The element offsets the strided kernels compute for output element `i` (elementwise.cu's
    /// `strided_offsets`), emulated on the host.
    fn kernel_offsets(s: &StridedArgs, mut i: i64, nin: usize) -> Vec<i64> {
        let mut off: Vec<i64> = s.offsets[..nin].to_vec();
        for d in (0..s.ndim as usize).rev() {
            let c = i % s.shape[d];
            i /= s.shape[d];
            for (k, o) in off.iter_mut().enumerate() {
                *o += c * s.strides[k][d];
            }
        }
        off
    }

    /// Views of a 4x6x8 buffer: contiguous, offset, permuted, narrowed, broadcast.
    fn views() -> Vec<Layout> {
        let base = Layout::contiguous(Shape::new(vec![4, 6, 8]));
        vec![
            base.clone(),
            base.narrow(1, 2, 3).unwrap(),
            base.permute(&[2, 0, 1]).unwrap(),
            base.narrow(2, 1, 5).unwrap().permute(&[1, 2, 0]).unwrap(),
            base.narrow(0, 1, 1)
                .unwrap()
                .broadcast_as(&Shape::new(vec![2, 1, 6, 8]))
                .unwrap(),
            Layout::new(Shape::new(vec![3, 2]), vec![0, 5], 7),
        ]
    }

    #[test]
    fn emulated_strided_copies_match_the_cpu() {
        let data: Vec<i64> = (0..192).map(|v| v * 1_000_003 - (1 << 40)).collect();
        for l in views() {
            let n = l.shape().elem_count();
            let mut want = vec![0i64; n];
            meshgrad_kernels::cpu::strided::copy_strided(
                &data,
                l.offset(),
                l.dims(),
                l.strides(),
                &mut want,
            );
            // 4-byte kernel elements.
            let s = strided_args("t", l.dims(), &[View::of(&l)]).unwrap();
            let got: Vec<i64> = (0..n as i64)
                .map(|i| data[kernel_offsets(&s, i, 1)[0] as usize])
                .collect();
            assert_eq!(got, want, "{l:?}");
            // 8-byte elements as word pairs of the little-endian buffer.
            let words: Vec<u32> = data
                .iter()
                .flat_map(|&v| [v as u32, (v >> 32) as u32])
                .collect();
            let (d, v) = as_word_pairs(l.dims(), &[View::of(&l)], &[1]);
            let s = strided_args("t", &d, &v).unwrap();
            assert_eq!(s.numel as usize, 2 * n);
            let got: Vec<i64> = (0..n as i64)
                .map(|i| {
                    let lo = words[kernel_offsets(&s, 2 * i, 1)[0] as usize] as u64;
                    let hi = words[kernel_offsets(&s, 2 * i + 1, 1)[0] as usize] as u64;
                    (lo | (hi << 32)) as i64
                })
                .collect();
            assert_eq!(got, want, "word pairs of {l:?}");
        }
    }

    #[test]
    fn emulated_where_over_word_pairs_keeps_the_condition_per_element() {
        // cond broadcast along dim 0; t, f [2, 3] 8-byte values.
        let cond = [1u8, 0, 1];
        let t: Vec<i64> = vec![-1, -2, -3, -4, -5, -6];
        let f: Vec<i64> = vec![10, 20, 30, 40, 50, 60];
        let lc = Layout::contiguous(Shape::new(vec![3]))
            .broadcast_as(&Shape::new(vec![2, 3]))
            .unwrap();
        let lt = Layout::contiguous(Shape::new(vec![2, 3]));
        let views = [View::of(&lc), View::of(&lt), View::of(&lt)];
        let (d, v) = as_word_pairs(&[2, 3], &views, &[0, 1, 1]);
        let s = strided_args("t", &d, &v).unwrap();
        let split = |x: &[i64]| -> Vec<u32> {
            x.iter()
                .flat_map(|&v| [v as u32, (v >> 32) as u32])
                .collect()
        };
        let (tw, fw) = (split(&t), split(&f));
        let out: Vec<u32> = (0..s.numel)
            .map(|i| {
                let o = kernel_offsets(&s, i, 3);
                if cond[o[0] as usize] != 0 {
                    tw[o[1] as usize]
                } else {
                    fw[o[2] as usize]
                }
            })
            .collect();
        let got: Vec<i64> = out
            .chunks(2)
            .map(|w| (w[0] as u64 | ((w[1] as u64) << 32)) as i64)
            .collect();
        assert_eq!(got, vec![-1, 20, -3, -4, 50, -6]);
    }

    #[test]
    fn emulated_pitched_writes_match_the_cpu() {
        // Destinations: slices of a 4x6x8 buffer (as `cat` writes them) and transposes, each
        // handled as copy_into does: dims by decreasing stride, then a contiguous write or
        // pitched 2-D copies of the contiguous source.
        let base = Layout::contiguous(Shape::new(vec![4, 6, 8]));
        let dsts = [
            base.narrow(1, 2, 3).unwrap(),
            base.narrow(2, 3, 4).unwrap(),
            base.narrow(0, 1, 2).unwrap().narrow(2, 0, 5).unwrap(),
            base.permute(&[1, 0, 2]).unwrap(),
            base.narrow(2, 1, 6).unwrap().permute(&[2, 1, 0]).unwrap(),
        ];
        for dl in dsts {
            let n = dl.shape().elem_count();
            let src: Vec<i64> = (0..n as i64).map(|v| 1000 + v).collect();
            let mut want = vec![0i64; 192];
            meshgrad_kernels::cpu::strided::copy_into_strided(
                &src,
                &mut want,
                dl.offset(),
                dl.dims(),
                dl.strides(),
            );
            let perm = by_decreasing_stride(&dl);
            let pdl = dl.permute(&perm).unwrap();
            // The source, permuted the same way and made contiguous (what copy_strided does).
            let sl = Layout::contiguous(dl.shape().clone())
                .permute(&perm)
                .unwrap();
            let mut psrc = vec![0i64; n];
            meshgrad_kernels::cpu::strided::copy_strided(
                &src,
                sl.offset(),
                sl.dims(),
                sl.strides(),
                &mut psrc,
            );
            let mut got = vec![0i64; 192];
            if pdl.is_contiguous() {
                got[pdl.offset()..pdl.offset() + n].copy_from_slice(&psrc);
            } else {
                let p = pitch_plan(pdl.dims(), pdl.strides());
                assert!(p.pitch >= p.run);
                for k in 0..p.copies() {
                    for r in 0..p.height {
                        for e in 0..p.run {
                            got[pdl.offset() + p.dst_offset(k) + r * p.pitch + e] =
                                psrc[(k * p.height + r) * p.run + e];
                        }
                    }
                }
            }
            assert_eq!(got, want, "{dl:?}");
        }
    }

    #[test]
    fn dims_sort_by_decreasing_stride() {
        let l = Layout::new(Shape::new(vec![3, 2, 4]), vec![1, 12, 3], 0);
        assert_eq!(by_decreasing_stride(&l), vec![1, 2, 0]);
    }
}

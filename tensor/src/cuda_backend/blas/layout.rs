//! The host-side mapping of the backend's row-major batched product onto cuBLASLt's
//! column-major strided-batched GEMM. Pure arithmetic on sizes and strides: no CUDA call, so it
//! is tested on machines without a GPU (see `emulate.rs`).
//!
//! The backend computes the row-major `C[b] = A[b] · B[b]` (`A` is `m×k`, `B` is `k×n`, `C` is
//! a fresh contiguous `m×n`) as the column-major `Cᵀ[b] = Bᵀ[b] · Aᵀ[b]`: the contiguous
//! row-major `C` is, read column-major, the `n×m` matrix `Cᵀ` with leading dimension `n`. So
//! cuBLASLt's operand A is the logical `B` (read as `Bᵀ`, `n×k`), its operand B is the logical
//! `A` (read as `Aᵀ`, `k×m`), and its problem sizes are `(m, n, k) = (n, m, k)` of ours.
//!
//! An operand is read in place when one of its two strides is 1 and the other is at least the
//! extent of the first dimension (a row-major or column-major matrix, rows or columns possibly
//! padded): that is one transpose flag and one leading dimension. Strides of dimensions of
//! extent 1 are never used and are ignored. Any other layout (two non-unit strides, stride-0
//! rows or columns, overlapping rows) is copied to a contiguous buffer first ([`PackedCopy`]).
//! The batch stride is passed as is, 0 included (one matrix broadcast over the batch).

use cudarc::cublaslt::sys::{cublasComputeType_t, cublasLtEpilogue_t, cudaDataType};
use meshgrad_kernels::ops::MatrixLayout;

use crate::DType;

/// One operand as cuBLASLt reads it: a stored column-major `rows×cols` matrix with leading
/// dimension `ld`, used as is (`trans == false`) or transposed, `batch_stride` elements
/// between the matrices of the batch (0: one matrix for all).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Operand {
    /// Whether cuBLASLt reads the stored matrix transposed (`CUBLAS_OP_T`).
    pub trans: bool,
    /// Rows of the stored matrix (before the transpose).
    pub rows: u64,
    /// Columns of the stored matrix (before the transpose).
    pub cols: u64,
    /// Leading dimension: elements between consecutive columns of the stored matrix.
    pub ld: i64,
    /// Elements between consecutive matrices of the batch.
    pub batch_stride: i64,
}

/// One cuBLASLt strided-batched GEMM, `D[b] = op(A[b]) · op(B[b])`, in cuBLASLt's names and
/// column-major terms: `op(A)` is `m×k`, `op(B)` is `k×n`, `D` is `m×n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Gemm {
    /// Rows of `D` (the logical `n`).
    pub m: u64,
    /// Columns of `D` (the logical `m`).
    pub n: u64,
    /// The reduced dimension.
    pub k: u64,
    /// Matrices in the batch.
    pub batch: i32,
    /// cuBLASLt's A: the logical right operand, read as `Bᵀ`.
    pub a: Operand,
    /// cuBLASLt's B: the logical left operand, read as `Aᵀ`.
    pub b: Operand,
    /// The output (also passed as C, with beta 0): contiguous, never transposed.
    pub d: Operand,
}

/// The column-major matrix `X` (`r×c`) whose element `(p, q)` sits at `p·sp + q·sq` (plus the
/// batch offset), as one cuBLASLt operand; `None` when no transpose flag and leading dimension
/// describe it (it must be copied).
fn read_as(r: usize, c: usize, sp: usize, sq: usize, batch_stride: i64) -> Option<Operand> {
    let (r_free, c_free) = (r <= 1, c <= 1);
    // As stored: rows contiguous (stride 1 along p), columns `sq` apart.
    if (r_free || sp == 1) && (c_free || sq >= r.max(1)) {
        let ld = if c_free { r.max(1) } else { sq };
        return Some(Operand {
            trans: false,
            rows: r as u64,
            cols: c as u64,
            ld: i64::try_from(ld).ok()?,
            batch_stride,
        });
    }
    // Transposed: X is the transpose of a stored `c×r` column-major matrix with ld `sp`.
    if (c_free || sq == 1) && (r_free || sp >= c.max(1)) {
        let ld = if r_free { c.max(1) } else { sp };
        return Some(Operand {
            trans: true,
            rows: c as u64,
            cols: r as u64,
            ld: i64::try_from(ld).ok()?,
            batch_stride,
        });
    }
    None
}

/// The batch stride cuBLASLt is given: the layout's, or 0 when there is only one matrix.
fn batch_stride(l: &MatrixLayout, batch: usize) -> Option<i64> {
    if batch <= 1 {
        Some(0)
    } else {
        i64::try_from(l.batch_stride).ok()
    }
}

/// The logical left operand `A` (`m×k`, layout `al`) as cuBLASLt's B (`Aᵀ`, `k×m`); `None`
/// when it must be copied first.
pub(crate) fn lhs_operand(al: &MatrixLayout, batch: usize, m: usize, k: usize) -> Option<Operand> {
    // Aᵀ(p, q) = A[q][p] at q·row_stride + p·col_stride.
    read_as(k, m, al.col_stride, al.row_stride, batch_stride(al, batch)?)
}

/// The logical right operand `B` (`k×n`, layout `bl`) as cuBLASLt's A (`Bᵀ`, `n×k`); `None`
/// when it must be copied first.
pub(crate) fn rhs_operand(bl: &MatrixLayout, batch: usize, k: usize, n: usize) -> Option<Operand> {
    // Bᵀ(p, q) = B[q][p] at q·row_stride + p·col_stride.
    read_as(n, k, bl.col_stride, bl.row_stride, batch_stride(bl, batch)?)
}

/// The output: the contiguous row-major `[batch, m, n]` buffer as the column-major `n×m` D.
pub(crate) fn output_operand(batch: usize, m: usize, n: usize) -> Operand {
    Operand {
        trans: false,
        rows: n as u64,
        cols: m as u64,
        ld: n.max(1) as i64,
        batch_stride: if batch <= 1 { 0 } else { (m * n) as i64 },
    }
}

/// The GEMM computing the row-major product from the two operands found by [`lhs_operand`] and
/// [`rhs_operand`]; `Err` says why cuBLASLt cannot take the sizes.
pub(crate) fn gemm(
    lhs: Operand,
    rhs: Operand,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
) -> Result<Gemm, String> {
    let batch = i32::try_from(batch)
        .map_err(|_| format!("a batch of {batch} matrices exceeds cuBLASLt's i32 count"))?;
    if m.checked_mul(n)
        .and_then(|mn| i64::try_from(mn).ok())
        .is_none()
    {
        return Err(format!(
            "an output matrix of {m}x{n} exceeds cuBLASLt's i64 strides"
        ));
    }
    Ok(Gemm {
        m: n as u64,
        n: m as u64,
        k: k as u64,
        batch,
        a: rhs,
        b: lhs,
        d: output_operand(batch as usize, m, n),
    })
}

/// One past the largest flat index `batch` matrices of `rows×cols` in layout `l` touch (0 when
/// any of the three is 0): a layout reaching past its buffer is refused before any device call.
pub(crate) fn extent(l: &MatrixLayout, batch: usize, rows: usize, cols: usize) -> Option<usize> {
    if batch == 0 || rows == 0 || cols == 0 {
        return Some(0);
    }
    let mut e = l.offset;
    for (count, stride) in [
        (batch, l.batch_stride),
        (rows, l.row_stride),
        (cols, l.col_stride),
    ] {
        e = e.checked_add((count - 1).checked_mul(stride)?)?;
    }
    e.checked_add(1)
}

/// How to copy an operand that cannot be read in place: the view to copy (`dims`, `strides`,
/// `offset` of a [`crate::Layout`]) and the layout of the contiguous copy. A broadcast batch
/// (stride 0) or a batch of one copies one matrix and keeps stride 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PackedCopy {
    /// Dimensions of the view to copy: `[rows, cols]` or `[batch, rows, cols]`.
    pub dims: Vec<usize>,
    /// Strides of the view, matching `dims`.
    pub strides: Vec<usize>,
    /// Offset of the view.
    pub offset: usize,
    /// The layout of the contiguous copy (offset 0, row-major).
    pub packed: MatrixLayout,
}

/// The copy making `batch` matrices of `rows×cols` in layout `l` contiguous.
pub(crate) fn packed_copy(l: &MatrixLayout, batch: usize, rows: usize, cols: usize) -> PackedCopy {
    let one = batch <= 1 || l.batch_stride == 0;
    let (dims, strides) = if one {
        (vec![rows, cols], vec![l.row_stride, l.col_stride])
    } else {
        (
            vec![batch, rows, cols],
            vec![l.batch_stride, l.row_stride, l.col_stride],
        )
    };
    PackedCopy {
        dims,
        strides,
        offset: l.offset,
        packed: MatrixLayout {
            offset: 0,
            batch_stride: if one { 0 } else { rows * cols },
            row_stride: cols,
            col_stride: 1,
        },
    }
}

/// The largest power of two, at most 256, dividing a device address: what the preference's
/// `MIN_ALIGNMENT_*_BYTES` attributes are set to, so the heuristic only picks algorithms that
/// work on this pointer (cuBLASLt assumes 256 by default; an offset into a buffer breaks that).
pub(crate) fn alignment(addr: u64) -> u32 {
    if addr == 0 {
        256
    } else {
        1u32 << addr.trailing_zeros().min(8)
    }
}

/// The alignment (bytes, power of two up to 256) cuBLASLt may assume for operand `o` whose
/// first element is at `addr`: the least of the alignments of the address, of the leading
/// dimension and (with more than one matrix) of the batch stride, in bytes. An algorithm's
/// minimum alignment covers the pointer, the leading dimension and other strides, so this is
/// what the preference's `MIN_ALIGNMENT_*_BYTES` is set to.
pub(crate) fn operand_alignment(addr: u64, o: &Operand, batch: i32, elem_bytes: usize) -> u32 {
    let bytes = |elems: i64| (elems.unsigned_abs()).saturating_mul(elem_bytes as u64);
    let mut a = alignment(addr).min(alignment(bytes(o.ld)));
    if batch > 1 {
        a = a.min(alignment(bytes(o.batch_stride)));
    }
    a
}

/// Alignment cuBLASLt's bias epilogue is given: a bias pointer less aligned than this is copied
/// to a fresh buffer (cuBLASLt has no preference attribute for the bias pointer's alignment).
pub(crate) const BIAS_ALIGNMENT: u32 = 16;

/// What cuBLASLt does to the product before writing D (the `EPILOGUE` attribute and the
/// pointers it needs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// `D = A·B`.
    Plain,
    /// `D = A·B + bias`, the bias having one entry per row of D (per output feature).
    Bias,
    /// `aux = A·B (+ bias)`, `D = gelu(aux)` with the tanh approximation: the pre-activation is
    /// written to the auxiliary buffer (same element type as D, leading dimension `aux_ld`).
    GeluAux {
        /// Whether the bias is added first (`GELU_AUX_BIAS`) or not (`GELU_AUX`).
        bias: bool,
        /// The `EPILOGUE_AUX_LD` attribute: elements between columns of the aux matrix.
        aux_ld: i64,
    },
}

impl Epilogue {
    /// Whether the epilogue reads a bias vector (`BIAS_POINTER`).
    pub fn has_bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluAux { bias: true, .. })
    }

    /// The leading dimension of the auxiliary output, when the epilogue writes one
    /// (`EPILOGUE_AUX_POINTER` and `EPILOGUE_AUX_LD`).
    pub fn aux_ld(self) -> Option<i64> {
        match self {
            Epilogue::GeluAux { aux_ld, .. } => Some(aux_ld),
            _ => None,
        }
    }

    /// The `cublasLtEpilogue_t` value of the `EPILOGUE` attribute.
    pub fn lt(self) -> cublasLtEpilogue_t {
        match self {
            Epilogue::Plain => cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAux { bias: false, .. } => cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX,
            Epilogue::GeluAux { bias: true, .. } => {
                cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_AUX_BIAS
            }
        }
    }
}

/// The GELU epilogue (with or without a bias) for a product of `batch` matrices writing `d`,
/// its pre-activation laid out exactly like D (the contiguous row-major `[m, n]` of the logical
/// product: D's leading dimension); `None` when cuBLASLt cannot take it: the aux leading
/// dimension must be a multiple of 8 (and at least D's rows), and only single products are
/// mapped (a batch would also need `EPILOGUE_AUX_BATCH_STRIDE`).
pub(crate) fn gelu_epilogue(d: &Operand, batch: usize, bias: bool) -> Option<Epilogue> {
    let ld = d.ld;
    (batch == 1 && ld % 8 == 0 && ld >= d.rows as i64)
        .then_some(Epilogue::GeluAux { bias, aux_ld: ld })
}

/// The epilogue of a product of `batch` matrices writing `d`, with a bias or not, and with GELU
/// (writing the pre-activation) or not; `None` when cuBLASLt cannot take the GELU epilogue
/// there (see [`gelu_epilogue`]).
pub(crate) fn epilogue_for(d: &Operand, batch: usize, bias: bool, gelu: bool) -> Option<Epilogue> {
    match (gelu, bias) {
        (true, _) => gelu_epilogue(d, batch, bias),
        (false, true) => Some(Epilogue::Bias),
        (false, false) => Some(Epilogue::Plain),
    }
}

/// What a cached plan is keyed by: everything the matmul descriptor, the matrix layouts, the
/// preference and the heuristic's choice depend on. Pointers are not part of it (they are
/// passed at each call), only their alignments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PlanKey {
    /// Element type of A, B and D (and of the bias and the aux output).
    pub dtype: DType,
    /// The epilogue (none, bias, GELU with its aux output).
    pub epilogue: Epilogue,
    /// Sizes, transposes, leading dimensions and batch strides.
    pub gemm: Gemm,
    /// Alignments (bytes, powers of two up to 256) of A, B and D ([`operand_alignment`]), of
    /// the bias pointer (0 without a bias) and of the aux pointer (0 without one): the
    /// heuristic's choice depends on them.
    pub align: [u32; 5],
}

/// The cuBLASLt types of one dtype: element type, compute type and scale (alpha, beta) type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LtTypes {
    /// The `cudaDataType` of A, B, C, D and the bias.
    pub data: cudaDataType,
    /// Accumulation: `CUBLAS_COMPUTE_32F` (full f32, no TF32) or `CUBLAS_COMPUTE_64F`.
    pub compute: cublasComputeType_t,
    /// The type of alpha and beta (f32 or f64).
    pub scale: cudaDataType,
}

/// The cuBLASLt types for `dtype`: f32 in f32 (no TF32, to match the CPU's f32 results), bf16
/// and f16 accumulated in f32 with output in their own type, f64 in f64; `None` for the
/// integer dtypes.
pub(crate) fn lt_types(dtype: DType) -> Option<LtTypes> {
    use cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_64F};
    use cudaDataType::{CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F, CUDA_R_64F};
    let (data, compute, scale) = match dtype {
        DType::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::BF16 => (CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        DType::F64 => (CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F),
        DType::U8 | DType::U32 | DType::I64 => return None,
    };
    Some(LtTypes {
        data,
        compute,
        scale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ml(
        offset: usize,
        batch_stride: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> MatrixLayout {
        MatrixLayout {
            offset,
            batch_stride,
            row_stride,
            col_stride,
        }
    }

    #[test]
    fn contiguous_operands_give_the_tn_gemm_of_a_linear_layer() {
        // x [m, k] row-major; Wᵀ read through the strides of a row-major W [n, k].
        let (m, n, k) = (5, 3, 4);
        let lhs = lhs_operand(&ml(0, 0, k, 1), 1, m, k).unwrap();
        let rhs = rhs_operand(&ml(0, 0, 1, k), 1, k, n).unwrap();
        let g = gemm(lhs, rhs, 1, m, n, k).unwrap();
        assert_eq!((g.m, g.n, g.k, g.batch), (3, 5, 4, 1));
        // cuBLASLt's A is W stored k×n column-major, transposed; B is x stored k×m, as is.
        assert_eq!(
            g.a,
            Operand {
                trans: true,
                rows: 4,
                cols: 3,
                ld: 4,
                batch_stride: 0
            }
        );
        assert_eq!(
            g.b,
            Operand {
                trans: false,
                rows: 4,
                cols: 5,
                ld: 4,
                batch_stride: 0
            }
        );
        assert_eq!(g.d, output_operand(1, m, n));
        assert_eq!((g.d.rows, g.d.cols, g.d.ld), (3, 5, 3));
        // Sizes cuBLASLt cannot take are refused.
        assert!(gemm(lhs, rhs, 1 << 31, m, n, k).is_err());
        assert!(gemm(lhs, rhs, 1, usize::MAX / 2, 3, k).is_err());
    }

    #[test]
    fn row_major_and_column_major_operands_map_to_one_flag_each() {
        // Row-major A with padded rows: Aᵀ is stored as is with ld = the row stride.
        let a = lhs_operand(&ml(3, 100, 7, 1), 4, 2, 5).unwrap();
        assert_eq!(
            (a.trans, a.rows, a.cols, a.ld, a.batch_stride),
            (false, 5, 2, 7, 100)
        );
        // Column-major A (a transposed view): Aᵀ is the transpose of the stored m×k matrix.
        let a = lhs_operand(&ml(0, 0, 1, 6), 4, 6, 5).unwrap();
        assert_eq!(
            (a.trans, a.rows, a.cols, a.ld, a.batch_stride),
            (true, 6, 5, 6, 0)
        );
        // A column-major stride smaller than the rows overlaps: copied.
        assert_eq!(lhs_operand(&ml(0, 0, 1, 5), 1, 6, 5), None);
        // Two non-unit strides, or a stride-0 broadcast inner dimension: copied.
        assert_eq!(lhs_operand(&ml(0, 0, 10, 2), 1, 3, 4), None);
        assert_eq!(rhs_operand(&ml(0, 0, 0, 1), 1, 3, 4), None);
    }

    #[test]
    fn strides_of_unit_dimensions_are_ignored() {
        // m = 1: any row stride, including 0 or a huge one.
        for rs in [0, 1, 3, 1 << 40] {
            let a = lhs_operand(&ml(0, 0, rs, 1), 1, 1, 8).unwrap();
            assert!(a.ld >= a.rows as i64 && a.ld >= 1, "{a:?}");
        }
        // k = 1 and n = 1 with arbitrary strides.
        let b = rhs_operand(&ml(0, 0, 9, 0), 1, 1, 1).unwrap();
        assert!(b.ld >= 1);
        let b = rhs_operand(&ml(0, 0, 5, 0), 1, 6, 1).unwrap();
        assert!(b.ld >= b.rows as i64, "{b:?}");
    }

    #[test]
    fn batch_strides_are_kept_zero_included_and_dropped_for_one_matrix() {
        let a = lhs_operand(&ml(0, 0, 4, 1), 3, 2, 4).unwrap();
        assert_eq!(a.batch_stride, 0);
        let a = lhs_operand(&ml(0, 12345, 4, 1), 1, 2, 4).unwrap();
        assert_eq!(a.batch_stride, 0, "a single matrix has no batch stride");
        assert_eq!(output_operand(3, 2, 5).batch_stride, 10);
        assert_eq!(output_operand(1, 2, 5).batch_stride, 0);
    }

    #[test]
    fn extents_and_packed_copies() {
        assert_eq!(extent(&ml(2, 10, 3, 1), 2, 3, 3), Some(2 + 10 + 6 + 2 + 1));
        assert_eq!(extent(&ml(2, 10, 3, 1), 0, 3, 3), Some(0));
        assert_eq!(extent(&ml(0, usize::MAX, 1, 1), 3, 1, 1), None);
        let c = packed_copy(&ml(7, 0, 2, 9), 4, 3, 5);
        assert_eq!((c.dims, c.strides, c.offset), (vec![3, 5], vec![2, 9], 7));
        assert_eq!(c.packed, ml(0, 0, 5, 1));
        let c = packed_copy(&ml(7, 100, 2, 9), 4, 3, 5);
        assert_eq!(c.dims, vec![4, 3, 5]);
        assert_eq!(c.strides, vec![100, 2, 9]);
        assert_eq!(c.packed, ml(0, 15, 5, 1));
        // A packed copy is always readable in place, on either side.
        assert!(lhs_operand(&c.packed, 4, 3, 5).is_some());
        assert!(rhs_operand(&c.packed, 4, 3, 5).is_some());
    }

    #[test]
    fn alignments_are_powers_of_two_capped_at_256() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0100 + 2), 2);
        assert_eq!(alignment(0x7f00_0000_0000 + 4 * 3), 4);
        assert_eq!(alignment(0x7f00_0000_0000 + 48), 16);
        assert_eq!(alignment(0x7f00_0000_0000 + 128), 128);
    }

    #[test]
    fn operand_alignment_is_the_least_of_pointer_ld_and_batch_stride() {
        let o = |ld, batch_stride| Operand {
            trans: false,
            rows: 4,
            cols: 4,
            ld,
            batch_stride,
        };
        let base = 0x7f00_0000_0000u64;
        // bf16, ld 64, packed batches of 64x64: all 128 bytes or more.
        assert_eq!(operand_alignment(base, &o(64, 4096), 3, 2), 128);
        // An odd leading dimension of bf16: 2 bytes, whatever the pointer.
        assert_eq!(operand_alignment(base, &o(33, 0), 1, 2), 2);
        // f32, ld 8 (32 bytes), pointer one element in (4 bytes).
        assert_eq!(operand_alignment(base + 4, &o(8, 0), 1, 4), 4);
        // The batch stride counts only with more than one matrix; stride 0 costs nothing.
        assert_eq!(operand_alignment(base, &o(64, 3), 1, 4), 256);
        assert_eq!(operand_alignment(base, &o(64, 3), 2, 4), 4);
        assert_eq!(operand_alignment(base, &o(64, 0), 2, 4), 256);
    }

    #[test]
    fn epilogues_map_to_their_cublaslt_values_and_pointers() {
        use cublasLtEpilogue_t::*;
        let gelu = |bias, aux_ld| Epilogue::GeluAux { bias, aux_ld };
        for (e, lt, bias, aux) in [
            (Epilogue::Plain, CUBLASLT_EPILOGUE_DEFAULT, false, None),
            (Epilogue::Bias, CUBLASLT_EPILOGUE_BIAS, true, None),
            (gelu(false, 16), CUBLASLT_EPILOGUE_GELU_AUX, false, Some(16)),
            (
                gelu(true, 24),
                CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                true,
                Some(24),
            ),
        ] {
            assert_eq!((e.lt(), e.has_bias(), e.aux_ld()), (lt, bias, aux), "{e:?}");
        }
        // The aux output is laid out like D: ld n for a linear layer's [m, n] output, which
        // cuBLASLt takes only when n is a multiple of 8 (and for a single product).
        let (m, k) = (5, 4);
        for (n, fused) in [(16, true), (8, true), (17, false), (4, false)] {
            let lhs = lhs_operand(&ml(0, 0, k, 1), 1, m, k).unwrap();
            let rhs = rhs_operand(&ml(0, 0, 1, k), 1, k, n).unwrap();
            let g = gemm(lhs, rhs, 1, m, n, k).unwrap();
            let e = gelu_epilogue(&g.d, 1, true);
            assert_eq!(e, gelu_epilogue(&output_operand(1, m, n), 1, true));
            assert_eq!(e.is_some(), fused, "n = {n}");
            if let Some(e) = e {
                assert_eq!(e.aux_ld(), Some(n as i64));
                assert_eq!(e.aux_ld(), Some(g.d.ld));
            }
        }
        let lhs = lhs_operand(&ml(0, 40, 8, 1), 2, 5, 8).unwrap();
        let rhs = rhs_operand(&ml(0, 0, 16, 1), 2, 8, 16).unwrap();
        let g = gemm(lhs, rhs, 2, 5, 16, 8).unwrap();
        assert_eq!(
            gelu_epilogue(&g.d, g.batch as usize, false),
            None,
            "batched products are not mapped"
        );
    }

    #[test]
    fn dtypes_map_to_their_cublaslt_types() {
        let t = lt_types(DType::F32).unwrap();
        assert_eq!(
            t.compute,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            "no TF32"
        );
        let t = lt_types(DType::BF16).unwrap();
        assert_eq!(
            (t.data, t.scale),
            (cudaDataType::CUDA_R_16BF, cudaDataType::CUDA_R_32F)
        );
        let t = lt_types(DType::F64).unwrap();
        assert_eq!(t.compute, cublasComputeType_t::CUBLAS_COMPUTE_64F);
        assert_eq!(lt_types(DType::I64), None);
    }
}

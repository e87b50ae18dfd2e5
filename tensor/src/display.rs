//! Printing tensors with their values, PyTorch-style (the format is documented on
//! [`Tensor::fmt_named`]).

use std::fmt::{self, Write};

use crate::storage::{CpuStorage, Storage};
use crate::{Error, Tensor};

/// Tensors with more elements than this are summarised.
const THRESHOLD: usize = 1000;
/// Entries shown at each end of a summarised dimension.
const EDGE: usize = 3;
/// Rows wrap at this many columns.
const LINE_WIDTH: usize = 80;
/// Decimals of floats unless the format gives a precision.
const DEFAULT_PRECISION: usize = 4;

/// One element as read from storage.
#[derive(Clone, Copy)]
enum Elem {
    Float(f64),
    Int(i64),
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_named(f, "Tensor", &[])
    }
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_named(f, "Tensor", &[])
    }
}

impl Tensor {
    /// Writes this tensor as its `Display` does, under `name` instead of `Tensor` and with the
    /// `extra` fields after the device: `name(values, shape=.., dtype=.., device=.., k=v, ..)`.
    /// Wrappers such as autograd's `Var` print through it.
    ///
    /// `Display` and `Debug` of a tensor print the same thing: the values in nested brackets
    /// (one level per dimension), then the shape, dtype and device:
    ///
    /// ```text
    /// Tensor([[ 1.0000, -2.5000,  3.0000],
    ///         [ 4.0000,  5.0000,  6.0000]], shape=[2, 3], dtype=f32, device=cpu)
    /// ```
    ///
    /// - Floats (of any float dtype, values as stored) get 4 decimals, or the precision of the
    ///   format (`{:.2}`). When the finite non-zero magnitudes span more than a factor of 1000,
    ///   or reach 1e8, or fall below 1e-4, all of them are in scientific notation
    ///   (`1.2346e+05`), except that integer-valued floats stay fixed below 1e8. `nan`, `inf`
    ///   and `-inf` print as such. Integer dtypes print as integers.
    /// - All elements of one tensor share that format and are right-aligned to the widest.
    /// - More than 1000 elements are summarised: in each dimension longer than 6 only the first
    ///   and last 3 entries are shown, with `...` between.
    /// - Rows longer than 80 columns wrap, aligned under their first element.
    /// - Empty tensors print `[]`, 0-d tensors their value without brackets, and a tensor whose
    ///   storage is released (FSDP) prints `released` instead of values.
    ///
    /// ```
    /// use std::fmt;
    /// use meshgrad_tensor::{Device, Tensor};
    /// struct Param(Tensor);
    /// impl fmt::Display for Param {
    ///     fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    ///         self.0.fmt_named(f, "Param", &[("trainable", &true)])
    ///     }
    /// }
    /// let p = Param(Tensor::from_vec(vec![0.5f32, 1.3], 2, Device::Cpu)?);
    /// assert_eq!(
    ///     format!("{p:.1}"),
    ///     "Param([0.5, 1.3], shape=[2], dtype=f32, device=cpu, trainable=true)"
    /// );
    /// # Ok::<(), meshgrad_tensor::Error>(())
    /// ```
    pub fn fmt_named(
        &self,
        f: &mut fmt::Formatter<'_>,
        name: &str,
        extra: &[(&str, &dyn fmt::Display)],
    ) -> fmt::Result {
        let precision = f.precision().unwrap_or(DEFAULT_PRECISION);
        let mut out = String::new();
        out.push_str(name);
        out.push('(');
        let indent = out.chars().count();
        match self.read_values() {
            Ok(values) => self.render_values(&values, precision, indent, &mut out),
            Err(Error::Released { .. }) => out.push_str("released"),
            Err(e) => write!(out, "<unreadable: {e}>")?,
        }
        write!(
            out,
            ", shape={}, dtype={}, device={}",
            self.shape(),
            self.dtype(),
            self.device()
        )?;
        for (k, v) in extra {
            write!(out, ", {k}={v}")?;
        }
        out.push(')');
        f.write_str(&out)
    }

    /// The indices shown along each dimension (`None` marks the `...` of a summarised one).
    fn shown_indices(&self) -> Vec<Vec<Option<usize>>> {
        let summarise = self.elem_count() > THRESHOLD;
        self.dims()
            .iter()
            .map(|&n| {
                if summarise && n > 2 * EDGE {
                    (0..EDGE)
                        .map(Some)
                        .chain(std::iter::once(None))
                        .chain((n - EDGE..n).map(Some))
                        .collect()
                } else {
                    (0..n).map(Some).collect()
                }
            })
            .collect()
    }

    /// The shown elements in row-major order (empty for an empty tensor).
    fn read_values(&self) -> crate::Result<Vec<Elem>> {
        let g = self.read_storage("display")?;
        if self.elem_count() == 0 {
            return Ok(Vec::new());
        }
        let shown = self.shown_indices();
        let strides = self.layout().strides();
        let mut offsets = Vec::new();
        fn walk(shown: &[Vec<Option<usize>>], strides: &[usize], at: usize, out: &mut Vec<usize>) {
            match shown.split_first() {
                None => out.push(at),
                Some((first, rest)) => {
                    for i in first.iter().flatten() {
                        walk(rest, &strides[1..], at + i * strides[0], out);
                    }
                }
            }
        }
        walk(&shown, strides, self.layout().offset(), &mut offsets);
        let s = Storage::read_elements(&g, &offsets)?;
        Ok(match s {
            CpuStorage::F64(v) => v.into_iter().map(Elem::Float).collect(),
            CpuStorage::F32(v) => v.into_iter().map(|x| Elem::Float(x.into())).collect(),
            CpuStorage::BF16(v) => v.into_iter().map(|x| Elem::Float(x.to_f64())).collect(),
            CpuStorage::F16(v) => v.into_iter().map(|x| Elem::Float(x.to_f64())).collect(),
            CpuStorage::U8(v) => v.into_iter().map(|x| Elem::Int(x.into())).collect(),
            CpuStorage::U32(v) => v.into_iter().map(|x| Elem::Int(x.into())).collect(),
            CpuStorage::I64(v) => v.into_iter().map(Elem::Int).collect(),
        })
    }

    /// Writes the nested brackets of `values` (the shown elements), the first at column `indent`.
    fn render_values(&self, values: &[Elem], precision: usize, indent: usize, out: &mut String) {
        if self.elem_count() == 0 {
            out.push_str("[]");
            return;
        }
        let texts = format_elements(values, precision);
        let width = texts.iter().map(|t| t.chars().count()).max().unwrap_or(0);
        let shown = self.shown_indices();
        let mut next = texts.iter().map(|t| format!("{t:>width$}"));
        if shown.is_empty() {
            out.push_str(&next.next().unwrap_or_default());
            return;
        }
        render_dim(&shown, 0, indent, width, &mut next, out);
    }
}

/// Writes dimension `depth` of the shown elements (taken in order from `next`); `indent` is the
/// column of the outermost `[`.
fn render_dim(
    shown: &[Vec<Option<usize>>],
    depth: usize,
    indent: usize,
    width: usize,
    next: &mut impl Iterator<Item = String>,
    out: &mut String,
) {
    let rank = shown.len();
    let col = indent + depth + 1; // column of this dimension's first entry
    out.push('[');
    if depth + 1 == rank {
        let per_line = ((LINE_WIDTH.saturating_sub(col)) / (width + 2)).max(1);
        for (k, i) in shown[depth].iter().enumerate() {
            if k > 0 {
                if k % per_line == 0 {
                    out.push_str(",\n");
                    out.extend(std::iter::repeat_n(' ', col));
                } else {
                    out.push_str(", ");
                }
            }
            match i {
                Some(_) => out.push_str(&next.next().unwrap_or_default()),
                None => out.push_str("..."),
            }
        }
    } else {
        for (k, i) in shown[depth].iter().enumerate() {
            if k > 0 {
                out.push(',');
                out.extend(std::iter::repeat_n('\n', rank - depth - 1));
                out.extend(std::iter::repeat_n(' ', col));
            }
            match i {
                Some(_) => render_dim(shown, depth + 1, indent, width, next, out),
                None => out.push_str("..."),
            }
        }
    }
    out.push(']');
}

/// The text of each element, in one format for all of them (see the module documentation).
fn format_elements(values: &[Elem], precision: usize) -> Vec<String> {
    let floats: Vec<f64> = values
        .iter()
        .filter_map(|v| match v {
            Elem::Float(x) => Some(*x),
            Elem::Int(_) => None,
        })
        .collect();
    let finite_nonzero = floats
        .iter()
        .filter(|x| x.is_finite() && **x != 0.0)
        .map(|x| x.abs());
    let (min, max) =
        finite_nonzero.fold((f64::INFINITY, 0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    let all_integral = floats
        .iter()
        .filter(|x| x.is_finite())
        .all(|x| x.fract() == 0.0);
    let sci = max > 0.0 && (max >= 1e8 || (!all_integral && (min < 1e-4 || max / min > 1000.0)));
    values
        .iter()
        .map(|v| match *v {
            Elem::Int(i) => i.to_string(),
            Elem::Float(x) if x.is_nan() => "nan".into(),
            Elem::Float(x) if x.is_infinite() => if x > 0.0 { "inf" } else { "-inf" }.into(),
            Elem::Float(x) if sci => scientific(x, precision),
            Elem::Float(x) => format!("{x:.precision$}"),
        })
        .collect()
}

/// `x` as `d.dddde±XX` with `precision` decimals and at least two exponent digits.
fn scientific(x: f64, precision: usize) -> String {
    let s = format!("{x:.precision$e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let e: i32 = exp.parse().unwrap_or(0);
            let sign = if e < 0 { '-' } else { '+' };
            format!("{mantissa}e{sign}{:02}", e.abs())
        }
        None => s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scientific_has_a_signed_two_digit_exponent() {
        assert_eq!(scientific(123456.0, 4), "1.2346e+05");
        assert_eq!(scientific(-1e-5, 4), "-1.0000e-05");
        assert_eq!(scientific(1.0, 2), "1.00e+00");
        assert_eq!(scientific(1e-300, 1), "1.0e-300");
    }
}

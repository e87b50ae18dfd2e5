//! Launch-argument checking: the parameter byte sizes of every `extern "C" __global__` entry
//! point, read from the kernel source text, so that a launch whose argument list does not match
//! its kernel is a clear error instead of a crash or garbage on the device.
//!
//! The declarations come from `meshgrad_kernels::cuda::parse` (the reader that also generates
//! the kernels crate's entry-point table at build time: it expands the function-like macros, so
//! the entries instantiated by `MG_FOR_FLOAT_TYPES(EW_ENTRIES)` come out with their concrete
//! names and element types). A parameter's size is 8 for a pointer, the C size of a scalar
//! type, or the `size_of` of the `#[repr(C)]` mirror in `meshgrad_kernels::cuda` for the
//! argument structs. Sizes catch a missing, extra or swapped (differently sized) argument; they
//! cannot tell `int` from `float` or one pointer from another.
//!
//! Each source is parsed once per process (at its first launch) and cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use meshgrad_kernels::cuda::{self as kc, AttnParams, GatherArgs, HeadLayout, StridedArgs};

use crate::{Error, Result};

/// The parameter byte sizes of every entry point of one source, by entry name.
pub(crate) type Signatures = HashMap<String, Vec<usize>>;

/// The byte size of a by-value parameter whose type is `ty` (tokens without qualifiers).
fn scalar_size(ty: &str) -> Option<usize> {
    Some(match ty {
        "double"
        | "i64"
        | "u64"
        | "long long"
        | "long long int"
        | "unsigned long long"
        | "unsigned long long int"
        | "size_t"
        | "int64_t"
        | "uint64_t"
        | "long" => 8,
        "float" | "int" | "unsigned" | "unsigned int" | "u32" | "i32" | "int32_t" | "uint32_t" => 4,
        "__half" | "__nv_bfloat16" | "short" | "unsigned short" | "int16_t" | "uint16_t" => 2,
        "u8" | "char" | "unsigned char" | "signed char" | "bool" | "uint8_t" | "int8_t" => 1,
        "StridedArgs" => std::mem::size_of::<StridedArgs>(),
        "GatherArgs" => std::mem::size_of::<GatherArgs>(),
        "AttnParams" => std::mem::size_of::<AttnParams>(),
        "HeadLayout" => std::mem::size_of::<HeadLayout>(),
        _ => return None,
    })
}

/// The byte size of one parameter declaration (`const T *x`, `i64 n`, `StridedArgs s`).
fn param_size(param: &[String]) -> std::result::Result<usize, String> {
    if param.iter().any(|t| t == "*" || t == "&") {
        return Ok(8);
    }
    let words: Vec<&str> = param
        .iter()
        .map(String::as_str)
        .filter(|t| !matches!(*t, "const" | "volatile" | "__restrict__" | "struct"))
        .collect();
    if let Some(n) = scalar_size(&words.join(" ")) {
        return Ok(n); // unnamed parameter
    }
    match words.split_last() {
        Some((_, ty)) if !ty.is_empty() => scalar_size(&ty.join(" "))
            .ok_or_else(|| format!("unknown parameter type `{}`", ty.join(" "))),
        _ => Err(format!("cannot read parameter `{}`", param.join(" "))),
    }
}

/// The entry points declared in `files` ((name, text) pairs read in order as one translation
/// unit: put the common header first for the macros it defines) with their parameter sizes. An
/// unreadable declaration is an error naming its file and line.
fn parse_files(files: &[(&str, &str)]) -> std::result::Result<Signatures, String> {
    let mut out = Signatures::new();
    for e in kc::parse::entry_points(files).map_err(|e| e.to_string())? {
        let sizes = e
            .params
            .iter()
            .map(|p| {
                param_size(p).map_err(|m| {
                    format!("kernels/cuda/{}:{}: kernel {}: {m}", e.file, e.line, e.name)
                })
            })
            .collect::<std::result::Result<Vec<_>, _>>()?;
        out.insert(e.name, sizes);
    }
    Ok(out)
}

/// [`parse_files`] of one text.
#[cfg(test)]
fn parse(source: &str) -> std::result::Result<Signatures, String> {
    parse_files(&[("test.cu", source)])
}

/// The parsed signatures of source `file` (a name in `meshgrad_kernels::cuda::SOURCES`),
/// parsed with the common header at the first request and cached.
pub(crate) fn signatures(file: &str) -> Result<Arc<Signatures>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<Signatures>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(s) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(file) {
        return Ok(s.clone());
    }
    let src = kc::source(file)
        .ok_or_else(|| Error::Msg(format!("no kernel source kernels/cuda/{file}")))?;
    let sigs = Arc::new(parse_files(&src.files()).map_err(|e| {
        Error::Msg(format!(
            "reading the kernel signatures of kernels/cuda/{file}: {e}"
        ))
    })?);
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(file.to_owned(), sigs.clone());
    Ok(sigs)
}

/// Checks a launch's argument byte sizes against the declaration of `entry` in `file`: an
/// unknown entry or a mismatch is an error naming the entry, the expected sizes and the given
/// ones.
pub(crate) fn check_args(file: &str, entry: &str, sizes: &[usize]) -> Result<()> {
    let sigs = signatures(file)?;
    let expected = sigs.get(entry).ok_or_else(|| {
        Error::Msg(format!(
            "kernel {entry} is not declared in kernels/cuda/{file}"
        ))
    })?;
    if expected.as_slice() != sizes {
        return Err(Error::Msg(format!(
            "kernel {entry} (kernels/cuda/{file}): argument sizes {sizes:?} ({} arguments) do \
             not match its parameters {expected:?} ({} parameters)",
            sizes.len(),
            expected.len()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_of_every_source_has_a_signature_and_no_more() {
        for src in kc::SOURCES {
            let sigs = signatures(src.name).unwrap();
            for e in src.entries {
                assert!(sigs.contains_key(*e), "{}: no signature for {e}", src.name);
            }
            for name in sigs.keys() {
                assert!(
                    src.entries.contains(&name.as_str()),
                    "{}: parsed {name}, which the entry table does not list",
                    src.name
                );
            }
        }
    }

    #[test]
    fn hand_checked_signatures() {
        let strided = std::mem::size_of::<StridedArgs>();
        let attn = std::mem::size_of::<AttnParams>();
        let gather = std::mem::size_of::<GatherArgs>();
        let cases: &[(&str, &str, Vec<usize>)] = &[
            // (const T *x, T *out, i64 n, int op, double a, double b)
            ("elementwise.cu", "unary_f32", vec![8, 8, 8, 4, 8, 8]),
            // (int op, StridedArgs s, const T *a, const T *b, T *out)
            ("elementwise.cu", "binary_f32", vec![4, strided, 8, 8, 8]),
            ("elementwise.cu", "fill_u8", vec![8, 8, 4]),
            ("cast.cu", "cast_bf16_to_f16", vec![8, 8, 8]),
            // (x, w, b, y, mean, rstd, i64 rows, i64 cols, float eps)
            (
                "layer_norm.cu",
                "layer_norm_fwd_bf16",
                vec![8, 8, 8, 8, 8, 8, 8, 8, 4],
            ),
            // (q, k, v, out, lse, key_padding, AttnParams P)
            (
                "attention.cu",
                "attn_fwd_d64_f32",
                vec![8, 8, 8, 8, 8, 8, attn],
            ),
            ("attention.cu", "attn_bwd_delta_f16", vec![8, 8, 8, attn, 8]),
            ("gather.cu", "gather_bwd_f16", vec![gather, 8, 8, 8, 8]),
            // (out, n, u64 seed, u64 start, float p, double scale)
            ("dropout.cu", "dropout_mask_bf16", vec![8, 8, 8, 8, 4, 8]),
            ("random.cu", "randint_i64", vec![8, 8, 8, 8, 8, 8]),
        ];
        for (file, entry, want) in cases {
            assert_eq!(&signatures(file).unwrap()[*entry], want, "{entry}");
            check_args(file, entry, want).unwrap();
        }
    }

    #[test]
    fn a_mismatch_names_the_entry_and_both_lists() {
        let e = check_args("elementwise.cu", "unary_f32", &[8, 8, 8, 4, 8])
            .unwrap_err()
            .to_string();
        assert!(e.contains("unary_f32"), "{e}");
        assert!(e.contains("[8, 8, 8, 4, 8]"), "{e}");
        assert!(e.contains("[8, 8, 8, 4, 8, 8]"), "{e}");
        let e = check_args("elementwise.cu", "nope_f32", &[]).unwrap_err();
        assert!(e.to_string().contains("nope_f32"));
        assert!(check_args("nope.cu", "x", &[]).is_err());
    }

    #[test]
    fn the_preprocessor_pastes_rescans_and_skips_comments() {
        let src = "#define P(sfx, T, D) extern \"C\" __global__ void __launch_bounds__(128) \\\n\
                   k_d##D##_##sfx(const T *x, T v, /* c */ i64 n) {}\n\
                   #define ALL(M) M(f32, float) M(h, __half)\n\
                   #define Q(sfx, T) P(sfx, T, 64) // trailing\n\
                   ALL(Q)\n\
                   extern \"C\" __global__ void plain(unsigned long long a, u8 b, GatherArgs g) {}\n";
        let s = parse(src).unwrap();
        assert_eq!(s["k_d64_f32"], vec![8, 4, 8]);
        assert_eq!(s["k_d64_h"], vec![8, 2, 8]);
        assert_eq!(s["plain"], vec![8, 1, std::mem::size_of::<GatherArgs>()]);
        assert_eq!(s.len(), 3);
        assert!(parse("extern \"C\" __global__ void bad(Mystery m) {}").is_err());
    }
}

//! Launch-argument checking: the parameter byte sizes of every `extern "C" __global__` entry
//! point, read from the kernel source text, so that a launch whose argument list does not match
//! its kernel is a clear error instead of a crash or garbage on the device.
//!
//! The reader is a small C preprocessor for what `kernels/cuda/*.cu` use: comments, line
//! continuations and function-like `#define`s (with `##` pasting and rescanning, so the
//! entries instantiated by `MG_FOR_FLOAT_TYPES(EW_ENTRIES)` come out with their concrete names
//! and element types). Each expanded declaration `extern "C" __global__ void
//! [__launch_bounds__(..)] name(params)` yields one entry; a parameter's size is 8 for a
//! pointer, the C size of a scalar type, or the `size_of` of the `#[repr(C)]` mirror in
//! `meshgrad_kernels::cuda` for the argument structs. Sizes catch a missing, extra or swapped
//! (differently sized) argument; they cannot tell `int` from `float` or one pointer from another.
//!
//! Each source is parsed once per process (at its first launch) and cached.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use meshgrad_kernels::cuda::{self as kc, AttnParams, GatherArgs, HeadLayout, StridedArgs};

use crate::{Error, Result};

/// The parameter byte sizes of every entry point of one source, by entry name.
pub(crate) type Signatures = HashMap<String, Vec<usize>>;

/// One preprocessing token: an identifier or number, a string literal, `##`, or one other
/// character.
type Token = String;

/// Splits preprocessed text (no comments, no continuations) into tokens.
fn tokenize(text: &str) -> Vec<Token> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            // Numbers such as `1.0f` or `0x9E3779B9u` stay one token (the dot joins digits).
            while i < chars.len()
                && (chars[i].is_alphanumeric()
                    || chars[i] == '_'
                    || (chars[i] == '.' && chars[start].is_ascii_digit()))
            {
                i += 1;
            }
            out.push(chars[start..i].iter().collect());
        } else if c == '"' || c == '\'' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != c {
                if chars[i] == '\\' {
                    i += 1;
                }
                i += 1;
            }
            i = (i + 1).min(chars.len());
            out.push(chars[start..i].iter().collect());
        } else if c == '#' && chars.get(i + 1) == Some(&'#') {
            out.push("##".to_owned());
            i += 2;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

/// Removes `//` and `/* */` comments (outside string literals) and joins continued lines.
fn strip_comments(src: &str) -> String {
    let joined = src.replace("\\\r\n", " ").replace("\\\n", " ");
    let chars: Vec<char> = joined.chars().collect();
    let mut out = String::with_capacity(chars.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != '"' && chars[i] != '\n' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i = (i + 1).min(chars.len());
            out.extend(&chars[start..i]);
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                i += 1;
            }
            i += 2;
            out.push(' ');
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// A function-like macro: parameter names and body tokens.
struct Macro {
    params: Vec<String>,
    body: Vec<Token>,
}

/// Splits comment-free text into the function-like macros it defines and the tokens of its
/// non-directive lines.
fn read_defines(text: &str) -> (HashMap<String, Macro>, Vec<Token>) {
    let mut macros = HashMap::new();
    let mut tokens = Vec::new();
    for line in text.lines() {
        let t = line.trim_start();
        let Some(directive) = t.strip_prefix('#') else {
            tokens.extend(tokenize(line));
            continue;
        };
        let Some(def) = directive.trim_start().strip_prefix("define") else {
            continue; // #include, #line, #pragma, ...
        };
        let def = def.trim_start();
        let name_end = def
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(def.len());
        let (name, rest) = def.split_at(name_end);
        // Function-like only when `(` follows the name directly; object-like macros (numeric
        // constants) do not occur in declarations and are left alone.
        let Some(rest) = rest.strip_prefix('(') else {
            continue;
        };
        let Some(close) = rest.find(')') else {
            continue;
        };
        let params = rest[..close]
            .split(',')
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
            .collect();
        let body = tokenize(&rest[close + 1..]);
        macros.insert(name.to_owned(), Macro { params, body });
    }
    (macros, tokens)
}

/// The index of the `)` matching the `(` at `open`, if any.
fn matching_paren(tokens: &[Token], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        match t.as_str() {
            "(" => depth += 1,
            ")" => {
                depth -= 1;
                if depth == 0 {
                    return Some(k);
                }
            }
            _ => {}
        }
    }
    None
}

/// Splits the tokens strictly between two parentheses at their top-level commas.
fn split_args(tokens: &[Token]) -> Vec<Vec<Token>> {
    let mut args = vec![Vec::new()];
    let mut depth = 0usize;
    for t in tokens {
        match t.as_str() {
            "(" => depth += 1,
            ")" => depth = depth.saturating_sub(1),
            "," if depth == 0 => {
                args.push(Vec::new());
                continue;
            }
            _ => {}
        }
        args.last_mut().expect("one list at least").push(t.clone());
    }
    if args.len() == 1 && args[0].is_empty() {
        args.clear();
    }
    args
}

/// The body of `m` with `args` substituted and `##` pasted.
fn substitute(m: &Macro, args: &[Vec<Token>]) -> Vec<Token> {
    let mut out: Vec<Token> = Vec::new();
    let mut paste = false;
    for t in &m.body {
        if t == "##" {
            paste = true;
            continue;
        }
        let replacement: Vec<Token> = match m.params.iter().position(|p| p == t) {
            Some(k) => args.get(k).cloned().unwrap_or_default(),
            None => vec![t.clone()],
        };
        let mut it = replacement.into_iter();
        if paste {
            if let (Some(last), Some(first)) = (out.last_mut(), it.next()) {
                last.push_str(&first);
            }
            paste = false;
        }
        out.extend(it);
    }
    out
}

/// Expands every invocation of a function-like macro in `tokens`, rescanning the results
/// (`depth` bounds runaway recursion).
fn expand(tokens: &[Token], macros: &HashMap<String, Macro>, depth: usize) -> Vec<Token> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        let t = &tokens[i];
        if let Some(m) = macros.get(t) {
            if depth < 16 && tokens.get(i + 1).map(String::as_str) == Some("(") {
                if let Some(close) = matching_paren(tokens, i + 1) {
                    let args = split_args(&tokens[i + 2..close]);
                    let body = substitute(m, &args);
                    // Rescan the expansion together with what follows (a macro name passed as an
                    // argument, e.g. `M(f32, float)` inside MG_FOR_FLOAT_TYPES, is invoked
                    // there).
                    out.extend(expand(&body, macros, depth + 1));
                    i = close + 1;
                    continue;
                }
            }
        }
        out.push(t.clone());
        i += 1;
    }
    out
}

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
fn param_size(param: &[Token]) -> std::result::Result<usize, String> {
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

/// The entry points declared in `source` (a `.cu` text; prepend the common header for the
/// macros it defines) with their parameter sizes. An unreadable declaration is an error naming
/// it.
pub(crate) fn parse(source: &str) -> std::result::Result<Signatures, String> {
    let (macros, tokens) = read_defines(&strip_comments(source));
    let tokens = expand(&tokens, &macros, 0);
    let mut out = Signatures::new();
    let mut i = 0;
    while i + 3 < tokens.len() {
        let is_decl = tokens[i] == "extern"
            && tokens[i + 1] == "\"C\""
            && tokens[i + 2] == "__global__"
            && tokens[i + 3] == "void";
        if !is_decl {
            i += 1;
            continue;
        }
        let mut k = i + 4;
        if tokens.get(k).map(String::as_str) == Some("__launch_bounds__") {
            k = matching_paren(&tokens, k + 1).ok_or("unclosed __launch_bounds__")? + 1;
        }
        let name = tokens
            .get(k)
            .cloned()
            .ok_or("a declaration without a name")?;
        if tokens.get(k + 1).map(String::as_str) != Some("(") {
            return Err(format!("kernel {name}: no parameter list"));
        }
        let close = matching_paren(&tokens, k + 1)
            .ok_or_else(|| format!("kernel {name}: unclosed parameter list"))?;
        let sizes = split_args(&tokens[k + 2..close])
            .iter()
            .map(|p| param_size(p).map_err(|e| format!("kernel {name}: {e}")))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        if out.insert(name.clone(), sizes).is_some() {
            return Err(format!("kernel {name} is declared twice"));
        }
        i = close + 1;
    }
    Ok(out)
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
    let text = format!("{}\n{}", kc::COMMON_HEADER, src.source);
    let sigs = Arc::new(parse(&text).map_err(|e| {
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
            ("elementwise.cu", "cast_bf16_to_f16", vec![8, 8, 8]),
            // (x, w, b, y, mean, rstd, i64 rows, i64 cols, float eps)
            (
                "norms.cu",
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
            ("random.cu", "dropout_mask_bf16", vec![8, 8, 8, 8, 4, 8]),
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

//! The reader of `extern "C" __global__` entry-point declarations in `kernels/cuda/*.cu`: where
//! each source's list of entry points comes from, so that an entry point is written once (in its
//! `.cu` file).
//!
//! Used twice: `kernels/build.rs` includes this file (`#[path]`) to generate
//! [`SOURCES`](super::SOURCES) at build time, and the tensor crate's CUDA backend reads the
//! parameter lists from it to check every launch's argument sizes. So this file depends on
//! nothing but `std`.
//!
//! It is a small C preprocessor for what the kernel files use: comments, line continuations and
//! function-like `#define`s (with `##` pasting and rescanning, so the entries instantiated by
//! `MG_FOR_FLOAT_TYPES(EW_ENTRIES)` come out with their concrete names). Object-like macros
//! (numeric constants) are not expanded; they do not occur in declarations. Each expanded
//! declaration `extern "C" __global__ void [__launch_bounds__(..)] name(params)` yields one
//! [`EntryPoint`]. What the reader cannot read unambiguously is an error naming the file and
//! line: a conditional directive (`#if`, `#ifdef`, ..., `#undef`), an `extern "C" { .. }` block,
//! a `__global__` function that is not `extern "C"` (its PTX name would be mangled), a
//! declaration without a name or parameter list, or a name declared twice.

use std::collections::HashMap;

/// A place in the kernel sources: a file name (as given to [`entry_points`]) and a 1-based line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Loc<'a> {
    file: &'a str,
    line: usize,
}

/// One preprocessing token: an identifier or number, a string or character literal, `##`, or
/// one other character; with where its text is written (`at`) and where it entered the
/// top-level token stream (`site`: the macro invocation it came from, or `at`).
#[derive(Clone, Debug)]
struct Token<'a> {
    text: String,
    at: Loc<'a>,
    site: Loc<'a>,
}

impl Token<'_> {
    fn is(&self, s: &str) -> bool {
        self.text == s
    }
}

/// One `extern "C" __global__` entry point, as declared after macro expansion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EntryPoint {
    /// The entry point's (unmangled) name, e.g. `softmax_fwd_bf16`.
    pub name: String,
    /// The parameter declarations, each as its tokens (e.g. `["const", "__half", "*", "x"]`).
    pub params: Vec<Vec<String>>,
    /// The file the declaration's text is written in (a macro body's file, for an instantiated
    /// entry).
    pub file: String,
    /// The 1-based line of the declaration's name (in a macro body, for an instantiated entry).
    pub line: usize,
}

/// A declaration (or a directive) the reader cannot read, with where it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// The file name, as given to [`entry_points`].
    pub file: String,
    /// The 1-based line.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "kernels/cuda/{}:{}: {}",
            self.file, self.line, self.message
        )
    }
}

impl std::error::Error for ParseError {}

/// An error at `at`, noting the macro invocation at `site` when the text came from one.
fn error_at(at: Loc<'_>, site: Loc<'_>, message: impl Into<String>) -> ParseError {
    let mut message = message.into();
    if site != at {
        message.push_str(&format!(
            " (in the expansion of the macro invoked at {}:{})",
            site.file, site.line
        ));
    }
    ParseError {
        file: at.file.to_owned(),
        line: at.line,
        message,
    }
}

/// An error at token `t`.
fn error(t: &Token<'_>, message: impl Into<String>) -> ParseError {
    error_at(t.at, t.site, message)
}

/// Removes `//` and `/* */` comments (outside string and character literals); a block comment
/// keeps its line breaks, so line numbers stay those of the file. Line continuations are kept.
fn strip_comments(src: &str) -> String {
    let chars: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(chars.len());
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' {
            let start = i;
            i += 1;
            while i < chars.len() && chars[i] != c && chars[i] != '\n' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i = (i + 1).min(chars.len());
            out.extend(&chars[start..i]);
        } else if c == '/' && chars.get(i + 1) == Some(&'/') {
            // To the end of the line; a backslash before the line break continues the comment.
            while i < chars.len() {
                if chars[i] == '\n' {
                    if i > 0 && chars[i - 1] == '\\' {
                        out.push('\n');
                        i += 1;
                        continue;
                    }
                    break;
                }
                i += 1;
            }
        } else if c == '/' && chars.get(i + 1) == Some(&'*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                if chars[i] == '\n' {
                    out.push('\n');
                }
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

/// Splits one line (no comments, no continuation backslash) into tokens located at `at`.
fn tokenize<'a>(text: &str, at: Loc<'a>, out: &mut Vec<Token<'a>>) {
    let chars: Vec<char> = text.chars().collect();
    let mut push = |text: String| out.push(Token { text, at, site: at });
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
            push(chars[start..i].iter().collect());
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
            push(chars[start..i].iter().collect());
        } else if c == '#' && chars.get(i + 1) == Some(&'#') {
            push("##".to_owned());
            i += 2;
        } else {
            push(c.to_string());
            i += 1;
        }
    }
}

/// A function-like macro: parameter names and body tokens.
struct Macro<'a> {
    params: Vec<String>,
    body: Vec<Token<'a>>,
}

/// The physical lines of `text` (comment-free) grouped into logical lines: each is a list of
/// (1-based line number, text without the continuation backslash).
fn logical_lines(text: &str) -> Vec<Vec<(usize, &str)>> {
    let mut out: Vec<Vec<(usize, &str)>> = Vec::new();
    let mut continued = false;
    for (k, line) in text.lines().enumerate() {
        let (body, cont) = match line.trim_end().strip_suffix('\\') {
            Some(b) => (b, true),
            None => (line, false),
        };
        if continued {
            out.last_mut()
                .expect("a line to continue")
                .push((k + 1, body));
        } else {
            out.push(vec![(k + 1, body)]);
        }
        continued = cont;
    }
    out
}

/// Reads one file: adds the function-like macros it defines to `macros` and the tokens of its
/// non-directive lines to `tokens`.
fn read_file<'a>(
    file: &'a str,
    text: &str,
    macros: &mut HashMap<String, Macro<'a>>,
    tokens: &mut Vec<Token<'a>>,
) -> Result<(), ParseError> {
    let text = strip_comments(text);
    for logical in logical_lines(&text) {
        let (first_line, first) = logical[0];
        let loc = |line| Loc { file, line };
        let Some(directive) = first.trim_start().strip_prefix('#') else {
            for (line, part) in &logical {
                tokenize(part, loc(*line), tokens);
            }
            continue;
        };
        let directive = directive.trim_start();
        let word_end = directive
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(directive.len());
        let (word, def) = directive.split_at(word_end);
        match word {
            "define" => {}
            "if" | "ifdef" | "ifndef" | "elif" | "else" | "endif" | "undef" => {
                let at = loc(first_line);
                return Err(error_at(
                    at,
                    at,
                    format!(
                        "`#{word}`: the entry-point reader does not evaluate conditional \
                         directives or #undef; declare entry points unconditionally"
                    ),
                ));
            }
            _ => continue, // #include, #line, #pragma, ...
        }
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
        let at = loc(first_line);
        let Some(close) = rest.find(')') else {
            return Err(error_at(
                at,
                at,
                format!("#define {name}: the parameter list must close on its first line"),
            ));
        };
        let params: Vec<String> = rest[..close]
            .split(',')
            .map(|p| p.trim().to_owned())
            .filter(|p| !p.is_empty())
            .collect();
        if let Some(p) = params
            .iter()
            .find(|p| !p.chars().all(|c| c.is_alphanumeric() || c == '_'))
        {
            return Err(error_at(
                at,
                at,
                format!("#define {name}: unsupported macro parameter `{p}`"),
            ));
        }
        let mut body = Vec::new();
        tokenize(&rest[close + 1..], at, &mut body);
        for (line, part) in &logical[1..] {
            tokenize(part, loc(*line), &mut body);
        }
        macros.insert(name.to_owned(), Macro { params, body });
    }
    Ok(())
}

/// The index of the `)` matching the `(` at `open`, if any.
fn matching_paren(tokens: &[Token<'_>], open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (k, t) in tokens.iter().enumerate().skip(open) {
        match t.text.as_str() {
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
fn split_args<'a>(tokens: &[Token<'a>]) -> Vec<Vec<Token<'a>>> {
    let mut args = vec![Vec::new()];
    let mut depth = 0usize;
    for t in tokens {
        match t.text.as_str() {
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

/// The body of `m` with `args` substituted and `##` pasted; every token's `site` is `site`.
fn substitute<'a>(m: &Macro<'a>, args: &[Vec<Token<'a>>], site: Loc<'a>) -> Vec<Token<'a>> {
    let mut out: Vec<Token<'a>> = Vec::new();
    let mut paste = false;
    for t in &m.body {
        if t.is("##") {
            paste = true;
            continue;
        }
        let replacement: Vec<Token<'a>> = match m.params.iter().position(|p| *p == t.text) {
            Some(k) => args.get(k).cloned().unwrap_or_default(),
            None => vec![t.clone()],
        };
        let mut it = replacement.into_iter().map(|mut r| {
            r.site = site;
            r
        });
        if paste {
            if let (Some(last), Some(first)) = (out.last_mut(), it.next()) {
                last.text.push_str(&first.text);
            }
            paste = false;
        }
        out.extend(it);
    }
    out
}

/// Expands every invocation of a function-like macro in `tokens`, rescanning the results
/// (`depth` bounds runaway recursion).
fn expand<'a>(
    tokens: &[Token<'a>],
    macros: &HashMap<String, Macro<'a>>,
    depth: usize,
) -> Vec<Token<'a>> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        let t = &tokens[i];
        if let Some(m) = macros.get(&t.text) {
            if depth < 16 && tokens.get(i + 1).is_some_and(|n| n.is("(")) {
                if let Some(close) = matching_paren(tokens, i + 1) {
                    let args = split_args(&tokens[i + 2..close]);
                    let site = if depth == 0 { t.at } else { t.site };
                    let body = substitute(m, &args, site);
                    // Rescan the expansion (a macro name passed as an argument, e.g.
                    // `M(f32, float)` inside MG_FOR_FLOAT_TYPES, is invoked there).
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

/// Whether `s` is a C identifier.
fn is_identifier(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The entry points declared in `files`, read in order as one translation unit (so the macros
/// of an earlier file, e.g. `("common.cuh", header)`, are defined for the later ones): each
/// file is a (name, text) pair, the name used in [`EntryPoint::file`] and in errors. Entry
/// points come in the order of the expanded text.
pub fn entry_points(files: &[(&str, &str)]) -> Result<Vec<EntryPoint>, ParseError> {
    let mut macros = HashMap::new();
    let mut tokens = Vec::new();
    for (name, text) in files {
        read_file(name, text, &mut macros, &mut tokens)?;
    }
    let tokens = expand(&tokens, &macros, 0);
    let mut out: Vec<EntryPoint> = Vec::new();
    let mut seen: HashMap<String, Loc<'_>> = HashMap::new();
    let mut i = 0;
    while i < tokens.len() {
        let t = &tokens[i];
        let next = |k: usize| tokens.get(i + k).map(|t| t.text.as_str());
        if t.is("__global__") {
            return Err(error(
                t,
                "a `__global__` function must be declared `extern \"C\" __global__ void \
                 name(...)` (otherwise its PTX name is mangled and the reader cannot list it)",
            ));
        }
        if !(t.is("extern") && next(1) == Some("\"C\"")) {
            i += 1;
            continue;
        }
        if next(2) != Some("__global__") {
            if next(2) == Some("{") {
                return Err(error(
                    t,
                    "an `extern \"C\" { .. }` block: declare each entry point as \
                     `extern \"C\" __global__ void name(...)`",
                ));
            }
            i += 2; // an extern "C" device function or variable: not an entry point
            continue;
        }
        // `__launch_bounds__(..)` may stand before or after `void`.
        let skip_bounds = |k: usize| -> Result<usize, ParseError> {
            if tokens.get(k).is_some_and(|t| t.is("__launch_bounds__")) {
                Ok(matching_paren(&tokens, k + 1)
                    .ok_or_else(|| error(&tokens[k], "unclosed `__launch_bounds__(`"))?
                    + 1)
            } else {
                Ok(k)
            }
        };
        let k = skip_bounds(i + 3)?;
        if !tokens.get(k).is_some_and(|t| t.is("void")) {
            return Err(error(
                &tokens[k.min(tokens.len() - 1)],
                "an `extern \"C\" __global__` function must return `void`",
            ));
        }
        let k = skip_bounds(k + 1)?;
        let name = tokens
            .get(k)
            .filter(|n| is_identifier(&n.text))
            .ok_or_else(|| {
                error(
                    &tokens[k.min(tokens.len() - 1)],
                    "an entry point without a name",
                )
            })?;
        if !tokens.get(k + 1).is_some_and(|p| p.is("(")) {
            return Err(error(
                name,
                format!(
                    "entry point `{}`: no parameter list after the name (an unexpanded macro?)",
                    name.text
                ),
            ));
        }
        let close = matching_paren(&tokens, k + 1).ok_or_else(|| {
            error(
                name,
                format!("entry point `{}`: unclosed parameter list", name.text),
            )
        })?;
        if let Some(first) = seen.insert(name.text.clone(), name.at) {
            return Err(error(
                name,
                format!(
                    "entry point `{}` is declared twice (first at {}:{})",
                    name.text, first.file, first.line
                ),
            ));
        }
        out.push(EntryPoint {
            name: name.text.clone(),
            params: split_args(&tokens[k + 2..close])
                .into_iter()
                .map(|p| p.into_iter().map(|t| t.text).collect())
                .collect(),
            file: name.at.file.to_owned(),
            line: name.at.line,
        });
        i = close + 1;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(files: &[(&str, &str)]) -> Vec<String> {
        entry_points(files)
            .unwrap()
            .into_iter()
            .map(|e| e.name)
            .collect()
    }

    #[test]
    fn macros_paste_rescan_and_keep_order() {
        let header = "// header\n#define ALL(M) M(f32, float) M(h, __half)\n";
        let src = "/* a\n   block */\n\
                   #define P(sfx, T, D) extern \"C\" __global__ void __launch_bounds__(128) \\\n\
                   k_d##D##_##sfx(const T *x, T v, /* c */ i64 n) {}\n\
                   #define Q(sfx, T) P(sfx, T, 64) // trailing\n\
                   ALL(Q)\n\
                   extern \"C\" __global__ void plain(unsigned long long a, u8 b) {}\n";
        let e = entry_points(&[("h.cuh", header), ("s.cu", src)]).unwrap();
        let n: Vec<_> = e.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(n, ["k_d64_f32", "k_d64_h", "plain"]);
        assert_eq!(e[0].params[0], ["const", "float", "*", "x"]);
        assert_eq!(e[1].params[1], ["__half", "v"]);
        assert_eq!(e[2].params[0], ["unsigned", "long", "long", "a"]);
        // The instantiated name is written on the continued line 4 of s.cu; `plain` on line 7.
        assert_eq!((e[0].file.as_str(), e[0].line), ("s.cu", 4));
        assert_eq!((e[2].file.as_str(), e[2].line), ("s.cu", 7));
    }

    #[test]
    fn comments_literals_and_device_functions_are_not_entries() {
        let src = "// extern \"C\" __global__ void not_me(int a) {}\n\
                   /* extern \"C\" __global__ void nor_me(int a) {} */\n\
                   const char *s = \"extern \\\"C\\\" __global__\";\n\
                   extern \"C\" __device__ float helper(float x) { return x; }\n\
                   extern \"C\" __global__ void one(int a) {}\n";
        assert_eq!(names(&[("a.cu", src)]), ["one"]);
    }

    #[test]
    fn unreadable_declarations_name_the_file_and_line() {
        let err = |src: &str| entry_points(&[("bad.cu", src)]).unwrap_err();
        let e = err("\n\ntemplate <int N> __global__ void k(int a) {}\n");
        assert_eq!((e.file.as_str(), e.line), ("bad.cu", 3));
        assert!(e.message.contains("extern \"C\""), "{e}");
        assert!(e.to_string().starts_with("kernels/cuda/bad.cu:3: "), "{e}");

        let e = err("extern \"C\" __global__ void a(int x) {}\n\nextern \"C\" __global__ void a(int y) {}\n");
        assert_eq!(e.line, 3);
        assert!(
            e.message.contains("declared twice (first at bad.cu:1)"),
            "{e}"
        );

        let e = err("#ifdef X\nextern \"C\" __global__ void a(int x) {}\n#endif\n");
        assert_eq!(e.line, 1);
        assert!(e.message.contains("#ifdef"), "{e}");

        let e = err("extern \"C\" {\n__global__ void a(int x) {}\n}\n");
        assert_eq!(e.line, 1);
        assert!(e.message.contains("block"), "{e}");

        let e = err("extern \"C\" __global__ void 3k(int x) {}\n");
        assert!(e.message.contains("without a name"), "{e}");

        let e = err("#define N(s) s\nextern \"C\" __global__ void N(k)\n");
        assert!(e.message.contains("no parameter list"), "{e}");

        // An error inside an instantiated macro points at the macro body and at the invocation.
        let e = err("#define E(s) \\\n  extern \"C\" __global__ int k_##s(int x) {}\n\nE(f32)\n");
        assert_eq!(e.line, 2);
        assert!(e.message.contains("return `void`"), "{e}");
        assert!(e.message.contains("invoked at bad.cu:4"), "{e}");
    }
}

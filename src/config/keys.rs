//! Every config key, read from the config's own serde form: the dotted keys `--set` accepts,
//! setting one from a command-line string, and the integers a TOML file cannot hold. A key is
//! written once, as a field of the structs in [`crate::config`]; nothing here names one.

use serde_json::Value;

use super::{ConfigError, TrainConfig, MAX_TOML_INT};

/// The config with every optional key present, as JSON (an absent optional key is `null`).
fn template() -> Value {
    serde_json::to_value(TrainConfig::default()).expect("the default config serializes")
}

/// Every dotted key of `value` (objects are tables; anything else is a key), in order.
fn flatten(prefix: &str, value: &Value, out: &mut Vec<(String, Value)>) {
    match value {
        Value::Object(map) => {
            for (k, v) in map {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        other => out.push((prefix.to_string(), other.clone())),
    }
}

/// Every key [`TrainConfig::apply_override`] accepts, with the default value that gives its
/// type (`null` for an optional key that is unset by default), sorted.
pub(crate) fn keys_and_defaults() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    flatten("", &template(), &mut out);
    out
}

/// Every key [`TrainConfig::apply_override`] accepts, sorted.
pub fn keys() -> Vec<String> {
    keys_and_defaults().into_iter().map(|(k, _)| k).collect()
}

/// What a key of default `default` takes, in messages.
fn expected(default: &Value) -> &'static str {
    match default {
        Value::Bool(_) => "true or false",
        Value::Number(n) if n.is_f64() => "a number",
        Value::Number(_) => "a non-negative integer",
        _ => "text",
    }
}

/// A string value for an override: surrounding double quotes, if any, are removed.
fn string_value(value: &str) -> String {
    let trimmed = value.trim();
    trimmed
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(trimmed)
        .to_string()
}

/// An integer for `key`: non-negative and at most [`MAX_TOML_INT`] (what the saved config can
/// hold), or `None` when `text` is not a non-negative integer.
fn integer(key: &str, text: &str) -> Result<Option<toml::Value>, ConfigError> {
    match text.trim().parse::<u64>() {
        Ok(n) if n > MAX_TOML_INT => Err(too_large(key, n)),
        Ok(n) => Ok(Some(toml::Value::Integer(n as i64))),
        Err(_) => Ok(None),
    }
}

/// The error for an integer a TOML file cannot hold.
fn too_large(key: &str, n: u64) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: format!(
            "{n} is too large: the config file (TOML) holds integers up to {MAX_TOML_INT}"
        ),
    }
}

/// The values `text` may mean for `key`, whose default is `default`, most likely first
/// (`None`: unset an optional key).
fn candidates(
    key: &str,
    default: &serde_json::Value,
    text: &str,
) -> Result<Vec<Option<toml::Value>>, ConfigError> {
    use serde_json::Value as J;
    let t = text.trim();
    let float = || t.parse::<f64>().ok().map(toml::Value::Float);
    let boolean = || t.parse::<bool>().ok().map(toml::Value::Boolean);
    let string = || toml::Value::String(string_value(text));
    // A value that does not parse as the key's type gives no candidate (never an unset).
    let only = |v: Option<toml::Value>| v.map(Some).into_iter().collect::<Vec<_>>();
    Ok(match default {
        J::Bool(_) => only(boolean()),
        J::Number(n) if n.is_f64() => only(float()),
        J::Number(_) => only(integer(key, t)?),
        J::String(_) => vec![Some(string())],
        // An optional key: empty unsets it; otherwise whatever its field takes.
        _ if t.is_empty() => vec![None],
        _ => [Some(string()), integer(key, t)?, float(), boolean()]
            .into_iter()
            .flatten()
            .map(Some)
            .collect(),
    })
}

/// `root` with `key` (dotted) set to `value`, or removed for `None`.
fn with_key(root: &toml::Table, key: &str, value: Option<toml::Value>) -> toml::Table {
    let mut root = root.clone();
    let mut at = &mut root;
    let mut parts = key.split('.').peekable();
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            match value {
                Some(v) => {
                    at.insert(part.to_string(), v);
                }
                None => {
                    at.remove(part);
                }
            }
            break;
        }
        at = match at
            .entry(part.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        {
            toml::Value::Table(t) => t,
            _ => unreachable!("config tables are tables"),
        };
    }
    root
}

impl TrainConfig {
    /// Every key that [`TrainConfig::apply_override`] accepts, sorted: the fields of the config
    /// structs, dotted by table.
    pub fn keys() -> Vec<String> {
        keys()
    }

    /// Sets one key from a command-line string: `key` is dotted (`train.steps`, `model.n_embd`,
    /// `out`; see [`TrainConfig::keys`]) and `value` is parsed as the key's type (integers,
    /// numbers such as `3e-4`, `true`/`false`, or text; surrounding double quotes are removed from
    /// text). An empty value for an optional key (`data.path`, `data.tokenizer`, `metrics`,
    /// `model.tie_embeddings`, `model.expert_capacity_factor`) unsets it.
    ///
    /// Errors name the key: [`ConfigError::UnknownKey`] (with a suggestion when one is close),
    /// [`ConfigError::BadValue`], or [`ConfigError::Invalid`] for an integer above
    /// [`MAX_TOML_INT`] (the saved config could not hold it). Other ranges are not checked here;
    /// call [`TrainConfig::validate`] after.
    pub fn apply_override(&mut self, key: &str, value: &str) -> Result<(), ConfigError> {
        let key = key.trim();
        let known = keys_and_defaults();
        let Some((_, default)) = known.iter().find(|(k, _)| k == key) else {
            return Err(ConfigError::UnknownKey {
                key: key.to_string(),
                suggestion: closest_key(key, &known),
            });
        };
        if let Some((k, n)) = self.integer_too_large_for_toml() {
            return Err(too_large(&k, n));
        }
        let current = toml::Table::try_from(&*self).map_err(|e| ConfigError::Serialize {
            message: e.to_string(),
        })?;
        let mut field_error = None;
        for candidate in candidates(key, default, value)? {
            match with_key(&current, key, candidate).try_into::<TrainConfig>() {
                Ok(config) => {
                    *self = config;
                    return Ok(());
                }
                Err(e) => field_error = Some(e.message().to_string()),
            }
        }
        Err(ConfigError::BadValue {
            key: key.to_string(),
            value: value.to_string(),
            expected: match field_error {
                // The field's own words for an enum ("one of `gpt`, `bert`, `llama`") and for
                // an optional key, whose default (unset) tells no type ("a boolean").
                Some(e) if e.contains("variant") || default.is_null() => {
                    match e.find("expected ") {
                        Some(i) => e[i + "expected ".len()..].trim().to_string(),
                        None => e,
                    }
                }
                _ => expected(default).to_string(),
            },
        })
    }

    /// The first integer of the config that a TOML file cannot hold (above [`MAX_TOML_INT`]),
    /// with its key.
    pub(crate) fn integer_too_large_for_toml(&self) -> Option<(String, u64)> {
        let mut all = Vec::new();
        flatten("", &serde_json::to_value(self).ok()?, &mut all);
        all.into_iter()
            .find_map(|(key, v)| v.as_u64().filter(|&n| n > MAX_TOML_INT).map(|n| (key, n)))
    }
}

/// The known key closest to `key` by edit distance, if it is within a third of `key`'s length
/// (1 to 3 edits); a bare field name (`steps`) matches its dotted key (`train.steps`).
fn closest_key(key: &str, known: &[(String, Value)]) -> Option<String> {
    if let Some((exact, _)) = known
        .iter()
        .find(|(k, _)| k.rsplit('.').next() == Some(key))
    {
        return Some(exact.clone());
    }
    let (best, distance) = known
        .iter()
        .map(|(k, _)| (k, edit_distance(k, key)))
        .min_by_key(|&(_, d)| d)?;
    let allowed = (key.chars().count() / 3).clamp(1, 3);
    (distance <= allowed).then(|| best.clone())
}

/// Levenshtein distance between two strings, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

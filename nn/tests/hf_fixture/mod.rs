//! The transformers-made fixtures of `tests/fixtures/<name>/`: their folder, `expected.json`
//! (transformers' figures) and its ids, shared by the Llama and Mixtral checks.

use std::path::{Path, PathBuf};

use meshgrad_tensor::{Device, Tensor};
use serde_json::Value;

/// The fixture folder `tests/fixtures/<name>`.
pub fn folder(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// `expected.json` of the fixture folder `name`.
pub fn expected(name: &str) -> Value {
    let text = std::fs::read_to_string(folder(name).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A JSON list of ints, or of rows of ints, flattened.
pub fn ints(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|x| match x.as_array() {
            Some(row) => row.iter().map(|y| y.as_i64().unwrap()).collect(),
            None => vec![x.as_i64().unwrap()],
        })
        .collect()
}

/// `[B, T]` ids and targets of the fixtures.
pub fn batch(e: &Value) -> (Tensor, Tensor) {
    let rows = e["ids"].as_array().unwrap().len();
    let ids = ints(&e["ids"]);
    let t = ids.len() / rows;
    (
        Tensor::from_vec(ids, (rows, t), Device::Cpu).unwrap(),
        Tensor::from_vec(ints(&e["targets"]), (rows, t), Device::Cpu).unwrap(),
    )
}

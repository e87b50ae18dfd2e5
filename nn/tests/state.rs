//! State dicts, safetensors files and Hugging Face GPT-2 checkpoints.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use meshgrad_nn::state::{
    gpt_config_from_hf_json, load_gpt2, load_gpt2_into, load_safetensors,
    load_safetensors_with_metadata, load_state_dict, save_gpt2, save_safetensors, state_dict,
};
use meshgrad_nn::{Gpt, GptConfig, Module};
use meshgrad_tensor::{DType, Device, Tensor};
use safetensors::tensor::TensorView;
use safetensors::Dtype;

/// A fresh, empty directory for one test (removed by `Drop`).
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("meshgrad-state-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
    /// Names of the entries in the directory, sorted.
    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Deterministic pseudo-random values in [-1, 1) (a small LCG).
fn values(seed: u64, n: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x1234_5678;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect()
}

/// The token table of a whole model.
fn wte(m: &Gpt) -> &Tensor {
    m.wte
        .as_ref()
        .expect("a whole model holds wte")
        .weight
        .tensor()
}

fn raw_bytes(t: &Tensor) -> Vec<u8> {
    t.to_cpu_storage().unwrap().as_bytes().to_vec()
}

// ----- safetensors -----

fn every_dtype() -> Vec<(String, Tensor)> {
    let c = Device::Cpu;
    vec![
        (
            "f64".into(),
            Tensor::from_vec(values(1, 6), (2, 3), c).unwrap(),
        ),
        (
            "f32".into(),
            Tensor::from_vec(
                values(2, 24).iter().map(|&x| x as f32).collect::<Vec<_>>(),
                (2, 3, 4),
                c,
            )
            .unwrap(),
        ),
        (
            "bf16".into(),
            Tensor::from_vec(
                values(3, 5)
                    .iter()
                    .map(|&x| bf16::from_f64(x))
                    .collect::<Vec<_>>(),
                5,
                c,
            )
            .unwrap(),
        ),
        (
            "f16".into(),
            Tensor::from_vec(
                values(4, 4)
                    .iter()
                    .map(|&x| f16::from_f64(x))
                    .collect::<Vec<_>>(),
                (4, 1),
                c,
            )
            .unwrap(),
        ),
        (
            "u8".into(),
            Tensor::from_vec(vec![0u8, 1, 255, 7], (2, 2), c).unwrap(),
        ),
        (
            "u32".into(),
            Tensor::from_vec(vec![0u32, 1, u32::MAX], 3, c).unwrap(),
        ),
        (
            "i64".into(),
            Tensor::from_vec(vec![i64::MIN, -1, 0, 1, i64::MAX, 42], (3, 2), c).unwrap(),
        ),
        ("scalar".into(), Tensor::scalar(2.5, DType::F32, c).unwrap()),
    ]
}

#[test]
fn safetensors_round_trip_every_dtype() {
    let dir = TempDir::new("st-roundtrip");
    let path = dir.path().join("all.safetensors");
    let tensors = every_dtype();
    let meta = HashMap::from([("step".to_string(), "12".to_string())]);
    save_safetensors(&path, &tensors, Some(meta.clone())).unwrap();
    let (loaded, got_meta) = load_safetensors_with_metadata(&path).unwrap();
    assert_eq!(got_meta, Some(meta));
    let mut want = tensors.clone();
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(loaded.len(), want.len());
    for ((n, a), (m, b)) in loaded.iter().zip(&want) {
        assert_eq!(n, m);
        assert_eq!(a.dtype(), b.dtype(), "{n}");
        assert_eq!(a.dims(), b.dims(), "{n}");
        assert_eq!(raw_bytes(a), raw_bytes(b), "{n}");
    }
    // No temporary files left behind.
    assert_eq!(dir.entries(), vec!["all.safetensors".to_string()]);
}

#[test]
fn safetensors_saves_views_in_logical_order() {
    let dir = TempDir::new("st-views");
    let path = dir.path().join("v.safetensors");
    let base = Tensor::from_vec(
        (0..12).map(|x| x as f32).collect::<Vec<_>>(),
        (3, 4),
        Device::Cpu,
    )
    .unwrap();
    let t = base.t().unwrap().narrow(0, 1, 2).unwrap(); // [2, 3], non-contiguous
    save_safetensors(&path, &[("t".into(), t.clone())], None).unwrap();
    let l = load_safetensors(&path).unwrap();
    assert_eq!(l[0].1.dims(), &[2, 3]);
    assert_eq!(l[0].1.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    assert_eq!(
        l[0].1.to_vec::<f32>().unwrap(),
        vec![1., 5., 9., 2., 6., 10.]
    );
}

#[test]
fn safetensors_unsupported_dtype_names_tensor_and_dtype() {
    let dir = TempDir::new("st-dtype");
    let path = dir.path().join("i32.safetensors");
    let bytes: Vec<u8> = [1i32, 2, 3].iter().flat_map(|x| x.to_le_bytes()).collect();
    let ok: Vec<u8> = [1f32].iter().flat_map(|x| x.to_le_bytes()).collect();
    let views = vec![
        (
            "counts",
            TensorView::new(Dtype::I32, vec![3], &bytes).unwrap(),
        ),
        ("fine", TensorView::new(Dtype::F32, vec![1], &ok).unwrap()),
    ];
    safetensors::serialize_to_file(views, &None, &path).unwrap();
    let e = load_safetensors(&path).unwrap_err().to_string();
    assert!(
        e.contains("counts") && e.contains("I32") && e.contains("i32.safetensors"),
        "{e}"
    );
}

#[test]
fn safetensors_read_errors_name_the_file() {
    let dir = TempDir::new("st-read-errors");
    let missing = dir.path().join("nope.safetensors");
    let e = load_safetensors(&missing).unwrap_err().to_string();
    assert!(e.contains("nope.safetensors"), "{e}");
    let garbage = dir.path().join("garbage.safetensors");
    std::fs::write(&garbage, b"this is not a safetensors file").unwrap();
    let e = load_safetensors(&garbage).unwrap_err().to_string();
    assert!(e.contains("garbage.safetensors"), "{e}");
}

#[test]
fn safetensors_failed_writes_leave_the_target_intact() {
    let dir = TempDir::new("st-atomic");
    // Into a directory that does not exist: an error naming the path, nothing created.
    let bad = dir.path().join("no-such-dir").join("x.safetensors");
    let e = save_safetensors(&bad, &every_dtype(), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no-such-dir") && e.contains("x.safetensors"),
        "{e}"
    );
    assert!(!bad.exists());

    // A failure while preparing the data leaves an existing file as it was.
    let path = dir.path().join("ckpt.safetensors");
    let good = vec![(
        "a".to_string(),
        Tensor::from_vec(vec![1f32, 2., 3.], 3, Device::Cpu).unwrap(),
    )];
    save_safetensors(&path, &good, None).unwrap();
    let before = std::fs::read(&path).unwrap();
    let released = Tensor::zeros(4, DType::F32, Device::Cpu).unwrap();
    released.release_storage();
    let e = save_safetensors(
        &path,
        &[("a".into(), good[0].1.clone()), ("b".into(), released)],
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("ckpt.safetensors") && e.contains('b'), "{e}");
    assert_eq!(std::fs::read(&path).unwrap(), before);

    // A failure at the rename (the target is a non-empty directory): no temporary file left.
    let blocker = dir.path().join("blocker.safetensors");
    std::fs::create_dir_all(blocker.join("inside")).unwrap();
    let e = save_safetensors(&blocker, &good, None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("blocker.safetensors"), "{e}");
    assert!(blocker.join("inside").is_dir());
    assert_eq!(
        dir.entries(),
        vec![
            "blocker.safetensors".to_string(),
            "ckpt.safetensors".to_string()
        ]
    );

    // Overwriting an existing file replaces it whole.
    let newer = vec![(
        "z".to_string(),
        Tensor::from_vec(vec![7i64], 1, Device::Cpu).unwrap(),
    )];
    save_safetensors(&path, &newer, None).unwrap();
    let l = load_safetensors(&path).unwrap();
    assert_eq!(l.len(), 1);
    assert_eq!(l[0].0, "z");

    // Duplicate names are refused.
    let dup = vec![good[0].clone(), good[0].clone()];
    assert!(
        save_safetensors(dir.path().join("dup.safetensors"), &dup, None)
            .unwrap_err()
            .to_string()
            .contains("twice")
    );
}

// ----- state dicts -----

fn tiny_config() -> GptConfig {
    GptConfig {
        vocab_size: 11,
        block_size: 5,
        n_layer: 2,
        n_head: 2,
        n_embd: 8,
        dropout: 0.0,
        bias: true,
        layer_norm_eps: 1e-5,
    }
}

fn ids() -> Tensor {
    Tensor::from_vec(vec![1i64, 4, 7, 10, 0, 3, 3, 9, 2, 5], (2, 5), Device::Cpu).unwrap()
}

fn logits(model: &Gpt) -> Vec<f32> {
    model.set_training(false);
    let l = meshgrad_autograd::no_grad(|| model.forward(&ids())).unwrap();
    assert_eq!(l.tensor().dims(), &[2, 5, model.config.vocab_size]);
    l.tensor().to_vec_f32().unwrap()
}

fn to_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn state_dict_round_trip_gives_identical_logits() {
    let dir = TempDir::new("sd-roundtrip");
    let a = Gpt::new(tiny_config(), 1, DType::F32, Device::Cpu).unwrap();
    let b = Gpt::new(tiny_config(), 2, DType::F32, Device::Cpu).unwrap();
    assert_ne!(to_bits(&logits(&a)), to_bits(&logits(&b)));
    let sd = state_dict(&a);
    assert_eq!(sd.len(), a.named_parameters().len());
    assert_eq!(sd[0].0, "wte.weight");
    let path = dir.path().join("model.safetensors");
    save_safetensors(&path, &sd, None).unwrap();
    let loaded = load_safetensors(&path).unwrap();
    load_state_dict(&b, &loaded, true).unwrap();
    assert_eq!(to_bits(&logits(&a)), to_bits(&logits(&b)));
    // Loading copies: the models do not share storage afterwards.
    assert!(!wte(&a).same_storage(wte(&b)));

    // Through `&dyn Module` and with dtype conversion (an f64 state dict into an f32 model).
    let c = Gpt::new(tiny_config(), 3, DType::F32, Device::Cpu).unwrap();
    let sd64: Vec<(String, Tensor)> = sd
        .iter()
        .map(|(n, t)| (n.clone(), t.to_dtype(DType::F64).unwrap()))
        .collect();
    let dynm: &dyn Module = &c;
    load_state_dict(dynm, &sd64, true).unwrap();
    assert_eq!(to_bits(&logits(&a)), to_bits(&logits(&c)));
}

#[test]
fn load_state_dict_errors_name_tensors_and_shapes() {
    let a = Gpt::new(tiny_config(), 1, DType::F32, Device::Cpu).unwrap();
    let b = Gpt::new(tiny_config(), 2, DType::F32, Device::Cpu).unwrap();
    let b_before = to_bits(&logits(&b));
    let sd: Vec<(String, Tensor)> = state_dict(&a)
        .into_iter()
        .map(|(n, t)| (n, t.deep_clone().unwrap()))
        .collect();
    let b_fc = raw_bytes(b.h[1].mlp.c_fc.weight.tensor());
    assert_ne!(b_fc, raw_bytes(a.h[1].mlp.c_fc.weight.tensor()));

    // Wrong shape (a transposed c_attn weight), late in the order: names it and both shapes, and
    // nothing is copied.
    let mut bad = sd.clone();
    let i = bad
        .iter()
        .position(|(n, _)| n == "h.1.attn.c_attn.weight")
        .unwrap();
    bad[i].1 = bad[i].1.t().unwrap().contiguous().unwrap();
    let e = load_state_dict(&b, &bad, true).unwrap_err().to_string();
    assert!(
        e.contains(
            "h.1.attn.c_attn.weight: checkpoint has shape [8, 24] but the model expects [24, 8]"
        ),
        "{e}"
    );
    let e = load_state_dict(&b, &bad, false).unwrap_err().to_string();
    assert!(e.contains("[8, 24]"), "{e}");
    assert_eq!(
        to_bits(&logits(&b)),
        b_before,
        "a failed load must not change the model"
    );

    // Missing tensor: an error when strict, skipped otherwise.
    let partial: Vec<_> = sd
        .iter()
        .filter(|(n, _)| n != "h.1.mlp.c_fc.weight")
        .cloned()
        .collect();
    let e = load_state_dict(&b, &partial, true).unwrap_err().to_string();
    assert!(
        e.contains("missing") && e.contains("h.1.mlp.c_fc.weight"),
        "{e}"
    );
    assert_eq!(to_bits(&logits(&b)), b_before);
    load_state_dict(&b, &partial, false).unwrap();
    assert_eq!(raw_bytes(wte(&b)), raw_bytes(wte(&a)));
    assert_eq!(
        raw_bytes(b.h[1].mlp.c_fc.weight.tensor()),
        b_fc,
        "a missing tensor keeps its value"
    );

    // Unexpected tensor: an error when strict, ignored otherwise.
    let mut extra = sd.clone();
    extra.push((
        "h.9.attn.c_attn.weight".into(),
        Tensor::zeros((24, 8), DType::F32, Device::Cpu).unwrap(),
    ));
    let e = load_state_dict(&b, &extra, true).unwrap_err().to_string();
    assert!(e.contains("h.9.attn.c_attn.weight"), "{e}");
    load_state_dict(&b, &extra, false).unwrap();
    assert_eq!(to_bits(&logits(&a)), to_bits(&logits(&b)));

    // Duplicate names.
    let mut dup = sd.clone();
    dup.push(sd[0].clone());
    assert!(load_state_dict(&b, &dup, true)
        .unwrap_err()
        .to_string()
        .contains("twice"));
}

// ----- Hugging Face GPT-2 -----

const V: usize = 11;
const T: usize = 5;
const C: usize = 8;
const NH: usize = 2;
const NL: usize = 2;
const EPS: f64 = 1e-5;

/// A hand-made HF GPT-2 checkpoint: names without prefix, Conv1D weights `[in, out]`, f32.
fn hf_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    let mut seed = 0;
    let mut add = |name: String, shape: Vec<usize>, scale: f64, offset: f64| {
        seed += 1;
        let n = shape.iter().product();
        let v = values(seed, n)
            .iter()
            .map(|x| (offset + scale * x) as f32)
            .collect();
        out.push((name, shape, v));
    };
    add("wte.weight".into(), vec![V, C], 0.5, 0.0);
    add("wpe.weight".into(), vec![T, C], 0.3, 0.0);
    for l in 0..NL {
        let p = format!("h.{l}");
        add(format!("{p}.ln_1.weight"), vec![C], 0.2, 1.0);
        add(format!("{p}.ln_1.bias"), vec![C], 0.1, 0.0);
        add(format!("{p}.attn.c_attn.weight"), vec![C, 3 * C], 0.4, 0.0);
        add(format!("{p}.attn.c_attn.bias"), vec![3 * C], 0.1, 0.0);
        add(format!("{p}.attn.c_proj.weight"), vec![C, C], 0.3, 0.0);
        add(format!("{p}.attn.c_proj.bias"), vec![C], 0.1, 0.0);
        add(format!("{p}.ln_2.weight"), vec![C], 0.2, 1.0);
        add(format!("{p}.ln_2.bias"), vec![C], 0.1, 0.0);
        add(format!("{p}.mlp.c_fc.weight"), vec![C, 4 * C], 0.3, 0.0);
        add(format!("{p}.mlp.c_fc.bias"), vec![4 * C], 0.1, 0.0);
        add(format!("{p}.mlp.c_proj.weight"), vec![4 * C, C], 0.2, 0.0);
        add(format!("{p}.mlp.c_proj.bias"), vec![C], 0.1, 0.0);
    }
    add("ln_f.weight".into(), vec![C], 0.2, 1.0);
    add("ln_f.bias".into(), vec![C], 0.1, 0.0);
    out
}

/// The causal-mask buffers HF checkpoints carry: `h.N.attn.bias` `[1, 1, T, T]` and
/// `h.N.attn.masked_bias` (a scalar).
fn mask_buffers() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let mut out = Vec::new();
    for l in 0..NL {
        let tril = (0..T * T)
            .map(|i| if i % T <= i / T { 1.0 } else { 0.0 })
            .collect();
        out.push((format!("h.{l}.attn.bias"), vec![1, 1, T, T], tril));
        out.push((format!("h.{l}.attn.masked_bias"), vec![], vec![-1e4]));
    }
    out
}

const HF_CONFIG: &str = r#"{
  "activation_function": "gelu_new",
  "architectures": ["GPT2LMHeadModel"],
  "attn_pdrop": 0.1,
  "embd_pdrop": 0.1,
  "layer_norm_epsilon": 1e-05,
  "model_type": "gpt2",
  "n_embd": 8,
  "n_head": 2,
  "n_layer": 2,
  "n_positions": 5,
  "resid_pdrop": 0.1,
  "vocab_size": 11
}"#;

fn write_hf(dir: &Path, config: &str, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(&str, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            (
                n.as_str(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta = Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    safetensors::serialize_to_file(views, &meta, &dir.join("model.safetensors")).unwrap();
}

fn get<'a>(ts: &'a [(String, Vec<usize>, Vec<f32>)], name: &str) -> &'a [f32] {
    &ts.iter().find(|(n, _, _)| n == name).unwrap().2
}

// --- an independent f64 reference forward pass over the HF-layout tensors ---

fn layer_norm(x: &[f64], w: &[f32], b: &[f32]) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let inv = 1.0 / (var + EPS).sqrt();
    x.iter()
        .zip(w.iter().zip(b))
        .map(|(v, (w, b))| (v - mean) * inv * *w as f64 + *b as f64)
        .collect()
}

/// `x @ W + b` with `W` stored `[in, out]` (HF Conv1D).
fn conv1d(x: &[f64], w: &[f32], b: &[f32]) -> Vec<f64> {
    let (n_in, n_out) = (x.len(), b.len());
    assert_eq!(w.len(), n_in * n_out);
    (0..n_out)
        .map(|o| {
            b[o] as f64
                + (0..n_in)
                    .map(|i| x[i] * w[i * n_out + o] as f64)
                    .sum::<f64>()
        })
        .collect()
}

fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

fn reference_logits(ts: &[(String, Vec<usize>, Vec<f32>)], tokens: &[i64]) -> Vec<f64> {
    let t_len = tokens.len();
    let (wte, wpe) = (get(ts, "wte.weight"), get(ts, "wpe.weight"));
    let mut x: Vec<Vec<f64>> = tokens
        .iter()
        .enumerate()
        .map(|(t, &id)| {
            (0..C)
                .map(|c| wte[id as usize * C + c] as f64 + wpe[t * C + c] as f64)
                .collect()
        })
        .collect();
    let d = C / NH;
    for l in 0..NL {
        let p = |s: &str| get(ts, &format!("h.{l}.{s}"));
        let qkv: Vec<Vec<f64>> = x
            .iter()
            .map(|r| {
                conv1d(
                    &layer_norm(r, p("ln_1.weight"), p("ln_1.bias")),
                    p("attn.c_attn.weight"),
                    p("attn.c_attn.bias"),
                )
            })
            .collect();
        let mut y = vec![vec![0.0; C]; t_len];
        for h in 0..NH {
            for i in 0..t_len {
                let q = &qkv[i][h * d..(h + 1) * d];
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        q.iter()
                            .zip(&qkv[j][C + h * d..C + (h + 1) * d])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, w) in e.iter().enumerate() {
                    for k in 0..d {
                        y[i][h * d + k] += w / z * qkv[j][2 * C + h * d + k];
                    }
                }
            }
        }
        for (xi, yi) in x.iter_mut().zip(&y) {
            let o = conv1d(yi, p("attn.c_proj.weight"), p("attn.c_proj.bias"));
            xi.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
        for xi in x.iter_mut() {
            let hdn: Vec<f64> = conv1d(
                &layer_norm(xi, p("ln_2.weight"), p("ln_2.bias")),
                p("mlp.c_fc.weight"),
                p("mlp.c_fc.bias"),
            )
            .into_iter()
            .map(gelu_tanh)
            .collect();
            let o = conv1d(&hdn, p("mlp.c_proj.weight"), p("mlp.c_proj.bias"));
            xi.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        }
    }
    let mut out = Vec::new();
    for xi in &x {
        let f = layer_norm(xi, get(ts, "ln_f.weight"), get(ts, "ln_f.bias"));
        for v in 0..V {
            out.push((0..C).map(|c| f[c] * wte[v * C + c] as f64).sum());
        }
    }
    out
}

fn with_prefix(ts: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    ts.iter()
        .map(|(n, s, v)| (format!("transformer.{n}"), s.clone(), v.clone()))
        .collect()
}

#[test]
fn hf_gpt2_checkpoint_loads_and_matches_reference() {
    let dir = TempDir::new("hf-load");
    let ts = hf_tensors();
    let mut file = ts.clone();
    file.extend(mask_buffers());
    let plain = dir.path().join("plain");
    write_hf(&plain, HF_CONFIG, &file);

    let model = load_gpt2(&plain, DType::F32, Device::Cpu).unwrap();
    assert_eq!(
        model.config,
        GptConfig {
            vocab_size: V,
            block_size: T,
            n_layer: NL,
            n_head: NH,
            n_embd: C,
            dropout: 0.1,
            bias: true,
            layer_norm_eps: EPS
        }
    );
    assert!(
        !model.drop.as_ref().unwrap().is_training(),
        "loaded models are in eval mode, like from_pretrained"
    );

    // Conv1D weights are transposed into Linear's [out, in]; everything else is copied as is.
    for l in 0..NL {
        let b = &model.h[l];
        for (name, w) in [
            ("attn.c_attn.weight", &b.attn.c_attn.weight),
            ("attn.c_proj.weight", &b.attn.c_proj.weight),
            ("mlp.c_fc.weight", &b.mlp.c_fc.weight),
            ("mlp.c_proj.weight", &b.mlp.c_proj.weight),
        ] {
            let (_, shape, v) = ts
                .iter()
                .find(|(n, _, _)| *n == format!("h.{l}.{name}"))
                .unwrap();
            let (n_in, n_out) = (shape[0], shape[1]);
            assert_eq!(w.tensor().dims(), &[n_out, n_in], "h.{l}.{name}");
            let got = w.tensor().to_vec::<f32>().unwrap();
            for o in 0..n_out {
                for i in 0..n_in {
                    assert_eq!(
                        got[o * n_in + i].to_bits(),
                        v[i * n_out + o].to_bits(),
                        "h.{l}.{name}[{o}, {i}]"
                    );
                }
            }
        }
        assert_eq!(
            b.attn
                .c_attn
                .bias
                .as_ref()
                .unwrap()
                .tensor()
                .to_vec::<f32>()
                .unwrap(),
            get(&ts, &format!("h.{l}.attn.c_attn.bias"))
        );
    }
    assert_eq!(wte(&model).to_vec::<f32>().unwrap(), get(&ts, "wte.weight"));

    // Logits against the f64 reference.
    let got = logits(&model);
    let toks = ids().to_vec::<i64>().unwrap();
    let mut want = reference_logits(&ts, &toks[..T]);
    want.extend(reference_logits(&ts, &toks[T..]));
    let max_abs = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    assert!(max_abs > 0.1, "degenerate test model");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
            "logit {i}: {g} vs reference {w}"
        );
    }

    // The `transformer.`-prefixed variant (with n_ctx instead of n_positions, and a tied lm_head)
    // loads to the same model.
    let mut pre = with_prefix(&ts);
    pre.extend(with_prefix(&mask_buffers()));
    pre.push((
        "lm_head.weight".into(),
        vec![V, C],
        get(&ts, "wte.weight").to_vec(),
    ));
    let prefixed = dir.path().join("prefixed");
    write_hf(&prefixed, &HF_CONFIG.replace("n_positions", "n_ctx"), &pre);
    let model2 = load_gpt2(&prefixed, DType::F32, Device::Cpu).unwrap();
    assert_eq!(to_bits(&logits(&model2)), to_bits(&got));

    // Other dtypes: f64 parameters from the f32 file match the reference more closely.
    let model64 = load_gpt2(&plain, DType::F64, Device::Cpu).unwrap();
    let l64 = meshgrad_autograd::no_grad(|| model64.forward(&ids()))
        .unwrap()
        .tensor()
        .to_vec_f64()
        .unwrap();
    for (g, w) in l64.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-9 * (1.0 + w.abs()), "{g} vs {w}");
    }
}

#[test]
fn save_gpt2_then_load_gpt2_is_bitwise_identical() {
    let dir = TempDir::new("hf-save");
    let cfg = GptConfig {
        dropout: 0.1,
        ..tiny_config()
    };
    let model = Gpt::new(cfg, 7, DType::F32, Device::Cpu).unwrap();
    let want = logits(&model);
    let out = dir.path().join("nested").join("ckpt");
    save_gpt2(&model, &out).unwrap();
    let mut entries: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    entries.sort();
    assert_eq!(
        entries,
        vec!["config.json".to_string(), "model.safetensors".to_string()]
    );

    // config.json: the HF keys.
    let text = std::fs::read_to_string(out.join("config.json")).unwrap();
    let j: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(j["model_type"], "gpt2");
    assert_eq!(j["architectures"][0], "GPT2LMHeadModel");
    assert_eq!(j["activation_function"], "gelu_new");
    for (k, v) in [
        ("vocab_size", 11),
        ("n_positions", 5),
        ("n_embd", 8),
        ("n_layer", 2),
        ("n_head", 2),
    ] {
        assert_eq!(j[k], v, "{k}");
    }
    assert_eq!(j["layer_norm_epsilon"], 1e-5);
    assert_eq!(j["resid_pdrop"], 0.1);
    assert_eq!(gpt_config_from_hf_json(&text).unwrap().0, cfg);

    // model.safetensors: HF names without prefix, Conv1D weights [in, out], format pt.
    let (ts, meta) = load_safetensors_with_metadata(out.join("model.safetensors")).unwrap();
    assert_eq!(meta.unwrap()["format"], "pt");
    let names: Vec<&str> = ts.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), model.named_parameters().len());
    assert!(names.iter().all(|n| !n.starts_with("transformer.")
        && *n != "lm_head.weight"
        && !n.ends_with(".attn.bias")
        && !n.ends_with("masked_bias")));
    let shape = |n: &str| ts.iter().find(|(m, _)| m == n).unwrap().1.dims().to_vec();
    assert_eq!(shape("h.0.attn.c_attn.weight"), vec![8, 24]);
    assert_eq!(shape("h.1.mlp.c_fc.weight"), vec![8, 32]);
    assert_eq!(shape("h.1.mlp.c_proj.weight"), vec![32, 8]);
    assert_eq!(shape("wte.weight"), vec![11, 8]);

    let loaded = load_gpt2(&out, DType::F32, Device::Cpu).unwrap();
    assert_eq!(loaded.config, cfg);
    assert_eq!(to_bits(&logits(&loaded)), to_bits(&want));

    // load_gpt2_into an existing model of the same architecture, and refusal for another one.
    let other = Gpt::new(cfg, 99, DType::F32, Device::Cpu).unwrap();
    load_gpt2_into(&other, &out).unwrap();
    assert_eq!(to_bits(&logits(&other)), to_bits(&want));
    let wider = Gpt::new(GptConfig { n_embd: 16, ..cfg }, 0, DType::F32, Device::Cpu).unwrap();
    let e = load_gpt2_into(&wider, &out).unwrap_err().to_string();
    assert!(e.contains("n_embd") && e.contains("16"), "{e}");

    // Saving again over an existing checkpoint works (atomic replace).
    save_gpt2(&other, &out).unwrap();
    assert_eq!(
        to_bits(&logits(&load_gpt2(&out, DType::F32, Device::Cpu).unwrap())),
        to_bits(&want)
    );
}

#[test]
fn hf_gpt2_bad_checkpoints_are_clear_errors() {
    let dir = TempDir::new("hf-bad");
    let ts = hf_tensors();
    let load = |name: &str, config: &str, tensors: &[(String, Vec<usize>, Vec<f32>)]| -> String {
        let d = dir.path().join(name);
        write_hf(&d, config, tensors);
        match load_gpt2(&d, DType::F32, Device::Cpu) {
            Ok(_) => panic!("{name}: expected an error"),
            Err(e) => e.to_string(),
        }
    };

    // A Conv1D weight stored in Linear's layout: named, with both shapes.
    let mut wrong = ts.clone();
    let i = wrong
        .iter()
        .position(|(n, _, _)| n == "h.0.mlp.c_fc.weight")
        .unwrap();
    wrong[i].1 = vec![32, 8];
    let e = load("conv", HF_CONFIG, &wrong);
    assert!(
        e.contains("h.0.mlp.c_fc.weight") && e.contains("[32, 8]") && e.contains("[8, 32]"),
        "{e}"
    );
    assert!(e.contains("model.safetensors"), "{e}");

    // A plain tensor of the wrong shape (with the prefix: the file's name is reported).
    let mut wrong = with_prefix(&ts);
    let i = wrong
        .iter()
        .position(|(n, _, _)| n == "transformer.wpe.weight")
        .unwrap();
    wrong[i] = (
        "transformer.wpe.weight".into(),
        vec![4, C],
        vec![0.0; 4 * C],
    );
    let e = load("wpe", HF_CONFIG, &wrong);
    assert!(
        e.contains("transformer.wpe.weight") && e.contains("[4, 8]") && e.contains("[5, 8]"),
        "{e}"
    );

    // A missing tensor is named.
    let missing: Vec<_> = ts
        .iter()
        .filter(|(n, _, _)| n != "h.1.ln_2.bias")
        .cloned()
        .collect();
    let e = load("missing", HF_CONFIG, &missing);
    assert!(e.contains("missing") && e.contains("h.1.ln_2.bias"), "{e}");

    // An unknown tensor is named (a mask-like name that is not a mask buffer).
    let mut extra = ts.clone();
    extra.push(("h.0.attn.c_attn.extra".into(), vec![1], vec![0.0]));
    let e = load("extra", HF_CONFIG, &extra);
    assert!(e.contains("h.0.attn.c_attn.extra"), "{e}");

    // An untied head.
    let mut untied = ts.clone();
    untied.push(("lm_head.weight".into(), vec![V, C], vec![0.5; V * C]));
    let e = load("untied", HF_CONFIG, &untied);
    assert!(e.contains("lm_head.weight"), "{e}");

    // A tensor present both with and without the prefix.
    let mut both = ts.clone();
    both.push(("transformer.ln_f.bias".into(), vec![C], vec![0.0; C]));
    let e = load("both", HF_CONFIG, &both);
    assert!(e.contains("ln_f.bias") && e.contains("twice"), "{e}");

    // Config problems name the key.
    let e = load("no-embd", &HF_CONFIG.replace("\"n_embd\": 8,", ""), &ts);
    assert!(e.contains("n_embd") && e.contains("config.json"), "{e}");
    let e = load("bert", &HF_CONFIG.replace("\"gpt2\"", "\"bert\""), &ts);
    assert!(e.contains("model_type"), "{e}");
    let e = load("relu", &HF_CONFIG.replace("gelu_new", "relu"), &ts);
    assert!(e.contains("relu"), "{e}");
    let e = load(
        "heads",
        &HF_CONFIG.replace("\"n_head\": 2", "\"n_head\": 3"),
        &ts,
    );
    assert!(e.contains("n_head") || e.contains("divisible"), "{e}");
    let nodir = dir.path().join("does-not-exist");
    let e = load_gpt2(&nodir, DType::F32, Device::Cpu)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("does-not-exist") && e.contains("config.json"),
        "{e}"
    );
}

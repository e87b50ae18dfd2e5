"""Fixtures for nn/tests/llama_hf.rs, produced by Hugging Face transformers (never by meshgrad).

Builds tiny random LlamaForCausalLM models, saves them with save_pretrained under
nn/tests/fixtures/hf_llama/<case>/, and writes nn/tests/fixtures/hf_llama/expected.json with,
per case, the mean next-token cross-entropy on fixed ids (float32 and float64 runs) and the greedy
continuation of a fixed prompt (argmax of the last position's logits, the whole context recomputed
each step; no KV cache, no end-of-sequence stop).

Cases:
  gqa_untied     4 heads, 2 kv heads, untied head, rope_theta 10000, config.json as this
                 transformers writes it.
  tied_old_config  4 heads, 4 kv heads, tied head, rope_theta 500000; config.json rewritten to the
                 form of transformers 4.x (rope_theta at the top level, no rope_parameters), and
                 checked to give the same loss when transformers reads it back.

Run (outside the repository's environment, in a throwaway venv with torch, transformers and
safetensors):  python nn/tests/hf_llama_reference.py
"""

import json
import os
import sys

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "hf_llama")

IDS = [
    [3, 17, 42, 8, 0, 63, 25, 9, 31, 12, 5, 50],
    [60, 1, 1, 22, 47, 38, 14, 2, 7, 29, 33, 11],
]
IGNORE = -100
PROMPT = [5, 9, 13, 21]
NEW_TOKENS = 8


def targets():
    t = [row[1:] + [row[0]] for row in IDS]
    t[1][4] = IGNORE  # one ignored target
    return t


def build(name, tie, n_kv, theta):
    torch.manual_seed({"gqa_untied": 1, "tied_old_config": 2}[name])
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_theta=theta,
        tie_word_embeddings=tie,
        attention_bias=False,
        mlp_bias=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                # Large enough that the logits differ clearly (greedy ids are stable).
                p.copy_(0.3 * torch.randn_like(p))
    return model


def loss_of(model, dtype):
    m = model.to(dtype)
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = m(ids).logits
    v = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, v), torch.tensor(targets()).reshape(-1), ignore_index=IGNORE
    )
    return float(loss)


def greedy(model):
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(PROMPT):]


def to_old_config(path):
    with open(path) as f:
        c = json.load(f)
    params = c.pop("rope_parameters", None) or {}
    c["rope_theta"] = params.get("rope_theta", c.get("rope_theta"))
    c["rope_scaling"] = None
    if "dtype" in c:
        c["torch_dtype"] = c.pop("dtype")
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def main():
    torch.set_num_threads(1)
    cases = [("gqa_untied", False, 2, 10000.0), ("tied_old_config", True, 4, 500000.0)]
    expected = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "ids": IDS,
        "targets": targets(),
        "ignore_index": IGNORE,
        "prompt": PROMPT,
        "cases": {},
    }
    for name, tie, n_kv, theta in cases:
        model = build(name, tie, n_kv, theta)
        folder = os.path.join(OUT, name)
        model.to(torch.float32).save_pretrained(folder, safe_serialization=True)
        for extra in ("generation_config.json",):
            p = os.path.join(folder, extra)
            if os.path.exists(p):
                os.remove(p)
        if name == "tied_old_config":
            to_old_config(os.path.join(folder, "config.json"))
        # What transformers reads back from the folder (old config included) is the reference.
        reloaded = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        f32 = loss_of(reloaded, torch.float32)
        ids = greedy(reloaded)
        f64 = loss_of(reloaded, torch.float64)
        if abs(loss_of(model, torch.float32) - f32) > 1e-6:
            sys.exit(f"{name}: the reloaded model's loss differs from the saved one's")
        expected["cases"][name] = {"loss_f32": f32, "loss_f64": f64, "greedy": ids}
        print(f"{name}: loss f32 {f32:.8f}, f64 {f64:.10f}, greedy {ids}")
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()

"""Fixtures for nn/tests/mixtral_hf.rs and tests/cli_llama.rs, produced by Hugging Face
transformers (never by meshgrad).

Builds tiny random MixtralForCausalLM models (vocab 64, hidden 32, 2 layers, 4 heads, 4 experts
16 wide, top 2, context 32), saves them with save_pretrained under
nn/tests/fixtures/hf_mixtral/<case>/, and writes nn/tests/fixtures/hf_mixtral/expected.json with,
per case:
  loss_f32 / loss_f64  transformers' mean next-token cross-entropy (from the logits: the router's
                       auxiliary loss is not in it) on fixed ids, float32 and float64 runs;
  greedy               the greedy continuation of a fixed prompt by 8 tokens (argmax of the last
                       position, the whole context recomputed each step);
  eval                 the mean cross-entropy over the windows meshgrad's `eval` takes of
                       `eval_ids` (starts 0, 32, ... while start + 33 <= len; float32 model,
                       the cross-entropy summed in float64);
  min_top2_gap         the smallest gap, over every token of these runs and every layer, between
                       the router's k-th and (k+1)-th probabilities (how far the routing is
                       from a tie: a tiny gap would make the fixture fragile).

Cases:
  classic_gqa_untied  2 kv heads, untied head, rope_theta 10000, rms_norm_eps 1e-6; saved as
                      transformers saves by default: the classic layout
                      (block_sparse_moe.gate.weight, block_sparse_moe.experts.{e}.w1/w2/w3.weight).
  fused_tied_defaults 4 kv heads, tied head, saved with save_original_format=False: the fused
                      layout of transformers 5 (mlp.gate.weight, mlp.experts.gate_up_proj
                      [E, 2I, H], mlp.experts.down_proj [E, H, I]); config.json stripped of
                      rms_norm_eps and of rope_theta / rope_parameters, so transformers reads
                      MixtralConfig's defaults (1e-5 and 1e6, not Llama's 1e-6 and 1e4), and
                      checked to give the saved model's loss when transformers reads it back.

Run by hand (CI has no torch), outside the repository's environment, in a throwaway venv:
    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch transformers safetensors
    /tmp/hfvenv/bin/python nn/tests/hf_mixtral_reference.py
"""

import json
import os
import sys

import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "hf_mixtral")

IDS = [
    [3, 17, 42, 8, 0, 63, 25, 9, 31, 12, 5, 50],
    [60, 1, 1, 22, 47, 38, 14, 2, 7, 29, 33, 11],
]
IGNORE = -100
PROMPT = [5, 9, 13, 21]
NEW_TOKENS = 8
CONTEXT = 32


def targets():
    t = [row[1:] + [row[0]] for row in IDS]
    t[1][4] = IGNORE  # one ignored target
    return t


def eval_ids():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (2 * CONTEXT + 5,), generator=g).tolist()


def build(seed, tie, n_kv, theta, eps):
    torch.manual_seed(seed)
    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=eps,
        rope_theta=theta,
        tie_word_embeddings=tie,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_aux_loss_coef=0.02,
        sliding_window=None,
    )
    model = MixtralForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or n.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                # Large enough that the logits differ clearly (greedy ids are stable).
                p.copy_(0.3 * torch.randn_like(p))
    return model


GAPS = []


def record_gaps(model):
    """Forward hooks on the routers recording the k-th minus (k+1)-th probability."""
    k = model.config.num_experts_per_tok

    def hook(_module, _inputs, out):
        logits = out[0] if isinstance(out, tuple) else out
        p = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
        GAPS.append(float((p[:, k - 1] - p[:, k]).min()))

    for layer in model.model.layers:
        block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe")
        block.gate.register_forward_hook(hook)


def loss_of(model, dtype):
    m = model.to(dtype)
    with torch.no_grad():
        logits = m(torch.tensor(IDS)).logits
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


def eval_loss(model, ids):
    total, n, s = 0.0, 0, 0
    while s + CONTEXT + 1 <= len(ids):
        x = torch.tensor([ids[s:s + CONTEXT]])
        y = torch.tensor(ids[s + 1:s + CONTEXT + 1])
        with torch.no_grad():
            logits = model(x).logits[0]
        total += torch.nn.functional.cross_entropy(logits.double(), y, reduction="sum").item()
        n += CONTEXT
        s += CONTEXT
    return total / n


def strip_defaults(path):
    with open(path) as f:
        c = json.load(f)
    for key in ("rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling"):
        c.pop(key, None)
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def tensor_names(folder):
    from safetensors import safe_open

    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}


def main():
    torch.set_num_threads(1)
    cases = [
        # name, seed, tied, kv heads, rope_theta, rms eps, classic layout
        ("classic_gqa_untied", 1, False, 2, 10000.0, 1e-6, True),
        ("fused_tied_defaults", 2, True, 4, 1e6, 1e-5, False),
    ]
    ev = eval_ids()
    expected = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "ids": IDS,
        "targets": targets(),
        "ignore_index": IGNORE,
        "prompt": PROMPT,
        "eval_ids": ev,
        "cases": {},
    }
    for name, seed, tie, n_kv, theta, eps, classic in cases:
        model = build(seed, tie, n_kv, theta, eps)
        folder = os.path.join(OUT, name)
        model.to(torch.float32).save_pretrained(
            folder, safe_serialization=True, save_original_format=classic
        )
        p = os.path.join(folder, "generation_config.json")
        if os.path.exists(p):
            os.remove(p)
        if not classic:
            strip_defaults(os.path.join(folder, "config.json"))
        names = tensor_names(folder)
        fused = any(".mlp.experts.gate_up_proj" in k for k in names)
        if fused == classic:
            sys.exit(f"{name}: expected the {'classic' if classic else 'fused'} layout, got {sorted(names)}")
        # What transformers reads back from the folder is the reference, with the experts run
        # one by one ("eager": the grouped_mm default refuses float64; in float32 both agree).
        reloaded = MixtralForCausalLM.from_pretrained(
            folder, dtype=torch.float32, experts_implementation="eager"
        ).eval()
        grouped = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        c = reloaded.config
        theta_read = (c.rope_parameters or {}).get("rope_theta", getattr(c, "rope_theta", None))
        if (c.rms_norm_eps, theta_read) != (eps, theta):
            sys.exit(f"{name}: transformers read eps {c.rms_norm_eps}, theta {theta_read}")
        record_gaps(reloaded)
        f32 = loss_of(reloaded, torch.float32)
        ids = greedy(reloaded)
        ev_loss = eval_loss(reloaded, ev)
        f64 = loss_of(reloaded, torch.float64)
        if abs(loss_of(model, torch.float32) - f32) > 1e-6:
            sys.exit(f"{name}: the reloaded model's loss differs from the saved one's")
        f32_grouped = loss_of(grouped, torch.float32)
        if abs(f32_grouped - f32) > 1e-6 or greedy(grouped) != ids:
            sys.exit(f"{name}: grouped_mm experts give {f32_grouped}, eager {f32}")
        gap = min(GAPS)
        GAPS.clear()
        expected["cases"][name] = {
            "loss_f32": f32,
            "loss_f64": f64,
            "greedy": ids,
            "eval": ev_loss,
            "min_top2_gap": gap,
            "layout": "classic" if classic else "fused",
        }
        print(f"{name}: loss f32 {f32:.8f} (grouped_mm {f32_grouped:.8f}), f64 {f64:.10f}, eval {ev_loss:.8f}, greedy {ids}, "
              f"smallest router gap {gap:.2e}, {len(names)} tensors")
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()

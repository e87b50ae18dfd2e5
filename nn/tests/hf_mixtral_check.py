"""Loads the Mixtral folders meshgrad wrote (the ignored test `export_for_transformers` of
nn/tests/mixtral_hf.rs) with transformers' MixtralForCausalLM and compares transformers'
cross-entropy (from the logits; the router's auxiliary loss is not in it, as in meshgrad's) and
greedy ids with meshgrad's (meshgrad_expected.json beside the folders).

Run by hand (CI has no torch), in a throwaway venv with torch, transformers and safetensors:

    cargo test --release -p meshgrad-nn --test integration -- --ignored mixtral_hf::export_for_transformers
    /tmp/hfvenv/bin/python nn/tests/hf_mixtral_check.py target/mixtral_export

Exits non-zero when a loss differs by more than 1e-5 (relative) or a greedy id differs.
"""

import json
import os
import sys

import torch
import transformers
from transformers import MixtralForCausalLM


def main(out):
    with open(os.path.join(out, "meshgrad_expected.json")) as f:
        e = json.load(f)
    ids, targets = torch.tensor(e["ids"]), torch.tensor(e["targets"]).reshape(-1)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    ok = True
    for case, want in e["cases"].items():
        model = MixtralForCausalLM.from_pretrained(
            os.path.join(out, case), dtype=torch.float32
        ).eval()
        with torch.no_grad():
            logits = model(ids).logits
            loss = float(torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets, ignore_index=e["ignore_index"]))
            tokens = list(e["prompt"])
            for _ in range(len(want["greedy"])):
                tokens.append(int(torch.argmax(model(torch.tensor([tokens])).logits[0, -1])))
        greedy = tokens[len(e["prompt"]):]
        rel = abs(loss - want["loss"]) / abs(want["loss"])
        print(f"{case}: transformers loss {loss:.8f}, meshgrad {want['loss']:.8f}, "
              f"relative difference {rel:.2e}; greedy transformers {greedy}, "
              f"meshgrad {want['greedy']}")
        ok = ok and rel <= 1e-5 and greedy == want["greedy"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/mixtral_export")

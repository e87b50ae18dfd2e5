# Run: python nn/tests/hf_llama_eval_reference.py nn/tests/fixtures/hf_llama > nn/tests/fixtures/hf_llama/eval_expected.json
# (writes eval_ids.bin in the current folder as a by-product). transformers 5.24.0, torch 2.15.0.
# Writes eval_ids.bin (raw little-endian u16 ids, 2*32+5 tokens) and transformers' mean next-token
# cross-entropy over meshgrad eval's windows (starts 0, 32 while start+33 <= len) for each fixture.
import json, struct, sys, torch
from transformers import LlamaForCausalLM
fx = sys.argv[1]
g = torch.Generator().manual_seed(7)
ids = torch.randint(0, 64, (2 * 32 + 5,), generator=g).tolist()
open("eval_ids.bin", "wb").write(struct.pack("<%dH" % len(ids), *ids))
out = {"ids": ids}
for case in ["gqa_untied", "tied_old_config"]:
    m = LlamaForCausalLM.from_pretrained(f"{fx}/{case}", torch_dtype=torch.float32).eval()
    T = 32; total = 0.0; n = 0; s = 0
    while s + T + 1 <= len(ids):
        x = torch.tensor([ids[s:s + T]]); y = torch.tensor(ids[s + 1:s + T + 1])
        with torch.no_grad():
            logits = m(x).logits[0]
        total += torch.nn.functional.cross_entropy(logits.double(), y, reduction="sum").item(); n += T; s += T
    out[case] = total / n
print(json.dumps(out))

"""Check that a Llama trained by `meshgrad train --model llama` loads in Hugging Face transformers
and agrees with meshgrad's own `eval` (loss) and `generate` (greedy ids).

Three shapes are trained for 40 steps on the CPU into a temporary folder:
  gqa   --set model.n_kv_head=2           (grouped-query attention, untied head)
  tied  --set model.tie_embeddings=true   (head reads the embedding table)
  pad   --set model.vocab_multiple=96     (byte vocabulary 256 padded to 288)

For each, on a byte-level text file (each byte is one id):
  * loss: `meshgrad eval` scores windows of the context length T at starts 0, T, 2T, ... while
    start + T + 1 <= len (inputs tokens[s:s+T], targets tokens[s+1:s+T+1]) and prints the mean
    cross-entropy over all targets, the softmax taken over every logit (padded ids included).
    transformers' LlamaForCausalLM scores the same windows the same way.
  * greedy ids: `meshgrad generate --temperature 0` from the prompt 10,20,30 against an argmax
    loop in transformers (full forward each step), the argmax taken over the ids the run's data
    used (the first 256), as meshgrad's generation does.

Run:  python tests/hf_llama_train_check.py /path/to/meshgrad
Needs torch and transformers. Exits non-zero when a loss differs by more than 1e-5 or a greedy
id differs.
"""

import os
import re
import subprocess
import sys
import tempfile

import torch
import transformers
from transformers import LlamaForCausalLM

CASES = {
    "gqa": ["--set", "model.n_kv_head=2"],
    "tied": ["--set", "model.tie_embeddings=true"],
    "pad": ["--set", "model.vocab_multiple=96"],
}
PROMPT = [10, 20, 30]
NEW_TOKENS = 16
BYTE_VOCAB = 256
TOL = 1e-5


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return out.strip().splitlines()[-1]


def load(folder):
    try:
        return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except TypeError:  # transformers before `dtype=`
        return LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def hf_loss(model, ids, t):
    n = (len(ids) - 1) // t
    x = torch.tensor([ids[s : s + t] for s in range(0, n * t, t)])
    y = torch.tensor([ids[s + 1 : s + t + 1] for s in range(0, n * t, t)])
    with torch.no_grad():
        logits = model(x).logits.double()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return ce.item(), n


def hf_greedy(model, prompt, new, vocab):
    ids, mattered = list(prompt), False
    with torch.no_grad():
        for _ in range(new):
            last = model(torch.tensor([ids])).logits[0, -1]
            pick = int(torch.argmax(last[:vocab]))
            mattered |= int(torch.argmax(last)) != pick
            ids.append(pick)
    return ids[len(prompt) :], mattered


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    exe = os.path.abspath(sys.argv[1])
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        text = "".join(
            f"Line {i}: the quick brown fox jumps over the lazy dog; caf\u00e9 \u2014 na\u00efve r\u00e9sum\u00e9.\n"
            for i in range(30)
        ).encode()
        data = os.path.join(tmp, "eval.txt")
        with open(data, "wb") as f:
            f.write(text)
        ids = list(text)
        for name, flags in CASES.items():
            out = os.path.join(tmp, name)
            subprocess.run(
                [exe, "train", "--model", "llama", "--steps", "40", "--set",
                 "train.sample_tokens=0", "--out", out, *flags],
                check=True, capture_output=True,
            )
            mg_loss = float(re.search(r"loss=(\S+)", run([exe, "eval", "--checkpoint", out, "--data", data])).group(1))
            mg_ids = [int(v) for v in re.search(r"ids=(\S*)", run(
                [exe, "generate", "--checkpoint", out, "--prompt-tokens", ",".join(map(str, PROMPT)),
                 "--temperature", "0", "--max-new-tokens", str(NEW_TOKENS)])).group(1).split(",") if v]
            model = load(out)
            cfg = model.config
            if name == "tied":
                assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "head not tied"
            if name == "pad":
                assert cfg.vocab_size == 288, f"vocab_size {cfg.vocab_size}, expected 288"
            loss, windows = hf_loss(model, ids, cfg.max_position_embeddings)
            hf_ids, mattered = hf_greedy(model, PROMPT, NEW_TOKENS, BYTE_VOCAB)
            diff = abs(loss - mg_loss)
            ok = diff <= TOL and hf_ids == mg_ids
            failed |= not ok
            print(f"[{name}] vocab={cfg.vocab_size} kv_heads={cfg.num_key_value_heads} "
                  f"tied={cfg.tie_word_embeddings} windows={windows}x{cfg.max_position_embeddings}")
            print(f"  loss meshgrad={mg_loss:.8f} transformers={loss:.8f} diff={diff:.2e}")
            print(f"  greedy meshgrad    ={mg_ids}")
            print(f"  greedy transformers={hf_ids} (argmax over all {cfg.vocab_size} ids "
                  f"{'differs' if mattered else 'same'})")
            print(f"  {'ok' if ok else 'MISMATCH'}")
    print("FAILED" if failed else "all cases agree")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

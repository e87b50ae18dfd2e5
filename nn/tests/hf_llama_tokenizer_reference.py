"""A Llama-2-style tokenizer.json and the ids Hugging Face produces with it, for
nn/tests/llama_hf.rs (expected values from Python's tokenizers / transformers, never meshgrad).

The tokenizer has the structure transformers' LlamaConverter gives Llama 2's SentencePiece model:
a BPE with byte fallback (`<0x00>` .. `<0xFF>` in the vocabulary), `<unk>` `<s>` `</s>` at ids
0 1 2, the normalizer "prepend ▁, spaces to ▁", no pre-tokenizer, the decoder "▁ to space, byte
fallback, fuse, strip one leading space", and the post-processor `<s> $A`. Its merges are
learned from a few sentences.

    python nn/tests/hf_llama_tokenizer_reference.py
"""

import json
import os

import tokenizers
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fixtures", "hf_llama", "tokenizer")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Llama models read text as pieces of words.",
    "Tensor parallelism splits the heads of attention over the ranks.",
    "the the the quick quick brown brown fox fox",
]
TEXTS = [
    "The quick brown fox.",
    "tensor parallel heads",
    "naïve café, 東京 and emoji 🦙!",
    "  two  spaces",
]


def main():
    # Learn merges on the normalised corpus (spaces as ▁, as the model sees them).
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    learner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tok, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if tok not in vocab:
            vocab[tok] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = learner.normalizer
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "tokenizer.json")
    tok.save(path)
    # transformers' fast tokenizer over the same file is the reference.
    fast = PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    cases = []
    for text in TEXTS:
        with_bos = fast(text)["input_ids"]
        plain = fast(text, add_special_tokens=False)["input_ids"]
        cases.append({
            "text": text,
            "ids": with_bos,
            "ids_without_special": plain,
            "decoded": fast.decode(plain),
        })
        print(repr(text), with_bos)
    expected = {
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "vocab_size": tok.get_vocab_size(),
        "cases": cases,
    }
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()

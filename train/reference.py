"""The third oracle: train/xing4.py's forward, in f32 on the CPU, on a checkpoint's GGUF weights
dequantized by the `gguf` package (llama.cpp's own Python reader), over a fixed prompt. Writes
`oracle.json` (the prompt's token ids, what made it) and `oracle-logits.f32` (little-endian f32,
one row of vocab logits per prompt position) into the checkpoint directory; the runtime's CPU
logits are tested against them (tests/tests/trained_default.rs).

Usage: python3 train/reference.py DIR [--out OUT] [--prompt TEXT]
(DIR holds model.gguf, config.json, tokenizer.json; OUT defaults to DIR.) Any checkpoint this
script's model reads: xing4_0, and deepseek2 without hyper-connections (tests/tests/reference/).
"""

import argparse

import json
import os
import sys

import numpy as np
import torch
from tokenizers import Tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from xing4 import Config, Xing4, load_gguf_weights  # noqa: E402

# A chat prompt as the template renders it (thinking on), then text of the corpus's kind.
PROMPT = (
    "<_system><_user>Tell me about Elizabeth.<_bot><think>\n</think>"
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. And God said, Let there be light: and there was light."
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--out")
    ap.add_argument("--prompt", default=PROMPT)
    args = ap.parse_args()
    d, out = args.dir, args.out or args.dir
    os.makedirs(out, exist_ok=True)
    cfg = Config.load(os.path.join(d, "config.json"))
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    ids = tok.encode(args.prompt, add_special_tokens=False).ids
    torch.manual_seed(0)
    model = Xing4(cfg).eval()
    load_gguf_weights(model, os.path.join(d, "model.gguf"))
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0].float().numpy()
    logits.astype("<f4").tofile(os.path.join(out, "oracle-logits.f32"))
    with open(os.path.join(out, "oracle.json"), "w") as f:
        json.dump(
            {
                "made_by": "train/reference.py: train/xing4.py's forward in f32 on the CPU over "
                "model.gguf dequantized by the gguf package",
                "torch": torch.__version__,
                "prompt": args.prompt,
                "tokens": ids,
                "n_vocab": cfg.vocab,
                "logits": "oracle-logits.f32",
            },
            f,
            indent=1,
        )
        f.write("\n")
    top = logits.argmax(-1)
    print(f"reference: {len(ids)} positions; greedy next tokens {tok.decode(top[-8:].tolist())!r}")


if __name__ == "__main__":
    main()

"""Tokenizes the corpus (train/data/corpus.txt, from corpus.sh) with a checkpoint's tokenizer.json
and writes the training and validation token streams (uint16) beside it.

The stream holds the corpus paragraphs, each followed by a newline, and between them chat turns
rendered as the project's chat template renders them (spec §8), so that the chat path answers in
sentences: a user line and an assistant answer taken from the corpus, half with the thinking
preamble (`<_bot><think>\\n</think>answer<_end>`: the reasoning is empty, the model knows nothing
to reason about), half without (`<_bot></think>answer<_end>`). Every 50th paragraph, and the chat
turns made from it, is held out for validation.

Usage: python3 train/prepare.py --tokenizer DIR/tokenizer.json [--corpus train/data/corpus.txt]
"""

import argparse
import random
import re

import numpy as np
from tokenizers import Tokenizer

# A sentence ends at . ! or ? before a capital, except after a title (Mr. Henry Dashwood).
SENTENCE_END = re.compile(r"(?<=[.!?])(?<!Mr\.)(?<!Mrs\.)(?<!Dr\.)(?<!St\.)\s+(?=[A-Z\"'])")
NAME = re.compile(r"\b([A-Z][a-z]{2,})\b")
NOT_NAMES = {
    "The", "And", "But", "For", "Then", "Now", "When", "Thou", "Thy", "They", "There", "This", "That",
    "What", "She", "Her", "His", "Him", "Yet", "Let", "Lord", "God", "Behold", "Mrs", "Miss", "Chapter",
    "CHAPTER", "Who", "Why", "How", "With", "Which", "Not", "Nor", "Its", "Our", "Your", "All", "Ye",
}
ASK = [
    "Tell me about {}.",
    "Who is {}?",
    "What do you know of {}?",
    "Say something about {}.",
]
OPEN = [
    "Tell me a story.",
    "Say something.",
    "Go on.",
    "What happened next?",
    "Write a few lines.",
]


def chat(user, answer, thinking):
    bot = "<_bot><think>\n</think>" if thinking else "<_bot></think>"
    return f"<_system><_user>{user}{bot}{answer}<_end>\n"


def chat_turns(paragraph, rng):
    """Chat samples drawn from one paragraph."""
    sents = [s.strip() for s in SENTENCE_END.split(paragraph) if s.strip()]
    if len(sents) < 2 or max(len(s) for s in sents) > 600:
        return []
    out = []
    # Continue: a sentence, then the next one or two.
    k = rng.randrange(len(sents) - 1)
    out.append(chat(sents[k], " ".join(sents[k + 1 : k + 1 + rng.choice((1, 2))]), rng.random() < 0.5))
    # Ask about a name the answer holds.
    k = rng.randrange(len(sents))
    names = [n for n in NAME.findall(sents[k]) if n not in NOT_NAMES]
    if names:
        q = rng.choice(ASK).format(rng.choice(names))
        out.append(chat(q, " ".join(sents[k : k + 2]), rng.random() < 0.5))
    # An open request.
    if rng.random() < 0.3:
        k = rng.randrange(len(sents))
        out.append(chat(rng.choice(OPEN), " ".join(sents[k : k + 3]), rng.random() < 0.5))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--corpus", default="train/data/corpus.txt")
    ap.add_argument("--out", default="train/data")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    rng = random.Random(args.seed)
    with open(args.corpus, encoding="utf-8") as f:
        paragraphs = [line.rstrip("\n") for line in f if line.strip()]
    train, val = [], []
    n_chat = [0, 0]
    for i, p in enumerate(paragraphs):
        texts = [p + "\n"] + chat_turns(p, rng)
        held = i % 50 == 7
        for t in texts:
            ids = tok.encode(t, add_special_tokens=False).ids
            (val if held else train).extend(ids)
        n_chat[held] += len(texts) - 1
    for name, ids in (("train", train), ("val", val)):
        a = np.asarray(ids, dtype=np.uint16)
        a.tofile(f"{args.out}/{name}.bin")
    print(
        f"prepare: {len(paragraphs)} paragraphs, {n_chat[0]} + {n_chat[1]} chat turns; "
        f"train {len(train):,} tokens, val {len(val):,} tokens"
    )


if __name__ == "__main__":
    main()

"""LongBench's head + tail truncation (the rule lm-eval's LongBench tasks leave to MiddleTruncatingHFLM)."""

import re

from toptheta.evaluation.longbench import truncate_middle


class PieceTokenizer:
    """Offline stand-in for a SentencePiece tokenizer: a piece is a word with its trailing
    whitespace, `encode` adds a BOS (id 0) and `decode` drops it when asked, like HF's."""

    def __init__(self):
        self.vocab: dict[str, int] = {"<s>": 0}

    def pieces(self, text: str) -> list[str]:
        return re.findall(r"\S+\s*|\s+", text)

    def encode(self, text: str) -> list[int]:
        return [0] + [self.vocab.setdefault(p, len(self.vocab)) for p in self.pieces(text)]

    def decode(self, ids, skip_special_tokens=False) -> str:
        inverse = {i: p for p, i in self.vocab.items()}
        return "".join(inverse[i] for i in ids if not (skip_special_tokens and i == 0))


def test_truncation_keeps_exactly_head_and_tail():
    tok = PieceTokenizer()
    prompt = " ".join(f"w{i}" for i in range(100))  # BOS + 100 pieces = 101 tokens
    pieces = tok.pieces(prompt)
    out = truncate_middle(prompt, tok, max_length=21)  # half = 10 tokens from each end
    assert out == "".join(pieces[:9]) + "".join(pieces[-10:])  # the head's first token is the BOS
    assert len(tok.encode(out)) == 1 + 19
    assert truncate_middle(prompt, tok, max_length=101) == prompt  # fits: returned untouched
    out = truncate_middle(prompt, tok, max_length=100)  # BOS + w0..w48, then w50..w99
    assert out.startswith("w0 ") and out.endswith("w99") and "w48 w50 " in out and "w49 " not in out

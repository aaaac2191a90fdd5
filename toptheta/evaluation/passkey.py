"""Passkey retrieval: a number hidden at a chosen depth in filler text, asked for at the end.

The task follows the passkey convention of Mohtashami & Jaggi 2023 (Landmark Attention): an
instruction, irrelevant filler, one sentence stating the key, more filler, then the question.
Everything here is generated: the filler is a fixed list of bland sentences written for this
project, drawn in a seeded order, so a (seed, length, depth, index) always gives the same prompt.

Lengths are in tokens of the caller's tokenizer: the number of filler sentences is the largest
that keeps the whole prompt at or under the target, so a prompt is at most one sentence (about
10-15 tokens) short of it.

Filler: ``"independent"`` (each prompt draws its own sentence order; the first layout of this project) or
``"shared"`` (one order per length and sample index, the layout of the original passkey test, whose filler is
one repeated text): prompts of one length then differ only in the key and where it sits, so everything before
the key is a prefix they share, which generation can run once (``prefix_sharing.py``).
"""

from __future__ import annotations

import random
import re
from typing import Callable, Iterable, Sequence

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. "
         "Find it and memorize it. I will quiz you about the important information afterwards.\n\n")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"

# Self-written filler. Short, neutral, digit-free (so no number competes with the key).
FILLER_SENTENCES: tuple[str, ...] = (
    "The morning light settled slowly over the quiet fields.",
    "A gentle wind moved through the tall grass near the river.",
    "Clouds drifted across the sky without any hurry.",
    "The old bridge creaked a little as the carts rolled over it.",
    "Somewhere in the distance a dog barked twice and then fell silent.",
    "The baker opened the shutters and the smell of bread filled the street.",
    "Children walked to school along the narrow stone path.",
    "The library kept its windows open during the warm afternoons.",
    "A small boat rested on the shore, its ropes loosely tied.",
    "The market was busy with people choosing apples and pears.",
    "Rain tapped softly against the roof of the wooden shed.",
    "The train left the station a few minutes after noon.",
    "Leaves turned yellow and red as the season slowly changed.",
    "The garden was full of bees moving from flower to flower.",
    "An owl watched the empty road from the branch of an oak tree.",
    "The lamps along the harbour came on one after another.",
)

TokenCounter = Callable[[str], int]
FILLERS = ("independent", "shared")


def token_counter(tokenizer) -> TokenCounter:
    """A function text -> number of tokens, from a tokenizer or a callable.

    Accepts anything with `encode(text) -> list` (Hugging Face tokenizers: the count then
    includes the special tokens `encode` adds, e.g. BOS, as the model will see them), or a
    callable returning a token list or an int.
    """
    if hasattr(tokenizer, "encode"):
        return lambda text: len(tokenizer.encode(text))
    if callable(tokenizer):
        def count(text: str) -> int:
            out = tokenizer(text)
            return out if isinstance(out, int) else len(out)
        return count
    raise TypeError("tokenizer must have an encode(text) method (e.g. a transformers tokenizer) "
                    f"or be a callable text -> tokens; got {type(tokenizer).__name__}")


def _compose(sentences: Sequence[str], depth: float, key: str) -> str:
    cut = round(depth * len(sentences))  # the needle goes after `cut` filler sentences
    head, tail = " ".join(sentences[:cut]), " ".join(sentences[cut:])
    parts = [p for p in (head, NEEDLE.format(key=key).strip(), tail) if p]
    return INTRO + " ".join(parts) + QUESTION


def make_passkey_prompt(count_tokens: TokenCounter, target_tokens: int, depth: float,
                        rng: random.Random, digits: int = 5,
                        filler_rng: random.Random | None = None) -> tuple[str, str, int]:
    """One prompt of at most `target_tokens` tokens with the key after `depth` of the filler.

    Returns (prompt, key, length in tokens). The key is drawn from `rng` first, then the filler order from
    `filler_rng` (default: `rng` too).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1] (0 = start, 1 = end of the filler), got {depth}")
    key = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    filler_rng = filler_rng or rng
    filler: list[str] = []

    def prompt_with(n: int) -> str:
        while len(filler) < n:  # drawn lazily, always in the same order for this rng
            filler.append(filler_rng.choice(FILLER_SENTENCES))
        return _compose(filler[:n], depth, key)

    if count_tokens(prompt_with(0)) > target_tokens:
        raise ValueError(f"target of {target_tokens} tokens is shorter than the prompt without "
                         "filler; ask for a longer target")
    lo, hi = 0, 1  # invariant: prompt_with(lo) fits; find hi that does not
    while count_tokens(prompt_with(hi)) <= target_tokens:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # token counts grow with the number of sentences
        mid = (lo + hi) // 2
        if count_tokens(prompt_with(mid)) <= target_tokens:
            lo = mid
        else:
            hi = mid
    prompt = prompt_with(lo)
    return prompt, key, count_tokens(prompt)


def build_passkey_records(tokenizer, lengths: Iterable[int] = (1024, 2048, 4096, 8192, 16384),
                          depths: Iterable[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
                          samples_per_cell: int = 1, seed: int = 0, digits: int = 5,
                          filler: str = "independent") -> list[dict]:
    """The passkey data set: `samples_per_cell` prompts for each (length, depth).

    Records: {id, prompt, answer, length_tokens, target_tokens, depth}. Deterministic in `seed`. `filler`:
    "independent" (a sentence order per prompt) or "shared" (per length and sample index: see the module's doc).
    """
    if samples_per_cell < 1 or not 1 <= digits <= 18:
        raise ValueError("samples_per_cell must be >= 1 and digits in 1..18")
    if filler not in FILLERS:
        raise ValueError(f"filler must be one of {', '.join(FILLERS)}, got {filler!r}")
    count = token_counter(tokenizer)
    records = []
    for target in lengths:
        for depth in depths:
            for i in range(samples_per_cell):
                # A string seed is hashed deterministically (not by PYTHONHASHSEED).
                rng = random.Random(f"passkey:{seed}:{target}:{depth}:{i}")
                order = random.Random(f"passkey-filler:{seed}:{target}:{i}") if filler == "shared" else None
                prompt, key, n_tokens = make_passkey_prompt(count, int(target), float(depth), rng, digits, order)
                records.append({"id": f"passkey-{target}-d{depth:g}-{i}", "prompt": prompt,
                                "answer": key, "length_tokens": n_tokens,
                                "target_tokens": int(target), "depth": float(depth)})
    return records


def extract_passkey(generated: str) -> str | None:
    """The first run of digits in the generated text, or None."""
    match = re.search(r"\d+", generated)
    return match.group(0) if match else None


def score_passkey(generated: str, answer: str) -> bool:
    """Exact match of the first number in the generation with the key."""
    return extract_passkey(generated) == str(answer)


def passkey_accuracy(records: Sequence[dict], generations: Sequence[str]) -> float:
    """Percentage of records whose generation names the right key."""
    if len(records) != len(generations) or not records:
        raise ValueError(f"need one generation per record, got {len(generations)} for {len(records)}")
    hits = sum(score_passkey(g, r["answer"]) for r, g in zip(records, generations))
    return 100.0 * hits / len(records)

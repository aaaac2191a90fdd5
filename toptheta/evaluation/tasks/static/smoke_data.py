"""The `smoke` task's documents: simple multiple-choice questions generated in code.

The content is our own (no dataset is copied), tiny, and fully offline, so smoke runs and tests
exercise the real lm-eval path without network or data files. Generation is deterministic:
a fixed seed drives `random.Random`, whose integer-seeded sequence is stable across Python
versions and platforms.

lm-eval loads this file by path (``custom_dataset: !function smoke_data.smoke_dataset`` in
smoke.yaml), so it imports nothing from toptheta.
"""

from __future__ import annotations

import random
import string
from typing import Any, Callable

import datasets

SEED = 20250212
DOCS_PER_SPLIT = 40
SPLITS = ("test", "train")  # generated in this order, so the test split never depends on train's size



def _addition(rng: random.Random) -> tuple[str, str, list[str]]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    answer = a + b
    wrong = [answer - 2, answer - 1, answer + 1, answer + 2, answer + 10]
    return f"What is {a} plus {b}?", str(answer), [str(w) for w in wrong if w > 0]


def _successor(rng: random.Random) -> tuple[str, str, list[str]]:
    n = rng.randint(2, 98)
    return f"Which number comes right after {n}?", str(n + 1), [str(n - 1), str(n + 2), str(n + 10)]


def _largest(rng: random.Random) -> tuple[str, str, list[str]]:
    numbers = rng.sample(range(1, 100), 4)
    best = max(numbers)
    text = "Which number is the largest: " + ", ".join(str(x) for x in numbers) + "?"
    return text, str(best), [str(x) for x in numbers if x != best]


def _next_letter(rng: random.Random) -> tuple[str, str, list[str]]:
    i = rng.randint(1, 23)
    letters = string.ascii_uppercase
    wrong = [letters[i - 1], letters[i + 2], letters[(i + 7) % 26]]
    return f"Which letter comes right after {letters[i]} in the alphabet?", letters[i + 1], wrong


_FAMILIES: tuple[Callable[[random.Random], tuple[str, str, list[str]]], ...] = (
    _addition,
    _successor,
    _largest,
    _next_letter,
)


def smoke_docs() -> dict[str, list[dict[str, Any]]]:
    """All splits as lists of ``{"question", "choices" (4 strings), "label" (int)}`` records.

    Question texts are unique across splits, so calibrating on train never sees a test item.
    """
    rng = random.Random(SEED)
    seen: set[str] = set()
    out: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        docs: list[dict[str, Any]] = []
        while len(docs) < DOCS_PER_SPLIT:
            family = _FAMILIES[len(docs) % len(_FAMILIES)]  # round robin: every family in every split
            question, answer, wrong = family(rng)
            if question in seen:
                continue
            seen.add(question)
            choices = [answer] + rng.sample(sorted(set(wrong) - {answer}), 3)
            rng.shuffle(choices)
            docs.append({"question": question, "choices": choices, "label": choices.index(answer)})
        out[split] = docs
    return out


def smoke_dataset(**_ignored: Any) -> datasets.DatasetDict:
    """lm-eval's ``custom_dataset`` hook; it passes task metadata as keyword args, unused here."""
    return datasets.DatasetDict(
        {split: datasets.Dataset.from_list(docs) for split, docs in smoke_docs().items()}
    )

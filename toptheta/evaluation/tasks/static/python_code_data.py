"""The `python_code` task's documents: documented standard-library functions (toptheta/data/python_code).

Built by scripts/make_code_corpus.py (see toptheta/data/PROVENANCE.md): each document is a function's prompt
(signature and docstring) and its body. lm-eval loads this file by path (``custom_dataset: !function
python_code_data.python_code_dataset`` in python_code.yaml), so it imports nothing from toptheta.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parents[3] / "data" / "python_code"  # toptheta/data/python_code


def python_code_documents(split: str) -> list[dict]:
    """The documents of one split ("train" or "test"): {"id", "prompt", "body"} each, in the file's order."""
    with gzip.open(DATA / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def python_code_dataset(**_) -> dict[str, datasets.Dataset]:
    return {split: datasets.Dataset.from_list(python_code_documents(split)) for split in ("train", "test")}


def process_results(doc: dict, results: list) -> dict[str, float]:
    """Per document: the body's negative log-likelihood per character (nats; lower is better) and whether greedy
    decoding reproduces it. (lm-eval's document perplexity, exp of a whole body's summed loss, overflows.)"""
    loglikelihood, is_greedy = results[0]
    return {"nats_per_char": -loglikelihood / max(1, len(doc["body"])), "acc": float(is_greedy)}

"""The `long_documents` task's documents: long texts to calibrate Top-θ thresholds on the row lengths of long-context
tasks (passkey, RULER, LongBench), built from shipped train-split text that no long-context task evaluates on.

Each document is a seeded shuffle of ARC-Easy and ARC-Challenge train questions, each followed by its correct answer
("Question? Answer."), joined until the document reaches its length in characters; lengths double from 4,000 to
64,000 characters (about 1k to 16k tokens of a 4-characters-a-token tokenizer), DOCS_PER_LENGTH documents each, so the
calibrated row lengths cover every length up to the longest. A document is scored as a context (all but its last
question) and a target (the last question and answer), so its rows reach its full length. Deterministic: the same
documents on every machine. lm-eval loads this file by path (``custom_dataset: !function
long_documents_data.long_documents_dataset`` in long_documents.yaml), so it imports nothing from toptheta.
"""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import datasets

DATA = Path(__file__).resolve().parents[3] / "data"  # toptheta/data
SOURCES = ("arc_easy/train.jsonl.gz", "arc_challenge/train.jsonl.gz")
LENGTHS = (4_000, 8_000, 16_000, 32_000, 64_000)  # characters
DOCS_PER_LENGTH = {"train": 4, "test": 1}
SEEDS = {"train": 0, "test": 1}  # the test split's documents are other shuffles of the same sentences


def _sentences() -> list[str]:
    """Every ARC train question with its correct answer, in file order."""
    out = []
    for rel in SOURCES:
        with gzip.open(DATA / rel, "rt", encoding="utf-8") as f:
            for line in f:
                doc = json.loads(line)
                answer = doc["choices"]["text"][doc["choices"]["label"].index(doc["answerKey"])]
                out.append(f"{doc['question'].strip()} {answer.strip()}.")
    return out


def documents(split: str) -> list[dict]:
    """The split's documents: {id, length (target characters), context, ending}."""
    sentences, rng, docs = _sentences(), random.Random(SEEDS[split]), []
    for length in LENGTHS:
        for i in range(DOCS_PER_LENGTH[split]):
            order = rng.sample(range(len(sentences)), len(sentences))
            parts, size = [], 0
            for j in order:
                parts.append(sentences[j])
                size += len(sentences[j]) + 1
                if size >= length:
                    break
            docs.append({"id": f"{split}-{length}-{i}", "length": length, "context": " ".join(parts[:-1]),
                         "ending": " " + parts[-1]})
    return docs


def long_documents_dataset(**_) -> dict[str, datasets.Dataset]:
    return {split: datasets.Dataset.from_list(documents(split)) for split in ("train", "test")}


def process_results(doc: dict, results: list) -> dict[str, float]:
    """Per document: the last question's and answer's negative log-likelihood per character (nats)."""
    loglikelihood, _ = results[0]
    return {"nats_per_char": -loglikelihood / max(1, len(doc["ending"]))}

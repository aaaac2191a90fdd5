"""Documents of the offline LongBench tasks (templates/longbench.yaml): THUDM's schema -> lm-eval's.

THUDM's LongBench files hold the query as `input`; lm-eval's LongBench prompts come from the hub
copy Xnhyacinth/LongBench, which calls it `question`. Everything else is read as is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasets import Dataset


def add_question(dataset: Dataset) -> Dataset:
    """`dataset` with a `question` column equal to `input` (unchanged if it has one already)."""
    if "question" in dataset.column_names:
        return dataset
    if "input" not in dataset.column_names:
        raise ValueError(
            f"a LongBench file needs an `input` field (THUDM's schema: input, context, answers, "
            f"length, dataset, language, all_classes, _id); found {dataset.column_names}"
        )
    return dataset.add_column("question", dataset["input"])

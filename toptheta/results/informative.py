"""Which settings can inform a verdict: the dense model must answer well above chance and below its ceiling.

A setting (model, task, shots, questions, metric: one trade-off group) where the dense model guesses (SmolLM2 on
ARC-Challenge, 0.27 against 0.25) or is perfect (passkey at 2k-8k, 1.00) cannot show a loss under pruning: every
method ties there, which pushes non-inferiority claims towards "holds" and dilutes superiority claims. The rule
(issue 28):

    informative  ⇔  dense ≥ chance + MIN_ABOVE_CHANCE (0.10)  and  dense < ceiling
                    (ceiling: CEILING_01 = 0.95 for 0/1 metrics; 1.0, i.e. none short of perfect, for scores)

Chance is derived from the dense run's per-sample outputs where they hold the answer choices (lm-eval's
`arguments`, one per choice: chance = the mean of 1 / choices over the questions), else from CHANCE (per task,
by prefix), else 0 for generation metrics (pass@1, Rouge, passkey accuracy: guessing scores nothing).
Pooled verdicts use informative settings only; the uninformative ones are reported apart (verdicts.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pandas as pd

from ..store.samples import read_samples, samples_path
from . import figures, selection

MIN_ABOVE_CHANCE = 0.10
CEILING_01 = 0.95
BINARY_METRICS = ("acc", "acc_norm", "pass@1", "accuracy", "exact_match")
# Chance of the 0/1 metric by task (name or prefix): 1 / the number of answer choices.
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "hellaswag": 0.25, "mmlu": 0.25, "openbookqa": 0.25,
          "medmcqa": 0.25, "piqa": 0.5, "winogrande": 0.5, "boolq": 0.5, "copa": 0.5}
RULE = (f"a setting is informative when its dense score is at least {MIN_ABOVE_CHANCE:g} above chance and below its "
        f"ceiling ({CEILING_01:g} for 0/1 metrics such as accuracy and pass@1; 1 for continuous scores such as "
        f"Rouge); chance is the mean of 1/choices over the questions where the dense run's samples list the "
        f"choices, else the task's (ARC, HellaSwag, MMLU 0.25; PIQA, WinoGrande, BoolQ 0.5), else 0 for "
        f"generation tasks")
COLUMNS = ["setting", "dense", "chance", "chance_source", "ceiling", "informative", "reason", "run_id"]


def binary_metric(metric: str) -> bool:
    return str(metric).split(",")[0] in BINARY_METRICS


def table_chance(task: str, metric: str) -> float | None:
    """Chance of `metric` on `task` from CHANCE (the longest matching prefix); 0 for generation metrics."""
    matches = [name for name in CHANCE if task == name or task.startswith(name + "_")]
    if matches:
        return CHANCE[max(matches, key=len)]
    if _full(metric) in figures.GENERATION_METRICS:
        return 0.0
    return None


def _full(metric: str) -> str:
    return metric if "," in metric else f"{metric},none"


@functools.lru_cache(maxsize=128)
def _sample_chance(path: str, mtime_ns: int, task: str) -> float | None:

    samples = read_samples(path)
    records = samples.get(task) if isinstance(samples, dict) else None
    choices = [len(r["arguments"]) for r in records or () if isinstance(r, dict) and isinstance(r.get("arguments"), list)
               and len(r["arguments"]) > 1]
    if not records or len(choices) != len(records):
        return None
    return round(sum(1.0 / c for c in choices) / len(choices), 6)


def chance_level(task: str, metric: str, run_dir: str | Path | None = None) -> tuple[float | None, str]:
    """(chance, where it came from): the dense run's samples (its choices), the task table, or unknown."""
    if run_dir is not None and binary_metric(metric):

        path = samples_path(run_dir)
        if path is not None:
            chance = _sample_chance(str(path.resolve()), path.stat().st_mtime_ns, task)
            if chance is not None:
                return chance, "choices in the samples"
    chance = table_chance(task, metric)
    return chance, ("task table" if chance is not None else "unknown")


def assess(dense: float, chance: float | None, metric: str) -> tuple[bool, str]:
    """(informative, why not) for a dense score; an unknown chance counts as 0 (said so)."""
    ceiling = CEILING_01 if binary_metric(metric) else 1.0
    floor = (chance or 0.0) + MIN_ABOVE_CHANCE
    if dense < floor - 1e-12:
        return False, f"dense {dense:.3f} is less than {MIN_ABOVE_CHANCE:g} above chance {chance or 0.0:.3f}"
    if dense >= ceiling:
        return False, f"dense {dense:.3f} is at its ceiling ({ceiling:g})"
    return True, "" if chance is not None else "chance unknown: taken as 0"


def settings_table(summary: pd.DataFrame, results_dir: str | Path | None = None) -> pd.DataFrame:
    """Every trade-off group (selection.tradeoff_groups) with its dense score, chance, ceiling and the rule's answer."""
    rows = []
    for group in selection.tradeoff_groups(summary):
        table = figures.tradeoff_table(summary, **group)
        dense = table[table["series"] == "Baseline"]
        if dense.empty or pd.isna(dense["value"].iloc[0]):
            continue
        value, run_id = float(dense["value"].iloc[0]), dense["run_id"].iloc[0]
        run_dir = Path(results_dir) / "runs" / str(run_id) if results_dir is not None else None
        chance, source = chance_level(str(group["task"]), str(group["metric"]), run_dir)
        informative, reason = assess(value, chance, str(group["metric"]))
        rows.append({"setting": selection.group_title(**group), "dense": value, "chance": chance,
                     "chance_source": source, "ceiling": CEILING_01 if binary_metric(group["metric"]) else 1.0,
                     "informative": informative, "reason": reason, "run_id": run_id})
    return pd.DataFrame(rows, columns=COLUMNS)


def informative_groups(settings: pd.DataFrame) -> set[Any]:
    """The group titles the rule admits."""
    return set(settings.loc[settings["informative"].astype(bool), "setting"])

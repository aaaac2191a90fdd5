"""Which rows of the summary a table or figure uses: the latest row per run, one setting at a time.

A setting is (model, task, metric of interest, few-shot count, limit); tradeoff_groups lists every setting
with a dense baseline and a sparse run, and select() returns the rows of one, failing when it is ambiguous.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

# rouge_score: lm-eval's LongBench Rouge-L; score: lm-eval's LongBench metric of any subset.
PREFERRED_METRICS = ("acc_norm,none", "pass@1,none", "rouge_score,none", "accuracy,none", "acc,none", "score,none")
NUMERIC = ("k", "num_fewshot", "limit", "value", "stderr", "kept_attention_fraction", "kept_vrow_fraction",
           "sigma_add", "calib_documents", "clamped_rows", "empty_row_count", "generated_tokens", "target_kept",
           "calib_seed", "kept_attention_fraction_sparsified")

ANY: Any = object()  # "whichever single setting the data holds" for num_fewshot / limit


def full_metric(metric: str) -> str:
    return metric if "," in metric else f"{metric},none"  # 'acc_norm' -> lm-eval's 'acc_norm,none'


def latest(summary: pd.DataFrame) -> pd.DataFrame:
    """The latest row per (run_id, task, metric), numeric columns as numbers.

    Reruns (force=true) append rows with the same run_id; the later timestamp wins, ties keep file order.
    """
    df = summary.copy()
    for col in NUMERIC:
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    if "timestamp" in df:
        df = df.sort_values("timestamp", kind="stable", na_position="first")
    return df.drop_duplicates(["run_id", "task", "metric"], keep="last").sort_index()


def _is(df: pd.DataFrame, col: str, value: Any) -> pd.Series:
    missing = value is None or (isinstance(value, float) and math.isnan(value))
    return df[col].isna() if missing else df[col] == value


def select(summary: pd.DataFrame, model: str, task: str, metric: str, num_fewshot: Any, limit: Any) -> pd.DataFrame:
    """Latest rows of one (model, task, metric, num_fewshot, limit); fails if the setting is ambiguous."""
    df = latest(summary)
    df = df[(df["model"] == model) & (df["task"] == task) & (df["metric"] == full_metric(metric))]
    if num_fewshot is not ANY:
        df = df[_is(df, "num_fewshot", num_fewshot)]
    if limit is not ANY:
        df = df[_is(df, "limit", limit)]
    settings = df[["num_fewshot", "limit"]].drop_duplicates()
    if len(settings) > 1:
        choices = "; ".join(f"num_fewshot={as_number(a)}, limit={as_number(b)}"
                            for a, b in settings.itertuples(index=False))
        raise ValueError(f"{model} / {task} was evaluated in several settings ({choices}); "
                         "pass num_fewshot= and limit= (None = whole split) to choose one")
    return df


def as_number(value: Any) -> Any:
    """64.0 -> 64, NaN -> None (for labels and file names)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return int(value) if float(value).is_integer() else value


def metric_of_interest(summary: pd.DataFrame, task: str) -> str | None:
    """The metric a task is judged by: acc_norm (QA), pass@1 (HumanEval), Rouge-L (LongBench), accuracy (passkey)."""
    present = set(summary.loc[summary["task"] == task, "metric"])
    return next((m for m in PREFERRED_METRICS if m in present), None)


def tradeoff_groups(summary: pd.DataFrame) -> list[dict[str, Any]]:
    """Every (model, task, metric of interest, num_fewshot, limit) with a dense baseline and a sparse run.

    Each item holds the keyword arguments of tradeoff_table / tradeoff_figure.
    """
    df = latest(summary)
    groups = []
    for (model, task, fewshot, limit), rows in df.groupby(["model", "task", "num_fewshot", "limit"], dropna=False):
        metric = metric_of_interest(df, task)
        rows = rows[rows["metric"] == metric]
        dense = rows["sparsifier"].fillna("dense").eq("dense")
        if dense.any() and (~dense).any():
            groups.append({"model": model, "task": task, "metric": metric, "num_fewshot": as_number(fewshot),
                           "limit": as_number(limit)})
    return sorted(groups, key=lambda g: (g["model"], g["task"], str(g["num_fewshot"]), str(g["limit"])))


def group_title(model: str, task: str, metric: str, num_fewshot: Any = None, limit: Any = None) -> str:
    setting = ", ".join(filter(None, (f"{as_number(num_fewshot)}-shot" if as_number(num_fewshot) is not None else "",
                                      f"limit {as_number(limit)}" if as_number(limit) is not None else "")))
    return f"{model} · {task}" + (f" ({setting})" if setting else "") + f" · {metric.split(',')[0]}"


def setting_of(table: pd.DataFrame) -> tuple[Any, Any]:
    if table.empty:
        return None, None
    return table["num_fewshot"].iloc[0], table["limit"].iloc[0]

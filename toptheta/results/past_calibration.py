"""Past the calibrated length (issue 30, item 2): does Top-θ keep what Top-k keeps at the same k on rows longer than
any it was calibrated on?

A Top-θ row longer than every calibrated row takes θ from the rule ``calib.beyond`` names (thresholds/beyond.py):
``clamp``, the longest calibrated row's θ, or ``fit``, a per-(layer, head) law of θ against row length fitted over
the calibrated lengths. Each row of the table is a Top-θ run (or one of its per-length views: passkey_<n>, ruler_<n>)
that met such rows (``clamped_rows`` > 0), used ``fit``, or was calibrated on long documents (``calib_task``
long_documents: thresholds for the lengths it meets, the issue's third remedy), beside the Top-k run of the same
setting and k (model, task, shots, questions, layer_k, placement, compensation): their kept attention and V-row
fractions, the ratios Top-θ / Top-k, and the task metric of both. The target: both ratios within ×1.3 (TARGET) at
every length, with the same accuracy.
"""

from __future__ import annotations

import pandas as pd

from .comparisons import as_text
from .selection import latest, metric_of_interest

TARGET = 1.3
LONG_CONTEXT = ("passkey", "ruler", "longbench")  # task name prefixes: the tasks whose rows outgrow a QA calibration
LONG_CALIBRATION = ("long_documents",)  # calibration tasks whose rows reach the long-context tasks' lengths
MATCH = ("model", "task", "num_fewshot", "limit", "metric", "fewshot_sampler", "k", "layer_k", "placement", "comp")
COLUMNS = ["model", "task", "num_fewshot", "limit", "metric", "k", "placement", "comp", "calib_task", "calib_beyond", "clamped_rows",
           "kept_attention_toptheta", "kept_attention_topk", "attention_ratio", "kept_vrow_toptheta", "kept_vrow_topk",
           "vrow_ratio", "within_target", "value_toptheta", "value_topk", "diff", "run_id", "run_topk"]


def _ratio(a, b) -> float | None:
    a, b = pd.to_numeric(a, errors="coerce"), pd.to_numeric(b, errors="coerce")
    return None if pd.isna(a) or pd.isna(b) or b <= 0 else float(a) / float(b)


def past_calibration_table(summary: pd.DataFrame, tasks: tuple[str, ...] = LONG_CONTEXT) -> pd.DataFrame:
    """One row per Top-θ run (or per-length view) of a task named with one of ``tasks``' prefixes past its
    calibration or calibrated on long documents, beside Top-k at the same k, in the task's metric of interest (empty
    when none)."""
    df = latest(summary)
    df = df[(df["target_kept"].map(as_text) == "") & df["task"].astype(str).str.startswith(tasks)]  # equal k
    judged_by = {task: metric_of_interest(df, task) for task in set(df["task"])}
    df = df[df["metric"] == df["task"].map(judged_by)]
    key = lambda r: tuple(as_text(r.get(c)) for c in MATCH)  # noqa: E731
    topk = {key(r): r for _, r in df[df["sparsifier"] == "topk"].iterrows()}
    clamped = pd.to_numeric(df.get("clamped_rows"), errors="coerce").fillna(0)
    long_calibration = df["calib_task"].map(as_text).isin(LONG_CALIBRATION)
    theta = df[(df["sparsifier"] == "toptheta")
               & ((clamped > 0) | (df["calib_beyond"].map(as_text) == "fit") | long_calibration)]
    rows = []
    for _, t in theta.iterrows():
        k = topk.get(key(t))
        if k is None:
            continue
        attention = _ratio(t["kept_attention_fraction"], k["kept_attention_fraction"])
        vrows = _ratio(t["kept_vrow_fraction"], k["kept_vrow_fraction"])
        measured = [r for r in (attention, vrows) if r is not None]
        rows.append({
            "model": t["model"], "task": t["task"], "num_fewshot": t["num_fewshot"], "limit": t["limit"],
            "metric": t["metric"], "k": t["k"], "placement": t["placement"],
            "comp": t["comp"], "calib_task": t["calib_task"], "calib_beyond": as_text(t["calib_beyond"]) or "clamp",
            "clamped_rows": t.get("clamped_rows"),
            "kept_attention_toptheta": t["kept_attention_fraction"], "kept_attention_topk": k["kept_attention_fraction"],
            "attention_ratio": attention, "kept_vrow_toptheta": t["kept_vrow_fraction"],
            "kept_vrow_topk": k["kept_vrow_fraction"], "vrow_ratio": vrows,
            "within_target": bool(measured) and all(r <= TARGET for r in measured),
            "value_toptheta": t["value"], "value_topk": k["value"], "diff": float(t["value"]) - float(k["value"]),
            "run_id": t["run_id"], "run_topk": k["run_id"]})
    table = pd.DataFrame(rows, columns=COLUMNS)
    return table.sort_values(["model", "task", "k", "calib_beyond"], kind="stable").reset_index(drop=True)

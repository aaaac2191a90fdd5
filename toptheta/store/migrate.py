"""Rebuild summary.csv from the run directories, so older rows gain the columns added since.

    python -m toptheta.store.migrate [--results results] [--dry-run]

Every complete run directory (DONE present) is read back (config.json, lm_eval.json, stats.json,
meta.json) and turned into summary rows by the current `summary_rows`, with the run's own commit and
timestamp from meta.json. Rows of summary.csv whose run directory is gone are kept as they were. One
conversion of old data: passkey accuracy was stored in percent before it became a fraction like every
other accuracy; a passkey `accuracy` above 1 is divided by 100 (its stderr too). Nothing is recomputed;
the file is replaced atomically under the store's lock.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .rows import STAT_COLUMNS, SUMMARY_COLUMNS, fitted_parameters, summary_rows
from ..atomic import write_text_atomic
from .runs import DONE_MARKER, RunStore


def _read(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _percent_to_fraction(config: dict, rows: list[dict]) -> list[dict]:
    if (config.get("task") or {}).get("kind") != "passkey":
        return rows
    for row in rows:
        if row["metric"].startswith("accuracy,") and isinstance(row["value"], (int, float)) and row["value"] > 1:
            row["value"] /= 100.0
            if isinstance(row.get("stderr"), (int, float)):
                row["stderr"] /= 100.0
    return rows


def _restore_scalar_stats(rows: list[dict], old_rows: list[dict]) -> None:
    """stats.json of older runs holds per-layer lists under the names of the run's scalar fractions (the
    pipeline merged both dicts), so the scalar survives only in the old summary row: take it from there,
    for rows that carry statistics (stats_scope set), never for a sub-task's row."""
    old = {(r.get("run_id"), r.get("task"), r.get("metric")): r for r in old_rows}
    for row in rows:
        before = old.get((row["run_id"], row["task"], row["metric"]))
        if before is None or not row.get("stats_scope"):
            continue
        for column in STAT_COLUMNS:
            if row.get(column) is None and before.get(column) not in (None, ""):
                row[column] = float(before[column])


def run_rows(run_dir: Path) -> list[dict] | None:
    """Summary rows of one complete run directory (None when it is incomplete)."""
    if not (run_dir / DONE_MARKER).is_file() or not (run_dir / "config.json").is_file():
        return None
    config, meta = _read(run_dir / "config.json"), _read(run_dir / "meta.json")
    stats = _read(run_dir / "stats.json")
    stats = {k: v for k, v in stats.items()  # per-layer lists and records are not row statistics
             if not isinstance(v, list) and k not in ("per_layer", "vrow_popularity")}
    new = summary_rows(run_dir.name, config, _read(run_dir / "lm_eval.json"), stats, overrides=fitted_parameters(stats),
                       commit=meta.get("git_commit") or "", timestamp=meta.get("timestamp"))
    return _percent_to_fraction(config, new)


def rebuilt_rows(results_dir: str | Path) -> tuple[list[dict], set[str]]:
    """Summary rows of every complete run directory, and the run ids they cover."""
    rows, covered = [], set()
    for run_dir in sorted(Path(results_dir, "runs").glob("*/")):
        new = run_rows(run_dir)
        if new is None:
            continue
        rows += new
        covered.add(run_dir.name)
    return rows, covered


def summarised_run_ids(store: RunStore) -> set[str]:
    """The run ids summary.csv has rows for."""
    if not store.summary_path.exists():
        return set()
    with open(store.summary_path, newline="", encoding="utf-8") as fh:
        return {row.get("run_id") for row in csv.DictReader(fh)}


def restore_summary(store: RunStore, run_id: str) -> int:
    """Append the rows of a stored run that summary.csv lacks (a job killed between storing the run and appending
    its rows); returns the number of rows appended. Call it holding the run's claim, so the job writing the run
    (which holds it until its rows are appended) is never raced."""
    if run_id in summarised_run_ids(store):
        return 0
    rows = run_rows(store.run_dir(run_id))
    if not rows:
        return 0
    store.append_summary(rows)
    return len(rows)


def rebuilt_summary(results_dir: str | Path) -> tuple[str, dict]:
    """summary.csv's text as rebuilt from the run directories, and counts (rows, runs rebuilt, rows kept). A store
    whose every row was appended by the pipeline (which reads its rows back from the run it stored) rebuilds to the
    same bytes."""
    store = RunStore(results_dir)
    old_rows = []
    if store.summary_path.exists():
        with open(store.summary_path, newline="", encoding="utf-8") as fh:
            old_rows = list(csv.DictReader(fh))
    rows, covered = rebuilt_rows(results_dir)
    _restore_scalar_stats(rows, old_rows)
    kept = [r for r in old_rows if r.get("run_id") not in covered]
    rows = sorted(kept + rows, key=lambda r: (str(r.get("timestamp") or ""), str(r["run_id"])))
    columns = [*SUMMARY_COLUMNS, *sorted({k for r in rows for k in r} - set(SUMMARY_COLUMNS))]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
    return buffer.getvalue(), {"rows": len(rows), "rebuilt": len(covered), "kept": len(kept)}


def migrate(results_dir: str | Path, *, dry_run: bool = False) -> int:
    """Rewrite summary.csv from the run directories; returns the number of rows written."""
    store = RunStore(results_dir)
    with store.summary_lock():
        text, counts = rebuilt_summary(results_dir)
        unchanged = store.summary_path.exists() and store.summary_path.read_text(encoding="utf-8") == text
        if not dry_run and not unchanged:
            write_text_atomic(store.summary_path, text, fsync=True)
    print(f"{'would write' if dry_run else 'wrote'} {store.summary_path}: {counts['rows']} rows "
          f"({counts['rebuilt']} runs rebuilt from their directories, {counts['kept']} rows kept as they were)"
          + ("; identical to the file there" if unchanged else ""))
    return counts["rows"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="the results store (holds summary.csv and runs/)")
    parser.add_argument("--dry-run", action="store_true", help="report, write nothing")
    args = parser.parse_args(argv)
    if not Path(args.results, "runs").is_dir():
        print(f"{args.results} has no runs/ directory: nothing to rebuild from", file=sys.stderr)
        return 1
    migrate(args.results, dry_run=args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate every table and figure the results store supports.

    python scripts/make_figures.py [--results results] [--out results/figures]

For each (model, task, metric of interest, few-shot count, limit) with a dense baseline and a sparse
run: the trade-off table (csv + md) and one trade-off figure per kept fraction measured (attention
elements, and V rows for generation tasks). A granularity table and figure where Top-θ runs span
several calibration granularities. Per-layer kept fractions per (model, task, series), one line per k.

Every file is written atomically; each figure has a sidecar `.md`, each csv a same-named `.md`
table, both starting with the command that produced them. `index.md` lists all outputs; files a
previous run listed in `manifest.txt` and this run no longer produces are deleted. Nothing is
computed here: the numbers come from toptheta.results.figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib
import pandas as pd

matplotlib.use("Agg")  # before anything imports pyplot: no display needed

from toptheta.results import figures  # noqa: E402
from toptheta.results.store import load_summary  # noqa: E402

X_SHORT = {"kept_attention_fraction": "kept_attn", "kept_vrow_fraction": "kept_vrow"}


def slug(*parts: object) -> str:
    """A file-name-safe name: 'llama3-8b', 'acc_norm,none' -> 'llama3-8b-acc_norm'."""
    text = "-".join(str(p).split(",")[0] for p in parts if p not in (None, ""))
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def group_slug(group: dict) -> str:
    shots = f"{group['num_fewshot']}shot" if group["num_fewshot"] is not None else None
    limit = f"limit{group['limit']}" if group["limit"] is not None else "full"
    return slug(group["model"], group["task"], shots, limit, group["metric"])


def markdown(table) -> str:
    """A DataFrame as a GitHub markdown table (floats to 4 significant digits, missing blank)."""
    def cell(v) -> str:
        if pd.api.types.is_scalar(v) and pd.isna(v):
            return ""
        return f"{v:.4g}" if isinstance(v, float) else str(v).replace("|", "\\|")
    rows = [list(table.columns), ["---"] * len(table.columns)]
    rows += [[cell(v) for v in record] for record in table.itertuples(index=False)]
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in rows) + "\n"


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    """Write through `write(tmp_path)` to a temporary sibling, then os.replace it onto `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


class Outputs:
    """Writes tables and figures under `out`, each carrying `command`, and records what it wrote."""

    def __init__(self, out: Path, command: str, source: Path):
        self.out, self.command, self.source = out, command, source
        self.written: list[tuple[str, str]] = []  # (file name, description)

    def _header(self, title: str) -> str:
        return f"# {title}\n\nProduced by `{self.command}` from `{self.source}`; do not edit by hand.\n\n"

    def _record(self, path: Path, description: str) -> None:
        if any(path.name == name for name, _ in self.written):
            raise RuntimeError(f"{path.name} would be written twice in one run: two outputs share a name")
        self.written.append((path.name, description))
        print(f"wrote {path}")

    def table(self, name: str, table, title: str) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        csv_path, md_path = self.out / f"{name}.csv", self.out / f"{name}.md"
        _write_text(csv_path, table.to_csv(index=False))
        _write_text(md_path, self._header(title) + f"Data: `{csv_path.name}`.\n\n"
                    + markdown(table))
        self._record(csv_path, title)
        self._record(md_path, f"{title} (markdown, with the command)")

    def figure(self, name: str, fig, title: str, notes: str = "") -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        png, md = self.out / f"{name}.png", self.out / f"{name}.md"
        _atomic(png, lambda tmp: fig.savefig(tmp, format="png", dpi=150))
        _write_text(md, self._header(title) + f"Figure: `{png.name}`.\n\n{notes}")
        self._record(png, title)
        self._record(md, f"{title} (sidecar, with the command)")

    def finish(self) -> None:
        """index.md and manifest.txt; delete outputs of a previous run that this run no longer produces."""
        manifest = self.out / "manifest.txt"
        names = {name for name, _ in self.written} | {"index.md", "manifest.txt"}
        if manifest.is_file():
            for old in manifest.read_text(encoding="utf-8").split():
                if old not in names and "/" not in old and (self.out / old).is_file():
                    (self.out / old).unlink()
                    print(f"removed stale {self.out / old}")
        lines = [f"- `{name}`: {description}" for name, description in self.written]
        _write_text(self.out / "index.md", self._header("Tables and figures") + "\n".join(lines) + "\n")
        _write_text(manifest, "\n".join(sorted(names)) + "\n")
        print(f"wrote {self.out / 'index.md'} ({len(self.written)} files)")


def _runs_note(table) -> str:
    runs = [r for r in table["run_id"].dropna().unique()]
    return f"Runs ({len(runs)}): " + ", ".join(f"`{r}`" for r in runs) + "\n" if runs else ""


def write_tradeoffs(outputs: Outputs, summary) -> None:
    for group in figures.tradeoff_groups(summary):
        name, title = group_slug(group), figures.group_title(**group)
        table = figures.tradeoff_table(summary, **group)
        outputs.table(f"tradeoff-{name}", table, f"Accuracy vs kept fraction: {title}")
        for x in figures.x_columns(table):
            fig = figures.tradeoff_figure(summary, x=x, **group)
            outputs.figure(f"tradeoff-{name}-{X_SHORT[x]}", fig, f"{title} against {figures.X_LABELS[x]}",
                           f"Numbers: `tradeoff-{name}.csv`.\n\n" + _runs_note(table))


def write_granularity(outputs: Outputs, summary) -> None:
    for group in figures.granularity_groups(summary):
        name, title = group_slug(group), figures.group_title(**group)
        table = figures.granularity_table(summary, **group)
        outputs.table(f"granularity-{name}", table, f"θ granularity ablation: {title}")
        outputs.figure(f"granularity-{name}-bars", figures.granularity_figure(summary, **group),
                       f"θ granularity ablation: {title}", f"Numbers: `granularity-{name}.csv`.\n\n" + _runs_note(table))


def write_per_layer(outputs: Outputs, results: Path) -> None:
    for group in figures.per_layer_groups(results):
        table = figures.per_layer_table(group["run_dirs"])
        name = slug("per_layer", group["model"], group["task"], group["series"].replace("θ", "theta"))
        outputs.table(name, table, f"Per-layer statistics: {group['title']}")
        for stat in ("kept_attention_fraction", "kept_vrow_fraction"):
            if table[stat].notna().any():
                fig = figures.per_layer_figure(group["run_dirs"], stat=stat, title=group["title"])
                outputs.figure(f"{name}-{X_SHORT[stat]}", fig, f"{figures.X_LABELS[stat]} per layer: {group['title']}",
                               f"Numbers: `{name}.csv`.\n\n" + _runs_note(table))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="the results store (holds summary.csv and runs/)")
    parser.add_argument("--out", default=None, help="output folder (default: <results>/figures)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    out = Path(args.out) if args.out else results / "figures"
    command = shlex.join(["python", "scripts/make_figures.py", *(sys.argv[1:] if argv is None else argv)])

    summary = load_summary(results)
    if summary.empty and not (results / "runs").is_dir():
        print(f"nothing to plot: no results in {results} (no summary.csv, no runs/). "
              "Run experiments first, e.g. `python run.py`, or point --results at a results store.")
        return 0
    outputs = Outputs(out, command, results / "summary.csv")
    write_tradeoffs(outputs, summary)
    write_granularity(outputs, summary)
    write_per_layer(outputs, results)
    if not outputs.written:
        print(f"nothing to plot: {results} holds {len(summary)} summary rows, but no (model, task) has both a "
              "dense baseline and a sparse run, and no sparse run has per-layer statistics. Nothing written.")
        return 0
    outputs.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

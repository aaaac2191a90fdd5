"""Regenerate every table and figure the results store supports.

    python scripts/make_figures.py [--results results] [--out results/figures] [--redraw]

From the store alone (summary.csv and the run directories):
- trade-offs: per (model, task, metric of interest, few-shot count, limit) with a dense baseline and a
  sparse run, the table and one figure per kept fraction measured (attention elements; V rows for
  generation tasks), curves with error bars on a log-scale kept-fraction axis;
- ablations (toptheta.results.ablations): compensation, θ granularity, layers 0-1 at a larger k,
  calibration-set size, empty-row rule, pre/post placement, cross-dataset transfer;
- passkey accuracy per context length; threshold storage per model; per-layer kept fractions; calibrated
  thresholds (histograms, θ against row length) from the threshold files the run directories keep; V-row
  popularity heatmaps of the runs that recorded it (task.vrow_popularity);
- the verdict on each of the paper's claims (scripts/verdicts.py writes them into results/README.md).

Every table is written as csv, Markdown and LaTeX, every figure as PNG and PDF with a Markdown sidecar;
each Markdown file starts with the command that produced it. Files are written atomically and without
timestamps, so rerunning on the same store changes no file. `index.md` lists all outputs; files a
previous run listed in `manifest.txt` and this run no longer produces are deleted. A figure drawn from
files (per-run thresholds, per-layer statistics) is drawn again only when those files, its own files or the
drawing code changed since the last run here (a record in the cache directory; `--redraw` draws every figure).
Nothing is computed here: the numbers come from toptheta.results.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before anything imports pyplot: no display needed

from toptheta.results import (ablations, baselines, figures, informative, past_calibration, reduction,  # noqa: E402
                               run_figures, selection, storage, threshold_plots, tradeoff_panels, verdicts)
from toptheta.results.render import (FIGURE_FORMATS, RenderRecord, doc_text, latex, markdown, save_figure,  # noqa: E402
                                     write_text)
from toptheta.results.summary import load_summary  # noqa: E402

# Floats in csv files to 10 significant digits: a sum's last bit depends on the order numpy adds in (SIMD width,
# alignment), so 0.0008 and 0.0008000000000000001 must print alike for a rerun to rewrite the same bytes.
CSV_FLOAT = "%.10g"
X_SHORT = {"kept_attention_fraction": "kept_attn", "kept_vrow_fraction": "kept_vrow"}


SPELLED = {"θ": "theta", "ρ": "rho"}  # the method names' Greek letters, spelt out in file names


def slug(*parts: object) -> str:
    """A file-name-safe name: 'llama3-8b', 'acc_norm,none' -> 'llama3-8b-acc_norm'; 'Top-θ' -> 'Top-theta'."""
    text = "-".join(str(p).split(",")[0] for p in parts if p not in (None, ""))
    for letter, name in SPELLED.items():
        text = text.replace(letter, name)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def group_slug(group: dict) -> str:
    shots = f"{group['num_fewshot']}shot" if group["num_fewshot"] is not None else None
    limit = f"limit{group['limit']}" if group["limit"] is not None else "full"
    return slug(group["model"], group["task"], shots, limit, group["metric"])


def _rounded(table):
    """Floats held in object columns (mixed with text or None) rounded as CSV_FLOAT rounds float columns."""
    table = table.copy()
    for col in table.columns:
        if table[col].dtype == object:
            table[col] = [float(CSV_FLOAT % v) if isinstance(v, float) else v for v in table[col]]
    return table


class Outputs:
    """Writes tables and figures under `out`, each carrying `command`, and records what it wrote."""

    def __init__(self, out: Path, command: str, source: Path, redraw: bool = False):
        self.out, self.command, self.source = out, command, source
        self.written: list[tuple[str, str]] = []  # (file name, description)
        self.record = RenderRecord(out, sources=(Path(__file__),), enabled=not redraw)
        self.drawn = self.kept = 0  # figures drawn, and figures whose files were current (not drawn again)

    def _header(self, title: str) -> str:
        return f"# {title}\n\nProduced by `{self.command}` from `{self.source}`; do not edit by hand.\n\n"

    def _record(self, path: Path, description: str) -> None:
        if any(path.name == name for name, _ in self.written):
            raise RuntimeError(f"{path.name} would be written twice in one run: two outputs share a name")
        self.written.append((path.name, description))
        print(f"wrote {path}")

    def table(self, name: str, table, title: str, notes: str = "") -> None:
        """`name`.csv, `name`.md (with the command) and `name`.tex (a booktabs tabular)."""
        paths = {ext: self.out / f"{name}.{ext}" for ext in ("csv", "md", "tex")}
        write_text(paths["csv"], _rounded(table).to_csv(index=False, float_format=CSV_FLOAT))
        write_text(paths["md"], self._header(title) + f"Data: `{paths['csv'].name}`.\n\n{notes}" + markdown(table))
        write_text(paths["tex"], f"% Produced by {self.command}; do not edit by hand.\n" + latex(table, title))
        self._record(paths["csv"], title)
        self._record(paths["md"], f"{title} (Markdown, with the command)")
        self._record(paths["tex"], f"{title} (LaTeX)")

    def figure(self, name: str, fig, title: str, notes: str = "", inputs: tuple | None = None) -> None:
        """`name`.png, `name`.pdf and a sidecar `name`.md. With `inputs` (the files the figure is drawn from, and any
        other value it depends on), `fig` is a function that draws it, called only when the files on disk were
        not drawn from the same inputs by the same code (RenderRecord)."""
        paths = [self.out / f"{name}.{fmt}" for fmt in FIGURE_FORMATS]
        key = None if inputs is None else self.record.key(name, title, *inputs)
        if key is not None and self.record.current(key, paths):
            self.kept += 1
        else:
            fig = fig() if key is not None else fig
            for fmt, path in zip(FIGURE_FORMATS, paths):
                save_figure(fig, path, fmt)
            if key is not None:
                self.record.drawn(key, paths)
            self.drawn += 1
        for path in paths:
            self._record(path, title)
        md = self.out / f"{name}.md"
        write_text(md, self._header(title) + f"Figure: `{name}.png`, `{name}.pdf`.\n\n{notes}")
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
        write_text(self.out / "index.md", self._header("Tables and figures") + "\n".join(lines) + "\n")
        write_text(manifest, "\n".join(sorted(names)) + "\n")
        self.record.save(names)
        print(f"wrote {self.out / 'index.md'} ({len(self.written)} files; {self.drawn} figures drawn, {self.kept} "
              "current from an earlier run: --redraw draws every figure)")


def _runs_note(table) -> str:
    runs = [r for r in table["run_id"].dropna().unique()]
    return f"Runs ({len(runs)}): " + ", ".join(f"`{r}`" for r in runs) + "\n" if runs else ""


PANELS_NOTE = ("Small multiples of at most four series, sharing both axes. Each bar is the paired 95 % interval of "
               "the run's difference to dense on the same questions (calibration seeds resampled too), drawn around "
               "its accuracy; hollow points: no per-question outputs, the interval from two stderrs. Dashed: dense; "
               "dotted: dense − 0.01, the non-inferiority margin. Labels: k.\n\n")
EQUIVALENCE_NOTE = ("Top-k post (+VMC) is the same computation as Top-k pre (+SDC +VMC) (identical kept set, "
                    "β = the dropped mass; method.md §3.2): it is run once and labelled as both.\n\n")


def write_tradeoffs(outputs: Outputs, summary, results: Path) -> None:
    for group in selection.tradeoff_groups(summary):
        name, title = group_slug(group), selection.group_title(**group)
        table = figures.tradeoff_table(summary, **group)
        outputs.table(f"tradeoff-{name}", table, f"Top-θ and Top-k: accuracy vs kept fraction, {title}",
                      EQUIVALENCE_NOTE)
        for x in figures.x_columns(table):
            fig = tradeoff_panels.tradeoff_panels_figure(summary, x=x, results_dir=results, **group)
            outputs.figure(f"tradeoff-{name}-{X_SHORT[x]}", fig, f"{title} against {figures.X_LABELS[x]}",
                           f"Numbers: `tradeoff-{name}.csv`.\n\n" + PANELS_NOTE + EQUIVALENCE_NOTE + _runs_note(table))


def write_ablations(outputs: Outputs, summary, results: Path) -> None:
    for ab in ablations.ABLATIONS.values():
        for group in selection.tradeoff_groups(summary):
            table = ablations.ablation_table(summary, ab, results_dir=results, **group)
            if table.empty:
                continue
            name, title = f"ablation-{ab.name}-{group_slug(group)}", selection.group_title(**group)
            notes = ("diff: the run minus the reference setting of its cell (same series and k, or same "
                     "target_kept for runs matched by sparsity), 95 % interval; "
                     "diff_method says whether it is paired per question or from two stderrs.\n\n")
            outputs.table(name, table, f"{ab.title}: {title}", notes)
            outputs.figure(f"{name}-fig", ablations.ablation_figure(table, ab, title), f"{ab.title}: {title}",
                           f"Numbers: `{name}.csv`.\n\n" + _runs_note(table))


def write_passkey(outputs: Outputs, summary, results: Path) -> None:
    for model in ablations.passkey_models(summary):
        table = ablations.passkey_table(summary, model, results_dir=results)
        name = slug("passkey", model, "accuracy_by_length")
        note = ("correct of prompts_at_length: counted in each run's samples; ci_low, ci_high: the 95 % Wilson "
                "interval of that proportion. Kept fractions per length appear only where the run recorded per-length "
                "statistics (stats_scope = task); pooled statistics are not copied onto per-length rows.\n\n")
        outputs.table(name, table, f"Passkey accuracy by context length: {model}", note)
        outputs.figure(f"{name}-fig", ablations.passkey_figure(table, model),
                       f"Passkey accuracy by context length: {model}",
                       f"Numbers: `{name}.csv`.\n\n" + note + "The right panel (drawn when some run has them): kept "
                       "attention (solid) and V-row (dashed) fractions per length.\n\n" + _runs_note(table))


def write_storage(outputs: Outputs, results: Path) -> None:
    table = storage.storage_table(results)
    outputs.table("threshold_storage", table, "Threshold storage per model (one θ per layer, head and row length)",
                  storage.__doc__.split("\n\n", 1)[1].replace("\n", " ").strip() + "\n\n")


def write_verdicts(outputs: Outputs, summary, results: Path) -> None:
    found = verdicts.verdicts(summary, results)
    outputs.table("verdicts", verdicts.verdict_table(found), "Verdicts on the paper's claims")
    pairs = verdicts.pairs_table(found)
    if len(pairs):
        outputs.table("verdict_pairs", pairs, "The run pairs behind each verdict")
    settings = verdicts.settings_table(found)
    if len(settings):
        outputs.table("verdict_settings", settings, "Each claim in each setting",
                      doc_text(verdicts.per_setting.__doc__, 1) + " informative = False: a "
                      "setting the pooled verdicts exclude (`informative_settings.md`), decided on its own.\n\n")
    found_baselines = baselines.baseline_verdicts(summary, results)
    if any(v.pairs for v in found_baselines):
        outputs.table("baseline_verdicts", verdicts.verdict_table(found_baselines),
                      "Top-θ against today's threshold baselines at equal sparsity",
                      doc_text(baselines.__doc__, 1, 2) + " " + baselines.SCOPE_ALL + "\n\n")
        outputs.table("baseline_pairs", verdicts.pairs_table(found_baselines), "The run pairs behind each baseline verdict")
    for matched in baselines.MATCHED_TABLES:
        table = matched.pairs(summary, results)
        if len(table):
            outputs.table(matched.name, table, matched.caption, matched.note + "\n\n")
    crossing = past_calibration.past_calibration_table(summary)
    if len(crossing):
        outputs.table("past_calibration", crossing, "Past the calibrated length: Top-θ against Top-k at the same k",
                      doc_text(past_calibration.__doc__, 1, 2) + "\n\n")
    outputs.table("informative_settings", informative.settings_table(summary, results),
                  "Which settings the pooled verdicts use", f"Rule: {informative.RULE}.\n\n")
    if found[5].table is not None:
        outputs.table("claim6_reduction", found[5].table,
                      "Claim 6: the largest reduction at which each method is non-inferior to dense",
                      doc_text(reduction.__doc__) + "\n\n" + verdicts.STATISTICS_NOTE + "\n\n")


def write_thresholds(outputs: Outputs, results: Path) -> None:
    for path in threshold_plots.threshold_files(results):
        name = slug("thresholds", path.parent.name)
        title = f"run {path.parent.name}"
        outputs.table(name, threshold_plots.summary_table(path), f"Top-θ thresholds per layer: {title}")
        outputs.figure(f"{name}-hist", lambda: threshold_plots.histogram_figure(path, title=title),
                       f"Top-θ threshold histograms: {title}", f"File: `{path}`.\n", inputs=(path,))
        outputs.figure(f"{name}-by_length", lambda: threshold_plots.theta_vs_length_figure(path, title=title),
                       f"Top-θ: θ against row length: {title}", f"File: `{path}`.\n", inputs=(path,))


def write_per_layer(outputs: Outputs, results: Path) -> None:
    for group in run_figures.per_layer_groups(results):
        table = run_figures.per_layer_table(group["run_dirs"])
        name = slug("per_layer", group["model"], group["task"], group["series"])
        outputs.table(name, table, f"Per-layer statistics: {group['title']}")
        for stat in ("kept_attention_fraction", "kept_vrow_fraction"):
            if table[stat].notna().any():
                outputs.figure(f"{name}-{X_SHORT[stat]}",
                               lambda: run_figures.per_layer_figure(group["run_dirs"], stat=stat, title=group["title"]),
                               f"{figures.X_LABELS[stat]} per layer: {group['title']}",
                               f"Numbers: `{name}.csv`.\n\n" + _runs_note(table),
                               inputs=(stat, *run_figures.per_layer_inputs(group["run_dirs"])))


def write_vrow_popularity(outputs: Outputs, results: Path) -> None:
    records = run_figures.vrow_popularity_records(results)
    if not records:
        return
    table = run_figures.vrow_popularity_table(records)
    for model, rows in table.groupby("model", sort=True):
        outputs.table(slug("vrow_popularity", model), rows.drop(columns=["model"]),
                      f"V-row popularity in a GQA group during decoding: {model}")
    for item in records:
        rec = item["record"]
        problem = f" · problem {item['problem']} (the run's first generation)" if item.get("problem") else ""
        title = (f"{item['model']} · {item['task']}{problem} · {item['label']} · layer {rec['layer']}, "
                 f"KV group {rec['group']}")
        label = item["label"].replace(", ", " ")
        name = slug("vrow_popularity", item["model"], label, f"layer{rec['layer']}", f"group{rec['group']}")
        outputs.figure(name, run_figures.vrow_popularity_figure(rec, title=title),
                       f"V-row popularity: {title}", f"Run: `{item['run_id']}`.\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="results", help="the results store (holds summary.csv and runs/)")
    parser.add_argument("--out", default=None, help="output folder (default: <results>/figures)")
    parser.add_argument("--redraw", action="store_true",
                        help="draw every figure, also those whose files were drawn from the same inputs by the same "
                             "code in an earlier run (by default those are kept; the bytes are the same either way)")
    args = parser.parse_args(argv)
    results = Path(args.results)
    out = Path(args.out) if args.out else results / "figures"
    given = sys.argv[1:] if argv is None else list(argv)
    command = shlex.join(["python", "scripts/make_figures.py", *(a for a in given if a != "--redraw")])

    summary = load_summary(results)
    if summary.empty and not (results / "runs").is_dir():
        print(f"nothing to plot: no results in {results} (no summary.csv, no runs/). "
              "Run experiments first, e.g. `python run.py`, or point --results at a results store.")
        return 0
    outputs = Outputs(out, command, results / "summary.csv", redraw=args.redraw)
    write_tradeoffs(outputs, summary, results)
    write_ablations(outputs, summary, results)
    write_passkey(outputs, summary, results)
    write_per_layer(outputs, results)
    write_thresholds(outputs, results)
    write_vrow_popularity(outputs, results)
    if not outputs.written:
        print(f"nothing to plot: {results} holds {len(summary)} summary rows, but no (model, task) has both a "
              "dense baseline and a sparse run, and no sparse run has per-layer statistics. Nothing written.")
        return 0
    write_verdicts(outputs, summary, results)
    write_storage(outputs, results)
    outputs.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())

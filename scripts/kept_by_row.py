"""Where stored runs spend their attention budget: per head, and in the rows the task's answer is scored on.

    python scripts/kept_by_row.py RUN_ID [RUN_ID ...] [--questions 24] [--on questions|target] [--results results]
                                  [--out DIR]

Two runs can keep the same fraction of a layer's attention elements and still keep different ones. This replays
each run's sparsifier (its config.json, the parameter a matched run fitted from its stats.json; a Top-θ run's
thresholds.safetensors) on the first ``--questions`` questions of its evaluation, each prompt its exemplars and the
question with the correct answer appended (the first run's task requests rebuilt through lm-eval as the run built
them, the correct choice from its samples.json.gz, fed as HFLM feeds them), and records per (layer, head):

- the kept fraction of all the causal elements (what stats.json calls kept_attention_fraction);
- the kept fraction and the kept probability mass of the **answer rows** (the rows of the continuation's tokens,
  whose log-likelihoods decide the question) against those of all rows;
- the spread over heads: per layer, the coefficient of variation of the heads' kept fractions (0: every head
  keeps as much), averaged over the layers.

``--on target`` replays instead on the first ``--questions`` calibration rows the first run's
``sparsifier.target_kept`` was fitted on (``matched.target_rows``: train documents after the same shots, none of them
evaluated): per-head shares a deployment can measure without the test set (``scripts/head_budget.py --csv``). Those
rows have no answer, so the answer columns are empty.

Every run must be of one model. Writes ``kept_by_row.csv`` (run, layer, head, the fractions) and
``kept_by_row.md`` (per run: the summary and the command) to ``--out`` (default ``results/analysis``;
``kept_by_row-target.*`` with ``--on target``); the replay runs the plain attention path with an observer (minutes
on CPU for 24 questions of ~900 tokens).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd
import torch

from toptheta.attention.backend import sparsify
from toptheta.attention.stats import per_head_columns
from toptheta.builders import build_sparsifier, compensation_objects
from toptheta.results.labels import series_label
from toptheta.results.render import markdown, write_text
from toptheta.results.run_figures import config_row
from toptheta.spec import data_dir_setting
from toptheta.store.rows import fitted_parameters
from toptheta.thresholds.table import Thresholds


class Recorder:
    """The observer: per (layer, head) sums over the replayed rows, the answer rows apart."""

    def __init__(self, layers: int, heads: int):
        shape = (layers, heads)
        self.kept, self.valid = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        self.answer_kept, self.answer_valid = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        self.answer_mass, self.answer_rows = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
        self.first_answer_row = 0  # rows at positions ≥ this one are the answer's

    def __call__(self, rows) -> None:
        n = rows.n[:, 0].double()  # (B, Q) valid keys per row: the row's position + 1 (causal)
        B, H, Q, K = rows.logits.shape
        if rows.keep is None:  # nothing dropped in this chunk
            kept, mass = n.unsqueeze(1).expand(B, H, Q), torch.ones(B, H, Q, dtype=torch.float64)
        else:
            kept = rows.keep.sum(-1).double()  # (B, H, Q)
            mass = (rows.probs * rows.keep).sum(-1).double()
        answer = (n - 1 >= self.first_answer_row).unsqueeze(1).expand(B, H, Q)  # (B, H, Q)
        layer = rows.layer
        self.kept[layer] += kept.sum((0, 2))
        self.valid[layer] += n.sum() * torch.ones(H, dtype=torch.float64)
        self.answer_kept[layer] += (kept * answer).sum((0, 2))
        self.answer_valid[layer] += (n.unsqueeze(1).expand(B, H, Q) * answer).sum((0, 2))
        self.answer_mass[layer] += (mass * answer).sum((0, 2))
        self.answer_rows[layer] += answer.sum((0, 2)).double()


def prompts(run_dir: Path, config: dict, tokenizer, questions: int) -> list[tuple[list[int], list[int]]]:
    """(context ids, correct continuation ids) of the first `questions` questions the run evaluated: its task's
    requests rebuilt as the run built them (its shots and exemplars), the correct choice from its samples."""
    from toptheta.evaluation.calibration_inputs import evaluated_requests  # lm-eval: heavy

    task = config["task"]
    data = json.loads(gzip.open(run_dir / "samples.json.gz").read())
    (samples,) = data.values()
    gold = {s["doc_id"]: int(s["target"]) for s in samples}
    requests = evaluated_requests(tokenizer, task.get("lm_eval_task") or task["name"], data_dir=data_dir_setting(config.get("data_dir", "local")),
                                  num_fewshot=task.get("num_fewshot"), limit=questions,
                                  seed=config.get("seed", 1234), fewshot_sampler=task.get("fewshot_sampler"))
    return [(context, answer) for doc, choice, context, answer in requests if gold.get(doc) == choice]


def question_rows(pairs: list[tuple[list[int], list[int]]]) -> list[tuple[list[int], int]]:
    """(ids fed, first answer row) per question, fed as HFLM feeds them: the last token's logits are unused, and the
    row that predicts the answer's first token is the first answer row."""
    return [((context + answer)[:-1], len(context) - 1) for context, answer in pairs]


def target_rows(model, tokenizer, config: dict, count: int) -> list[tuple[list[int], int]]:
    """(ids, no answer row) of the first ``count`` rows a matched run fitted its parameter on."""
    from toptheta.matched import target_rows as rows_of
    from toptheta.spec import RunSpec

    spec = RunSpec.from_identity(config, data_dir_path=data_dir_setting(config.get("data_dir", "local")))
    return [(ids, len(ids)) for ids in rows_of(spec, model, tokenizer)[:count]]


def replay(model, run_dir: Path, config: dict, sequences: list[tuple[list[int], int]], layers: int,
           heads: int) -> Recorder:
    thresholds = None
    if (run_dir / "thresholds.safetensors").is_file():
        thresholds = Thresholds.load(run_dir / "thresholds.safetensors", model)
    stats = json.loads((run_dir / "stats.json").read_text(encoding="utf-8"))
    sparsifier = build_sparsifier(config["sparsifier"] | fitted_parameters(stats), thresholds)
    recorder = Recorder(layers, heads)
    with sparsify(model, sparsifier, compensation_objects(config["comp"], thresholds), observer=recorder), \
            torch.inference_mode():
        for ids, first_answer_row in sequences:
            recorder.first_answer_row = first_answer_row
            model(torch.tensor([ids]))
    return recorder


def tables(run_id: str, series: str, rec: Recorder) -> tuple[pd.DataFrame, dict]:
    frac = rec.kept / rec.valid  # (layers, heads)
    per_head = pd.DataFrame({"run_id": run_id, "series": series, **per_head_columns(
        kept_fraction=frac, answer_kept_fraction=rec.answer_kept / rec.answer_valid,
        answer_kept_mass=rec.answer_mass / rec.answer_rows)})
    spread = (frac.std(1) / frac.mean(1)).mean().item()
    summary = {"series": series, "run_id": run_id, "kept_fraction": (rec.kept.sum() / rec.valid.sum()).item(),
               "answer_kept_fraction": (rec.answer_kept.sum() / rec.answer_valid.sum()).item(),
               "answer_kept_mass": (rec.answer_mass.sum() / rec.answer_rows.sum()).item(),
               "head_spread": spread}
    summary["answer_to_all"] = summary["answer_kept_fraction"] / summary["kept_fraction"]
    return per_head, summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_ID")
    parser.add_argument("--questions", type=int, default=24, help="how many questions (or target rows) to replay")
    parser.add_argument("--on", choices=("questions", "target"), default="questions",
                        help="the questions the first run scored, or the rows its target_kept was fitted on")
    parser.add_argument("--results", default="results")
    parser.add_argument("--out", default=None, help="where to write (default: <results>/analysis)")
    args = parser.parse_args(argv)
    runs = [Path(args.results) / "runs" / r for r in args.runs]
    needed = ("config.json", "samples.json.gz") if args.on == "questions" else ("config.json", "stats.json")
    missing = [str(r) for r in runs if not all((r / name).is_file() for name in needed)]
    if missing:
        print(f"not a finished run with {' and '.join(needed)}: {', '.join(missing)}", file=sys.stderr)
        return 2
    configs = [json.loads((r / "config.json").read_text(encoding="utf-8")) for r in runs]
    models = {c["model"]["name"] for c in configs}
    if len(models) != 1:
        print(f"the runs are of several models ({', '.join(sorted(models))}); give runs of one", file=sys.stderr)
        return 2
    if args.on == "target" and configs[0].get("target") is None:
        print(f"--on target: run {runs[0].name} has no target rows (it was not matched: sparsifier.target_kept "
              "unset); give a matched run first, or replay on its questions", file=sys.stderr)
        return 2
    if args.on == "target" and configs[0]["target"].get("kind") is not None:
        print(f"--on target: run {runs[0].name} was fitted on {configs[0]['target']['kind']} prompts that it "
              "decodes, not on rows of a task scored by log-likelihood; replay a run of such a task", file=sys.stderr)
        return 2
    from toptheta.models import load_model  # heavy: transformers' model classes

    model, tokenizer, info = load_model(configs[0]["model"]["source"], dtype="float32", device="cpu")
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    if args.on == "target":
        sequences, what = target_rows(model, tokenizer, configs[0], args.questions), "target rows, no answer rows"
    else:
        sequences, what = question_rows(prompts(runs[0], configs[0], tokenizer, args.questions)), "questions"
    frames, rows = [], []
    for run_dir, config in zip(runs, configs):
        per_head, summary = tables(run_dir.name, series_label(config_row(config)),
                                   replay(model, run_dir, config, sequences, layers, heads))
        frames.append(per_head)
        rows.append(summary)
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in summary.items()}, flush=True)
    out = Path(args.out or Path(args.results) / "analysis")
    command = "python scripts/kept_by_row.py " + " ".join(args.runs) + f" --questions {args.questions}"
    stem = "kept_by_row"
    if args.on == "target":
        command, stem = command + " --on target", "kept_by_row-target"
    write_text(out / f"{stem}.csv", pd.concat(frames).to_csv(index=False, float_format="%.6g"))
    write_text(out / f"{stem}.md", f"# Where each run keeps its attention\n\nProduced by `{command}`; do not edit "
               f"by hand. {len(sequences)} {what} ({next(iter(models))}); per (layer, head): `{stem}.csv`. "
               "answer_*: the rows of the correct answer's tokens; head_spread: the heads' coefficient of variation "
               "of the kept fraction, averaged over the layers.\n\n" + markdown(pd.DataFrame(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Which tasks toptheta evaluates, where their data comes from, and the checks made before any
model work.

Every task is lm-eval's own stock task (prompt, choices, metrics) with only its data source
swapped, except `smoke`, `python_code` and `long_documents`, which are ours. Each task `T` has a calibration variant
`T_calibration` that evaluates the train split instead (see templates/calibration.yaml),
except LongBench's `longbench_<subset>` tasks, one per stock lm-eval LongBench YAML: they read
the original THUDM file `longbench/<subset>.jsonl` and have only a test split.

Data source per run (see resolve_data_dir):
- a data dir: local JSON Lines files in the Hugging Face schemas, plain (`.jsonl`) or gzipped
  (`.jsonl.gz`); the default is the copy shipped in toptheta/data (see its PROVENANCE.md);
- no data dir: the Hugging Face hub (or its local cache), exactly as lm-eval defines the task.
`smoke` never needs either.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

CALIBRATION_SUFFIX = "_calibration"
LONGBENCH_PREFIX = "longbench_"
DATA_DIR_ENV = "TOPTHETA_DATA_DIR"
SHIPPED_DATA_DIR = Path(__file__).resolve().parents[2] / "data"  # toptheta/data, package data


def resolve_data_dir(value: str | os.PathLike[str] | None) -> Path | None:
    """Where task documents come from: an absolute data dir, or None for the Hugging Face hub.

    `"auto"`: $TOPTHETA_DATA_DIR when set (non-empty), else the copy shipped with toptheta;
    `None` or `"hub"`: the hub; anything else: that directory, which must exist.
    """
    if value is None or str(value) == "hub":
        return None
    source = "data_dir"
    if str(value) == "auto":
        if not os.environ.get(DATA_DIR_ENV):
            return SHIPPED_DATA_DIR
        value, source = os.environ[DATA_DIR_ENV], f"${DATA_DIR_ENV}"
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(
            f"data dir {path} (from {source}) is not a directory. Point it at a folder laid out like "
            f"{SHIPPED_DATA_DIR} (arc_easy/test.jsonl[.gz], hellaswag/validation.jsonl[.gz], ...), use "
            f"data_dir=auto for the shipped copy, or data_dir=hub for the Hugging Face hub."
        )
    return path


HELLASWAG_HEAD = 1000  # hellaswag_split: validation documents [0, 1000) are its train split, the rest its test split


def split_slice(rel: str) -> tuple[str, int | None, int | None]:
    """`"dir/file.jsonl[a:b]"` -> ("dir/file.jsonl", a, b): a split that is a range of a file's records (either bound
    may be empty); a plain path -> (path, None, None)."""
    if not rel.endswith("]") or "[" not in rel:
        return rel, None, None
    path, bounds = rel[:-1].rsplit("[", 1)
    start, stop = bounds.split(":")
    return path, int(start) if start else None, int(stop) if stop else None


def data_file(data_dir: Path, rel: str) -> Path:
    """`data_dir/rel` if it exists, else its gzipped twin `rel.gz` if that exists, else `data_dir/rel` (a record range
    `rel[a:b]` names its whole file here: see split_slice)."""
    rel = split_slice(rel)[0]
    plain = data_dir / rel
    if plain.is_file():
        return plain
    gzipped = plain.with_name(plain.name + ".gz")
    return gzipped if gzipped.is_file() else plain


@dataclass(frozen=True)
class TaskSpec:
    """One base task.

    Attributes:
        name: lm-eval task name, also our task name.
        stock_yaml: lm-eval's YAML for it, relative to lm-eval's tasks dir; None for our own.
        data_files: the files it reads from a data dir, relative to that dir, split -> path.
        own_source: for our own tasks, where their documents come from (a data dir never replaces them).
    """

    name: str
    stock_yaml: str | None
    data_files: dict[str, str]
    own_source: str = ""  # our own tasks (no stock YAML): where their documents come from, for the results record

    @property
    def has_offline_train(self) -> bool:
        """Whether a data dir provides the train split (few-shot examples, calibration)."""
        return "train" in self.data_files

    @property
    def needs_data(self) -> bool:
        """Whether this task reads a data dir or the hub (False only for our own tasks)."""
        return self.stock_yaml is not None


def _arc(subset: str) -> dict[str, str]:
    return {split: f"{subset}/{split}.jsonl" for split in ("train", "validation", "test")}


BASE_TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        TaskSpec("smoke", None, {}, "toptheta (generated in code)"),
        TaskSpec("python_code", None, {}, "toptheta/data/python_code (Python standard library functions)"),
        TaskSpec("long_documents", None, {}, "toptheta/data/arc_* train (questions with answers, shuffled into long texts)"),
        TaskSpec("arc_challenge", "arc/arc_challenge.yaml", _arc("arc_challenge")),
        TaskSpec("arc_easy", "arc/arc_easy.yaml", _arc("arc_easy")),
        # Only validation exists offline for these two (see toptheta/data/PROVENANCE.md).
        TaskSpec("hellaswag", "hellaswag/hellaswag.yaml", {"validation": "hellaswag/validation.jsonl"}),
        TaskSpec("medmcqa", "medmcqa/medmcqa.yaml", {"validation": "medmcqa/validation.jsonl"}),
        # HellaSwag with held-out exemplars: the head of validation as its train split (few-shot exemplars and
        # calibration documents, so it calibrates offline on rows built like the evaluated ones), the rest as its test
        # split. Disjoint by construction; the evaluated documents are validation's from HELLASWAG_HEAD on.
        TaskSpec("hellaswag_split", "hellaswag/hellaswag.yaml",
                 {"train": f"hellaswag/validation.jsonl[:{HELLASWAG_HEAD}]",
                  "test": f"hellaswag/validation.jsonl[{HELLASWAG_HEAD}:]"}),
    )
}


def longbench_subsets() -> list[str]:
    """LongBench subsets lm-eval defines a task for (`multi_news`, `qmsum`, `multi_news_e`, ...)."""
    return sorted(p.stem for p in (stock_tasks_dir() / "longbench").glob("*.yaml") if not p.stem.startswith("_"))


def is_longbench(task: str) -> bool:
    return task.startswith(LONGBENCH_PREFIX)


def task_spec(task: str) -> TaskSpec:
    """The spec of base task `task` (a name from task_names() without the calibration suffix)."""
    if task in BASE_TASKS:
        return BASE_TASKS[task]
    subset = task[len(LONGBENCH_PREFIX) :]
    if is_longbench(task) and subset in longbench_subsets():
        return TaskSpec(task, f"longbench/{subset}.yaml", {"test": f"longbench/{subset}.jsonl"})
    raise KeyError(task)


def stock_tasks_dir() -> Path:
    """lm-eval's installed tasks dir, found without importing lm-eval (its import takes seconds)."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("lm-eval is not installed: pip install 'lm-eval>=0.4.13,<0.5'")
    return Path(next(iter(spec.submodule_search_locations))) / "tasks"


def calibration_name(task: str) -> str:
    """`arc_easy` -> `arc_easy_calibration` (idempotent)."""
    return task if is_calibration(task) else task + CALIBRATION_SUFFIX


def is_calibration(task: str) -> bool:
    return task.endswith(CALIBRATION_SUFFIX)


def base_name(task: str) -> str:
    """`arc_easy_calibration` -> `arc_easy`; a base name is returned as is."""
    return task[: -len(CALIBRATION_SUFFIX)] if is_calibration(task) else task


def task_names() -> list[str]:
    """Every task name toptheta accepts, sorted."""
    longbench = [LONGBENCH_PREFIX + s for s in longbench_subsets()]
    return sorted([*BASE_TASKS, *(calibration_name(t) for t in BASE_TASKS), *longbench])


def check_tasks(tasks: list[str], data_dir: Path | None, num_fewshot: int | None) -> None:
    """Raise a clear error if `tasks` cannot run with this data dir and few-shot count.

    Checks only names, files and split availability; it is cheap and runs before any model
    or dataset work. `data_dir` must already be resolved (absolute) or None for the hub.
    `num_fewshot` (None = task default, or an int >= 0) is checked here too so planners fail
    early; any count is allowed (see fewshot_source for offline tasks without a train split).
    """
    if num_fewshot is not None and (
        isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0
    ):
        raise ValueError(f"num_fewshot must be None (task default) or an int >= 0, got {num_fewshot!r}")
    if isinstance(tasks, str) or not isinstance(tasks, (list, tuple)) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of task names, got {tasks!r}")
    valid = set(task_names())
    unknown = [t for t in tasks if not isinstance(t, str) or t not in valid]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; valid tasks: {', '.join(task_names())}")
    duplicates = sorted({t for t in tasks if tasks.count(t) > 1})
    if duplicates:
        raise ValueError(f"task(s) {duplicates} listed more than once; list each task once")
    for task in tasks:
        spec = task_spec(base_name(task))
        if data_dir is None and any(split_slice(rel)[1:] != (None, None) for rel in spec.data_files.values()):
            raise ValueError(f"task {task!r} divides an offline file into splits and has no hub version; with "
                             f"data_dir=hub use the stock task ({spec.stock_yaml}), or data_dir=auto for {task!r}")
        if data_dir is None or not spec.needs_data:
            continue
        _check_offline_splits(task, spec)
        for split, rel in spec.data_files.items():
            path = data_file(data_dir, rel)
            if not path.is_file():
                raise FileNotFoundError(
                    f"task {task!r} needs its {split} split file {rel!r} (or {rel}.gz) in the data dir, "
                    f"but {path} does not exist{_files_beside(path)}. Point data_dir (or "
                    f"{DATA_DIR_ENV}) at a directory holding {rel}, use data_dir=auto for the copy "
                    f"shipped with toptheta, or data_dir=hub for the Hugging Face hub."
                )


def _files_beside(path: Path) -> str:
    """`; <dir> holds: a.jsonl, b.jsonl` (or says it is missing), to point at a misnamed file."""
    if not path.parent.is_dir():
        return f" (no directory {path.parent})"
    found = sorted(p.name for p in path.parent.iterdir() if p.name.endswith((".jsonl", ".jsonl.gz")))
    return f"; {path.parent} holds: {', '.join(found) or 'no .jsonl files'}"


def _check_offline_splits(task: str, spec: TaskSpec) -> None:
    """Offline, a task without a train split cannot calibrate (its few-shot source: see below)."""
    if spec.has_offline_train or not is_calibration(task):
        return
    raise ValueError(
        f"{task!r} cannot run offline: the data dir has no train split for {spec.name} "
        f"(only {', '.join(spec.data_files)}). Calibrate on another task's train split "
        f"instead (cross-dataset calibration, e.g. calibration task 'arc_challenge'), or run "
        f"with data_dir=hub and hub access to use {spec.name}'s own train split."
    )


def fewshot_source(task: str, data_dir: Path | None, num_fewshot: int | None) -> str | None:
    """Where `task` draws few-shot examples from when it differs from stock lm-eval, else None.

    Offline tasks without a train split (hellaswag, medmcqa) draw them from the evaluated
    validation split, leaving out the evaluated document (see their templates).
    """
    spec = task_spec(base_name(task))
    if not num_fewshot or data_dir is None or not spec.needs_data or spec.has_offline_train:
        return None
    return "validation (the offline data has no train split; the evaluated document is left out)"

"""Finding and building lm-eval tasks: argument checks, the task index, loading, few-shot samplers, data sources.

Tasks come from toptheta.evaluation.tasks (stock lm-eval tasks with a local or hub data source, their
`_calibration` variants, and `smoke`) or from lm-eval itself (and a user's folder of task YAMLs). Every check here
runs before lm-eval builds anything and before the model is touched, so a typo fails in milliseconds rather than
after model loading. ``lm_eval_adapter.evaluate_tasks`` and ``calibration_requests`` both start here.
"""

from __future__ import annotations

import difflib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_eval.tasks import TaskManager

from ..compat import compile_templates_once, replace_sampler
from ..config import is_int
from .tasks import DATA_DIR_ENV, base_name, task_names, task_spec

if TYPE_CHECKING:
    from lm_eval.api.task import Task

log = logging.getLogger(__name__)


def check_run_args(num_fewshot: Any, limit: Any, batch_size: Any, max_length: Any) -> None:
    """Argument checks shared by evaluate_tasks and calibration_requests."""
    if num_fewshot is not None and not is_int(num_fewshot, 0):
        raise ValueError(f"num_fewshot must be None (task default) or an int >= 0, got {num_fewshot!r}")
    if limit is not None:
        # lm-eval reads a float < 1 as a fraction of the docs but int(limit) otherwise, so 1.0
        # would silently mean "1 document": accept only unambiguous values.
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise ValueError(f"limit must be None, an int >= 1 or a float in (0, 1), got {limit!r}")
        if isinstance(limit, int) and limit < 1:
            raise ValueError(f"limit must be >= 1 documents, got {limit}; use None for all documents")
        if isinstance(limit, float) and not 0.0 < limit < 1.0:
            raise ValueError(
                f"a float limit is a fraction of the documents and must be in (0, 1), got {limit}; "
                f"use an int for a document count"
            )
    if not (is_int(batch_size, 1) or batch_size == "auto"):
        raise ValueError(f"batch_size must be an int >= 1 or 'auto', got {batch_size!r}")
    if max_length is not None and not is_int(max_length, 2):
        raise ValueError(f"max_length must be None (model default) or an int >= 2, got {max_length!r}")


def task_manager(include_paths: list[str], stock: bool = False) -> TaskManager:
    """A TaskManager that indexes our task dirs (and lm-eval's own tasks only if `stock`).

    Indexing lm-eval's ~15k stock YAMLs costs ~20 s per call, and our YAMLs reach the stock ones
    through absolute `include:` paths anyway, so it happens only for tasks outside our catalogue.
    """
    compile_templates_once()
    return TaskManager(include_path=include_paths, include_defaults=stock)


def is_catalogued(task: str) -> bool:
    """Whether `task` is one of ours (an offline variant, a calibration variant, smoke)."""
    return isinstance(task, str) and task in task_names()


def user_paths(include_path: str | os.PathLike[str] | None) -> list[str]:
    if include_path is None:
        return []
    path = Path(include_path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"task include_path {path} does not exist; point it at a folder of lm-eval task YAMLs")
    return [str(path)]


def needs_stock(external: list[str], user_paths: list[str]) -> bool:
    """Whether the external tasks need lm-eval's own index (not all of them are in the user's YAMLs)."""
    return bool(external) and not set(external) <= set(task_manager(user_paths).all_tasks if user_paths else [])


def check_external_tasks(tasks: list[str], include_path: str | os.PathLike[str] | None = None) -> list[str]:
    """Check that `tasks` (names outside our catalogue) are lm-eval tasks; return the include paths to use.

    Looks in `include_path` first, then lm-eval's own tasks (indexing those takes ~20 s, still before any
    model work). Unknown names raise ValueError with the closest known names.
    """
    paths = user_paths(include_path)
    known = set(task_manager(paths, stock=needs_stock(tasks, paths)).all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        close = sorted({m for t in unknown for m in difflib.get_close_matches(t, known, n=5)})
        raise ValueError(
            f"unknown lm-eval task(s) {unknown}: neither ours ({', '.join(task_names())}) nor lm-eval's"
            f"{' nor under ' + paths[0] if paths else ''}. Close names: {', '.join(close) or 'none'}. "
            f"`lm_eval ls tasks` lists lm-eval's tasks; task.include_path=<folder> adds your own YAMLs."
        )
    return paths


FEWSHOT_SAMPLERS = ("default", "first_n")  # lm-eval's samplers this project offers (lm_eval.api.samplers)


def check_sampler(sampler: str | None) -> None:
    if sampler is not None and sampler not in FEWSHOT_SAMPLERS:
        raise ValueError(f"fewshot_sampler={sampler!r}: use None (the task's own), "
                         f"{' or '.join(FEWSHOT_SAMPLERS)} (first_n: the same exemplars for every question)")


def load_tasks(manager: TaskManager, tasks: list[str], data_dir: Path | None,
                fewshot_sampler: str | None = None) -> dict[str, Task]:
    """Build the lm-eval Task objects (this loads the datasets), with a hint on hub failures, each with the
    few-shot sampler ``fewshot_sampler`` when one is given (None or ``default``: the task's own)."""
    try:
        loaded = manager.load(tasks)["tasks"]
    except Exception as err:
        if data_dir is not None or all(is_catalogued(t) and not task_spec(base_name(t)).needs_data for t in tasks):
            raise
        raise RuntimeError(
            f"loading {tasks} from the Hugging Face hub failed ({type(err).__name__}: {err}). "
            f"Offline, use data_dir='auto' (the copy shipped with toptheta, or ${DATA_DIR_ENV}) or a data dir."
        ) from err
    if fewshot_sampler not in (None, "default"):
        for task in loaded.values():
            replace_sampler(task, fewshot_sampler)
    return loaded


def data_sources(tasks: list[str], data_dir: Path | None) -> dict[str, str]:
    """Where each task's documents came from, for the results record."""
    out = {}
    for task in tasks:
        if not is_catalogued(task):
            out[task] = "lm-eval task (its own data source, usually the Hugging Face hub)"
            continue
        spec = task_spec(base_name(task))
        if not spec.needs_data:
            out[task] = spec.own_source
        elif data_dir is None:
            out[task] = "huggingface hub"
        else:
            out[task] = str(data_dir)
    return out

"""toptheta's lm-eval tasks: offline variants of stock tasks (LongBench included), calibration variants, `smoke`.

See catalog.py for the task list and checks, render.py for how the YAMLs reach lm-eval.
"""

from toptheta.evaluation.tasks.catalog import (
    BASE_TASKS,
    DATA_DIR_ENV,
    SHIPPED_DATA_DIR,
    base_name,
    calibration_name,
    check_tasks,
    fewshot_source,
    is_calibration,
    is_longbench,
    resolve_data_dir,
    task_names,
    task_spec,
)
from toptheta.evaluation.tasks.render import task_include_paths

__all__ = [
    "BASE_TASKS",
    "DATA_DIR_ENV",
    "SHIPPED_DATA_DIR",
    "base_name",
    "calibration_name",
    "check_tasks",
    "fewshot_source",
    "is_calibration",
    "is_longbench",
    "resolve_data_dir",
    "task_include_paths",
    "task_names",
    "task_spec",
]

"""Write the lm-eval include dir for one run: our task YAMLs with this run's paths filled in.

lm-eval YAML cannot read environment variables, and `include:` only takes paths (relative to
the including file, or absolute), never task names. So the templates in ./templates name the
stock YAML and the data dir by placeholders, and this module renders the ones a run needs into
a fresh temporary directory. ./static holds our own tasks, which need no rendering; it is
passed to lm-eval's TaskManager as a second include path.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from string import Template

from toptheta.atomic import write_text_atomic
from toptheta.evaluation.tasks.catalog import (
    base_name,
    data_file,
    is_calibration,
    is_longbench,
    split_slice,
    stock_tasks_dir,
    task_spec,
)

TASKS_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = TASKS_DIR / "templates"
STATIC_DIR = TASKS_DIR / "static"


def _quoted(value: str | Path) -> str:
    """`value` escaped for the inside of a YAML double-quoted scalar (JSON's rules are valid YAML)."""
    return json.dumps(str(value))[1:-1]


def _render(template: str, **values: str | Path) -> str:
    text = (TEMPLATES_DIR / template).read_text(encoding="utf-8")
    return Template(text).substitute({k: _quoted(v) for k, v in values.items()})


def write_task_dir(target: Path, tasks: list[str], data_dir: Path | None) -> None:
    """Render the YAMLs `tasks` need into the existing directory `target`.

    A calibration task includes its rendered base task, so both are written. Our own tasks
    (static/) are skipped. `tasks` must have passed catalog.check_tasks.
    """
    stock_dir = stock_tasks_dir()
    bases = {base_name(t) for t in tasks if task_spec(base_name(t)).needs_data}
    for base in sorted(bases):
        spec = task_spec(base)
        stock = stock_dir / spec.stock_yaml
        if data_dir is None:
            text = _render("hub.yaml", stock=stock, task=base)
        else:  # one placeholder per split: its file, plain .jsonl or gzipped .jsonl.gz (or a range of one's records)
            files = {split: _split_file(target, base, split, data_dir, rel) for split, rel in spec.data_files.items()}
            template = "longbench.yaml" if is_longbench(base) else f"{base}.yaml"
            text = _render(template, stock=stock, task=base, **files)
        write_text_atomic(target / f"{base}.yaml", text)
    for task in sorted(t for t in tasks if is_calibration(t) and base_name(t) in bases):
        text = _render("calibration.yaml", base=target / f"{base_name(task)}.yaml", task=task)
        write_text_atomic(target / f"{task}.yaml", text)


def _split_file(target: Path, base: str, split: str, data_dir: Path, rel: str) -> Path:
    """The file a split reads: the data dir's own, or for a record range (`file.jsonl[a:b]`, catalog.split_slice)
    those records written to `target/<base>.<split>.jsonl` (the datasets json loader reads whole files only)."""
    path, start, stop = split_slice(rel)
    source = data_file(data_dir, path)
    if start is None and stop is None:
        return source
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt", encoding="utf-8") as handle:
        records = [line for line in handle if line.strip()][start:stop]
    out = target / f"{base}.{split}.jsonl"
    write_text_atomic(out, "".join(line if line.endswith("\n") else line + "\n" for line in records))
    return out


@contextlib.contextmanager
def task_include_paths(tasks: list[str], data_dir: Path | None) -> Iterator[list[str]]:
    """Yield the `include_path` list for lm-eval's TaskManager; the rendered dir is removed after.

    Keep the context open until evaluation ends: lm-eval re-reads a task's YAML when it builds it.
    """
    with tempfile.TemporaryDirectory(prefix="toptheta-lm-eval-tasks-") as tmp:
        write_task_dir(Path(tmp), tasks, data_dir)
        yield [str(STATIC_DIR), tmp]

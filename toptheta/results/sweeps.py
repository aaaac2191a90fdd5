"""The runs an experiment's sweep plans: each job composed and planned as run.py does, no model loaded.

`experiments.jobs` lists a sweep's override lists from its YAML alone; this module composes each job with
Hydra (conf/, whose `experiment` group is experiments/) and runs `pipeline.plan` on it, so the run ids are
exactly the ones `python run.py -m experiment=<name>` would make or find in its store. Planning checks the
configuration and the data files, so it fails where the run would (say, a calibration task without a train
split offline); `run_owners` records such an experiment as unplannable instead of stopping.

Composing a sweep job by job takes seconds per experiment, so a plan is cached
(`$TOPTHETA_CACHE/plans/`, default `~/.cache/toptheta/plans/`) under a key made of the experiment, its extra
overrides, the `TOPTHETA_*` environment and the content of everything a plan is computed from: conf/,
experiments/ and the package's source. Any edit there plans afresh; only plans that succeeded are cached.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..atomic import write_text_atomic
from ..cachedir import cache_dir
from . import experiments

CONF = Path(__file__).resolve().parents[2] / "conf"
PACKAGE = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def composing() -> Iterator[None]:
    """A Hydra context on conf/ (the schema registered); inside an already initialised one, that one is used."""
    from hydra import initialize_config_dir  # hydra and the schema (omegaconf): only to compose
    from hydra.core.global_hydra import GlobalHydra

    from toptheta.config import register

    register()
    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


@dataclass
class PlannedJob:
    overrides: list[str]
    results_dir: str
    runs: list[tuple[str, str]] = field(default_factory=list)  # (run id, label), the baseline first


def plan_jobs(name: str, extra: Sequence[str] = ()) -> list[PlannedJob]:
    """Every job of the experiment's sweep with the runs it plans; call inside `composing()`. Quiet: plan()'s
    notes (e.g. compensation ignored for dense) are logged at INFO, which this silences for its duration.
    Cached (module docstring): a second call with nothing changed reads the plan back."""
    cached = _plan_cache(name, extra)
    try:
        return [PlannedJob(job["overrides"], job["results_dir"], [tuple(run) for run in job["runs"]])
                for job in json.loads(cached.read_text(encoding="utf-8"))]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    planned = _plan_jobs(name, extra)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(cached, json.dumps([asdict(job) for job in planned]))
    except OSError:  # a read-only cache only costs the time to plan again
        pass
    return planned


def _plan_cache(name: str, extra: Sequence[str]) -> Path:
    environment = sorted((k, v) for k, v in os.environ.items() if k.startswith("TOPTHETA_"))
    key = json.dumps([name, list(extra), environment, _sources_fingerprint()])
    return cache_dir("plans", f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json")


@functools.cache
def _sources_fingerprint() -> str:
    """A hash of every file a plan is computed from: conf/ and experiments/ (YAML) and the package's source."""
    digest = hashlib.sha256()
    files = [*CONF.rglob("*.yaml"), *experiments.experiments_dir().rglob("*.yaml"), *PACKAGE.rglob("*.py")]
    for path in sorted(files):
        digest.update(str(path).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _plan_jobs(name: str, extra: Sequence[str]) -> list[PlannedJob]:
    from hydra import compose  # hydra and the pipeline (omegaconf): only when planning

    from toptheta import pipeline

    log = logging.getLogger("toptheta")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        out = []
        for job in experiments.jobs(name):
            cfg = compose("config", overrides=[*job, *extra])
            out.append(PlannedJob(job, str(cfg.results_dir), [(s.run_id, s.label) for s in pipeline.plan(cfg)]))
        return out
    finally:
        log.setLevel(level)


@dataclass
class Owners:
    """run id -> the experiments whose sweeps plan it; and the experiments that could not be planned here."""

    by_run: dict[str, list[str]] = field(default_factory=dict)
    planned: dict[str, int] = field(default_factory=dict)  # experiment -> the number of distinct runs it plans
    unplannable: dict[str, str] = field(default_factory=dict)  # experiment -> the first line of its error


def run_owners(names: Iterable[str] | None = None, models: Iterable[str] | None = None) -> Owners:
    """Plan every named experiment (default: all of them, the `paper` protocols included) and index its runs.
    With `models` (model names), an experiment none of whose jobs uses one of them is not planned: it cannot own
    a run of those models, and composing a big GPU sweep job by job takes a minute."""
    owners = Owners()
    wanted = set(models) if models is not None else None
    with composing():
        for name in names if names is not None else experiments.list_experiments():
            try:
                if wanted is not None and not _job_models(name) & wanted:
                    continue
                planned = plan_jobs(name)
            except Exception as error:  # noqa: BLE001 - a sweep that cannot be planned here owns nothing here
                owners.unplannable[name] = str(error).splitlines()[0] if str(error) else type(error).__name__
                continue
            owners.planned[name] = len({run_id for job in planned for run_id, _ in job.runs})
            for job in planned:
                for run_id, _ in job.runs:
                    names_of = owners.by_run.setdefault(run_id, [])
                    if name not in names_of:
                        names_of.append(name)
    return owners


def _job_models(name: str) -> set[str]:
    """The model names an experiment's jobs use: their `model=` overrides, and the experiment's own model for
    jobs without one (one job composed). Inside `composing()`."""
    from hydra import compose  # hydra: only to compose

    jobs = experiments.jobs(name)
    models = {o.split("=", 1)[1] for job in jobs for o in job if experiments.override_key(o) == "model"}
    plain = next((job for job in jobs if not any(experiments.override_key(o) == "model" for o in job)), None)
    if plain is not None:
        models.add(str(compose("config", overrides=plain).model.name))
    return models


def cover(run_ids: Iterable[str], owners: Owners) -> tuple[list[str], int]:
    """The fewest experiments whose sweeps make all of `run_ids` (greedy: the one planning most of those left,
    ties to a smol protocol over a paper one, then by name), and how many of the runs no experiment plans (made
    by direct `python run.py` commands)."""
    left = {r for r in run_ids if r in owners.by_run}
    unowned = len(set(run_ids)) - len(left)
    chosen: list[str] = []
    while left:
        counts: dict[str, int] = {}
        for run_id in left:
            for name in owners.by_run[run_id]:
                counts[name] = counts.get(name, 0) + 1
        best = min(counts, key=lambda n: (-counts[n], n.endswith("/paper"), n))
        chosen.append(best)
        left = {r for r in left if best not in owners.by_run[r]}
    return sorted(chosen), unowned

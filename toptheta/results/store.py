"""The results store: one directory per run plus one summary CSV for all runs.

Layout under `results_dir`:

    runs/<run_id>/config.json     the resolved run config (as given, ignored keys included)
    runs/<run_id>/lm_eval.json    lm-eval's results dict, without per-sample logs
    runs/<run_id>/samples.json.gz lm-eval's per-sample logs, gzipped (only when it produced them;
                                  older runs: samples.json, read the same, see read_samples)
    runs/<run_id>/stats.json      sparsity statistics (kept fractions, ...)
    runs/<run_id>/meta.json       run_id, thresholds_ref, extra, git_commit, timestamp
    runs/<run_id>/invocation.json the command line, Hydra overrides and job (written by the pipeline)
    runs/<run_id>/thresholds.safetensors  a copy of the thresholds the run used (Top-θ runs)
    runs/<run_id>/DONE            written last: a run counts as complete only with it
    summary.csv                   one row per (run, task, metric); appended under a lock

A run directory is assembled in a temporary sibling and renamed into place, so readers never
see half a run, and a crash leaves no partial files behind. summary.csv is rewritten whole to a
temporary file and os.replace'd while holding a lock on summary.csv.lock, so parallel
jobs (e.g. a Hydra multirun) never lose or interleave rows. RunStore.claim(run_id) is the
per-run claim (lock files in .claims/, see claims.py) that keeps two jobs from computing one run.

The run id is a hash of the resolved config minus IGNORED_CONFIG_KEYS (settings that cannot
change results), so rerunning an identical experiment finds the existing run.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import gzip
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import default_mode, write_bytes_atomic, write_text_atomic
from .claims import claim

if TYPE_CHECKING:
    import pandas as pd

# Top-level or dotted config keys left out of the run id: where results go, logging, whether to
# overwrite, Hydra's own bookkeeping. Everything else (model, sparsifier, tasks, data_dir,
# limit, seed, ...) is part of it: when in doubt a key stays in, since a spurious new run id
# only costs a rerun while a missing key would silently reuse a different experiment's result.
IGNORED_CONFIG_KEYS: tuple[str, ...] = ("logger", "force", "results_dir", "hydra", "wandb",
                                        # how code runs or how many contexts share a forward, not what it scores
                                        # (batches score as batch 1 does: tests/test_shared_context.py). Generation
                                        # (ours, and lm-eval's generate_until requests) batches with task.decode_batch,
                                        # which is part of the id: at a near-tie a batch's GEMM rounding can change a
                                        # greedy token.
                                        "task.allow_unsafe_code", "task.batch_size", "task.prefix_cache")

SUMMARY_COLUMNS: tuple[str, ...] = (
    "run_id",
    "model",
    "sparsifier",
    "placement",
    "k",
    "comp",
    "granularity",
    "layer_k",
    "calib_task",
    "calib_statistic",
    "sigma_add",
    "tac",
    "calib_documents",
    "calib_compensation",
    "empty_rows",
    "task",
    "num_fewshot",
    "fewshot_sampler",
    "target_kept",
    "calib_seed",
    "p",
    "lam",
    "calib_beyond",
    "limit",
    "metric",
    "value",
    "stderr",
    "kept_attention_fraction",
    "kept_vrow_fraction",
    "kept_attention_fraction_sparsified",
    "clamped_rows",
    "empty_row_count",
    "generated_tokens",
    "stats_scope",
    "git_commit",
    "phase",
    "timestamp",
)

# Where summary_rows finds each config-derived column: candidate dotted paths, the first one
# present wins (a mapping becomes a short label, see _cell). Pass `field_paths=` to summary_rows
# to adapt to another config layout, or `overrides=` to set a column outright.
SUMMARY_FIELD_PATHS: dict[str, tuple[str, ...]] = {
    "model": ("model.name", "model.id", "model"),
    "sparsifier": ("sparsifier.name", "sparsifier"),
    "placement": ("sparsifier.placement", "placement"),
    "k": ("sparsifier.k", "k"),
    "comp": ("comp.label", "comp.name", "comp", "sparsifier.comp"),
    "granularity": ("calib.granularity", "sparsifier.granularity", "granularity"),
    "layer_k": ("sparsifier.layer_k",),
    "calib_task": ("calib.task",),
    "calib_statistic": ("calib.statistic",),
    "sigma_add": ("calib.sigma_add",),
    "tac": ("calib.tac",),
    "calib_documents": ("calib.num_samples",),
    "calib_compensation": ("calib.compensation",),
    "empty_rows": ("sparsifier.empty_rows",),
    "num_fewshot": ("task.num_fewshot", "eval.num_fewshot", "num_fewshot"),
    "fewshot_sampler": ("task.fewshot_sampler",),
    "target_kept": ("sparsifier.target_kept",),
    "calib_seed": ("calib.seed",),
    "p": ("sparsifier.p",),  # top-p's probability mass
    "lam": ("sparsifier.lam",),  # skip-softmax's λ
    "calib_beyond": ("calib.beyond",),  # rows past the calibrated lengths: clamp (the default) or fit
    "limit": ("task.limit", "eval.limit", "limit"),
    "phase": ("phase",),
}

# Columns that describe sparsification: empty for a dense run, whatever its config holds.
SPARSE_ONLY_COLUMNS: tuple[str, ...] = ("placement", "k", "layer_k", "empty_rows", "p", "lam", "calib_beyond")

# Columns read from the run's statistics: column -> candidate keys of stats (the first present wins).
STAT_SOURCES: dict[str, tuple[str, ...]] = {
    "kept_attention_fraction": ("kept_attention_fraction",),
    "kept_vrow_fraction": ("kept_vrow_fraction",),
    "kept_attention_fraction_sparsified": ("kept_attention_fraction_sparsified",),  # layers outside layer_k
    "clamped_rows": ("clamped_rows",),  # rows longer than the calibrated lengths (θ of the longest one used)
    "empty_row_count": ("empty_rows", "empty_row_count"),  # Top-θ rows where nothing passed θ
    "generated_tokens": ("generated_tokens",),  # generation tasks: mean tokens per generated text
}
STAT_COLUMNS: tuple[str, ...] = tuple(STAT_SOURCES)

DONE_MARKER = "DONE"


# ---------------------------------------------------------------- helpers


def _jsonable(obj: Any) -> Any:
    """json.dump's fallback: NumPy/torch scalars and arrays, paths, sets; anything else as str.

    lm-eval's results hold a few non-JSON values (NumPy numbers, callables in task configs);
    like lm-eval's own writer we keep them readable rather than fail a finished run.
    """
    if hasattr(obj, "tolist"):  # NumPy scalars/arrays, torch tensors
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def _dumps(obj: Any) -> str:
    # Key order kept as given: sort_keys would fail on dicts mixing int and str keys.
    return json.dumps(obj, indent=2, default=_jsonable) + "\n"


SAMPLES_FILE = "samples.json.gz"
_OLD_SAMPLES_FILE = "samples.json"


def compress_json(obj: Any) -> bytes:
    """gzip of the JSON text, with no timestamp in the header: the same samples give the same bytes.
    Per-sample logs are ~1.3 MB of JSON per 500-question run and compress about tenfold."""
    return gzip.compress(_dumps(obj).encode("utf-8"), compresslevel=9, mtime=0)


def samples_path(run_dir: str | Path) -> Path | None:
    """A run directory's per-sample file (gzipped, or the plain JSON of older runs); None without one."""
    for name in (SAMPLES_FILE, _OLD_SAMPLES_FILE):
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    return None


def read_samples(path: str | Path) -> Any:
    """The per-sample logs in a samples file (see samples_path)."""
    path = Path(path)
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def compress_samples(run_dir: str | Path) -> bool:
    """Replace an older run's samples.json by samples.json.gz (same content); True when it did."""
    plain = Path(run_dir) / _OLD_SAMPLES_FILE
    if not plain.is_file():
        return False
    write_bytes_atomic(Path(run_dir) / SAMPLES_FILE, compress_json(json.loads(plain.read_text(encoding="utf-8"))),
                       fsync=True)
    plain.unlink()
    return True


def _write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same directory, fsync, then os.replace."""
    write_text_atomic(path, text, fsync=True)


def _to_plain(obj: Any) -> Any:
    """Mappings -> dicts, tuples -> lists, Paths -> str, recursively (for hashing configs)."""
    if isinstance(obj, Mapping):
        return {str(k): _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(
        f"config value {obj!r} of type {type(obj).__name__} cannot be hashed stably; convert the "
        f"config to plain dicts/lists/scalars first (e.g. OmegaConf.to_container(cfg, resolve=True))"
    )


def _drop_keys(config: dict[str, Any], dotted_keys: Sequence[str]) -> dict[str, Any]:
    """A copy of `config` without the given top-level or dotted keys."""
    out = json.loads(json.dumps(config))  # deep copy of plain data
    for dotted in dotted_keys:
        *parents, leaf = dotted.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return out


def _lookup(config: Mapping[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def comp_label(comp: Mapping[str, Any]) -> str:
    """A compensation config as a short label: `none`, `sdc=exact`, `vmc`, `sdc=exact*0.9+vmc`.

    Reads the keys `sdc` (estimator or None), `sdc_scale` (shown when not 1) and `vmc` (bool).
    """
    parts = []
    if comp.get("sdc"):
        scale = comp.get("sdc_scale", 1.0)
        parts.append(f"sdc={comp['sdc']}" + ("" if scale in (None, 1, 1.0) else f"*{scale}"))
    if comp.get("vmc"):
        parts.append("vmc")
    return "+".join(parts) or "none"


def _cell(value: Any) -> Any:
    """A config value as one CSV cell: scalars as they are, lists joined, mappings labelled.

    A mapping with `sdc`/`vmc` keys gets comp_label; any other mapping lists its set entries
    (`key=value`, a bare `key` for True, None/False left out), or `none` when nothing is set.
    """
    if isinstance(value, Mapping):
        if {"sdc", "vmc"} & set(value):
            return comp_label(value)
        parts = [
            str(k) if v is True else f"{k}={_cell(v)}" for k, v in value.items() if v not in (None, False)
        ]
        return ",".join(parts) or "none"
    if isinstance(value, (list, tuple)):
        return ",".join(str(_cell(v)) for v in value)
    return value


def _first_present(config: Mapping[str, Any], paths: Sequence[str]) -> Any:
    for path in paths:
        value = _lookup(config, path)
        if value is not None:
            return _cell(value)
    return None


def _number_or_none(value: Any) -> float | None:
    """lm-eval reports missing stderrs as "N/A"; NaN also means no value."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return None if math.isnan(value) else value


def git_commit(path: str | os.PathLike[str] | None = None) -> str | None:
    """HEAD's commit hash of the checkout holding `path` (default: this code), or None.

    "-dirty" is appended when tracked files have uncommitted changes, since the hash alone
    would then not identify the code that ran. None when git or the checkout is missing.
    """
    cwd = Path(path) if path is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd, capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------- summary rows


def summary_rows(
    run_id: str,
    config: Mapping[str, Any],
    lm_eval_results: Mapping[str, Any],
    stats: Mapping[str, Any] | None,
    *,
    field_paths: Mapping[str, Sequence[str]] = SUMMARY_FIELD_PATHS,
    overrides: Mapping[str, Any] | None = None,
    commit: str | None = None,
    timestamp: str | None = None,
) -> list[dict[str, Any]]:
    """One row per (task, metric) in lm-eval's `results` section.

    metric is lm-eval's key, e.g. `acc,none` or `acc_norm,none`; stderr is the matching
    `acc_stderr,none` (None when lm-eval gives "N/A"). num_fewshot and limit come from what
    lm-eval actually used (`n-shot`, `config.limit`), falling back to the config. The statistics
    (STAT_SOURCES) come from `stats[task]` when present, else from `stats` for the task the run
    evaluated; a sub-task without its own numbers (a passkey length) gets none, and the
    `stats_scope` column says which (`task`, `run`, empty). A dense run leaves the sparse-only
    columns (SPARSE_ONLY_COLUMNS) empty. Other columns: see
    SUMMARY_FIELD_PATHS; `overrides` sets columns outright (applied last). `commit` defaults
    to git_commit(), `timestamp` to now (UTC).
    """
    stats = stats or {}
    base = {column: _first_present(config, paths) for column, paths in field_paths.items()}
    base["run_id"] = run_id
    base["git_commit"] = commit if commit is not None else git_commit()
    base["timestamp"] = timestamp or _now()
    used_limit = (lm_eval_results.get("config") or {}).get("limit")
    if used_limit is not None:
        base["limit"] = used_limit
    elif base.get("limit") is None and _lookup(config, "task.kind") in ("passkey", "ruler"):
        base["limit"] = _passkey_prompts(config)

    if base.get("fewshot_sampler") is None and _lookup(config, "task.kind") == "lm_eval":
        base["fewshot_sampler"] = "default"  # lm-eval's per-question random draw
    if base.get("calib_beyond") is None and _lookup(config, "sparsifier.name") == "toptheta":
        base["calib_beyond"] = "clamp"  # the rule before calib.beyond existed, and its default (not in the run id)
    if _lookup(config, "sparsifier.name") == "dense":
        base.update({column: None for column in SPARSE_ONLY_COLUMNS})

    results = lm_eval_results.get("results") or {}
    own_tasks = {_lookup(config, "task.lm_eval_task"), _lookup(config, "task.name")} - {None}
    rows = []
    for task, metrics in results.items():
        task_stats, scope = _stats_for(task, stats, own=len(results) == 1 or task in own_tasks)
        fewshot = (lm_eval_results.get("n-shot") or {}).get(task)
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue  # alias/name/sample_len, or a stderr (reported with its metric)
            name, _, filt = key.partition(",")
            row = dict(base, task=task, metric=key)
            if fewshot is not None:
                row["num_fewshot"] = fewshot
            row["value"] = _number_or_none(value)
            row["stderr"] = _number_or_none(metrics.get(f"{name}_stderr,{filt}"))
            for column, keys in STAT_SOURCES.items():
                row[column] = next((task_stats[k] for k in keys if task_stats.get(k) is not None), None)
            row["stats_scope"] = scope
            rows.append(row | dict(overrides or {}))
    return rows


def _passkey_prompts(config: Mapping[str, Any]) -> int | None:
    """How many prompts a passkey run (one per length and depth) or a ruler run (task.prompts_per_length per length)
    without a limit evaluates: its `limit` column, so runs over other lengths, depths or prompt counts form settings
    of their own, and a larger one supersedes a smaller one."""
    lengths, depths = _lookup(config, "task.lengths"), _lookup(config, "task.depths")
    if _lookup(config, "task.kind") == "ruler":
        per_length = _lookup(config, "task.prompts_per_length")
        return len(lengths) * per_length if lengths and per_length else None
    return len(lengths) * len(depths) if lengths and depths else None


def _stats_for(task: str, stats: Mapping[str, Any], *, own: bool) -> tuple[Mapping[str, Any], str | None]:
    """The statistics a row of `task` reports, and their scope.

    `task`: stats[task] holds this task's own numbers (e.g. one passkey length; for the task the run
    evaluated, the run's numbers fill what it lacks); `run`: the run's statistics, for the task the run
    evaluated; None: a sub-task (a passkey length, a group member) without its own numbers gets no
    statistics rather than the pooled ones of the whole run.
    """
    pooled = stats if own else {}
    if isinstance(stats.get(task), Mapping):
        return {**pooled, **stats[task]}, "task"
    return pooled, ("run" if own else None)


# ---------------------------------------------------------------- the store


class RunStore:
    """Run directories and the summary CSV under `results_dir` (created on first write)."""

    def __init__(
        self,
        results_dir: str | os.PathLike[str] = "results",
        *,
        ignored_keys: Sequence[str] = IGNORED_CONFIG_KEYS,
    ):
        self.results_dir = Path(results_dir)
        self.runs_dir = self.results_dir / "runs"
        self.summary_path = self.results_dir / "summary.csv"
        self.ignored_keys = tuple(ignored_keys)

    # -- identity

    def run_id_for(self, config: Mapping[str, Any]) -> str:
        """A stable 16-hex-digit id: sha256 of the canonical JSON of `config` minus ignored keys.

        Canonical: keys sorted, tuples as lists, Paths as strings. Key order and ignored keys
        (see IGNORED_CONFIG_KEYS) do not change the id; any other value change does, and so do
        int vs float (1 vs 1.0). Non-plain values raise TypeError naming the fix.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        plain = _drop_keys(_to_plain(config), self.ignored_keys)
        canonical = json.dumps(plain, sort_keys=True, separators=(",", ":"), allow_nan=True)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]

    def run_dir(self, run_id: str) -> Path:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise ValueError(f"invalid run id {run_id!r}: use RunStore.run_id_for(config)")
        return self.runs_dir / run_id

    def partial_dir(self, run_id: str) -> Path:
        """Where a run saves its finished parts while it runs (passkey: each length), to resume from if it is
        interrupted; removed once the run is stored. Hidden beside the runs, so no reader takes it for one."""
        return self.runs_dir / f".partial-{self.run_dir(run_id).name}"

    def exists(self, run_id: str) -> bool:
        """Whether a complete run (its DONE marker present) is stored under `run_id`."""
        return (self.run_dir(run_id) / DONE_MARKER).is_file()

    # -- writing

    def write_run(
        self,
        run_id: str,
        *,
        config: Mapping[str, Any],
        lm_eval_results: Mapping[str, Any],
        stats: Mapping[str, Any],
        thresholds_ref: str | None,
        extra: Mapping[str, Any] | None = None,
        texts: Mapping[str, str] | None = None,
        copies: Mapping[str, str | os.PathLike[str]] | None = None,
    ) -> Path:
        """Store one run atomically and return its directory; an existing run is replaced.

        ``texts`` adds files by name and content (e.g. ``invocation.json``); ``copies`` copies files in
        by name and source path (e.g. the thresholds the run used), so the run directory stands alone.

        Files are written into a temporary directory next to the final one, DONE last, then
        the directory is renamed into place. Replacing an existing run moves the old directory
        aside first, so exists() is briefly False during a replace, never true for a mix of
        old and new files. On any error the temporary directory is removed.
        """
        final = self.run_dir(run_id)
        self.runs_dir.mkdir(parents=True, exist_ok=True)
        results = dict(lm_eval_results)
        samples = results.pop("samples", None)
        files = {
            "config.json": _dumps(dict(config)),
            "lm_eval.json": _dumps(results),
            "stats.json": _dumps(dict(stats)),
            "meta.json": _dumps(
                {
                    "run_id": run_id,
                    "thresholds_ref": thresholds_ref,
                    "extra": dict(extra or {}),
                    "git_commit": git_commit(),
                    "timestamp": _now(),
                }
            ),
        }
        if samples:
            files[SAMPLES_FILE] = compress_json(samples)
        files.update(texts or {})
        for name in [*(texts or {}), *(copies or {})]:
            if not name or "/" in name or name.startswith(".") or name == DONE_MARKER:
                raise ValueError(f"run file name {name!r}: give a plain file name such as 'thresholds.safetensors'")

        staging = Path(tempfile.mkdtemp(dir=self.runs_dir, prefix=f".tmp-{run_id}-"))
        os.chmod(staging, default_mode(directory=True))  # mkdtemp's 0700 would make the run private
        try:
            for name, content in files.items():
                if isinstance(content, bytes):
                    write_bytes_atomic(staging / name, content, fsync=True)
                else:
                    _write_text_atomic(staging / name, content)
            for name, source in (copies or {}).items():
                shutil.copyfile(source, staging / name)
            _write_text_atomic(staging / DONE_MARKER, _now() + "\n")
            self._swap_into_place(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return final

    def _swap_into_place(self, staging: Path, final: Path) -> None:
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(dir=self.runs_dir, prefix=f".old-{final.name}-"))
            os.replace(final, old / "run")
        try:
            os.replace(staging, final)
        except BaseException:
            if old is not None:  # put the previous run back rather than lose it
                os.replace(old / "run", final)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)

    @contextlib.contextmanager
    def _summary_lock(self) -> Iterator[None]:
        """Exclusive lock on a separate lock file (summary.csv itself gets replaced); see claims.py."""
        with claim(self.results_dir / "summary.csv.lock", "summary.csv"):
            yield

    def finished_since(self, run_id: str, since: float) -> bool:
        """Whether run ``run_id`` is complete and was stored at or after time ``since`` (time.time())."""
        done = self.run_dir(run_id) / DONE_MARKER
        return done.is_file() and done.stat().st_mtime >= since

    def claim(self, run_id: str, *, wait: bool = True) -> contextlib.AbstractContextManager[bool]:
        """The claim on computing run ``run_id`` (see claims.claim): check exists() inside it."""
        self.run_dir(run_id)  # validates the id
        return claim(self.results_dir / ".claims" / f"{run_id}.lock", f"run {run_id}", wait=wait)

    def append_summary(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Append `rows` to summary.csv atomically, under a lock shared by all processes.

        Columns: SUMMARY_COLUMNS first, then any other keys in sorted order; a new key adds a
        column (earlier rows get empty cells). None is written as an empty cell.
        """
        rows = [dict(r) for r in rows]
        if not rows:
            return
        with self._summary_lock():
            old_columns: list[str] = []
            old_rows: list[dict[str, str]] = []
            if self.summary_path.exists():
                with open(self.summary_path, newline="", encoding="utf-8") as fh:
                    reader = csv.DictReader(fh)
                    old_columns = list(reader.fieldnames or [])
                    old_rows = list(reader)
            known = set(SUMMARY_COLUMNS)
            extra = sorted(({k for r in rows for k in r} | set(old_columns)) - known)
            columns = [*SUMMARY_COLUMNS, *extra]
            buffer = io.StringIO()
            writer = csv.DictWriter(buffer, fieldnames=columns, restval="", lineterminator="\n")
            writer.writeheader()
            writer.writerows(old_rows)
            writer.writerows({k: ("" if v is None else v) for k, v in r.items()} for r in rows)
            _write_text_atomic(self.summary_path, buffer.getvalue())


def load_summary(results_dir: str | os.PathLike[str] = "results") -> pd.DataFrame:
    """summary.csv as a DataFrame (empty, with SUMMARY_COLUMNS, when there is none yet)."""
    import pandas as pd

    path = Path(results_dir) / "summary.csv"
    if not path.exists():
        return pd.DataFrame(columns=list(SUMMARY_COLUMNS))
    # Text columns pinned to str: a hex run id such as "1234e567..." would otherwise parse as a float.
    text = ("run_id", "model", "sparsifier", "placement", "comp", "granularity", "layer_k", "calib_task",
            "calib_statistic", "tac", "calib_compensation", "empty_rows", "calib_beyond", "task", "fewshot_sampler", "metric", "stats_scope",
            "git_commit", "phase", "timestamp")
    summary = pd.read_csv(path, dtype={c: str for c in text})
    for column in SUMMARY_COLUMNS:  # a store written before a column existed: the column, empty
        if column not in summary:
            summary[column] = None
    return summary

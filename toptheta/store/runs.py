"""The run store: one directory per run plus one summary CSV for all runs (what the pipeline writes).

Layout under `results_dir`:

    runs/<run_id>/config.json     the resolved run config (as given, ignored keys included)
    runs/<run_id>/lm_eval.json    lm-eval's results dict, without per-sample logs
    runs/<run_id>/samples.json.gz lm-eval's per-sample logs, gzipped (only when it produced them;
                                  see samples.py)
    runs/<run_id>/stats.json      sparsity statistics (kept fractions, ...)
    runs/<run_id>/meta.json       run_id, thresholds_ref, extra, git_commit, timestamp
    runs/<run_id>/invocation.json the command line, Hydra overrides and job (written by the pipeline)
    runs/<run_id>/thresholds.safetensors  a copy of the thresholds the run used (Top-θ runs); over 5 MB,
                                  thresholds.sampled.safetensors instead (every s-th row length, see
                                  threshold_copy.py)
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
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..atomic import default_mode, write_bytes_atomic, write_text_atomic
from .claims import claim
from .provenance import code_commit, now
from .rows import SUMMARY_COLUMNS
from .samples import SAMPLES_FILE, compress_json, dumps
from .threshold_copy import keep_copy

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

DONE_MARKER = "DONE"


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
        by name and source path (e.g. the thresholds the run used), so the run directory stands alone; a
        thresholds file over 5 MB is kept sampled (``threshold_copy.keep_copy``).

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
            "config.json": dumps(dict(config)),
            "lm_eval.json": dumps(results),
            "stats.json": dumps(dict(stats)),
            "meta.json": dumps(
                {
                    "run_id": run_id,
                    "thresholds_ref": thresholds_ref,
                    "extra": dict(extra or {}),
                    "git_commit": code_commit(),
                    "timestamp": now(),
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
                keep_copy(source, staging / name)  # sampled when over 5 MB: the store is tracked in git
            _write_text_atomic(staging / DONE_MARKER, now() + "\n")
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
    def summary_lock(self) -> Iterator[None]:
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
        with self.summary_lock():
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

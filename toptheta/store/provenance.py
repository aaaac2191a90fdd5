"""Provenance of a stored run: the commit of the code that ran it and when (meta.json, summary rows)."""

from __future__ import annotations

import datetime as dt
import functools
import os
import subprocess
from pathlib import Path


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


@functools.cache
def code_commit() -> str | None:
    """The commit of the code this process runs: :func:`git_commit` of this checkout when first asked, then the
    same answer. The pipeline asks when a run starts, so a run (or a Hydra multirun's later jobs, in the same
    process) still records the code it loaded when the checkout moves on under it (a pull while a sweep runs)."""
    return git_commit()


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")

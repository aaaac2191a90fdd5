"""Greedy decoding of prompts: one ``model.generate`` per prompt (the reference), in batches, or with shared prefixes.

``generate_all`` is what every generation task calls; ``decode_batch`` and ``share_prefix`` pick the fast paths of
``batched_generation`` and ``prefix_sharing``, which give the reference's tokens (see their docstrings for where
rounding may differ). Decoding happens inside the caller's ``toptheta.sparsify`` block, so prefill rows count kept
attention elements and every decode step counts kept V rows.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..attention.cache import growing_cache
from . import prefix_sharing
from .batched_generation import eos_ids, greedy_generate_batch
from .model_facts import pad_token_id


def encode_prompt(tokenizer, prompt: str, *, chat_template: bool = False) -> list[int]:
    """The prompt's token ids, wrapped in the tokenizer's chat template if asked and it has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def greedy_generate(model, tokenizer, prompt: str, *, max_new_tokens: int, chat_template: bool = False) -> tuple[str, int]:
    """Greedy continuation of ``prompt`` (chat-wrapped if asked); returns (text, prompt tokens)."""
    ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    return tokenizer.decode(_generate_ids(model, tokenizer, ids, max_new_tokens), skip_special_tokens=True), len(ids)


def _generate_ids(model, tokenizer, ids: list[int], max_new_tokens: int) -> list[int]:
    """The greedy continuation of the token ids ``ids`` through ``model.generate``: the reference path."""
    if max_new_tokens < 1:
        return []
    prompt = torch.tensor([ids], device=model.device)
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                         do_sample=False, num_beams=1, pad_token_id=pad_token_id(tokenizer),
                         cache=growing_cache(model))  # no re-concatenation of the whole cache per token
    return out[0, len(ids):].tolist()


def generate_all(model, tokenizer, prompts: list[str], *, max_new_tokens: int | list[int] | Callable[[int], int],
                 chat_template: bool, decode_batch: int = 1, share_prefix: bool = False, progress=None) -> list[dict]:
    """Greedy continuations of every prompt: ``{"text", "prompt_tokens", "seconds"}`` per prompt, in order.

    ``max_new_tokens``: one limit for all, one per prompt, or a function of a prompt's length in tokens (as the
    model sees it, chat template included), e.g. ``lambda n: max_length - n``. ``decode_batch`` > 1 decodes that
    many prompts together (``batched_generation``; prompts of similar length share a batch, and ``seconds`` is
    then the time from the batch's start to the sequence's end); 1 runs one ``model.generate`` per prompt, the
    reference. ``share_prefix`` runs the leading tokens prompts have in common once (``prefix_sharing``; one prompt
    at a time; ``seconds`` then counts from the call's start).
    """
    encoded = [encode_prompt(tokenizer, p, chat_template=chat_template) for p in prompts]
    if callable(max_new_tokens):
        limits = [max_new_tokens(len(ids)) for ids in encoded]
    elif isinstance(max_new_tokens, int):
        limits = [max_new_tokens] * len(prompts)
    else:
        limits = list(max_new_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(limits)} token limits")
    results: list[dict | None] = [None] * len(prompts)
    if share_prefix and decode_batch > 1:
        raise ValueError("share_prefix continues one prompt at a time: use decode_batch=1 with it")

    def record(i: int, tokens: list[int], t0: float) -> None:
        results[i] = {"text": tokenizer.decode(tokens, skip_special_tokens=True), "prompt_tokens": len(encoded[i]),
                      "seconds": round(time.time() - t0, 2)}
        if progress is not None:
            progress.update()
    if share_prefix:
        t0 = time.time()
        prefix_sharing.generate_shared(model, encoded, max_new_tokens=limits, pad_token_id=pad_token_id(tokenizer),
                        eos_token_ids=eos_ids(model, tokenizer), on_finish=lambda i, tokens: record(i, tokens, t0))
        return results
    if decode_batch <= 1:
        for i, ids in enumerate(encoded):
            t0 = time.time()
            record(i, _generate_ids(model, tokenizer, ids, limits[i]), t0)
        return results
    order = sorted(range(len(prompts)), key=lambda i: len(encoded[i]))  # little padding within a batch
    eos = eos_ids(model, tokenizer)
    for start in range(0, len(order), decode_batch):
        batch = order[start:start + decode_batch]
        t0 = time.time()

        def finish(j: int, tokens: list[int], batch=batch, t0=t0) -> None:
            record(batch[j], tokens, t0)

        greedy_generate_batch(model, [encoded[i] for i in batch], max_new_tokens=[limits[i] for i in batch],
                              pad_token_id=pad_token_id(tokenizer), eos_token_ids=eos, on_finish=finish)
    return results

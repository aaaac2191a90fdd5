"""Greedy generation of prompts that share prefixes: each shared prefix runs once.

Passkey prompts of one length with a shared filler (``passkey.py``) agree token for token up to where their keys
sit, so most of a prompt's prefill repeats the others'. ``generate_shared`` takes as its base the prompt that the
others share the most tokens with and runs the base's tokens once, in segments that end where some prompt's shared
part ends; then it continues each prompt from a copy of the cache cut at that point (``cache_prefix``): the
prompt's own remaining tokens, then greedy decoding (``batched_generation``'s loop at batch 1). A segment's
statistics count once per prompt that uses it (``SparsityStats.repeated``), so the run's statistics are those of
running every prompt whole.

The tokens are those of running each prompt whole where a row's bits do not depend on how a sequence is cut into
forwards: the one-pass prefill kernel (Top-θ, dense) sums each row in key order whatever its forward, and the
linear layers' GEMMs give a row the same bits in any forward of at least ``MIN_GEMM_ROWS`` rows
(``prefix_cache.py``), so every segment and every remainder is at least that long (a shared part is cut
shorter where needed). The plain kernel (Top-k) chunks rows per forward: a score within rounding of the k-th
may trade places. Sliding-window layers roll their cache and cannot be cut at a position: refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

import torch

from ..attention.cache import cache_prefix, growing_cache
from .batched_generation import greedy_generate_batch
from .model_facts import active_stats
from .prefix_cache import cached_forward, plan, run_prefix, track


@torch.inference_mode()
def generate_shared(model, prompt_ids: list[list[int]], *, max_new_tokens: list[int], pad_token_id: int,
                    eos_token_ids: set[int], on_finish=None, done: Collection[int] = ()) -> list[list[int]]:
    """Greedy continuations of each prompt, as ``greedy_generate_batch`` one prompt at a time, with shared prefixes
    run once. ``on_finish(i, tokens)`` is called as each prompt's generation ends.

    ``done``: prompts an earlier, interrupted call finished (their statistics, the shared segments' included, read
    back by the caller): they are not run (their continuations come back empty), and the shared segments the others
    need run again in the same segments, uncounted, so the others' tokens and counts are those of the whole call."""
    if len(prompt_ids) != len(max_new_tokens):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(max_new_tokens)} token limits")
    out: list[list[int]] = [[] for _ in prompt_ids]
    todo = [i for i, limit in enumerate(max_new_tokens) if limit > 0]  # a prompt with no token to make never runs
    for i in sorted(set(range(len(prompt_ids))) - set(todo) - set(done)):
        if on_finish is not None:
            on_finish(i, out[i])
    if not set(todo) - set(done):
        return out
    base, shared = plan([prompt_ids[i] for i in todo])  # the whole call's plan: its segments, whatever is done
    base_ids = prompt_ids[todo[base]]
    cache, stats = track(growing_cache(model)), active_stats(model)
    forward, start = cached_forward(model, cache), 0
    needed = max(s for j, s in enumerate(shared) if todo[j] not in done)  # the segments a prompt left still uses
    counted = set(done) & set(todo)  # a prompt that generated ran after every segment: they were counted then
    with stats.paused() if counted and stats is not None else contextlib.nullcontext():
        for end in sorted(set(shared) - {0}):  # the base's tokens, once, in segments ending where a shared part ends
            if end > needed:
                break
            run_prefix(forward, base_ids[:end], start=start, uses=sum(s >= end for s in shared), stats=stats)
            start = end
    for j, i in enumerate(todo):
        if i in done:
            continue
        own = cache_prefix(cache, shared[j]) if shared[j] else None
        out[i] = greedy_generate_batch(model, [prompt_ids[i][shared[j]:]], max_new_tokens=[max_new_tokens[i]],
                                       pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, cache=own)[0]
        if on_finish is not None:
            on_finish(i, out[i])
    return out

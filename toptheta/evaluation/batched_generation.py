"""Greedy decoding of several prompts at once: the fast path of ``greedy.greedy_generate``.

On CPU a decode step of a small model is bound by reading the weights, not by arithmetic: one step for 16
sequences costs little more than one step for one (Qwen2.5-Coder-0.5B, 2 cores: about 10× the tokens per
second at batch 16). ``greedy_generate_batch`` left-pads the prompts into one batch, runs the prompt forward
once, then one forward per step for the sequences still running. A sequence leaves the batch at its
end-of-sequence token or its token limit (its cache rows are dropped with ``batch_select_indices``), so no
step runs past a sequence's end and no sparsity statistic counts a row after it. Positions start at each
sequence's first real token, as ``model.generate`` numbers a left-padded prompt.

The plain path, one ``model.generate`` per prompt, stays the reference: at batch 1 the two take the same
tokens (tests/test_batched_generation.py). In a batch the linear layers' GEMMs have more rows, which BLAS
rounds differently, so at a near-tie a greedy token can differ from batch 1's; that is why a generation
task's ``decode_batch`` is part of its run id.
"""

from __future__ import annotations

import contextlib

import torch

from ..attention import decode
from ..attention.backend import decoding, is_sparsified
from ..attention.cache import cache_keyword, forward_accepts, growing_cache

# generation_config settings whose logits processors or stopping rules this loop does not apply: with any of
# them set, decode one prompt at a time through model.generate instead.
_UNSUPPORTED = {"repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,),
                "min_length": (None, 0), "min_new_tokens": (None, 0), "suppress_tokens": (None,),
                "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
                "sequence_bias": (None,), "stop_strings": (None,), "encoder_repetition_penalty": (None, 1.0)}


def unsupported_settings(model) -> list[str]:
    """The model's generation_config settings that this loop would ignore (empty: it decodes as generate does)."""
    gc = getattr(model, "generation_config", None)
    return [f"{k}={getattr(gc, k)!r}" for k, ok in _UNSUPPORTED.items() if gc is not None and getattr(gc, k, None) not in ok]


def eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a generation: the generation config's (one or a list), else the tokenizer's."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}


@torch.inference_mode()
def greedy_generate_batch(model, prompt_ids: list[list[int]], *, max_new_tokens: list[int], pad_token_id: int,
                          eos_token_ids: set[int], on_finish=None, stop_when=None, cache=None) -> list[list[int]]:
    """Greedy continuations (token ids, end-of-sequence token included) of each prompt, decoded together.

    ``max_new_tokens[i]`` bounds sequence i; ``stop_when(i, tokens)``, asked after each new token, ends it early
    (e.g. at a stop string). ``on_finish(i, tokens)`` is called as each sequence ends. ``cache``: a KV cache that
    already holds the first tokens of a single sequence (``prompt_ids`` then holds the tokens after them).
    """
    if len(prompt_ids) != len(max_new_tokens):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(max_new_tokens)} token limits")
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("every prompt needs at least one token")
    cached = 0 if cache is None else cache.get_seq_length()
    if cached and len(prompt_ids) != 1:
        raise ValueError("a cache that holds tokens already holds one sequence: continue one prompt at a time")
    B, L = len(prompt_ids), max(len(p) for p in prompt_ids)
    device = model.device
    ids = torch.full((B, L), pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompt_ids):  # left padding: every sequence's next token lands in the last column
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0) + cached  # (B, L): 0 at each sequence's first real token
    if cached:  # the mask covers the cached tokens too
        mask = torch.cat([mask.new_ones(B, cached), mask], dim=1)
    out: list[list[int]] = [[] for _ in range(B)]
    running = [i for i in range(B) if max_new_tokens[i] > 0]  # batch row r holds sequence running[r]
    for i in sorted(set(range(B)) - set(running)):
        _finished(on_finish, i, out[i])
    if not running:
        return out
    rows = torch.tensor(running, device=device)
    ids, mask, positions = ids[rows], mask[rows], positions[rows]
    cache = cache if cache is not None else growing_cache(model)
    decode.reset()  # running V sums belong to one generation's cache
    # Inside a sparsify block the steps after the prompt are decode steps (statistics, the decode fast path), as in
    # model.generate, which the backend recognises on its own; a hand-written loop says so.
    steps = (lambda: decoding(model)) if is_sparsified(model) else contextlib.nullcontext
    with_cache = {cache_keyword(model): cache}  # the forward's signature is read once, not per step
    trim = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                   **with_cache, **trim).logits[:, -1]  # (B, vocab)
    next_pos = positions[:, -1] + 1  # (B,)
    while True:
        tokens = logits.argmax(-1).tolist()
        keep = []
        for r, (i, t) in enumerate(zip(running, tokens)):
            out[i].append(t)
            if (t in eos_token_ids or len(out[i]) >= max_new_tokens[i]
                    or (stop_when is not None and stop_when(i, out[i]))):
                _finished(on_finish, i, out[i])
            else:
                keep.append(r)
        if not keep:
            return out
        step = torch.tensor(tokens, device=device)
        if len(keep) < len(running):  # finished sequences leave the batch and its cache
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            mask, next_pos, step = mask[index], next_pos[index], step[index]
            running = [running[r] for r in keep]
        mask = torch.cat([mask, mask.new_ones(len(running), 1)], dim=1)
        with steps():
            logits = model(input_ids=step[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                           use_cache=True, **with_cache).logits[:, -1]
        next_pos = next_pos + 1


def _finished(on_finish, i: int, tokens: list[int]) -> None:
    if on_finish is not None:
        on_finish(i, tokens)

"""Fast multiple-choice scoring for lm-eval: each context runs once, its choices scored from its cache.

lm-eval scores a multiple-choice question as one (context, continuation) request per answer choice, and HFLM runs
each request as its own forward over context + continuation. ``SharedContextHFLM`` (built on ``batched_lm``'s
``BatchedHFLM``, which left-pads batches with exact statistics) runs each distinct context once (contexts batched,
left-padded) with use_cache, then scores the continuations of all its choices from the cached keys and values:
packed back to back in one row per context, each attending to the context and to its own earlier tokens (a boolean
mask that also leaves padded query rows without keys; one continuation length per forward where such a mask cannot
be used). A continuation row's attention row over [context + continuation] keys is the row of the unshared run, so
Top-k and Top-θ decide as there, and it counts as a prefill row. The unshared run computes the context rows once
per forward, so the context forward's statistics are counted as many times as it has distinct forwards
(method.md §5: ratios comparable with the paper's).

On the one-pass prefill kernel (Top-θ and dense) a row has the same bits whether it runs alone, left-padded in a
batch or after a cached context, so every Top-θ decision is the unshared run's and the log-likelihoods differ only
by the LM head's rounding; elsewhere (Top-k, the plain kernel) summation orders differ, and a score within rounding
of the selection boundary may land on the other side. HFLM's semantics are kept as in ``BatchedHFLM``; requests
longer than max_length + 1 are truncated from the left and scored through the batched path.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from ..attention import prefill
from ..attention.cache import dropping_appends, growing_cache, grows, select_rows
from ..compat import cache_layers
from .batched_lm import (  # noqa: F401  (BatchedHFLM, check_decode_batch: importable from here, as before)
    BatchedHFLM,
    Request,
    ScoredInput,
    check_decode_batch,
    left_pad,
)
from .model_facts import active_stats, has_sliding_window
from .prefix_cache import MIN_GEMM_ROWS, move_padding_left, prefix_groups, run_prefix, track

if TYPE_CHECKING:
    from ..attention.stats import SparsityStats

# Continuation positions per forward (all their logits are kept: 512 × a 49k vocabulary = 100 MB).
LOGIT_BUDGET = 512


class SharedContextHFLM(BatchedHFLM):
    """HFLM that runs each distinct context once and scores its continuations from the cached keys/values.

    Usable from Python like HFLM: ``SharedContextHFLM(pretrained=model, tokenizer=tokenizer,
    batch_size="auto")``; inside ``toptheta.sparsify`` its statistics equal the unshared run's.
    ``batch_size`` counts contexts per forward. With ``prefix_cache`` (the default), contexts that share a long
    token prefix (few-shot prompts with fixed exemplars) run it once: see :meth:`_score_prefix_group`.
    """

    def __init__(self, *args, prefix_cache: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefix_cache = bool(prefix_cache)

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        fits = [len(c) + len(t) <= self.max_length + 1 for _, c, t in requests]
        with self._progress(requests, disable_tqdm) as bar:
            # Truncated requests lose the head of their context: nothing left to share, the batched path scores them.
            self._score_batched(requests, [i for i, ok in enumerate(fits) if not ok], answers, bar, override_bs)
            contexts = self._contexts(requests, [i for i, ok in enumerate(fits) if ok])
            stats = active_stats(self.model)
            if self.prefix_cache:
                keys = list(contexts)
                for shared, members in prefix_groups(keys):
                    group = [(keys[m], contexts.pop(keys[m])) for m in members]
                    self._score_prefix_group(requests, shared, group, stats, answers, bar, override_bs)
            for weight, batch in self._weighted_batches(list(contexts.items()), lambda item: len(item[0]), override_bs):
                self._score_contexts(requests, batch, weight, stats, answers, bar)
        return answers  # type: ignore[return-value]

    def _weighted_batches(self, items: list, length, override_bs: int | None = None):
        """(weight, batch): contexts of equal weight (their number of distinct forwards) share a batch, so one factor
        scales its statistics; longest first within a weight."""
        order = sorted(items, key=lambda item: (len(item[1]), -length(item), item[0]))
        groups: dict[int, list] = {}
        for item in order:
            groups.setdefault(len(item[1]), []).append(item)
        for weight, group in groups.items():
            for batch in self._batches(group, length, override_bs):
                yield weight, batch

    def _contexts(self, requests: list[Request], indices: list[int]) -> dict[tuple[int, ...], list[ScoredInput]]:
        """Distinct context ids -> the distinct inputs scored against them.

        An input shared by requests with different splits goes to the shortest context, whose
        continuation part covers every member's log-prob rows.
        """
        contexts: dict[tuple[int, ...], list[ScoredInput]] = {}
        for x in self._distinct_inputs(requests, indices):
            x.split = min(len(requests[i][1]) for i in x.members)
            contexts.setdefault(tuple(x.ids[:x.split]), []).append(x)
        return contexts

    def _score_contexts(self, requests, batch, weight: int, stats: SparsityStats | None, answers, bar) -> None:
        """One forward over a batch of contexts, then the continuations from its cache (a few forwards)."""
        ids, mask, pos = left_pad([list(context) for context, _ in batch], self.pad_id)
        with stats.repeated(weight) if stats is not None else contextlib.nullcontext():
            last, cache = self._forward(ids, mask, pos, logits_to_keep=1, cache=growing_cache(self.model),
                                        use_cache=True)  # (Bc, 1, V)
        self._score_continuations(requests, batch, last, cache, mask, pos, answers, bar)

    def _score_prefix_group(self, requests, shared: int, group, stats: SparsityStats | None, answers, bar,
                            override_bs: int | None = None) -> None:
        """Contexts whose first ``shared`` tokens agree: those tokens run once (counted once per distinct forward of
        every context in the group, as the unshared run computes them), then each context's own tokens run in
        batches on copies of the prefix's cache, then its continuations as in :meth:`_score_contexts`. The prefix's
        cache is dropped on return: memory holds one prefix at a time however many groups there are.

        Inside ``sparsify`` (and without sliding-window layers) a batch's own tokens are right-padded, with a mask
        whose padded query rows see no key; the cache is then re-padded on the left (``move_padding_left``), so the
        continuations follow their context directly, as in a left-padded batch of whole contexts. Elsewhere a batch
        holds contexts of one length only (no padding at all).
        """
        prefix = list(group[0][0][:shared])
        cache = track(growing_cache(self.model))
        uses = sum(len(inputs) for _, inputs in group)
        run_prefix(lambda i, m, p: self._forward(i, m, p, logits_to_keep=1, cache=cache, use_cache=True),
                   prefix, uses=uses, stats=stats)
        padded = stats is not None and not has_sliding_window(self.model)
        own = lambda item: len(item[0]) - shared  # noqa: E731  (the context's own tokens)
        for weight, batch in self._weighted_batches(group, own, override_bs):
            if padded:
                self._score_suffixes(requests, shared, cache, batch, weight, stats, answers, bar, padded=True)
                continue
            by_length: dict[int, list] = {}
            for item in batch:
                by_length.setdefault(own(item), []).append(item)
            for same in by_length.values():
                self._score_suffixes(requests, shared, cache, same, weight, stats, answers, bar, padded=False)

    def _score_suffixes(self, requests, shared: int, cache, batch, weight: int, stats, answers, bar,
                        padded: bool) -> None:
        """One forward of the contexts' own tokens after the cached prefix, then their continuations."""
        suffixes = [list(context[shared:]) for context, _ in batch]
        B = len(batch)
        lengths = torch.tensor([len(s) for s in suffixes])  # (B,)
        S = int(lengths.max())
        if padded:
            S = max(S, -(-MIN_GEMM_ROWS // B))  # enough GEMM rows; padded rows see no key and are never counted
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)  # (B, S): right-padded
        for b, tokens in enumerate(suffixes):
            ids[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        pos = (shared + torch.arange(S))[None].expand(B, S)
        rows = select_rows(cache, torch.zeros(B, dtype=torch.long, device=self.device), room=S)
        with stats.repeated(weight) if stats is not None else contextlib.nullcontext():
            if padded:
                real = torch.arange(S)[None, :] < lengths[:, None]  # (B, S)
                own = real[:, :, None] & real[:, None, :] & torch.ones(S, S, dtype=torch.bool).tril()  # (B, S, S)
                mask = torch.cat([real[:, :, None].expand(B, S, shared), own], dim=2)[:, None]  # (B, 1, S, P + S)
                wanted = sorted(set((lengths - 1).tolist()))
                logits = self._forward(ids, mask, pos, logits_to_keep=torch.tensor(wanted), cache=rows,
                                       use_cache=True)[0]  # (B, len(wanted), V)
                at = {w: j for j, w in enumerate(wanted)}
                last = torch.stack([logits[b, at[int(n) - 1]] for b, n in enumerate(lengths)])[:, None]  # (B, 1, V)
                rows = move_padding_left(rows, shared + lengths, shared + S, room=_continuation_room(batch))
                context_mask = (torch.arange(shared + S)[None, :] >= (S - lengths)[:, None]).long()  # (B, P + S)
            else:
                context_mask = torch.ones(B, shared + S, dtype=torch.long)
                last = self._forward(ids, context_mask, pos, logits_to_keep=1, cache=rows, use_cache=True)[0]
        context_pos = (context_mask.cumsum(1) - 1).clamp_min(0)
        self._score_continuations(requests, batch, last, rows, context_mask, context_pos, answers, bar)

    def _score_continuations(self, requests, batch, last, cache, mask, pos, answers, bar) -> None:
        """Score the continuations of a batch of contexts from ``cache`` (their keys and values, left-padded as
        ``mask`` (B, C) says, at positions ``pos``) and ``last``, each context's last logits (B, 1, V)."""
        rows = [(b, x) for b, (_, inputs) in enumerate(batch) for x in inputs]
        for b, x in rows:
            if len(x.ids) == x.split:  # a one-token continuation: the context's last logits are all it needs
                self._answer(requests, x, last[b], answers, bar)
        rows = [(b, x) for b, x in rows if len(x.ids) > x.split]
        # Packing a context's continuations into one row needs a custom mask whose padded query rows see no key:
        # only inside sparsify (the kernel gives such rows output 0 and never counts them), and only without
        # sliding-window layers (the mask replaces transformers' per-layer masks). Elsewhere: one length a forward.
        if active_stats(self.model) is not None and not has_sliding_window(self.model):
            packed: dict[int, list[ScoredInput]] = {}
            for b, x in rows:
                packed.setdefault(b, []).append(x)
            items = []
            for b, inputs in packed.items():
                # Packed, a continuation's keys sit after the earlier ones': they must fall in the same key block
                # of the kernel as they do unshared, or its online softmax would round differently (see below).
                if _packs_in_one_key_block(int(mask[b].sum()), sum(len(x.ids) - x.split for x in inputs)):
                    items.append((b, inputs))
                else:
                    items.extend((b, [x]) for x in inputs)
            for group in _groups(items, lambda item: sum(len(x.ids) - x.split for x in item[1])):
                self._score_packed(requests, group, last, cache, mask, pos, answers, bar, min_rows=MIN_GEMM_ROWS)
        else:
            rows.sort(key=lambda row: len(row[1].ids) - row[1].split)
            for group in _groups(rows, lambda row: len(row[1].ids) - row[1].split, same_size=True):
                self._score_packed(requests, [(b, [x]) for b, x in group], last, cache, mask, pos, answers, bar)

    def _score_packed(self, requests, group, last, cache, mask, pos, answers, bar, min_rows: int = 1) -> None:
        """One forward against the cached contexts: row n holds the continuations of one context back to back
        (right-padded to at least ``min_rows`` positions in all), each attending to the context and to its own
        earlier tokens only."""
        N = len(group)
        segments = [[x.ids[x.split:] for x in inputs] for _, inputs in group]
        P = max(max(sum(len(t) for t in seg) for seg in segments), -(-min_rows // N))
        ids = torch.full((N, P), self.pad_id, dtype=torch.long)  # (N, P)
        owner = torch.full((N, P), -1, dtype=torch.long)  # which continuation of the row a position holds
        offset = torch.zeros(N, P, dtype=torch.long)  # position inside that continuation
        for n, seg in enumerate(segments):
            start = 0
            for i, tokens in enumerate(seg):
                ids[n, start:start + len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                owner[n, start:start + len(tokens)] = i
                offset[n, start:start + len(tokens)] = torch.arange(len(tokens))
                start += len(tokens)
        select = torch.tensor([b for b, _ in group])
        cont_pos = pos[select, -1:] + 1 + offset  # (N, P): a continuation starts right after its context
        if len(segments[0]) == 1 and all(len(seg) == 1 and len(seg[0]) == P for seg in segments):
            # One continuation per row, all of one length: a plain mask, transformers builds the rest.
            cont_mask = torch.cat([mask[select], torch.ones_like(ids)], dim=1)  # (N, C + P)
        else:
            real = owner >= 0  # (N, P)
            own = (owner[:, :, None] == owner[:, None, :]) & torch.ones(P, P, dtype=torch.bool).tril()  # (N, P, P)
            context = mask[select].bool()[:, None, :].expand(-1, P, -1)  # (N, P, C)
            cont_mask = (torch.cat([context, own], dim=2) & real[:, :, None] & _pad(real, mask.shape[1]))[:, None]
        with _continuing(cache, select, P) as rows:
            logits = self._forward(ids, cont_mask, cont_pos, logits_to_keep=P, cache=rows)  # (N, P, V)
        for n, (b, inputs) in enumerate(group):
            start = 0
            for x in inputs:
                length = len(x.ids) - x.split
                self._answer(requests, x, torch.cat([last[b], logits[n, start:start + length]]), answers, bar)
                start += length


def _continuation_room(batch) -> int:
    """Positions the continuations of a batch of contexts append to its cache in one forward, at most."""
    return max(MIN_GEMM_ROWS, *(sum(len(x.ids) - x.split for x in inputs) for _, inputs in batch))


@contextlib.contextmanager
def _continuing(cache, select: torch.Tensor, room: int):
    """The cache a forward of continuations runs on: rows ``select`` of the contexts' ``cache``. When they are all
    its rows in order and its layers grow, ``cache`` itself, the continuations' keys dropped again on exit (written
    into its spare room: no copy); else a copy of those rows with room for them."""
    B = cache_layers(cache)[0].keys.shape[0]
    if select.tolist() == list(range(B)) and grows(cache):
        with dropping_appends(cache):
            yield cache
    else:
        yield select_rows(cache, select.to(cache_layers(cache)[0].keys.device), room=room)


def _packs_in_one_key_block(context: int, packed: int) -> bool:
    """Whether ``packed`` continuation positions after a context of ``context`` valid tokens stay inside the
    context's last key block of the prefill kernel, whose blocks start at a sequence's first valid key. Then
    each continuation row meets its keys in the same blocks as unshared (masked keys between add exact zeros),
    and the kernel gives it the same bits."""
    return context % prefill.KEY_BLOCK + packed <= prefill.KEY_BLOCK  # read at call time: tests vary it


def _pad(real: torch.Tensor, context: int) -> torch.Tensor:
    """(N, 1, C + P) key mask: every context key, and the continuation keys that are real tokens."""
    return torch.cat([torch.ones(real.shape[0], context, dtype=torch.bool), real], dim=1)[:, None, :]


def _groups(items: list, size, same_size: bool = False):
    """Consecutive items in forwards of at most LOGIT_BUDGET padded positions (every position's logits are
    kept, V floats each); with ``same_size``, a forward holds items of one size only."""
    group: list = []
    for item in items:
        n = size(item)
        fits = (len(group) + 1) * max(n, *(size(i) for i in group)) <= LOGIT_BUDGET if group else True
        if group and (not fits or (same_size and size(group[0]) != n)):
            yield group
            group = []
        group.append(item)
    if group:
        yield group

"""Fast multiple-choice scoring for lm-eval: padded batches with exact statistics, and each context run once.

lm-eval scores a multiple-choice question as one (context, continuation) request per answer choice, and
HFLM runs each request as its own forward over context + continuation. Two subclasses make that faster
with the same log-likelihoods, the same accuracy and the same sparsity statistics. On the one-pass prefill
kernel (Top-θ and dense) a row has the same bits whether it runs alone, left-padded in a batch or after a cached
context, so every Top-θ decision is the unshared run's and the log-likelihoods differ only by the LM head's
rounding; elsewhere (Top-k, the plain kernel) summation orders differ, and a score within rounding of the
selection boundary may land on the other side:

* ``BatchedHFLM`` batches requests with LEFT padding, an attention mask and explicit position ids. HFLM
  itself right-pads without a mask: harmless for the log-likelihoods of a causal model, but the padded
  query rows would be counted by the sparsity statistics. Left-padded rows attend to no valid key, so the
  kernel treats them as empty rows (output 0, never counted), and padded keys are masked for every row.
* ``SharedContextHFLM`` runs each distinct context once (contexts batched, left-padded) with use_cache,
  then scores the continuations of all its choices from the cached keys and values: packed back to back
  in one row per context, each attending to the context and to its own earlier tokens (a boolean mask
  that also leaves padded query rows without keys; one continuation length per forward where such a
  mask cannot be used). A continuation row's attention row over [context + continuation] keys is the
  row of the unshared run, so Top-k and Top-θ decide as there, and it counts as a prefill row. The
  unshared run computes the context rows once per forward, so the context forward's statistics are
  counted as many times as it has distinct forwards (method.md §5: ratios comparable with the paper's).

Both keep HFLM's semantics: identical inputs run once (HFLM's logits cache), requests longer than
max_length + 1 are truncated from the left (SharedContextHFLM scores those through the batched path),
answers come back in request order, and ``batch_size="auto"`` picks the largest batch within a token
budget on CPU (HFLM's probe on accelerators). Seq2seq models fall back to HFLM.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from ..attention.cache import cache_keyword, forward_accepts, growing_cache
from ..config import is_int
from .generation import pad_token_id
from .prefix_cache import MIN_GEMM_ROWS, move_padding_left, prefix_groups, repeat_rows, run_prefix, track

if TYPE_CHECKING:
    from toptheta.attention.stats import SparsityStats

Request = tuple[tuple[str, str] | None, list[int], list[int]]  # (strings or None, context ids, continuation ids)

# batch_size="auto" on CPU: padded tokens per forward. Memory is not the limit there (the logits are kept
# for the scored positions only); beyond a few thousand tokens per GEMM a larger batch is no faster.
CPU_TOKEN_BUDGET = 4096
# Continuation positions per forward (all their logits are kept: 512 × a 49k vocabulary = 100 MB).
LOGIT_BUDGET = 512


@dataclass
class _Input:
    """One distinct model input (HFLM's logits cache key) and the requests it answers."""

    ids: list[int]  # what the model sees: (context + continuation)[-(max_length + 1):][:-1]
    span: int = 0  # log-prob rows needed at the end of ids (the longest continuation among the members)
    members: list[int] = field(default_factory=list)  # request indices
    split: int = 0  # SharedContextHFLM: length of the context this input is scored against


def check_decode_batch(value) -> None:
    """BatchedHFLM's decode_batch: None (batch_size) or a positive int; anything else raises, naming the fix."""
    if value is not None and not is_int(value, 1):
        raise ValueError(f"decode_batch must be None (batch_size) or an int >= 1, got {value!r}: give the number of "
                         "generation requests to decode together, e.g. decode_batch=8, or leave it out")


class BatchedHFLM(HFLM):
    """HFLM whose loglikelihood requests run in left-padded batches with exact sparsity statistics.

    ``decode_batch`` (None: ``batch_size``, as HFLM) is the number of generate_until requests decoded together,
    so a long-context generation task can decode several documents at once while its scoring keeps its own
    batch size (greedy batches decode through ``batched_generation``; see ``_model_generate``).
    """

    def __init__(self, *args, decode_batch: int | None = None, **kwargs):
        check_decode_batch(decode_batch)
        super().__init__(*args, **kwargs)
        self.decode_batch = decode_batch

    def generate_until(self, requests, disable_tqdm: bool = False):
        if self.decode_batch is None:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        scoring_batch = self.batch_size_per_gpu  # HFLM's generate_until batches by self.batch_size
        self.batch_size_per_gpu = self.decode_batch
        try:
            return super().generate_until(requests, disable_tqdm=disable_tqdm)
        finally:
            self.batch_size_per_gpu = scoring_batch

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        if self.backend != "causal":
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        answers: list[tuple[float, bool] | None] = [None] * len(requests)
        with self._progress(requests, disable_tqdm) as bar:
            self._score_batched(requests, list(range(len(requests))), answers, bar, override_bs)
        return answers  # type: ignore[return-value]

    def tok_batch_encode(self, strings: list[str], padding_side: str = "left", left_truncate_len: int | None = None,
                         truncation: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """HFLM's, each string encoded as in a batch of one, then padded.

        HFLM decides whether to add a BOS token from the batch's first string alone (no BOS added when it starts
        with the BOS text), so a batch mixing contexts with and without the BOS text, as LongBench's head + tail
        truncation makes them, would encode some rows differently from batch 1.
        """
        if len(strings) <= 1 or self.backend != "causal":
            return super().tok_batch_encode(strings, padding_side, left_truncate_len, truncation)
        rows = [super(BatchedHFLM, self).tok_batch_encode([s], padding_side, left_truncate_len, truncation)[0][0]
                for s in strings]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=rows[0].dtype)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            span = slice(width - len(r), width) if padding_side == "left" else slice(0, len(r))
            ids[i, span], mask[i, span] = r, 1
        return ids, mask

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        """generate_until's batches: greedy ones decode through ``batched_generation``, the rest through HFLM.

        model.generate feeds a finished sequence padding until the batch's last one ends, and those rows would count
        in the sparsity statistics; here each sequence leaves the batch at its end token, its first stop string
        (checked as lm-eval's stopping criteria check it: in the decoded last tokens) or max_length. Batches of one,
        sampling and extra generation settings take HFLM's path (model.generate), the reference, with our growing
        KV cache (``attention/cache.py``: the same tokens; transformers' cache copies itself at every token).
        """
        from .batched_generation import eos_ids, greedy_generate_batch, unsupported_settings

        mask = generation_kwargs.get("attention_mask")
        greedy = not generation_kwargs.get("do_sample") and not generation_kwargs.get("temperature")
        if (context.shape[0] == 1 or not greedy or mask is None or self.backend != "causal"
                or set(generation_kwargs) - {"attention_mask", "do_sample", "temperature"}
                or unsupported_settings(self.model)):
            keyword = cache_keyword(self.model)
            if self.backend == "causal" and keyword not in generation_kwargs:
                generation_kwargs = {**generation_kwargs, keyword: growing_cache(self.model)}
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        B, L = context.shape
        prompts = [row[m.bool()].tolist() for row, m in zip(context.cpu(), mask.cpu())]
        lookback = {text: len(self.tokenizer.encode(text, add_special_tokens=False)) + 2 for text in stop}

        def stopped(i: int, tokens: list[int]) -> bool:
            return any(text in self.tokenizer.decode(tokens[-n:]) for text, n in lookback.items())

        outs = greedy_generate_batch(self.model, prompts, max_new_tokens=[max_length - L] * B, pad_token_id=self.pad_id,
                                     eos_token_ids=eos_ids(self.model, self.tokenizer), stop_when=stopped)
        full = torch.full((B, L + max(map(len, outs))), self.pad_id, dtype=context.dtype)  # (B, L + new)
        full[:, :L] = context.cpu()
        for i, tokens in enumerate(outs):
            full[i, L:L + len(tokens)] = torch.tensor(tokens, dtype=context.dtype)
        return full.to(context.device)

    # --- the plain batched path ------------------------------------------------------------------------
    def _score_batched(self, requests, indices, answers, bar, override_bs=None) -> None:
        inputs = self._distinct_inputs(requests, indices)
        inputs.sort(key=lambda x: (-len(x.ids), x.ids))  # longest first, like HFLM: little padding per batch
        for batch in self._batches(inputs, lambda x: len(x.ids), override_bs):
            ids, mask, pos = _left_pad([x.ids for x in batch], self.pad_id)
            keep = max(x.span for x in batch)
            logits = self._forward(ids, mask, pos, logits_to_keep=keep)  # (B, keep, V)
            for x, rows in zip(batch, logits):
                self._answer(requests, x, rows, answers, bar)

    def _distinct_inputs(self, requests: list[Request], indices: list[int]) -> list[_Input]:
        """HFLM's inputs, identical ones merged when the logits cache is on (HFLM runs those once too)."""
        inputs: dict[object, _Input] = {}
        for i in indices:
            _, context, continuation = requests[i]
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(f"request {i}: empty context/continuation or continuation longer than max_length")
            key = tuple(context + continuation[:-1]) if self.logits_cache else i
            x = inputs.setdefault(key, _Input((context + continuation)[-(self.max_length + 1):][:-1]))
            x.span = max(x.span, len(continuation))
            x.members.append(i)
        return list(inputs.values())

    def _answer(self, requests, x: _Input, rows: torch.Tensor, answers, bar) -> None:
        """Fill the answers of x's members from rows (≥ x.span, V): the logits at x's last positions."""
        logprobs = F.log_softmax(rows[-x.span:], dim=-1, dtype=self.softmax_dtype)  # (span, V)
        for i in x.members:
            request_str, _, continuation = requests[i]
            tokens = torch.tensor(continuation, dtype=torch.long, device=logprobs.device)
            lp = logprobs[-len(continuation):]
            greedy = bool((lp.argmax(-1) == tokens).all())
            answers[i] = (float(lp.gather(-1, tokens[:, None]).sum()), greedy)
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answers[i])
            bar.update(1)

    # --- batching and the forward ----------------------------------------------------------------------
    def _batches(self, items: list, length, override_bs: int | None = None):
        """Consecutive slices of items, each within the batch size (``auto``: within the token budget)."""
        start = 0
        while start < len(items):
            size = self._batch_size_for(length(items[start]), override_bs)
            yield items[start:start + size]
            start += size

    def _batch_size_for(self, padded_length: int, override_bs: int | None = None) -> int:
        if self.batch_size != "auto":
            return int(self.batch_size)
        if override_bs:
            return int(override_bs)
        if self.device.type == "cpu":
            return max(1, min(self.max_batch_size, CPU_TOKEN_BUDGET // max(1, padded_length)))
        if "auto" not in self.batch_sizes:  # accelerators: HFLM's out-of-memory probe, once per instance
            self.batch_sizes["auto"] = self._detect_batch_size()
        return self.batch_sizes["auto"]

    def _detect_batch_size(self, requests=None, pos: int = 0) -> int:
        """HFLM probes max_batch_size × max_length forwards until one fits: on CPU that means minutes of
        swapping instead of an out-of-memory error, so the CPU answer is the token budget's."""
        if self.device.type == "cpu":
            return max(1, min(self.max_batch_size, CPU_TOKEN_BUDGET // self.max_length))
        from ..attention.backend import statistics_paused

        with statistics_paused(self.model):  # the probe's forwards are not evaluated requests: never counted
            return super()._detect_batch_size(requests, pos)

    def _forward(self, ids, mask, pos, *, logits_to_keep: int | torch.Tensor, cache=None, use_cache: bool = False):
        """Logits (B, logits_to_keep, V) of the last positions, or of the positions a 1-D tensor ``logits_to_keep``
        names (and the cache when use_cache)."""
        kwargs = dict(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                      position_ids=pos.to(self.device), use_cache=use_cache)
        if cache is not None:
            kwargs[cache_keyword(self.model)] = cache
        trims = forward_accepts(self.model, "logits_to_keep")
        if trims:
            kwargs["logits_to_keep"] = logits_to_keep.to(self.device) if torch.is_tensor(logits_to_keep) else logits_to_keep
        with torch.no_grad(), torch.autocast(device_type=self.device.type, dtype=self.mixed_precision_dtype,
                                             enabled=self.mixed_precision_dtype is not None):
            out = self.model(**kwargs)
        if trims:
            logits = out.logits
        else:
            logits = out.logits[:, logits_to_keep] if torch.is_tensor(logits_to_keep) else out.logits[:, -logits_to_keep:]
        return (logits, _output_cache(out)) if use_cache else logits

    @property
    def pad_id(self) -> int:
        return pad_token_id(self.tokenizer)

    @contextlib.contextmanager
    def _progress(self, requests, disable_tqdm: bool):
        bar = tqdm(total=len(requests), disable=(disable_tqdm or (self.rank != 0)),
                   desc="Running loglikelihood requests")
        try:
            yield bar
        finally:
            bar.close()


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

    def _contexts(self, requests: list[Request], indices: list[int]) -> dict[tuple[int, ...], list[_Input]]:
        """Distinct context ids -> the distinct inputs scored against them.

        An input shared by requests with different splits goes to the shortest context, whose
        continuation part covers every member's log-prob rows.
        """
        contexts: dict[tuple[int, ...], list[_Input]] = {}
        for x in self._distinct_inputs(requests, indices):
            x.split = min(len(requests[i][1]) for i in x.members)
            contexts.setdefault(tuple(x.ids[:x.split]), []).append(x)
        return contexts

    def _score_contexts(self, requests, batch, weight: int, stats: SparsityStats | None, answers, bar) -> None:
        """One forward over a batch of contexts, then the continuations from its cache (a few forwards)."""
        ids, mask, pos = _left_pad([list(context) for context, _ in batch], self.pad_id)
        with stats.repeated(weight) if stats is not None else contextlib.nullcontext():
            last, cache = self._forward(ids, mask, pos, logits_to_keep=1, use_cache=True)  # (Bc, 1, V)
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
        padded = stats is not None and not _has_sliding_window(self.model)
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
        rows = repeat_rows(cache, torch.zeros(B, dtype=torch.long, device=self.device))
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
                move_padding_left(rows, (shared + lengths).to(self.device), shared + S)
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
        if active_stats(self.model) is not None and not _has_sliding_window(self.model):
            packed: dict[int, list[_Input]] = {}
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
        logits = self._forward(ids, cont_mask, cont_pos, logits_to_keep=P,
                               cache=repeat_rows(cache, select.to(self.device)))  # (N, P, V)
        for n, (b, inputs) in enumerate(group):
            start = 0
            for x in inputs:
                length = len(x.ids) - x.split
                self._answer(requests, x, torch.cat([last[b], logits[n, start:start + length]]), answers, bar)
                start += length


def _packs_in_one_key_block(context: int, packed: int) -> bool:
    """Whether ``packed`` continuation positions after a context of ``context`` valid tokens stay inside the
    context's last key block of the prefill kernel, whose blocks start at a sequence's first valid key. Then
    each continuation row meets its keys in the same blocks as unshared (masked keys between add exact zeros),
    and the kernel gives it the same bits."""
    from toptheta.attention.prefill import KEY_BLOCK

    return context % KEY_BLOCK + packed <= KEY_BLOCK


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


# --- transformers details, in one place ----------------------------------------------------------------

def active_stats(model) -> SparsityStats | None:
    """The statistics of the ``toptheta.sparsify`` block ``model`` is in (None outside one, or when off)."""
    from toptheta.attention import backend

    modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    session = backend._SESSIONS.get(modules[0]) if modules else None
    return session.stats if session is not None and session.stats.enabled else None


def _has_sliding_window(model) -> bool:
    """Whether some layer of ``model`` attends within a sliding window (transformers masks those itself)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return any("sliding" in str(t) for t in layer_types)
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def _left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids), each (B, L): padding on the left, positions 0.. per sequence."""
    L = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), L, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, L - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[b, L - len(s):] = 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    return ids, mask, pos


def _output_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values

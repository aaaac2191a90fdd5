"""lm-eval's HFLM with loglikelihood requests in LEFT-padded batches and exact sparsity statistics.

HFLM runs each (context, continuation) request as its own forward, and when it batches them it right-pads
without an attention mask: harmless for the log-likelihoods of a causal model, but the padded query rows would
be counted by the sparsity statistics. ``BatchedHFLM`` batches requests with left padding, an attention mask and
explicit position ids. Left-padded rows attend to no valid key, so the kernel treats them as empty rows (output 0,
never counted), and padded keys are masked for every row. On the one-pass prefill kernel (Top-θ and dense) a row
has the same bits alone or in a padded batch, so every Top-θ decision is the unbatched run's; elsewhere (Top-k,
the plain kernel) summation orders differ, and a score within rounding of the selection boundary may land on the
other side.

It keeps HFLM's semantics: identical inputs run once (HFLM's logits cache), requests longer than max_length + 1
are truncated from the left, answers come back in request order, and ``batch_size="auto"`` picks the largest
batch within a token budget on CPU (HFLM's probe on accelerators). Greedy generate_until batches decode through
``batched_generation``. Seq2seq models fall back to HFLM. ``shared_context_lm.SharedContextHFLM`` builds on it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from ..attention.backend import statistics_paused
from ..attention.cache import cache_keyword, forward_accepts, growing_cache
from ..config import is_int
from .batched_generation import eos_ids, greedy_generate_batch, unsupported_settings
from .model_facts import pad_token_id

Request = tuple[tuple[str, str] | None, list[int], list[int]]  # (strings or None, context ids, continuation ids)

# batch_size="auto" on CPU: padded tokens per forward. Memory is not the limit there (the logits are kept
# for the scored positions only); beyond a few thousand tokens per GEMM a larger batch is no faster.
CPU_TOKEN_BUDGET = 4096


@dataclass
class ScoredInput:
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
            ids, mask, pos = left_pad([x.ids for x in batch], self.pad_id)
            keep = max(x.span for x in batch)
            logits = self._forward(ids, mask, pos, logits_to_keep=keep)  # (B, keep, V)
            for x, rows in zip(batch, logits):
                self._answer(requests, x, rows, answers, bar)

    def _distinct_inputs(self, requests: list[Request], indices: list[int]) -> list[ScoredInput]:
        """HFLM's inputs, identical ones merged when the logits cache is on (HFLM runs those once too)."""
        inputs: dict[object, ScoredInput] = {}
        for i in indices:
            _, context, continuation = requests[i]
            if not context or not continuation or len(continuation) > self.max_length:
                raise ValueError(f"request {i}: empty context/continuation or continuation longer than max_length")
            key = tuple(context + continuation[:-1]) if self.logits_cache else i
            x = inputs.setdefault(key, ScoredInput((context + continuation)[-(self.max_length + 1):][:-1]))
            x.span = max(x.span, len(continuation))
            x.members.append(i)
        return list(inputs.values())

    def _answer(self, requests, x: ScoredInput, rows: torch.Tensor, answers, bar) -> None:
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


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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

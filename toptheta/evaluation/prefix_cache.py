"""A prefix cache across requests: leading tokens that sequences share run once, the rest from their keys and values.

Few-shot prompts with fixed exemplars (lm-eval's ``first_n`` sampler) agree token for token on their exemplars,
often hundreds of tokens; passkey prompts with one filler per length agree up to where their keys sit. Both run
the shared tokens once (with sparsification active, counted once per sequence that uses them, as running every
sequence whole counts them) and continue each sequence from the cached keys and values:

* multiple-choice scoring (``shared_context_lm.SharedContextHFLM``) groups its contexts by their longest common
  token prefix (:func:`prefix_groups`), runs each group's prefix once (:func:`run_prefix`), then its contexts'
  own tokens in batches on copies of that cache (``attention.cache.select_rows``); the group's cache is dropped
  before the next group's prefix runs, so memory holds one prefix at a time whatever the number of groups;
* generation (``prefix_sharing.generate_shared``) takes a base prompt (:func:`plan`) and runs its tokens once in
  segments that end where some prompt's shared part ends (:func:`run_prefix` again), then continues each prompt
  from a copy of the cache cut at its shared length (``attention.cache.cache_prefix``).

Prefixes are found on the token ids, never on text, so they are exact whatever the tokenizer does at text
boundaries. A row's bits do not depend on how its sequence is cut into forwards on the one-pass prefill kernel
(Top-θ, dense: each row summed in key order, key blocks anchored at the sequence's first valid key) as long as
each forward has at least ``MIN_GEMM_ROWS`` rows (the linear layers' GEMMs round a row alike in any forward that
long); Top-k's plain kernel chunks rows per forward, so a score within rounding of its k-th may trade places.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from ..attention.cache import cache_keyword, forward_accepts, growing_cache, select_rows
from ..compat import cache_layers

# Positions per forward, at least (padding positions see no key and are never counted). MKL's float32 GEMM rounds a
# row differently when it multiplies fewer rows (measured here, 2 threads: fewer than 12 rows change the results;
# 1 thread: fewer than 4); a Top-θ decision within rounding of θ would then flip.
MIN_GEMM_ROWS = 16
# A shared prefix shorter than this is not worth a forward of its own (zero-shot prompts share a few template
# tokens; random exemplars share none): such contexts run whole, as without the cache.
MIN_PREFIX = 64

_LIVE: "weakref.WeakSet[object]" = weakref.WeakSet()  # prefix caches noted by track() still referenced somewhere


def common_prefix(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = (torch.as_tensor(a[:n]) != torch.as_tensor(b[:n])).nonzero()
    return int(differ[0]) if len(differ) else n


def prefix_groups(sequences: list[tuple[int, ...]], *, min_prefix: int = MIN_PREFIX,
                  keep: int = 1) -> list[tuple[int, list[int]]]:
    """Groups of sequences that share a long prefix: ``[(prefix length, [indices into sequences]), ...]``.

    Sequences are sorted by their tokens, so a group is a run of neighbours; its prefix is the longest common
    prefix of its members, cut so that each member keeps at least ``keep`` tokens of its own. Runs are chosen to
    save the most tokens (a group of m members with a prefix of p tokens saves (m − 1)·p): a run is split at its
    weakest link when its two sides save more apart, so one question that shares only the template with a group of
    fixed-exemplar prompts does not shorten their prefix to the template. Prefixes shorter than ``min_prefix``
    are not shared, and sequences in no group of two or more are left out.
    """
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    if len(order) < 2:
        return []
    # links[j]: tokens the j-th and (j+1)-th sorted sequences can share
    links = [min(common_prefix(sequences[a], sequences[b]), len(sequences[a]) - keep, len(sequences[b]) - keep)
             for a, b in zip(order, order[1:])]
    best: dict[tuple[int, int], tuple[int, list[tuple[int, int, int]]]] = {}  # (lo, hi) -> (saved, [(p, lo, hi)])
    todo, visit = [(0, len(order) - 1)], []
    while todo:  # children before parents, without recursion (a run may be thousands of sequences long)
        lo, hi = todo.pop()
        visit.append((lo, hi))
        if hi > lo:
            j = min(range(lo, hi), key=links.__getitem__)
            todo += [(lo, j), (j + 1, hi)]
    for lo, hi in reversed(visit):
        if hi == lo:
            best[lo, hi] = (0, [])
            continue
        j = min(range(lo, hi), key=links.__getitem__)
        whole = (hi - lo) * links[j] if links[j] >= min_prefix else -1
        left, right = best.pop((lo, j)), best.pop((j + 1, hi))
        apart = (left[0] + right[0], left[1] + right[1])
        best[lo, hi] = (whole, [(links[j], lo, hi)]) if whole >= apart[0] else apart
    return [(p, [order[j] for j in range(lo, hi + 1)]) for p, lo, hi in best[0, len(order) - 1][1]]


def _cuts(shared: list[int], min_rows: int) -> list[int]:
    """Each sequence's shared length snapped down to segment ends at least ``min_rows`` apart (0: nothing shared)."""
    ends, last = [], 0
    for s in sorted(set(shared)):
        if s - last >= min_rows:
            ends.append(s)
            last = s
    return [max((e for e in ends if e <= s), default=0) for s in shared]


def plan(prompts: list[list[int]], min_rows: int = MIN_GEMM_ROWS) -> tuple[int, list[int]]:
    """(base, shared): the prompt the others share most with, and how many leading tokens of each prompt come
    from the base's cache. Each prompt keeps at least ``min_rows`` tokens of its own, and segment ends (the
    distinct shared lengths) lie at least ``min_rows`` apart."""
    best = (-1, 0, [0] * len(prompts))
    for b, base in enumerate(prompts):
        shared = _cuts([max(0, min(common_prefix(p, base), len(p) - min_rows)) for p in prompts], min_rows)
        if sum(shared) > best[0]:
            best = (sum(shared), b, shared)
    return best[1], best[2]


def run_prefix(forward, ids: list[int], *, start: int = 0, uses: int = 1, stats=None):
    """``forward(ids, mask, positions)`` on ``ids[start:]`` (one sequence, positions ``start``.., the first ``start``
    already in the caller's cache), its statistics counted ``uses`` times: once per sequence that shares it."""
    with stats.repeated(uses) if stats is not None else contextlib.nullcontext():
        return forward(torch.tensor([ids[start:]], dtype=torch.long), torch.ones(1, len(ids), dtype=torch.long),
                       torch.arange(start, len(ids))[None])


def cached_forward(model, cache):
    """``forward(ids, mask, positions)`` for :func:`run_prefix`: ``model`` on those tokens after what ``cache`` holds,
    appending to it, logits of the last position only (where the model allows)."""
    keyword = cache_keyword(model)
    trim = {"logits_to_keep": 1} if forward_accepts(model, "logits_to_keep") else {}
    device = next(model.parameters()).device
    return lambda ids, mask, pos: model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                        position_ids=pos.to(device), use_cache=True, **{keyword: cache}, **trim)


def run_shared(model, sequences: list[list[int]], repeated, done=None, *, skip_units: int = 0,
               unit_done=None) -> int:
    """Forwards of ``model`` over ``sequences`` (token id lists, one at a time) that run shared tokens once; returns
    the tokens run. What the forwards record (calibration sums, sparsity statistics) must be counted once per
    sequence: ``repeated(uses)`` is a context manager (``Collector.repeated``, ``SparsityStats.repeated``) around
    each forward, ``uses`` the number of sequences it runs for; ``done()`` is called once per sequence finished.

    Sequences are grouped by their longest common prefix (:func:`prefix_groups`); a group's prefix runs once, then
    its members' own tokens are grouped again and run from copies of that cache, down to single sequences. Every
    forward holds at least ``MIN_GEMM_ROWS`` rows, so the linear layers round each row as one forward of the
    whole sequence does; attention kernels that chunk rows per forward (the plain kernel) may still sum a row in
    another order, so a statistic equals the unshared one to float rounding (exactly, for counts).

    The top level is a list of units, each independent of the others: a group of sequences that share a prefix, or
    one sequence in no group. ``unit_done(units finished, tokens run so far)`` is called after each; a resumed run
    (``calibrate(progress_file=...)``) passes ``skip_units`` to leave out the units a saved state already holds, and
    runs the others exactly as the whole run would.
    """
    device = next(model.parameters()).device
    tokens_run = 0

    def forward(ids: list[int], start: int, cache, uses: int):
        nonlocal tokens_run
        tokens_run += len(ids) - start
        own = select_rows(cache, torch.zeros(1, dtype=torch.long, device=device), room=len(ids) - start) \
            if cache is not None else growing_cache(model)
        with repeated(uses):
            run_prefix(cached_forward(model, own), ids, start=start)
        return own

    def units(members: list[int], start: int) -> list[tuple[list[int], int]]:
        """(members, shared tokens) per unit: each group of ``members`` sharing a prefix past ``start``, then each
        member in no group (shared = 0), in the order they run."""
        rest = [tuple(sequences[i][start:]) for i in members]
        groups = [([members[j] for j in group], shared)
                  for shared, group in prefix_groups(rest, min_prefix=MIN_GEMM_ROWS, keep=MIN_GEMM_ROWS)]
        grouped = {i for indices, _ in groups for i in indices}
        return groups + [([i], 0) for i in members if i not in grouped]

    def run(indices: list[int], shared: int, start: int, cache) -> None:  # the first ``start`` tokens are in ``cache``
        if not shared:  # one sequence
            forward(sequences[indices[0]], start, cache, 1)
            if done is not None:
                done()
            return
        cache = forward(sequences[indices[0]][:start + shared], start, cache, len(indices))
        for members, more in units(indices, start + shared):
            run(members, more, start + shared, cache)

    with torch.no_grad():
        for number, (indices, shared) in enumerate(units(list(range(len(sequences))), 0), 1):
            if number <= skip_units:
                continue
            run(indices, shared, 0, None)
            if unit_done is not None:
                unit_done(number, tokens_run)
    return tokens_run


def track(cache):
    """Note a prefix cache, so :func:`live_prefixes` can tell whether it is still held."""
    _LIVE.add(cache)
    return cache


def live_prefixes() -> int:
    """How many prefix caches noted by :func:`track` are still alive (the memory bound's test reads it)."""
    return len(_LIVE)


def move_padding_left(cache, lengths: torch.Tensor, width: int, room: int = 0):
    """A copy of ``cache``, whose rows are right-padded (row b: its first ``lengths[b]`` of ``width`` positions
    valid, every layer holding all ``width``), laid out left-padded instead, with room for ``room`` more positions:
    the valid positions end at the last one, as a left-padded batch's context would, so later tokens follow their
    context directly and the prefill kernel anchors its key blocks where running the sequence whole would."""
    for layer in cache_layers(cache):
        if layer.keys.shape[-2] != width:
            raise ValueError(f"a cache layer holds {layer.keys.shape[-2]} positions, not {width}: cannot re-pad it")
    return select_rows(cache, torch.arange(len(lengths)), room=room, ends=lengths)

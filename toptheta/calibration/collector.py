"""Streaming calibration: the observer that turns attention rows into running sums (method.md §2.2).

``toptheta.sparsify(..., observer=collector)`` calls the collector with every chunk of attention
rows of every layer. The collector

1. keeps the rows the paper calibrates on: rows with n > k (shorter rows are kept whole at run
   time, method.md §1), of the requested phases, no longer than ``max_n``;
2. samples them: each eligible row survives with probability ``sample_frac``, drawn from a
   ``torch.Generator`` seeded by ``seed`` (the reference code ignored the fraction, method.md §9.3);
   a row is sampled for all heads at once;
3. scatter-adds their statistics into float64 sums indexed by (layer, head, key), vectorised over
   rows, so the memory depends on the number of keys, never on the number of rows seen.

Each layer's sums live on the device of that layer's rows (a model split over GPUs by
``device_map="auto"`` keeps every layer's statistics beside it) and meet on the CPU only in
``reduce``. On the CPU, which rows to use is decided on the host from their lengths (free there), and only
the sampled rows are scored. On any other device (or with ``device_path=True``) nothing inside a layer call
reads a tensor on the host: the choice stays a device mask, every row of the chunk is scored and the rows not
chosen add exactly 0, the row counters are device tensors, and the tables are sized from the chunk's key window
(a bound on n known from shapes); ``reduce`` reads everything once. Both paths give the same thresholds: the same
rows add the same values in the same order (a +0.0 changes no float64 sum), and the output tables have the
width the host path would give them. One difference: with ``sample_frac < 1`` the device path draws a chunk's
random numbers whenever its window is longer than k, the host path only when some row of it is eligible; the
draws (and so the samples) are the same wherever these agree, e.g. for unpadded sequences without ``max_n``.

The key is the row length n (:class:`OrderStatCollector`) or a bucket of row lengths
(``target_k.TargetKCollector``). Prefill row i and the decode step with KV length i + 1 share key
n = i + 1 (method.md §2.1, §2.4).

Every collector also measures the statistic calibrated SDC needs (method.md §3.1, pre-softmax only):
the mean over sampled rows of the dropped exponent mass Σ_{j dropped} exp(s_j − m). Our dropped set
is the complement of the row's exact top-k. [R] used the complement of a *running* θ in mode 0; the
calibrated θ is built to approximate the top-k set, so the top-k complement is the mass a good θ
drops, without the running estimate's dependence on sample order.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..sparsifiers.base import RowBlock, check_placement
from ..thresholds.table import GRANULARITIES

PHASES = ("prefill", "decode")
GROWTH = 1.25  # a table that must widen is reallocated this many times wider than asked (Collector._ensure) ...
MIN_ROOM = 64  # ... and at least this many keys wider


class SampledRows:
    """The sampled rows of one chunk as (R, H, Q', K) tensors: R·Q' rows, each with all H heads.

    The usual prefill case (whole rows from the first long row to the last) is a slice, so the
    scores are not copied; scattered samples are gathered into R = 1 row block. With
    ``topk_keep`` the chunk's keep-mask is the exact top-k (TAC), so the order statistics come from
    it instead of a second top-k: τ's index straight from the selection (``RowBlock.next_index``, which
    ``TopK.select`` finds in its one top-k call when the collector asks), else from one pass over the
    keys outside the mask.
    """

    def __init__(self, rows: RowBlock, pick: torch.Tensor, n: torch.Tensor, k: int, topk_keep: bool = False,
                 keep: torch.Tensor | None = None):
        self.k = k
        q = pick.any(0).nonzero().flatten()  # pick, n: (B, Q) on the CPU; the rows stay on their device
        q0, q1 = int(q[0]), int(q[-1]) + 1
        if bool(pick[:, q0:q1].all()):
            take = lambda t: t[:, :, q0:q1]  # noqa: E731
        else:
            b, q = pick.nonzero(as_tuple=True)
            take = lambda t: t[b, :, q].transpose(0, 1)[None]  # noqa: E731  (S, H, ...) -> (1, H, S, ...)
        self._rows, self._take = rows, take
        self.n = take(n[:, None])[:, 0]  # (R, Q') on the CPU
        self.logits = take(rows.logits)  # (R, H, Q', K)
        mask = rows.keep if topk_keep else keep  # the forward's keep-mask (TAC) or the collector's budget rule's
        self.keep = take(mask) if mask is not None else None  # (R, H, Q', K)
        self.next = take(rows.next_index) if topk_keep and self.keep is not None and rows.next_index is not None \
            else None
        self._top: torch.Tensor | None = None
        self._chosen: torch.Tensor | None = None  # (R·Q', 1) bool: the rows that count (device path), None: all

    @classmethod
    def whole(cls, rows: RowBlock, pick: torch.Tensor, n: torch.Tensor, k: int, topk_keep: bool = False,
              keep: torch.Tensor | None = None) -> "SampledRows":
        """Every row of the chunk (R = B, Q' = Q), with ``pick`` (B, Q) marking those that count: ``per_row``
        gives 0 for the others. Nothing is read on the host (the collector's device path)."""
        self = cls.__new__(cls)
        self.k, self._rows, self._take = k, rows, lambda t: t  # noqa: E731
        self.n, self.logits = n, rows.logits  # (B, Q), (B, H, Q, K)
        self.keep = rows.keep if topk_keep else keep
        self.next = rows.next_index if topk_keep and self.keep is not None else None
        self._top = None
        self._chosen = pick.reshape(-1, 1)
        return self

    @functools.cached_property
    def exp_scores(self) -> torch.Tensor:
        """exp(s − m) of the sampled rows (R, H, Q', K), 0 where invalid."""
        return self._take(self._rows.exp_scores)

    @functools.cached_property
    def row_max(self) -> torch.Tensor:
        """(R, H, Q', 1) max valid logit."""
        return self._take(self._rows.row_max)

    @functools.cached_property
    def row_sum(self) -> torch.Tensor:
        """(R, H, Q', 1) Σ exp(s − m), the dense softmax denominator."""
        return self._take(self._rows.row_sum)

    @functools.cached_property
    def probs(self) -> torch.Tensor:
        """The kernel's dense probabilities of the sampled rows (R, H, Q', K): the very values inference compares."""
        return self._take(self._rows.probs)

    def per_row(self, t: torch.Tensor) -> torch.Tensor:
        """(R, H, Q', ...) -> (R·Q', H, ...), rows in the order of ``n.flatten()``; 0 for rows that do not count."""
        return self.chosen(t.transpose(1, 2).flatten(0, 1))

    @functools.cached_property
    def drops(self) -> torch.Tensor:
        """(R·Q', H) bool: the (row, head) pairs whose keep-mask leaves out a valid key, so they have a τ (a budget
        rule keeps some heads' rows whole); False for rows that do not count."""
        left_out = (~self.keep & (self.logits > float("-inf"))).any(-1)  # invalid keys hold −inf
        return self.per_row(left_out)

    def per_head(self, t: torch.Tensor, budget: bool) -> torch.Tensor:
        """``per_row(t)`` (R·Q', H), and with a budget rule (``budget``) 0 where a head keeps its row whole: its τ
        (the largest score outside a mask holding every valid key) means nothing there."""
        t = self.per_row(t)
        return torch.where(self.drops, t, t.new_zeros(())) if budget else t

    def row_mask(self) -> torch.Tensor | None:
        """(R, 1, Q') bool: the rows that count (``whole``), or None: every row."""
        return None if self._chosen is None else self._chosen.view(self.n.shape[0], 1, -1)

    def chosen(self, t: torch.Tensor) -> torch.Tensor:
        """t (R·Q', H, ...) with 0 where a row does not count (``whole``); t itself otherwise."""
        if self._chosen is None:
            return t
        return torch.where(self._chosen.view(-1, *[1] * (t.dim() - 1)), t, t.new_zeros(()))

    @property
    def top_indices(self) -> torch.Tensor:
        """Indices of the k + 1 largest logits of each row (R, H, Q', k + 1), largest first."""
        if self._top is None:  # logits order keys like probabilities without underflow ties
            self._top = torch.topk(self.logits, self.k + 1, dim=-1).indices
        return self._top

    def scores(self, placement: str) -> torch.Tensor:
        """Scaled logits (pre) or probabilities (post), exactly as the kernel's ``RowBlock.scores``."""
        return self.logits if placement == "pre" else self.probs

    def tau(self, placement: str) -> torch.Tensor:
        """The (k + 1)-th largest score of each row (R, H, Q'): ``RowBlock.kth_largest(k + 1, placement)``."""
        if self.next is not None:  # found by the TAC selection itself (TopK.select under want_next)
            idx = self.next
        elif self.keep is not None:  # the largest score outside the top-k (invalid keys hold −inf)
            idx = self.logits.masked_fill(self.keep, float("-inf")).argmax(-1, keepdim=True)
        else:
            idx = self.top_indices[..., -1:]
        if placement == "pre":
            return self.logits.gather(-1, idx).squeeze(-1)
        return self.probs.gather(-1, idx).squeeze(-1)

    def dropped_mass(self) -> torch.Tensor:
        """Σ exp(s_j − m) over the valid keys outside the row's top-k (R, H, Q'); invalid keys hold 0."""
        if self.keep is not None:
            return self.exp_scores.masked_fill(self.keep, 0.0).sum(-1)
        return self.exp_scores.scatter(-1, self.top_indices[..., :-1], 0.0).sum(-1)


class Collector:
    """Base observer: row eligibility, sampling, and keyed float64 sums of shape (L, H, keys, ...).

    Args:
        k: the budget of every layer (a list of L ints); rows with n ≤ k are not calibrated.
        num_heads: query heads per layer.
        placement: "pre" or "post"; the dropped mass for calibrated SDC is collected for "pre" only.
        sample_frac: probability with which each eligible row is used, in (0, 1].
        seed: seed of the sampling generator (same inputs + same seed = same samples).
        phases: which rows to use, any of ("prefill", "decode").
        max_n: longest row length to calibrate (longer rows are skipped); None = grow as needed.
        topk_keep: the forward runs exact top-k with these k (TAC), so each chunk's keep-mask is
            the top-k set and the collector may read it instead of sorting again; with ``keep_rule``, the forward
            runs that rule (TAC) and its keep-mask is read.
        keep_rule: a sparsifier whose kept set the thresholds approximate instead of the top-k (``calibrate``'s
            ``rho``: Top-ρ, ⌈ρ·w_h·n⌉ keys per row and head): τ is each row's largest score outside that set, per
            head, and a head whose row the rule keeps whole adds nothing for that row (its count too). None: top-k.
        device_path: decide on the device, reading nothing on the host inside a layer call (module docstring);
            None (default): on every device but the CPU.
    """

    def __init__(self, k: list[int], num_heads: int, placement: str, *, sample_frac: float = 1.0, seed: int = 0,
                 phases: tuple[str, ...] = PHASES, max_n: int | None = None, topk_keep: bool = False,
                 device_path: bool | None = None, keep_rule=None):
        if not 0.0 < sample_frac <= 1.0:
            raise ValueError(f"sample_frac must be in (0, 1], got {sample_frac}")
        bad = set(phases) - set(PHASES)
        if bad or not phases:
            raise ValueError(f"phases must be a non-empty subset of {PHASES}, got {phases}")
        if max_n is not None and max_n <= min(k):
            raise ValueError(f"max_n={max_n} leaves no row to calibrate: it must exceed the smallest k ({min(k)})")
        self.k, self.num_heads = [int(x) for x in k], int(num_heads)
        self.placement = check_placement(placement)
        self.sample_frac, self.phases, self.max_n = float(sample_frac), tuple(phases), max_n
        self.topk_keep = bool(topk_keep)
        self.device_path = device_path
        self.keep_rule = keep_rule
        self.generator = torch.Generator().manual_seed(int(seed))
        # with TAC the selection finds each row's τ on the way (RowBlock.want_next): no second pass over the row
        self.wants_next_index = self.topk_keep and keep_rule is None
        self.weight = 1  # rows observed count this many times (``repeated``)
        L = len(self.k)
        self._rows_eligible = torch.zeros(L, dtype=torch.float64)  # per layer, before sampling
        self._rows_sampled = torch.zeros(L, dtype=torch.float64)
        self._max_n_seen = 0
        self._max_key: int | None = None  # key of max_n (_ensure)
        self._on_device: dict[int, torch.Tensor] = {}  # layer -> (eligible, sampled, max n) device sums (_collect)
        # name -> one (H, capacity, *extra) float64 tensor per layer, on that layer's device (None until it has rows);
        # keys [0, self._width[layer]) are in use (_ensure)
        self.sums: dict[str, list[torch.Tensor | None]] = {}
        self._width = [0] * L
        self._extra: dict[str, tuple[int, ...]] = {"count": (), **({"sdc": ()} if self.placement == "pre" else {})}

    # --- what a subclass defines ----------------------------------------------------------------
    def key_of(self, n: torch.Tensor) -> torch.Tensor:
        """Key of each row length: the row length itself here."""
        return n

    def add(self, layer: int, rows: SampledRows, keys: torch.Tensor) -> None:
        """Add the statistic of the sampled rows (keys: (S,) on the CPU) to ``self.sums``."""
        raise NotImplementedError

    def finalise(self, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        """Thresholds (L, H', K') from sums already pooled to the granularity; NaN where count = 0."""
        raise NotImplementedError

    @contextlib.contextmanager
    def repeated(self, times: int):
        """Count every row observed inside the block ``times`` times: rows computed once on behalf of ``times``
        sequences that share them (a shared prefix, ``calibrate``'s prefix sharing). Each row's contribution is
        multiplied by ``times``, so counts and histograms equal the unshared run's exactly and float64 sums to
        their rounding. Sampling (``sample_frac`` < 1) draws once per row computed: refused there."""
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise ValueError(f"times must be an integer >= 1, got {times!r}")
        if times > 1 and self.sample_frac < 1.0:
            raise ValueError("a sampled calibration (sample_frac < 1) draws each row where it is computed: "
                             "rows shared by several sequences cannot be counted as several draws")
        outer, self.weight = self.weight, times
        try:
            yield self
        finally:
            self.weight = outer

    # --- row counters (the device path's are folded in when read) ------------------------------------
    def _collect(self) -> None:
        on_device, self._on_device = self._on_device, {}
        for layer, counts in on_device.items():
            eligible, sampled, top = counts.cpu().tolist()
            self._rows_eligible[layer] += eligible
            self._rows_sampled[layer] += sampled
            self._max_n_seen = max(self._max_n_seen, int(top))

    @property
    def rows_eligible(self) -> torch.Tensor:
        """(L,) float64: rows with k < n (≤ max_n) seen per layer, before sampling."""
        self._collect()
        return self._rows_eligible

    @property
    def rows_sampled(self) -> torch.Tensor:
        """(L,) float64: rows used per layer."""
        self._collect()
        return self._rows_sampled

    @property
    def max_n_seen(self) -> int:
        """Longest sampled row."""
        self._collect()
        return self._max_n_seen

    # --- the observer ---------------------------------------------------------------------------
    def __call__(self, rows: RowBlock) -> None:
        if rows.phase not in self.phases:
            return
        device_path = self.device_path if self.device_path is not None else rows.n.device.type != "cpu"
        if device_path:
            return self._observe_on_device(rows)
        layer, k = rows.layer, self.k[rows.layer]
        n = rows.n[:, 0].cpu()  # (B, Q)
        pick = n > k
        if self.max_n is not None:
            pick &= n <= self.max_n
        eligible = int(pick.sum())
        if eligible == 0:
            return
        self._rows_eligible[layer] += eligible * self.weight
        if self.sample_frac < 1.0:  # drawn on the CPU generator: the same draws on any device
            pick &= torch.rand(n.shape, generator=self.generator) < self.sample_frac
            if not bool(pick.any()):
                return
        sampled = SampledRows(rows, pick, n, k, self.topk_keep, self._budget_keep(rows))
        self._rows_sampled[layer] += sampled.n.numel() * self.weight
        self._max_n_seen = max(self._max_n_seen, int(sampled.n.max()))
        keys = self.key_of(sampled.n.flatten())  # (S,) on the CPU, in the order of SampledRows.per_row
        device = rows.logits.device
        self._ensure(layer, int(keys.max()) + 1, device)
        self._add_rows(layer, sampled, keys, torch.ones(keys.numel(), self.num_heads, device=device))

    def _observe_on_device(self, rows: RowBlock) -> None:
        """``__call__`` without a host read: every row of the chunk scored, the unchosen ones adding 0."""
        layer, k = rows.layer, self.k[rows.layer]
        B, H, Q, K = rows.logits.shape
        if K <= k:  # n ≤ K (the chunk's key window) ≤ k: no row is eligible
            return
        n = rows.n[:, 0]  # (B, Q) on the device
        eligible = n > k
        if self.max_n is not None:
            eligible &= n <= self.max_n
        pick = eligible
        if self.sample_frac < 1.0:  # drawn on the CPU generator, as the host path (module docstring)
            pick = eligible & (torch.rand(n.shape, generator=self.generator) < self.sample_frac).to(n.device)
        sampled = SampledRows.whole(rows, pick, n, k, self.topk_keep, self._budget_keep(rows))
        counts = torch.stack([eligible.sum() * self.weight, pick.sum() * self.weight,
                              torch.where(pick, n, 0).max()]).double()
        if layer in self._on_device:  # Σ eligible, Σ sampled, max n
            old = self._on_device[layer]
            counts = torch.cat([old[:2] + counts[:2], torch.maximum(old[2:], counts[2:])])
        self._on_device[layer] = counts
        keys = self.key_of(n.flatten())  # (B·Q,) on the device, in the order of SampledRows.per_row
        device = rows.logits.device
        self._ensure(layer, self.key_bound(K) + 1, device)
        self._add_rows(layer, sampled, keys, sampled.chosen(torch.ones(B * Q, H, device=device)))

    def _budget_keep(self, rows: RowBlock) -> torch.Tensor | None:
        """The keep-mask of ``keep_rule`` for a chunk the forward did not select with it (no TAC); None otherwise.
        A rule that keeps every key returns a mask of every valid key, so no head counts."""
        if self.keep_rule is None or self.topk_keep:
            return None
        keep = self.keep_rule.select(rows)
        return rows.valid.expand_as(rows.logits) if keep is None else keep

    def _add_rows(self, layer: int, sampled: SampledRows, keys: torch.Tensor, ones: torch.Tensor) -> None:
        """The counts (``ones``: (S, H), 1 where a row counts), the dropped mass and the subclass's statistic of the
        sampled rows; with a budget rule only the (row, head) pairs it drops keys from."""
        budget = self.keep_rule is not None
        if budget and sampled.keep is None:  # the forward's rule kept every key of the chunk: nothing to add
            return
        self.scatter("count", layer, keys, torch.where(sampled.drops, ones, ones.new_zeros(())) if budget else ones)
        if "sdc" in self.sums:
            self.scatter("sdc", layer, keys, sampled.per_head(sampled.dropped_mass(), budget))
        self.add(layer, sampled, keys)

    def key_bound(self, n: int) -> int:
        """The key of row length ``n`` as a Python int, from shapes alone (key_of is non-decreasing in n)."""
        return n

    def flat_index(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Position of (head h, key of row s) in the flattened (H, keys) table of a layer: (S, H), on its device."""
        table = self.sums["count"][layer]  # (H, keys)
        heads = torch.arange(self.num_heads, device=table.device)
        return heads * table.shape[1] + keys.to(table.device)[:, None]

    def scatter(self, name: str, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """sums[name][layer][h, keys[s]] += weight · values[s, h] for every sampled row s and head h."""
        table = self.sums[name][layer]  # (H, keys, *extra), contiguous, on the layer's device
        flat = self.flat_index(layer, keys).flatten()  # (S·H,)
        target = table.flatten(0, 1)  # (H·keys, *extra), a view
        values = values.reshape(flat.numel(), *target.shape[1:]).double()
        target.index_add_(0, flat, values if self.weight == 1 else values * self.weight)

    def _ensure(self, layer: int, num_keys: int, device) -> None:
        """Widen a layer's key axis to ``num_keys`` on ``device``; with ``max_n`` it is allocated once at full size.

        A causal prefill widens it chunk by chunk (each chunk's rows are longer), so the tables are reallocated
        GROWTH times (at least MIN_ROOM keys) wider than asked, not to the exact width: a 12.9k-key prefill in chunks
        of 16 rows would otherwise copy every table ~800 times per layer (each a (heads, keys, grid) histogram for
        target-k; scripts/bench_collector_growth.py). The width in use (``_width``) is what ``shapes``, ``nbytes``,
        ``state_dict`` and the results see."""
        if self.max_n is not None:
            if self._max_key is None:  # once per collector
                self._max_key = int(self.key_of(torch.tensor([self.max_n]))[0])
            num_keys = max(num_keys, self._max_key + 1)
        if not self.sums:
            self.sums = {name: [None] * len(self.k) for name in self._extra}
        if num_keys <= self._width[layer]:
            return
        current = self.sums["count"][layer]
        capacity = 0 if current is None else current.shape[1]
        if num_keys > capacity:
            room = num_keys if self.max_n is not None else max(int(num_keys * GROWTH), num_keys + MIN_ROOM)
            for name, extra in self._extra.items():
                grown = torch.zeros(self.num_heads, room, *extra, dtype=torch.float64, device=device)
                if capacity:
                    grown[:, :capacity] = self.sums[name][layer]
                self.sums[name][layer] = grown
        self._width[layer] = num_keys

    def _in_use(self, t: torch.Tensor | None, layer: int) -> torch.Tensor | None:
        """A layer's table cut to the keys in use (a view)."""
        return None if t is None else t[:, :self._width[layer]]

    # --- saved progress (calibrate(progress_file=...)) ------------------------------------------------
    def state_dict(self) -> dict:
        """Everything the rows seen so far added (sums, row counters, the sampling generator), on the CPU: a collector
        of the same settings that loads it goes on as this one would."""
        self._collect()
        return {"collector": type(self).__name__,
                "sums": {name: [None if t is None else self._in_use(t, layer).cpu().clone()
                                for layer, t in enumerate(per_layer)] for name, per_layer in self.sums.items()},
                "devices": [None if t is None else str(t.device) for t in self.sums.get("count", [])],
                "rows_eligible": self._rows_eligible.clone(), "rows_sampled": self._rows_sampled.clone(),
                "max_n_seen": self._max_n_seen, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Take up a ``state_dict`` of a collector with the same settings (the caller checks them); each layer's sums
        go back to the device they were on."""
        if state["collector"] != type(self).__name__:
            raise ValueError(f"a {state['collector']} state cannot be loaded into a {type(self).__name__}")
        self.sums = {name: [None if t is None else t.to(device) for t, device in zip(per_layer, state["devices"])]
                     for name, per_layer in state["sums"].items()}
        self._width = [0 if t is None else t.shape[1] for t in self.sums.get("count", [None] * len(self.k))]
        self._rows_eligible, self._rows_sampled = state["rows_eligible"].clone(), state["rows_sampled"].clone()
        self._max_n_seen, self._on_device = int(state["max_n_seen"]), {}
        self.generator.set_state(state["generator"])

    # --- results --------------------------------------------------------------------------------
    def nbytes(self) -> int:
        """Bytes of the running sums in use (what grows with row length, never with sample count; while a prefill
        widens them the tables hold up to GROWTH times that)."""
        return sum(t.numel() * t.element_size() for per_layer in self.sums.values()
                   for t in map(self._in_use, per_layer, range(len(per_layer))) if t is not None)

    def shapes(self) -> dict[str, list[tuple[int, ...] | None]]:
        """Shape of each layer's sums (None for a layer without rows so far)."""
        return {name: [None if t is None else tuple(self._in_use(t, layer).shape) for layer, t in enumerate(per_layer)]
                for name, per_layer in self.sums.items()}

    def stacked(self) -> dict[str, torch.Tensor]:
        """Every layer's sums on the CPU, zero-padded to the widest key axis: name -> (L, H, keys, *extra).

        The width is the key of the longest row sampled (of ``max_n`` when set) + 1, as the host path sizes its
        tables; the device path's tables, sized from the key windows, are cut to it (the keys beyond hold 0)."""
        if not any(t is not None for t in self.sums.get("count", [])) or self.rows_sampled.sum() == 0:
            raise ValueError("the collector saw no row longer than k; calibrate on longer sequences or a smaller k")
        longest = self.max_n if self.max_n is not None else self.max_n_seen
        width = int(self.key_of(torch.tensor([longest]))[0]) + 1
        out = {}
        for name, extra in self._extra.items():
            full = torch.zeros(len(self.k), self.num_heads, width, *extra, dtype=torch.float64)
            for layer, t in enumerate(self.sums[name]):
                if t is not None:
                    part = t[:, :width].cpu()
                    full[layer, :, :part.shape[1]] = part
            out[name] = full
        return out

    def reduce(self, granularity: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(values, counts, sdc_mass) at a granularity, each (L, H|1, N|1) float32 on the CPU.

        Every granularity is the same sums pooled over heads and/or keys before the statistic
        (method.md §2.2; the paper's granularity ablation). Per-n results are indexed by row length
        n = 0..max sampled n; NaN marks lengths without samples (``Thresholds`` fills them).
        """
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
        per_head, per_n = GRANULARITIES[granularity]
        pooled = {}
        for name, t in self.stacked().items():
            if not per_head:
                t = t.sum(1, keepdim=True)
            if not per_n:
                t = t.sum(2, keepdim=True)
            pooled[name] = t
        values = self.finalise(pooled)  # (L, H', K')
        counts = pooled["count"]
        sdc = pooled["sdc"] / counts if "sdc" in pooled else None  # NaN where count = 0
        if per_n:  # from keys to row lengths: identity for exact n, bucket lookup otherwise
            keys = self.key_of(torch.arange(self.max_n_seen + 1))
            values, counts = values[..., keys], counts[..., keys]
            sdc = sdc[..., keys] if sdc is not None else None
        values = values.masked_fill(counts == 0, float("nan"))
        return values.float(), counts.float(), (sdc.float() if sdc is not None else None)


class OrderStatCollector(Collector):
    """The paper's statistic (method.md §2.2): per (layer, head, n) count, Σ τ and Σ τ² of the
    (k + 1)-th largest score τ of each sampled row, and θ = mean + σ_add · std (population std).
    """

    def __init__(self, k: list[int], num_heads: int, placement: str, *, sigma_add: float = 0.1, **options):
        super().__init__(k, num_heads, placement, **options)
        self.sigma_add = float(sigma_add)
        self._extra.update(tau=(), tau_sq=())

    def add(self, layer: int, rows: SampledRows, keys: torch.Tensor) -> None:
        tau = rows.per_head(rows.tau(self.placement), self.keep_rule is not None).double()  # (S, H)
        self.scatter("tau", layer, keys, tau)
        self.scatter("tau_sq", layer, keys, tau * tau)

    def finalise(self, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        count = sums["count"]
        mean = sums["tau"] / count
        var = (sums["tau_sq"] / count - mean * mean).clamp_min(0.0)  # float64: cancellation stays small
        std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))  # one sample: θ is that sample
        return mean + self.sigma_add * std

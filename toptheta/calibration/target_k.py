"""Target-mean-k calibration: θ such that the *expected* kept count per row is k (method.md §4).

The reference's MKC kept, for every sampled row, its whole threshold→kept-count curve and merged
the curves in Python; it needed ~1 TB for ~380 ARC-C examples (method.md §4, §9.14). The same
quantity is a ratio of two sums, so it streams in bounded memory:

    mean kept(t) = Σ_rows #{valid j : x_j > t} / #rows

We fix a grid of candidate thresholds t_0 < … < t_{G−1} and accumulate, per (layer, head, n-bucket),
a histogram of the sampled rows' scores over the grid (the row count is kept by the base
collector). A reverse cumulative sum turns it into Σ_rows #{x > t_b} at every edge; θ is where the
mean crosses k, linearly interpolated between the two edges that bracket it. Memory is
L · H · buckets · (G + 1) · 8 bytes, whatever the number of rows.

The grid is uniform in a coordinate c, so a score's bin is arithmetic (⌈(c − c_0)/Δ⌉, ten times
faster than a binary search); a score lying exactly on an edge may land on either side of it.
* post-softmax: c = log-probability = s − m − log Σ e, G edges from log 1e-10 to 0 (≈1.1 % apart in
  probability for G = 2048), the same for every layer: probabilities have a natural scale;
* pre-softmax: c = the scaled logit, which has no natural scale (a trained LLM spreads logits over
  units, a freshly initialised one over thousandths), so each layer's grid is fitted to its first
  sampled rows: the range of their (k + 1)-th largest logits, widened on each side by twice the
  range plus a fifth of the magnitude.
A θ that lands on a grid end is counted in ``grid_clamped`` so a run can see it.

Row lengths are bucketed: exact below ``exact_n``, then ``per_octave`` geometric buckets per
doubling. All rows of a bucket share one θ; the returned table repeats it over the bucket's lengths.
"""

from __future__ import annotations

import math

import torch

from .collector import Collector, SampledRows

GRID_SIZE = 2048
POST_FLOOR = 1e-10  # smallest probability threshold on the post-softmax grid


class TargetKCollector(Collector):
    """Streaming histograms for target-mean-k θ. Options are those of :class:`Collector`, plus:

    Args:
        grid_size: G, the number of candidate thresholds.
        exact_n: row lengths below this get a bucket each.
        per_octave: geometric buckets per doubling of the row length above ``exact_n``.
    """

    def __init__(self, k: list[int], num_heads: int, placement: str, *, grid_size: int = GRID_SIZE,
                 exact_n: int = 32, per_octave: int = 8, **options):
        super().__init__(k, num_heads, placement, **options)
        if self.keep_rule is not None:
            raise ValueError("the target-k statistic aims at k kept keys per row: a budget rule (calibrate's rho) "
                             "needs the order statistic (statistic='order')")
        if grid_size < 2 or exact_n < 1 or per_octave < 1:
            raise ValueError(f"need grid_size ≥ 2, exact_n ≥ 1 and per_octave ≥ 1; "
                             f"got {grid_size}, {exact_n}, {per_octave}")
        self.grid_size, self.exact_n, self.per_octave = int(grid_size), int(exact_n), int(per_octave)
        L = len(self.k)
        # grid of layer l: c_b = start[l] + b · step[l], b = 0..G−1 (float64, fixed once set)
        if self.placement == "post":
            self.start = torch.full((L,), math.log(POST_FLOOR), dtype=torch.float64)
            self.step = torch.full((L,), -math.log(POST_FLOOR) / (grid_size - 1), dtype=torch.float64)
        else:  # set by each layer's first sampled rows
            self.start = torch.full((L,), float("nan"), dtype=torch.float64)
            self.step = torch.full((L,), float("nan"), dtype=torch.float64)
        self._extra["hist"] = (grid_size + 1,)  # slot i: c in (c_{i−1}, c_i]; slot 0 = at or below c_0
        self.grid_clamped = 0
        # (start, step) of each fitted grid as Python numbers: read once, not in every layer call
        self._grid = {l: (float(self.start[l]), float(self.step[l])) for l in range(L) if self.placement == "post"}

    def state_dict(self) -> dict:
        """The base state and each layer's grid (pre-softmax grids are fitted to the first rows a layer sees)."""
        return {**super().state_dict(), "start": self.start.clone(), "step": self.step.clone(),
                "grid": {layer: list(grid) for layer, grid in self._grid.items()}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.start, self.step = state["start"].clone(), state["step"].clone()
        self._grid = {int(layer): (float(grid[0]), float(grid[1])) for layer, grid in state["grid"].items()}

    def key_of(self, n: torch.Tensor) -> torch.Tensor:
        """Bucket of each row length: n below ``exact_n``, then ``per_octave`` per doubling."""
        octaves = torch.log2(n.double().clamp_min(self.exact_n) / self.exact_n)
        geometric = self.exact_n + torch.floor(octaves * self.per_octave + 1e-9).long()
        return torch.where(n < self.exact_n, n.long(), geometric)

    def key_bound(self, n: int) -> int:
        """An upper bound on ``key_of`` of lengths ≤ n, from shapes alone (the key of n, or one more where the float
        rounding of log2 could differ: a table one key wider holds 0 there, and ``stacked`` cuts it off)."""
        if n < self.exact_n:
            return n
        return self.exact_n + math.floor(math.log2(n / self.exact_n) * self.per_octave + 1e-9) + 1

    def edges(self, layer: int) -> torch.Tensor:
        """The G candidate thresholds of a layer, in score units (probability or logit)."""
        c = self.start[layer] + self.step[layer] * torch.arange(self.grid_size, dtype=torch.float64)
        return c.exp() if self.placement == "post" else c

    def _fit_grid(self, layer: int, rows: SampledRows) -> bool:
        """Fit a pre-softmax layer's grid to these rows' τ (the layer's one host read); False: no row counts."""
        tau = rows.tau("pre")  # (R, H, Q') the logits θ must separate
        chosen = rows.row_mask()  # (R, 1, Q') or None: every row counts
        if chosen is None:
            lo, hi = float(tau.min()), float(tau.max())
        else:
            lo, hi = torch.stack([torch.where(chosen, tau, float("inf")).min(),
                                  torch.where(chosen, tau, float("-inf")).max()]).tolist()
            if lo > hi:
                return False
        margin = 2 * (hi - lo) + 0.2 * max(abs(lo), abs(hi)) + 1e-3  # never a zero-width grid
        self._grid[layer] = (lo - margin, (hi - lo + 2 * margin) / (self.grid_size - 1))  # float64, as the tensors
        self.start[layer], self.step[layer] = self._grid[layer]
        return True

    def add(self, layer: int, rows: SampledRows, keys: torch.Tensor) -> None:
        if layer not in self._grid and not self._fit_grid(layer, rows):
            return
        start, step = self._grid[layer]
        if self.placement == "post":  # log p = s − m − log Σ e, without a log per element
            shift = rows.row_max + rows.row_sum.clamp_min(torch.finfo(torch.float32).tiny).log()  # (R, H, Q', 1)
            u = rows.logits - (shift + start)
        else:  # invalid keys hold −inf and fall in slot 0
            u = rows.logits - start
        bins = u.div_(step).ceil_().clamp_(0, self.grid_size).long()  # (R, H, Q', K)
        R, H, Q = rows.logits.shape[:3]
        slots = self.grid_size + 1
        row_index = self.flat_index(layer, keys).view(R, Q, H).transpose(1, 2)  # (R, H, Q') position in (H, keys)
        flat = bins.add_(row_index[..., None] * slots)  # slot in the flattened (H, keys, slots)
        table = self.sums["hist"][layer].view(-1)
        # one add per score, in the chunk's size: a bincount the table's size added to the table is a pass over every
        # (head, key, slot) per chunk (gigabytes a layer on rows of 10k keys); counts are whole numbers in float64, so
        # the order of the adds cannot change them
        ones = torch.full((), float(self.weight), dtype=table.dtype, device=table.device).expand(flat.numel())
        chosen = rows.row_mask()
        if chosen is not None:  # rows that do not count add 0
            ones = torch.where(chosen[..., None], ones.view(flat.shape), 0.0).flatten()
        table.index_put_((flat.flatten(),), ones, accumulate=True)

    def finalise(self, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        # One layer at a time: the cumulative counts are as large as the histograms themselves.
        self.grid_clamped = 0
        return torch.stack([self._invert(layer, sums["hist"][layer], sums["count"][layer])
                            for layer in range(len(self.k))])

    def _invert(self, layer: int, hist: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """θ (H', K') where the mean kept count crosses k; hist (H', K', G + 1), rows (H', K')."""
        G, k = self.grid_size, self.k[layer]
        above = hist[..., 1:].flip(-1).cumsum(-1).flip(-1)  # (H', K', G): Σ_rows #{c > c_b}
        mean_kept = above / rows.clamp_min(1)[..., None]  # non-increasing along the grid
        b = (mean_kept >= k).sum(-1, keepdim=True)  # edges 0..b−1 keep ≥ k on average
        lo, hi = (b - 1).clamp(0, G - 1), b.clamp(0, G - 1)
        m_lo, m_hi = mean_kept.gather(-1, lo), mean_kept.gather(-1, hi)
        t = ((m_lo - k) / (m_lo - m_hi)).nan_to_num(0.0, posinf=0.0, neginf=0.0).clamp(0, 1)
        coord = self.start[layer] + self.step[layer] * (lo + t).squeeze(-1)  # (H', K')
        self.grid_clamped += int((((b == 0) | (b == G)).squeeze(-1) & (rows > 0)).sum())
        return coord.exp() if self.placement == "post" else coord

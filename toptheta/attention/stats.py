"""Sparsity statistics, accumulated in memory as tensors (method.md §5).

Every counter is a (layers, heads) or (layers, KV heads) tensor of sums, so recording costs a few
reductions per chunk and reading is free. The paper's headline ratios are ratios of means over all
(layer, head, forward) lines, which for sums is simply Σ kept / Σ valid.
"""

from __future__ import annotations

import contextlib

import torch

from ..sparsifiers.base import RowBlock


class SparsityStats:
    """Counters of one ``toptheta.sparsify`` session.

    Prefill rows (the prompt and every scoring pass) count attention elements per (layer, head);
    decode steps (the steps of ``generate`` after the prompt, one or more new tokens) count V rows per
    (layer, KV head), a V row being kept when any query head of the group keeps it (the union the
    paper reports), plus attention elements per head. ``empty_rows`` counts the Top-θ rows of either
    phase where no valid score passed θ (per layer and head; what happened to them is the sparsifier's
    ``empty_rows`` rule).
    """

    def __init__(self, num_layers: int, num_heads: int, num_kv_heads: int, enabled: bool = True):
        self.num_layers, self.num_heads, self.num_kv_heads = num_layers, num_heads, num_kv_heads
        self.enabled = enabled
        self.reset()

    def reset(self) -> None:
        L, H, Hkv = self.num_layers, self.num_heads, self.num_kv_heads
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64)  # noqa: E731
        self.prefill_kept, self.prefill_valid = zeros(L, H), zeros(L, H)
        self.decode_kept, self.decode_valid = zeros(L, H), zeros(L, H)
        self.vrow_kept, self.vrow_valid = zeros(L, Hkv), zeros(L, Hkv)
        self.dropped_mass, self.rows = zeros(L, H), zeros(L, H)  # Σ dropped dense probability, Σ rows
        self.decode_steps = zeros(L)  # decode forwards per layer (a step of a batch of sequences counts once)
        self.empty_rows = zeros(L, H)  # Top-θ rows (sparsified, any phase) where no valid score passed θ
        self.clamped_rows = 0

    def update(self, rows: RowBlock) -> None:
        """Add one chunk of rows. Called by the kernel after selection."""
        if not self.enabled:
            return
        layer, keep = rows.layer, rows.keep
        B, H, Q, K = rows.logits.shape
        valid_elems = rows.n.sum().double().cpu()
        kept = rows.counts().sum((0, 2)).double()  # (H,)
        if rows.phase == "prefill":
            self.prefill_kept[layer] += kept.cpu()
            self.prefill_valid[layer] += valid_elems
        else:
            self.decode_kept[layer] += kept.cpu()
            self.decode_valid[layer] += valid_elems
            Hkv = self.num_kv_heads
            if rows.vrow_counts is not None:  # a kernel that reported the union counts itself
                vrows = rows.vrow_counts.sum(0).double()
            elif keep is None:
                vrows = valid_elems.expand(Hkv)
            else:
                vrows = keep.reshape(B, Hkv, H // Hkv, Q, K).any(2).sum((0, 2, 3)).double()  # (Hkv,)
            self.vrow_kept[layer] += vrows.cpu()
            self.vrow_valid[layer] += valid_elems
            self.decode_steps[layer] += 1
        live = rows.n > 0  # (B, 1, Q)
        self.rows[layer] += live.sum().double().cpu()
        if keep is not None or rows.kept_mass is not None:
            # The kernel reports each row's kept dense mass; rows without a valid key drop nothing.
            kept_mass = rows.kept_mass if rows.kept_mass is not None else (rows.probs * keep).sum(-1, keepdim=True)
            dropped = (1.0 - kept_mass.squeeze(-1)).clamp_min(0.0).masked_fill(~live, 0.0)  # (B, H, Q)
            self.dropped_mass[layer] += dropped.sum((0, 2)).double().cpu()
        if rows.empty is not None:
            self.empty_rows[layer] += rows.empty.sum((0, 2)).double().cpu()
        self.clamped_rows += rows.clamped_rows

    # --- the paper's ratios -------------------------------------------------------------------
    @property
    def kept_attention_fraction(self) -> float | None:
        """Σ kept / Σ valid attention elements over prefill rows; None when no prefill ran."""
        return _ratio(self.prefill_kept, self.prefill_valid)

    @property
    def kept_vrow_fraction(self) -> float | None:
        """Σ kept / Σ valid V rows over decode steps (union over each KV group); None without decoding."""
        return _ratio(self.vrow_kept, self.vrow_valid)

    @property
    def decode_kept_attention_fraction(self) -> float | None:
        return _ratio(self.decode_kept, self.decode_valid)

    @property
    def mean_dropped_mass(self) -> float | None:
        """Mean dense probability mass dropped per row (what VMC's β puts back)."""
        return _ratio(self.dropped_mass, self.rows)

    # --- breakdowns for plots -----------------------------------------------------------------
    def per_layer(self) -> dict[str, list]:
        """Per-layer kept fractions (NaN where a layer saw no rows of that kind)."""
        frac = lambda a, b: (a.sum(1) / b.sum(1)).tolist()  # noqa: E731
        return {
            "layer": list(range(self.num_layers)),
            "kept_attention_fraction": frac(self.prefill_kept, self.prefill_valid),
            "kept_vrow_fraction": frac(self.vrow_kept, self.vrow_valid),
            "mean_dropped_mass": frac(self.dropped_mass, self.rows),
            "empty_rows": self.empty_rows.sum(1).tolist(),
        }

    def per_head(self) -> dict[str, list]:
        """Per (layer, head) prefill kept fraction, long format."""
        L, H = self.prefill_kept.shape
        frac = self.prefill_kept / self.prefill_valid
        return {
            "layer": [l for l in range(L) for _ in range(H)],
            "head": [h for _ in range(L) for h in range(H)],
            "kept_attention_fraction": frac.flatten().tolist(),
        }

    def summary(self) -> dict:
        """The scalar statistics, for logs and the results store."""
        return {
            "kept_attention_fraction": self.kept_attention_fraction,
            "kept_vrow_fraction": self.kept_vrow_fraction,
            "decode_kept_attention_fraction": self.decode_kept_attention_fraction,
            "mean_dropped_mass": self.mean_dropped_mass,
            "prefill_attention_elements": float(self.prefill_valid.sum()),
            "decode_steps": float(self.decode_steps.max()) if self.num_layers else 0.0,
            "clamped_rows": int(self.clamped_rows),
            "empty_rows": int(self.empty_rows.sum()),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        names = ["prefill_kept", "prefill_valid", "decode_kept", "decode_valid", "vrow_kept", "vrow_valid",
                 "dropped_mass", "rows", "decode_steps", "empty_rows"]
        return {name: getattr(self, name).clone() for name in names}

    def to_json(self) -> dict:
        """Every counter as plain numbers (float64 round-trips through JSON exactly), for a run's checkpoint."""
        return {"shape": [self.num_layers, self.num_heads, self.num_kv_heads], "clamped_rows": int(self.clamped_rows),
                **{name: value.tolist() for name, value in self.state_dict().items()}}

    @classmethod
    def from_json(cls, data: dict) -> "SparsityStats":
        out = cls(*data["shape"])
        for name, value in out.state_dict().items():
            getattr(out, name).copy_(torch.tensor(data[name], dtype=value.dtype))
        out.clamped_rows = int(data["clamped_rows"])
        return out

    def add(self, other: "SparsityStats") -> None:
        """Add another session's counters (a part of this run computed earlier, read back from a checkpoint)."""
        shape = [other.num_layers, other.num_heads, other.num_kv_heads]
        if shape != [self.num_layers, self.num_heads, self.num_kv_heads]:
            raise ValueError(f"statistics of shape {shape} cannot be added to "
                             f"{[self.num_layers, self.num_heads, self.num_kv_heads]} (another model's)")
        for name, value in other.state_dict().items():
            getattr(self, name).add_(value)
        self.clamped_rows += other.clamped_rows

    @contextlib.contextmanager
    def section(self):
        """Yield a ``SparsityStats`` that holds, after the block, only what was recorded inside it.

        This object keeps counting as before; the section is for statistics of a part of a run (one
        passkey length), computed exactly as the run's own (the same sums, restricted to the block).
        """
        before, clamped = self.state_dict(), self.clamped_rows
        part = SparsityStats(self.num_layers, self.num_heads, self.num_kv_heads, enabled=self.enabled)
        yield part
        for name, old in before.items():
            getattr(part, name).copy_(getattr(self, name) - old)
        part.clamped_rows = self.clamped_rows - clamped

    @contextlib.contextmanager
    def repeated(self, times: int):
        """Count what is recorded inside the block ``times`` times.

        For rows computed once on behalf of ``times`` forwards that would each compute them (a shared
        context scored against several continuations): the ratios then equal the unshared run's.
        """
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}")
        before, clamped = self.state_dict(), self.clamped_rows
        yield self
        if times > 1:
            for name, old in before.items():
                counter = getattr(self, name)
                counter.add_((counter - old) * (times - 1))
            self.clamped_rows += (self.clamped_rows - clamped) * (times - 1)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float | None:
    total = float(den.sum())
    return None if total == 0 else float(num.sum()) / total

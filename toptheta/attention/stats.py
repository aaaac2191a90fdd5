"""Sparsity statistics, accumulated in memory as tensors (method.md §5).

Every counter is a (layers, heads) or (layers, KV heads) tensor of sums, so recording costs a few
reductions per chunk and reading is free. The paper's headline ratios are ratios of means over all
(layer, head, forward) lines, which for sums is simply Σ kept / Σ valid.

Rows computed on an accelerator are added to a set of counters on that device (no host read inside a layer:
on a GPU each would be a synchronisation); reading any statistic moves them to the CPU counters once.
``backend_calls`` counts the layer calls each attention backend served (``backends/``); ``paused()`` records
nothing (lm-eval's batch-size probe, warm-up forwards).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..sparsifiers.base import RowBlock


# The counters a decode step adds to, in the order the C++ decode kernel takes their columns (csrc/decode.cpp).
DECODE_COLUMNS = ("decode_kept", "decode_valid", "vrow_kept", "vrow_valid", "dropped_mass", "rows", "decode_steps",
                  "empty_rows")


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
        self._packed, self._counters = self._packed_counters(torch.float64, torch.device("cpu"))
        self._clamped = 0
        self._on_device: dict[torch.device, dict] = {}  # accelerators' counters, moved here when read (_collect)
        self._device_packed: dict[torch.device, torch.Tensor] = {}  # the packed tensor those counters are views of
        self.backend_calls: dict[str, int] = {}  # layer calls per attention backend (backends/__init__.py)

    def _shapes(self) -> dict[str, tuple]:
        L, H, Hkv = self.num_layers, self.num_heads, self.num_kv_heads
        return {"prefill_kept": (L, H), "prefill_valid": (L, H), "decode_kept": (L, H), "decode_valid": (L, H),
                "vrow_kept": (L, Hkv), "vrow_valid": (L, Hkv),
                "dropped_mass": (L, H), "rows": (L, H),  # Σ dropped dense probability, Σ rows
                "decode_steps": (L,),  # decode forwards per layer (a step of a batch of sequences counts once)
                "empty_rows": (L, H)}  # Top-θ rows (sparsified, any phase) where no valid score passed θ

    # Where each counter sits in a layer's row of the packed (layers, DECODE_WIDTH) tensor: a decode kernel adds a
    # step's statistics to ``decode_row(layer)`` itself, in place, instead of a dozen tensor ops per layer call.
    def layout(self) -> dict[str, tuple[int, int]]:
        """(first column, width) of each counter in a layer's packed row."""
        out, at = {}, 0
        for name, shape in self._shapes().items():
            width = shape[1] if len(shape) > 1 else 1
            out[name], at = (at, width), at + width
        return out

    def _packed_counters(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, dict]:
        """One zeroed (layers, width) tensor and every counter as a view of its columns."""
        layout = self.layout()
        packed = torch.zeros(self.num_layers, sum(w for _, w in layout.values()), dtype=dtype, device=device)
        views = {name: packed[:, a:a + w] if len(shape) > 1 else packed[:, a]
                 for (name, shape), (a, w) in zip(self._shapes().items(), layout.values())}
        return packed, views

    @functools.cached_property
    def decode_columns(self) -> list[int]:
        """The first column of each of DECODE_COLUMNS in a packed row (the decode kernel's ``cols``; the layout is
        fixed by the shape, so it is worked out once, not on every decode step)."""
        layout = self.layout()
        return [layout[name][0] for name in DECODE_COLUMNS]

    def decode_row(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s CPU counters as one contiguous float64 row, columns as ``layout()`` (for a CPU decode
        kernel that adds one step's statistics itself: ``fused_decode``)."""
        return self._packed[layer]

    def packed_row(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer ``layer``'s counters on ``device`` as one contiguous row, columns as ``layout()``: for a kernel that
        adds a call's statistics itself (the Triton kernels, with atomic adds). No host read: on an accelerator
        the row is that device's own set, collected when a statistic is read."""
        if device.type == "cpu":
            return self._packed[layer]
        self._sums(device)
        return self._device_packed[device][layer]

    def _sums(self, device: torch.device) -> dict:
        """The counters updates add to: this object's own on the CPU, a device's own set elsewhere (adding there
        costs no synchronisation; reading any counter moves them here once, see _collect)."""
        if device.type == "cpu":
            return self._counters
        sums = self._on_device.get(device)
        if sums is None:
            dtype = torch.float32 if device.type == "mps" else torch.float64  # (MPS has no float64)
            packed, sums = self._packed_counters(dtype, device)
            self._device_packed[device] = packed
            sums["clamped"] = torch.zeros((), dtype=torch.long, device=device)
            self._on_device[device] = sums
        return sums

    def _collect(self) -> None:
        """Add the accelerators' counters to the CPU ones: one transfer per device, when the statistics are read."""
        if not self._on_device:
            return
        on_device, self._on_device, self._device_packed = self._on_device, {}, {}
        for sums in on_device.values():
            for name, value in sums.items():
                if name == "clamped":
                    self._clamped += int(value)
                else:
                    self._counters[name] += value.to("cpu", torch.float64)

    @property
    def clamped_rows(self) -> int:
        self._collect()
        return self._clamped

    @clamped_rows.setter
    def clamped_rows(self, value: int) -> None:
        self._collect()
        self._clamped = value

    def record_backend(self, name: str) -> bool:
        """Count one layer call run by backend ``name``; True the first time this session sees it."""
        first = name not in self.backend_calls
        self.backend_calls[name] = self.backend_calls.get(name, 0) + 1
        return first

    @contextlib.contextmanager
    def paused(self):
        """Record nothing inside the block (lm-eval's batch-size probe, warm-up forwards); restores the setting."""
        enabled, self.enabled = self.enabled, False
        try:
            yield self
        finally:
            self.enabled = enabled

    def update(self, rows: RowBlock) -> None:
        """Add one chunk of rows. Called by the kernel after selection.

        On the CPU the counters are added to at once; on an accelerator to device tensors (no host read inside a
        layer), which reading any statistic collects.
        """
        if not self.enabled:
            return
        # (``t[layer].add_(x)``, not ``t[layer] += x``: the latter also copies the row back onto itself)
        layer, keep = rows.layer, rows.keep
        B, H, Q, K = rows.logits.shape
        device = rows.n.device
        host = device.type == "cpu"
        c = self._sums(device)
        here = (lambda t: t.cpu()) if host else (lambda t: t.to(c["rows"].dtype))  # noqa: E731
        valid_elems = here(rows.n.sum().double())
        kept = rows.counts().sum((0, 2)).double()  # (H,)
        if rows.phase == "prefill":
            c["prefill_kept"][layer].add_(here(kept))
            c["prefill_valid"][layer].add_(valid_elems)
        else:
            c["decode_kept"][layer].add_(here(kept))
            c["decode_valid"][layer].add_(valid_elems)
            Hkv = self.num_kv_heads
            if rows.vrow_counts is not None:  # a kernel that reported the union counts itself
                vrows = rows.vrow_counts.sum(0).double()
            elif keep is None:
                vrows = valid_elems.expand(Hkv)
            else:
                vrows = keep.reshape(B, Hkv, H // Hkv, Q, K).any(2).sum((0, 2, 3)).double()  # (Hkv,)
            c["vrow_kept"][layer].add_(here(vrows))
            c["vrow_valid"][layer].add_(valid_elems)
            c["decode_steps"][layer].add_(1)
        live = rows.n > 0  # (B, 1, Q)
        c["rows"][layer].add_(here(live.sum().double()))
        if keep is not None or rows.kept_mass is not None:
            # The kernel reports each row's kept dense mass; rows without a valid key drop nothing.
            kept_mass = rows.kept_mass if rows.kept_mass is not None else (rows.probs * keep).sum(-1, keepdim=True)
            dropped = (1.0 - kept_mass.squeeze(-1)).clamp_min(0.0).masked_fill(~live, 0.0)  # (B, H, Q)
            c["dropped_mass"][layer].add_(here(dropped.sum((0, 2)).double()))
        if rows.empty is not None:
            c["empty_rows"][layer].add_(here(rows.empty.sum((0, 2)).double()))
        self.count_clamped(rows.clamped_rows, device)

    def count_clamped(self, clamped, device: torch.device) -> None:
        """Add a number of rows past the calibrated length (an int or a tensor) of rows computed on ``device``: kept
        there off the CPU (no host read inside a layer)."""
        if isinstance(clamped, torch.Tensor) and device.type != "cpu":
            self._sums(device)["clamped"] += clamped.to(device)
        else:
            self._clamped += int(clamped)

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
        return per_head_columns(kept_attention_fraction=self.prefill_kept / self.prefill_valid)

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
            "backend_calls": dict(self.backend_calls),
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._collect()
        return {name: value.clone() for name, value in self._counters.items()}

    def to_json(self) -> dict:
        """Every counter as plain numbers (float64 round-trips through JSON exactly), for a run's checkpoint."""
        return {"shape": [self.num_layers, self.num_heads, self.num_kv_heads], "clamped_rows": int(self.clamped_rows),
                **{name: value.tolist() for name, value in self.state_dict().items()},
                "backend_calls": dict(self.backend_calls)}

    @classmethod
    def from_json(cls, data: dict) -> "SparsityStats":
        out = cls(*data["shape"])
        for name, value in out.state_dict().items():
            getattr(out, name).copy_(torch.tensor(data[name], dtype=value.dtype))
        out.clamped_rows = int(data["clamped_rows"])
        out.backend_calls = dict(data.get("backend_calls") or {})
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
        for name, calls in other.backend_calls.items():
            self.backend_calls[name] = self.backend_calls.get(name, 0) + calls

    @contextlib.contextmanager
    def section(self):
        """Yield a ``SparsityStats`` that holds, after the block, only what was recorded inside it.

        This object keeps counting as before; the section is for statistics of a part of a run (one
        passkey length), computed exactly as the run's own (the same sums, restricted to the block).
        """
        before, clamped, calls = self.state_dict(), self.clamped_rows, dict(self.backend_calls)
        part = SparsityStats(self.num_layers, self.num_heads, self.num_kv_heads, enabled=self.enabled)
        yield part
        for name, old in before.items():
            getattr(part, name).copy_(getattr(self, name) - old)
        part.clamped_rows = self.clamped_rows - clamped
        part.backend_calls = {name: n - calls.get(name, 0) for name, n in self.backend_calls.items()
                              if n > calls.get(name, 0)}

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


def _counter(name: str) -> property:
    def read(self) -> torch.Tensor:
        self._collect()
        return self._counters[name]

    def write(self, value: torch.Tensor) -> None:
        self._collect()
        self._counters[name].copy_(value)  # in place: the counters are views of one packed tensor

    return property(read, write, doc=f"(layers, ...) float64 sums: {name}")


for _name in ("prefill_kept", "prefill_valid", "decode_kept", "decode_valid", "vrow_kept", "vrow_valid",
              "dropped_mass", "rows", "decode_steps", "empty_rows"):
    setattr(SparsityStats, _name, _counter(_name))


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float | None:
    total = float(den.sum())
    return None if total == 0 else float(num.sum()) / total


def per_head_columns(**values: torch.Tensor) -> dict[str, list]:
    """(layers, heads) tensors in long format: a `layer` and a `head` column, then one column per tensor."""
    L, H = next(iter(values.values())).shape
    return {"layer": [l for l in range(L) for _ in range(H)], "head": [h for _ in range(L) for h in range(H)],
            **{name: v.flatten().tolist() for name, v in values.items()}}

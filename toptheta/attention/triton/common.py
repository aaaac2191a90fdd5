"""What the Triton wrappers share: input checks, key bounds, v̄, and the result they return (torch only).

Nothing here imports triton, so the result type and the lowering helpers work where triton is absent.
Shapes use B (batch), H (query heads), Hkv (KV heads), Q (query rows), K (keys), D / Dv (head dims).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

SDC_MODES = {None: 0, "exact": 1, "exp-threshold": 2, "calibrated": 3}
EMPTY_ROWS = ("keep-max", "reference")
NO_WINDOW = 1 << 30  # the window the kernels see when there is none (wider than any cache)


@dataclass
class TritonAttention:
    """Output and per-row statistics of one Triton attention call, all device tensors (no host reads).

    out: (B, H, Q, Dv) in the query's dtype.
    n: (B, Q) int32 valid keys of each row (causal, not padding, inside the window).
    kept: (B, H, Q) int32 kept keys of each row (n for rows kept whole).
    kept_mass: (B, H, Q) float32 dense softmax probability mass of the kept keys (what stats call kept_mass;
        1 − kept_mass is the dropped mass VMC's β puts back with exact SDC or post-softmax).
    empty: (B, H, Q) bool rows with at least one valid key where no valid score passed θ.
    vrows: (B, Hkv, Q) int32 kept V rows of each query row (union over the G heads of the group), or None
        (the prefill kernel, whose programs hold one head each, does not compute the union).
    tiles, skipped_tiles: int32 key tiles each program visited, and how many of those had no kept score (their
        V loads and P·V product skipped); prefill (B, H, Q-blocks), decode (B, Hkv). Debug counters.
    """

    out: torch.Tensor
    n: torch.Tensor
    kept: torch.Tensor
    kept_mass: torch.Tensor
    empty: torch.Tensor
    vrows: torch.Tensor | None
    tiles: torch.Tensor
    skipped_tiles: torch.Tensor

    # --- the per-(B, H) sums the statistics add up (stats.SparsityStats.update) ------------------------
    def kept_per_head(self) -> torch.Tensor:
        """(B, H) int64 Σ kept keys over rows."""
        return self.kept.sum(-1, dtype=torch.int64)

    def valid_per_sequence(self) -> torch.Tensor:
        """(B,) int64 Σ valid keys over rows (the same for every head)."""
        return self.n.sum(-1, dtype=torch.int64)

    def empty_per_head(self) -> torch.Tensor:
        """(B, H) int64 empty rows."""
        return self.empty.sum(-1, dtype=torch.int64)

    def dropped_mass_per_head(self) -> torch.Tensor:
        """(B, H) float64 Σ over rows with a valid key of max(1 − kept_mass, 0), as stats.py sums it."""
        live = (self.n > 0)[:, None]  # (B, 1, Q)
        dropped = (1.0 - self.kept_mass).clamp_min(0.0).masked_fill(~live, 0.0)
        return dropped.double().sum(-1)

    def vrows_per_kv_head(self) -> torch.Tensor | None:
        """(B, Hkv) int64 Σ kept V rows over query rows, or None (prefill)."""
        return None if self.vrows is None else self.vrows.sum(-1, dtype=torch.int64)


def interpreted(kernel) -> bool:
    """Whether a @triton.jit kernel runs in Triton's CPU interpreter: TRITON_INTERPRET=1 when it was decorated
    (its module's import), whatever the variable says now."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_device(kernel, *tensors: torch.Tensor) -> torch.device:
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"all inputs must be on one device, got {t.device} and {device}")
    if interpreted(kernel) and tensors[0].dtype == torch.bfloat16:
        raise ValueError("Triton's interpreter computes tl.dot on bfloat16 tiles wrongly (triton 3.9: it multiplies the "
                         "raw bits); run bfloat16 on a GPU, or float16 / float32 in the interpreter")
    if device.type != "cuda" and not interpreted(kernel):
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got {device.type} tensors; move them to a GPU, or set "
            "TRITON_INTERPRET=1 before triton is first imported to run the kernels on CPU in Triton's interpreter")
    return device


def launching_on(device: torch.device):
    """A context in which Triton launches on ``device``. Triton launches on the current CUDA device, not the
    tensors': a model spread over GPUs (``model.device_map=auto``) has layers on cuda:1 and beyond, whose kernels
    would otherwise run on cuda:0 with pointers into another GPU's memory. A no-op off CUDA (the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[int, ...]:
    """(B, H, Hkv, Q, K, D, Dv) of valid shapes, or a ValueError naming the problem."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError("query (B, H, Q, D), key (B, Hkv, K, D) and value (B, Hkv, K, Dv) must be 4-D")
    B, H, Q, D = query.shape
    Bk, Hkv, K, Dk = key.shape
    if Bk != B or value.shape[:3] != key.shape[:3] or Dk != D:
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} KV heads")
    if query.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"query dtype must be float32, float16 or bfloat16, got {query.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise ValueError(f"query, key and value must share one dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    return B, H, Hkv, Q, K, D, value.shape[-1]


def check_options(placement: str | None, sdc: str | None, empty_rows: str) -> None:
    if placement not in (None, "pre", "post"):
        raise ValueError(f"placement must be 'pre', 'post' or None (dense), got {placement!r}")
    if sdc not in SDC_MODES:
        raise ValueError(f"sdc must be one of {list(SDC_MODES)}, got {sdc!r}")
    if sdc is not None and placement != "pre":
        raise ValueError("SDC compensates the softmax denominator: it needs placement='pre'")
    if empty_rows not in EMPTY_ROWS:
        raise ValueError(f"empty_rows must be one of {EMPTY_ROWS}, got {empty_rows!r}")


def per_sequence(x, B: int, default: int, device) -> torch.Tensor:
    """An int or a (B,) tensor as a contiguous (B,) int32 device tensor (no host read of a tensor)."""
    if x is None:
        x = default
    if isinstance(x, int):
        return torch.full((B,), x, dtype=torch.int32, device=device)
    if x.shape != (B,):
        raise ValueError(f"per-sequence inputs must be (B,) = ({B},), got {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int32).contiguous()


def per_row(x: torch.Tensor | None, B: int, H: int, Q: int, device, name: str, fill: float = 0.0,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A (B|1, H|1, Q|1) per-row tensor as contiguous (B, H, Q) ``dtype`` (float32 unless said)."""
    if x is None:
        return torch.full((B, H, Q), fill, dtype=dtype, device=device)
    if x.ndim != 3:
        raise ValueError(f"{name} must be (B, H, Q) = ({B}, {H}, {Q}) or broadcastable, got {tuple(x.shape)}")
    return x.to(device=device, dtype=dtype).expand(B, H, Q).contiguous()


def row_rule(theta: torch.Tensor | None, cut_offset: torch.Tensor | None, placement: str | None, sdc: str | None,
             empty_rows: str, B: int, H: int, Q: int, device) -> tuple[torch.Tensor, bool]:
    """(the kernels' per-row THETA input, whether it is skip-softmax's cut offset) from a wrapper's arguments.

    Top-θ gives ``theta`` (float32: a logit before the softmax, a probability after it); skip-softmax gives
    ``cut_offset`` = ln(λ/n) per row (float64, −inf for rows kept whole), from which the kernels cut each row at
    min(m + offset, m) with the row's own maximum m (``prefill.skip_cut``)."""
    if cut_offset is None:
        return per_row(theta, B, H, Q, device, "theta", fill=float("-inf")), False
    if theta is not None:
        raise ValueError("give theta (Top-θ) or cut_offset (skip-softmax), not both")
    if placement is None:
        raise ValueError("cut_offset selects keys: it needs placement='pre' or 'post'")
    if sdc == "exp-threshold":
        raise ValueError("SDC('exp-threshold') bounds the dropped logits by a calibrated θ, which skip-softmax has "
                         "not; use SDC('exact')")
    if empty_rows != "keep-max":
        raise ValueError("skip-softmax keeps each row's maximum where its cut passes it: empty_rows='keep-max'")
    return per_row(cut_offset, B, H, Q, device, "cut_offset", dtype=torch.float64), True


@dataclass
class RowInputs:
    """The per-sequence and per-row inputs of the prefill and decode kernels, checked and on the device.

    key_start, key_end, q_offset: (B,) int32. theta: (B, H, Q) the kernels' THETA (``row_rule``), ``skip`` when it
    holds skip-softmax's cut offsets. mass: (B, H, Q) calibrated dropped mass (sdc="calibrated"). uniform: reference
    empty rows before the softmax without SDC attend uniformly to all K keys of the call, whose mean V row is
    ``v_all`` (B, Hkv, Dv). A tensor the kernel does not read is ``theta`` (a valid pointer)."""

    key_start: torch.Tensor
    key_end: torch.Tensor
    q_offset: torch.Tensor
    theta: torch.Tensor
    skip: bool
    mass: torch.Tensor
    sparse: bool
    uniform: bool
    v_all: torch.Tensor


def row_inputs(value: torch.Tensor, B: int, H: int, Q: int, device, *, theta, cut_offset, placement, key_start,
               key_end, q_offset, causal: bool, window: int | None, sdc: str | None, sdc_mass, empty_rows: str
               ) -> RowInputs:
    """The wrappers' shared checks and per-row inputs (their arguments of the same names; K from ``value``)."""
    check_options(placement, sdc, empty_rows)
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a sliding window needs causal rows and window ≥ 1, got window={window}, causal={causal}")
    if sdc == "calibrated" and sdc_mass is None:
        raise ValueError("sdc='calibrated' needs sdc_mass, the calibrated dropped mass per row (B, H, Q)")
    K = value.shape[2]
    th, skip = row_rule(theta, cut_offset, placement, sdc, empty_rows, B, H, Q, device)
    mass = per_row(sdc_mass, B, H, Q, device, "sdc_mass") if sdc == "calibrated" else th
    sparse = placement is not None
    uniform = sparse and placement != "post" and sdc is None and empty_rows == "reference"
    return RowInputs(key_start=per_sequence(key_start, B, 0, device), key_end=per_sequence(key_end, B, K, device),
                     q_offset=per_sequence(q_offset, B, K - Q, device), theta=th, skip=skip, mass=mass, sparse=sparse,
                     uniform=uniform, v_all=value.float().mean(2).contiguous() if uniform else th)  # (B, Hkv, Dv)


def row_bounds(key_start: torch.Tensor, key_end: torch.Tensor, q_offset: torch.Tensor, Q: int,
               window: int | None, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) (B, Q) int64: row i of sequence b attends to keys lo ≤ j < hi (hi ≥ lo), as the kernels do.

    Query i sits at absolute position q_offset + i; causal rows see keys ≤ their position, a window of w the
    keys j > position − w (transformers' sliding window), and every row only keys in [key_start, key_end).
    """
    pos = q_offset.long()[:, None] + torch.arange(Q, device=q_offset.device)  # (B, Q)
    lo = key_start.long()[:, None].expand_as(pos)
    hi = key_end.long()[:, None].expand_as(pos)
    if causal:
        hi = torch.minimum(hi, pos + 1)
        if window is not None:
            lo = torch.maximum(lo, pos - window + 1)
    return lo, torch.maximum(hi, lo)


def value_means(value: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """v̄ of every row (B, Hkv, Q, Dv) float32: the mean V row over its valid keys [lo, hi) (method.md §3.2).

    Float64 prefix sums (as the plain kernel's causal path), torch ops only. The sums run along the last dimension
    (V seen as (B, Hkv, Dv, K)): on a GPU, torch's scan along an outer dimension runs one thread per column
    (6.3 ms for 16k keys of LLaMA-3-8B's 8 KV heads on an H200, a quarter of a prefill layer call,
    results/bench/gpu_profile.md), along the last one it is parallel. Rows without a valid key get 0.
    """
    B, Hkv, K, Dv = value.shape
    Q = lo.shape[1]
    sums = value.transpose(2, 3).double().cumsum(3)  # (B, Hkv, Dv, K): Σ over keys [0, j]
    prefix = torch.cat([sums.new_zeros(B, Hkv, Dv, 1), sums], 3)  # (B, Hkv, Dv, K + 1): Σ over [0, j)
    take = lambda idx: prefix.gather(3, idx[:, None, None, :].expand(B, Hkv, Dv, Q))  # noqa: E731
    n = (hi - lo).clamp_min(1)[:, None, None, :]  # (B, 1, 1, Q)
    return ((take(hi) - take(lo)) / n).transpose(2, 3).float().contiguous()


STATS_COUNTERS = ("kept", "valid", "vrow_kept", "vrow_valid", "decode_steps", "rows", "dropped_mass", "empty_rows")


def stats_target(stats, layer: int, phase: str, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """(the layer's packed counter row on ``device``, first column of each of STATS_COUNTERS) for a kernel that adds
    its call's statistics itself (``stats.SparsityStats.packed_row``); "kept"/"valid" are the phase's own."""
    layout = stats.layout()
    names = [f"{phase}_kept", f"{phase}_valid", *STATS_COUNTERS[2:]]
    return stats.packed_row(layer, device), [layout[name][0] for name in names]


def stats_arguments(stats_row: torch.Tensor | None, stats_columns, fallback: torch.Tensor) -> tuple[list, bool]:
    """The kernels' (STATS_ptr, C_KEPT .. C_EMPTY) arguments and their STATS switch; ``fallback`` stands in for
    the pointer when nothing is counted."""
    if stats_row is None:
        return [fallback] + [0] * len(STATS_COUNTERS), False
    if stats_row.dtype != torch.float64 or not stats_row.is_contiguous() or stats_row.device != fallback.device:
        raise ValueError(f"stats_row must be a contiguous float64 row on {fallback.device} "
                         f"(SparsityStats.packed_row), got {stats_row.dtype} on {stats_row.device}")
    if len(stats_columns) != len(STATS_COUNTERS):
        raise ValueError(f"stats_columns must give the first column of each of {STATS_COUNTERS}")
    return [stats_row, *(int(c) for c in stats_columns)], True


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())

"""The thresholds artefact: θ per (layer, head, row length), saved as safetensors + JSON metadata.

A ``Thresholds`` holds the calibrated values at their granularity (one per layer; per layer and row
length; per layer and head; per layer, head and row length) as a tensor of shape
(L, H or 1, N or 1), NaN where a row length was never calibrated. At run time it expands them once
into a dense lookup table (L, H, N_max + 1) indexed by row length, filling uncalibrated lengths by
the nearest calibrated one (the paper's rule; ties go to the shorter) or by linear interpolation,
optionally smoothed along n with a Gaussian. Rows longer than the longest calibrated length use the
last value (clamped; ``beyond="fit"`` extrapolates a law of θ against n instead, see ``beyond.py``), and
every such row is counted so a run can report it. A (layer, head) with no
calibrated length at all (every calibration row had n ≤ k) gets θ = −inf: it never drops.

A file records the model it was calibrated on (name and revision, see ``model_identity``), its shape and
its dtype; loading it for another model is refused unless the caller says ``allow_other_model=True``. The
values are float32 and device-independent (always saved from the CPU), and the kernel compares scores in
float32 whatever the model's dtype, so thresholds apply to the same model in another dtype unchanged: the
scores themselves shift by that dtype's rounding, so ``check_model`` says so once (and names the fix,
calibrating in that dtype) rather than refusing. ``save_pretrained`` / ``from_pretrained`` keep them in the
model's own folder (``checkpoint.py``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path

import logging

import torch

from .. import compat
from ..atomic import atomic_write
from .beyond import check_rule, fit as fit_beyond

log = logging.getLogger("toptheta")

FORMAT_VERSION = 1
GRANULARITIES = {  # name -> which of (head, row length) the values resolve
    "layer": (False, False),
    "layer-n": (False, True),
    "layer-head": (True, False),
    "layer-head-n": (True, True),
}
LOOKUPS = ("nearest", "linear")


class DamagedThresholds(ValueError):
    """A thresholds file that cannot be read (truncated, not safetensors, no toptheta header): recalibrate."""


class SampledCopy(ValueError):
    """A run store's sampled copy of a large table (store/threshold_copy.py): a record, not thresholds to run with."""


def model_dtype(model) -> str | None:
    """The dtype of a model's parameters as a plain name ("float32", "bfloat16"), None for a config."""
    try:
        return str(next(model.parameters()).dtype).removeprefix("torch.")
    except (AttributeError, StopIteration, TypeError):
        return None


def model_fingerprint(model_or_config) -> dict:
    """Shape identity of a model: what thresholds must match to be applied to it."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = config.num_attention_heads
    return {
        "layers": int(config.num_hidden_layers),
        "heads": int(heads),
        "kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(config, "head_dim", None) or config.hidden_size // heads),
    }


def model_identity(model_or_config) -> dict:
    """Which checkpoint a model is, as far as its config knows: {"name", "revision"}, None where unknown.

    The name is the hub id, or the folder name of a local checkout (not its path, so a moved cache still
    matches); the revision is the hub commit. A model built in code has neither.
    """
    config = getattr(model_or_config, "config", model_or_config)
    name = str(getattr(config, "_name_or_path", "") or "").rstrip("/\\")
    if name and (os.path.isabs(name) or name.startswith((".", "~")) or os.path.isdir(name)):
        name = os.path.basename(os.path.normpath(os.path.expanduser(name)))
    return {"name": name or None, "revision": compat.commit_hash(config) or None}


class Thresholds:
    """Calibrated thresholds for one model, k schedule and placement.

    Args:
        values: (L, H, N) tensor indexed by row length n (so N = max_n + 1), or a coarser
            (L, 1, N), (L, H, 1), (L, 1, 1) for the other granularities. NaN = not calibrated.
        k: the per-layer budget, a list of L ints (rows with n ≤ k[layer] are kept whole).
        placement: "pre" (logit thresholds) or "post" (probability thresholds).
        metadata: free-form provenance (model identity, calibration settings, ...).
        counts: calibration samples behind each value, same shape as ``values`` (optional).
        sdc_mass: mean dropped exponent mass per entry, for calibrated SDC (optional).
        lookup: "nearest" (the paper) or "linear" for row lengths that were not calibrated.
        smooth_sigma: Gaussian smoothing along n, in row lengths (0 = off).
        allow_other_model: apply them to a model whose name or revision differs from the one recorded
            in ``metadata["identity"]`` (the shape must still match).
        beyond: rows longer than any calibrated row: "clamp" (the θ of the longest) or "fit" (``beyond.py``).
    """

    def __init__(self, values: torch.Tensor, k: list[int], placement: str, metadata: dict | None = None,
                 counts: torch.Tensor | None = None, sdc_mass: torch.Tensor | None = None,
                 lookup: str = "nearest", smooth_sigma: float = 0.0, allow_other_model: bool = False,
                 beyond: str = "clamp"):
        values = torch.as_tensor(values, dtype=torch.float32)
        if values.ndim != 3:
            raise ValueError(f"threshold values must be (layers, heads or 1, row lengths or 1), got {tuple(values.shape)}")
        if len(k) != values.shape[0]:
            raise ValueError(f"k must list one budget per layer ({values.shape[0]}), got {len(k)}")
        if placement not in ("pre", "post"):
            raise ValueError(f"placement must be 'pre' or 'post', got {placement!r}")
        if lookup not in LOOKUPS:
            raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
        for name, t in (("counts", counts), ("sdc_mass", sdc_mass)):
            if t is not None and tuple(t.shape) != tuple(values.shape):
                raise ValueError(f"{name} must have the shape of values {tuple(values.shape)}, got {tuple(t.shape)}")
        self.values, self.counts, self.sdc_mass = values, counts, sdc_mass
        self.k = [int(x) for x in k]
        self.placement = placement
        self.lookup_rule, self.smooth_sigma = lookup, float(smooth_sigma)
        self.allow_other_model = bool(allow_other_model)
        self.beyond_rule, self._law = check_rule(beyond), None
        self.metadata = dict(metadata or {})
        self.metadata.setdefault("granularity", _granularity_of(values))
        self._tables: dict = {}
        self._max_n = self.max_n
        self._dtype_said: set = set()  # model dtypes already warned about (check_model runs per sparsify block)

    # --- run-time lookup ------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.values.shape[0]

    @property
    def max_n(self) -> int:
        """Longest calibrated row length (0 when the values do not depend on n)."""
        calibrated = (~torch.isnan(self.values)).any(0).any(0).nonzero()
        return int(calibrated[-1]) if self.values.shape[-1] > 1 and calibrated.numel() else 0

    def k_for(self, layer: int) -> int:
        return self.k[layer]

    def table(self, which: str = "values", device=None) -> torch.Tensor:
        """Dense (L, H|1, N) table with every row length filled; cached per device."""
        key = (which, str(device))
        if key not in self._tables:
            if which == "values":
                table = _fill(self.values, self.lookup_rule, self.smooth_sigma)
            else:  # an uncalibrated dropped mass is 0: compensate nothing rather than guess
                table = torch.nan_to_num(_fill(self.sdc_mass, self.lookup_rule, 0.0), nan=0.0, posinf=0.0, neginf=0.0)
            self._tables[key] = table.to(device)
        return self._tables[key]

    def lookup(self, layer: int, n: torch.Tensor, which: str = "values") -> tuple[torch.Tensor, int]:
        """θ for rows of lengths ``n`` (B, 1, Q) -> ((B, H, Q) float32, rows clamped at max_n)."""
        table = self.table(which, n.device)[layer]  # (H|1, N)
        last = table.shape[-1] - 1
        idx = n.clamp(max=last)  # (B, 1, Q)
        clamped = 0
        if last > 0:  # a count; on an accelerator a device tensor, read when the statistics are read
            clamped = (n > self._max_n).sum()
            clamped = int(clamped) if n.device.type == "cpu" else clamped
        theta = table[:, idx.flatten()].view(table.shape[0], *n.shape).squeeze(2).permute(1, 0, 2)  # (B, H|1, Q)
        if self.beyond_rule == "fit" and which == "values" and last > 0:
            if self._law is None:
                self._law = fit_beyond(self.values, self.placement, self.counts)
            theta = self._law.apply(layer, n, theta, self._max_n)
        return theta, clamped

    def lookup_sdc(self, layer: int, n: torch.Tensor) -> torch.Tensor:
        return self.lookup(layer, n, which="sdc_mass")[0]

    # --- checks ---------------------------------------------------------------------------------
    def check_model(self, model) -> None:
        """Refuse to apply thresholds to another checkpoint or a model of another shape, naming both.

        Name and revision are compared where both sides know them (``model_identity``); the
        ``allow_other_model`` flag lifts that check (e.g. base thresholds on the instruct model), never
        the shape check.
        """
        recorded, actual_id = self.metadata.get("identity") or {}, model_identity(model)
        differs = [f for f in ("name", "revision") if recorded.get(f) and actual_id[f] and recorded[f] != actual_id[f]]
        if differs and not self.allow_other_model:
            raise ValueError(
                f"these thresholds were calibrated on {recorded.get('name')} (revision {recorded.get('revision')}), "
                f"but this model is {actual_id['name']} (revision {actual_id['revision']}); calibrate for this "
                "model, or load with allow_other_model=True to apply them anyway"
            )
        expected = self.metadata.get("fingerprint")
        actual = model_fingerprint(model)
        if expected is not None and {k: expected.get(k) for k in actual} != actual:
            raise ValueError(
                f"these thresholds were calibrated for a model with {expected}, but this model has {actual} "
                f"(calibrated on {self.metadata.get('model', 'an unknown model')}); calibrate for this model"
            )
        if self.num_layers != actual["layers"]:
            raise ValueError(f"thresholds have {self.num_layers} layers, the model has {actual['layers']}")
        if self.values.shape[1] not in (1, actual["heads"]):
            raise ValueError(f"thresholds have {self.values.shape[1]} heads, the model has {actual['heads']}")
        self._say_dtype(model)

    def _say_dtype(self, model) -> None:
        """Calibrated in one dtype, applied in another: θ is used as stored (float32), said once per dtype."""
        recorded, actual = self.metadata.get("dtype"), model_dtype(model)
        if recorded and actual and recorded != actual and actual not in self._dtype_said:
            self._dtype_said.add(actual)
            log.warning("thresholds calibrated on a %s model are applied to a %s model: θ stays as calibrated (scores "
                        "are compared in float32) but the %s scores round differently, so kept counts may drift; "
                        "calibrate in %s for thresholds fitted to it", recorded, actual, actual, actual)

    # --- storage --------------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.values, self.counts, self.sdc_mass) if t is not None)

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``path`` (safetensors with the metadata as JSON in its header), atomically."""
        from safetensors.torch import save_file  # safetensors: not loaded by `import toptheta`, only to write a file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"values": self.values.cpu().contiguous()}  # device-independent: a file loads anywhere
        if self.counts is not None:
            tensors["counts"] = self.counts.float().cpu().contiguous()
        if self.sdc_mass is not None:
            tensors["sdc_mass"] = self.sdc_mass.float().cpu().contiguous()
        header = {"format": FORMAT_VERSION, "k": self.k, "placement": self.placement, "lookup": self.lookup_rule,
                  "smooth_sigma": self.smooth_sigma, "metadata": self.metadata}
        # fsynced before the rename: a cached file other jobs reuse must not be empty after a power cut
        return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata={"toptheta": json.dumps(header, default=str)}),
                            fsync=True)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write these thresholds into a Hugging Face model folder, beside its weights (see ``checkpoint.py``)."""
        from .checkpoint import save_pretrained  # cycle: checkpoint imports this module

        return save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, model=None, **kwargs) -> "Thresholds":
        """Read thresholds a model folder carries (``save_pretrained``), refusing another model (``checkpoint.py``)."""
        from .checkpoint import from_pretrained  # cycle: checkpoint imports this module

        return from_pretrained(directory, model, **kwargs)

    @classmethod
    def load(cls, path: str | os.PathLike, model=None, *, allow_other_model: bool = False,
             **overrides) -> "Thresholds":
        """Read a file written by :meth:`save`; with ``model``, check it is that model's (see ``check_model``).

        ``overrides``: ``lookup`` and ``smooth_sigma``, which only change how lengths are filled at run time.
        """
        from safetensors import safe_open  # safetensors: not loaded by `import toptheta`, only to read a file

        from ..store.threshold_copy import SAMPLED_KEY  # the run store's record of a large table: refused below

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no thresholds file at {path}; calibrate first (toptheta.calibrate or run.py)")
        try:
            with safe_open(str(path), framework="pt") as f:
                if SAMPLED_KEY in (f.metadata() or {}):
                    raise SampledCopy(f"{path} is a run store's sampled record of a thresholds table (every s-th row "
                                      "length), not thresholds to run with; rerun that run's command to recalibrate "
                                      "the full table, or load the file its meta.json's thresholds_ref names")
                header = json.loads((f.metadata() or {})["toptheta"])
                # copies, not views of the mapped file: a file changed under a running job cannot crash it
                tensors = {name: f.get_tensor(name).clone() for name in f.keys()}
        except SampledCopy:
            raise
        except Exception as err:  # safetensors raises several error types for damaged files
            raise DamagedThresholds(f"{path} is not a readable toptheta thresholds file ({err}); delete it and "
                                    "calibrate again") from err
        if not isinstance(header, dict):
            raise DamagedThresholds(f"{path} has no toptheta header; delete it and calibrate again")
        if header.get("format") != FORMAT_VERSION:
            raise ValueError(f"{path} has thresholds format {header.get('format')}, this toptheta reads {FORMAT_VERSION}")
        missing = [f for f in ("k", "placement") if f not in header] + (["values"] if "values" not in tensors else [])
        if missing:
            raise DamagedThresholds(f"{path} lacks {', '.join(missing)}, so it was not written by Thresholds.save; "
                             "delete it and calibrate again")
        options = {"lookup": header.get("lookup", "nearest"), "smooth_sigma": header.get("smooth_sigma", 0.0), **overrides}
        thresholds = cls(tensors["values"], header["k"], header["placement"], header.get("metadata"),
                         counts=tensors.get("counts"), sdc_mass=tensors.get("sdc_mass"),
                         allow_other_model=allow_other_model, **options)
        if model is not None:
            thresholds.check_model(model)
        return thresholds

    def __repr__(self) -> str:
        return (f"Thresholds(shape={tuple(self.values.shape)}, granularity={self.metadata.get('granularity')!r}, "
                f"placement={self.placement!r}, max_n={self.max_n}, k={sorted(set(self.k))})")


def check_sdc_source(source, sparsifier, model=None) -> None:
    """Refuse calibrated-SDC masses that were not measured for this sparsifier (and model), naming the fix.

    The masses of (layer, head, n) are the mean dropped mass of the k per layer and placement they were
    calibrated with (method.md §3.1): another k drops another mass, so k and placement must match the
    sparsifier's, and the shape must match the model's.
    """
    if source is None or getattr(source, "sdc_mass", None) is None:
        raise ValueError("SDC('calibrated') needs thresholds calibrated with the dropped-mass statistic "
                         "(toptheta.calibrate collects it for placement='pre'); pass SDC('calibrated', thresholds=...)")
    if source.placement != sparsifier.placement:
        raise ValueError(f"the calibrated SDC masses are for placement={source.placement!r}, the sparsifier selects "
                         f"{sparsifier.placement!r}; calibrate with placement={sparsifier.placement!r}")
    wanted = [sparsifier.k_for(layer) for layer in range(source.num_layers)]
    if wanted != source.k:
        raise ValueError(f"the calibrated SDC masses were measured with k per layer {source.k}, the sparsifier keeps "
                         f"{wanted}; calibrate with the sparsifier's k and layer_k")
    if model is not None:
        source.check_model(model)


def check_thresholds_fit(model, sparsifier, compensations=()) -> None:
    """Every thresholds object a ``toptheta.sparsify`` block reads fits the model and the sparsifier:
    the sparsifier's own (``check_model``) and each calibrated SDC's source (``check_sdc_source``)."""
    own = getattr(sparsifier, "thresholds", None)
    if own is not None:
        own.check_model(model)
    for c in compensations:
        if getattr(c, "estimator", None) == "calibrated":
            check_sdc_source(getattr(c, "thresholds", None) or own, sparsifier, model)


def stamp(metadata: dict) -> dict:
    """Add the package version and the date to calibration metadata."""
    from .. import __version__  # cycle: toptheta/__init__ imports this module before it sets __version__

    return {**metadata, "toptheta_version": __version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def storage_bytes(layers: int, heads: int, max_n: int, bytes_per_value: int = 2) -> int:
    """Bytes of one θ per (layer, head, row length), e.g. LLaMA-3-70B: storage_bytes(80, 64, 1200)."""
    return layers * heads * max_n * bytes_per_value


def _granularity_of(values: torch.Tensor) -> str:
    per_head, per_n = values.shape[1] > 1, values.shape[2] > 1
    return {v: k for k, v in GRANULARITIES.items()}[(per_head, per_n)]


def _fill(values: torch.Tensor, rule: str, sigma: float) -> torch.Tensor:
    """Fill NaN row lengths per (layer, head) by the nearest or linear rule, then smooth along n."""
    L, H, N = values.shape
    out = values.clone()
    if N == 1:  # nothing calibrated for this (layer, head): never drop (θ = −inf keeps every valid key)
        return torch.nan_to_num(out, nan=float("-inf"))
    n_axis = torch.arange(N, dtype=torch.float32)
    for layer in range(L):
        for head in range(H):
            row = values[layer, head]
            known = (~torch.isnan(row)).nonzero().flatten()
            if known.numel() == 0:  # nothing calibrated (e.g. every row had n ≤ k): never drop, θ = −inf
                out[layer, head] = float("-inf")
                continue
            out[layer, head] = _fill_row(row[known], known.float(), n_axis, rule)
            if sigma > 0:
                lo, hi = int(known[0]), int(known[-1]) + 1
                out[layer, head, lo:hi] = _gaussian_smooth(out[layer, head, lo:hi], sigma)
                out[layer, head, hi:] = out[layer, head, hi - 1]
                out[layer, head, :lo] = out[layer, head, lo]
    return out


def _fill_row(known_values: torch.Tensor, known_n: torch.Tensor, n_axis: torch.Tensor, rule: str) -> torch.Tensor:
    if rule == "nearest":
        return known_values[_nearest(known_n, n_axis)]
    # linear inside the calibrated range, clamped to the end values outside it
    idx = torch.searchsorted(known_n, n_axis.clamp(known_n[0], known_n[-1]), right=True).clamp(1, len(known_n) - 1)
    if len(known_n) == 1:
        return known_values[0].expand_as(n_axis).clone()
    x0, x1 = known_n[idx - 1], known_n[idx]
    y0, y1 = known_values[idx - 1], known_values[idx]
    t = ((n_axis.clamp(known_n[0], known_n[-1]) - x0) / (x1 - x0)).clamp(0, 1)
    return y0 + t * (y1 - y0)


def _nearest(known_n: torch.Tensor, n_axis: torch.Tensor) -> torch.Tensor:
    """Index of the calibrated length nearest to every n, ties to the shorter (method.md §2.1); O(N) memory.

    known_n (known,) ascending, n_axis (N,) -> (N,) indices into known_n. Only the two calibrated lengths
    around n can be nearest: the first one ≥ n (searchsorted) and the one before it.
    """
    above = torch.searchsorted(known_n, n_axis).clamp(max=len(known_n) - 1)  # (N,) first known ≥ n, or the last
    below = (above - 1).clamp(min=0)
    return torch.where((known_n[above] - n_axis).abs() < (n_axis - known_n[below]).abs(), above, below)


def _gaussian_smooth(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """1-D Gaussian filter with reflected edges (the reference's offline smoothing, method.md §2.5)."""
    radius = max(1, int(math.ceil(4 * sigma)))
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel /= kernel.sum()
    padded = torch.nn.functional.pad(x[None, None], (radius, radius), mode="reflect" if len(x) > radius else "replicate")
    return torch.nn.functional.conv1d(padded, kernel[None, None]).flatten()

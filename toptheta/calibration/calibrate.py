"""``toptheta.calibrate``: run calibration forwards and return a :class:`Thresholds` (method.md §2.2).

One straight path: check every argument, build a streaming collector, run the model over the
calibration batches inside ``toptheta.sparsify`` with the collector as observer (exact top-k during
calibration with TAC, dense otherwise, with the compensation of ``calibration_compensation``), reduce
the sums at the requested granularity, and wrap the result with its provenance.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Iterable, Sequence

import torch
from tqdm.auto import tqdm

from .. import compat
from ..attention.backend import model_shape, sparsify
from ..attention.cache import growing_cache
from ..compensation import SDC, VMC, is_compensation, lower
from ..sparsifiers import Dense, TopK, TopRho
from ..sparsifiers.base import check_placement
from .collector import PHASES, OrderStatCollector
from .progress import Progress, inputs_digest, weights_digest
from .target_k import TargetKCollector
from ..thresholds.checkpoint import budget_record as run_budget_record
from ..thresholds.table import GRANULARITIES, LOOKUPS, Thresholds, model_dtype, model_fingerprint, model_identity, stamp

log = logging.getLogger("toptheta")

STATISTICS = ("order", "target-k")
COMPENSATION_MODES = ("run", "reference", "none")


def calibration_compensation(compensations: Sequence, placement: str, mode: str = "run", tac: bool = True) -> list:
    """The compensation calibration forwards apply, given the run's (method.md §2.2 step 5).

    With TAC, calibration drops mass like the run will, so what is put back shapes the inputs of every
    deeper layer, and with them its thresholds.

    * ``"run"`` (default): the run's own compensation, so deeper layers calibrate on the activations
      they will see. SDC estimators that need calibration output (``exp-threshold``: θ; ``calibrated``:
      the masses) are applied as the exact dropped mass they estimate, with the run's λ.
    * ``"reference"``: the reference code's rule: VMC as in the run, SDC never. With pre-softmax
      selection and no SDC the rows are renormalised, β = 0 and VMC does nothing, so it is left out.
    * ``"none"``: nothing put back.

    Without TAC calibration forwards are dense: nothing is dropped, and nothing is compensated.
    """
    if mode not in COMPENSATION_MODES:
        raise ValueError(f"calibration compensation must be one of {COMPENSATION_MODES}, got {mode!r}")
    bad = [c for c in compensations if not is_compensation(c)]
    if bad:
        raise TypeError(f"compensations must be compensation objects (SDC, VMC, ...), got {bad}")
    if not tac or mode == "none":
        return []
    sdc = lower(compensations, "pre").sdc
    out = [SDC("exact", scale=sdc.scale)] if sdc is not None and mode == "run" else []
    if lower(compensations, "post").vmc and (placement == "post" or out):
        out.append(VMC())
    return out


def compensation_labels(compensations: Sequence) -> list[str]:
    """Short stable names, e.g. ["SDC(exact, λ=1.0)", "VMC"], for metadata and cache keys."""
    return [c.label for c in compensations]


def calibrate(
    model: torch.nn.Module,
    inputs: Iterable,
    *,
    k: int,
    placement: str = "post",
    layer_k: dict[int, int] | None = None,
    statistic: str = "order",
    sigma_add: float = 0.1,
    granularity: str = "layer-head-n",
    tac: bool = True,
    compensations: Sequence = (),
    compensation: str = "run",
    sample_frac: float = 1.0,
    seed: int = 0,
    generate_tokens: int = 0,
    phases: tuple[str, ...] = PHASES,
    lookup: str = "nearest",
    smooth_sigma: float = 0.0,
    max_n: int | None = None,
    metadata: dict | None = None,
    progress: bool = True,
    share_prefixes: bool = True,
    progress_file: str | Path | None = None,
    progress_every: float | None = None,
    rho: float | None = None,
    head_weights: Sequence[Sequence[float]] | None = None,
) -> Thresholds:
    """Calibrate Top-θ thresholds for ``model`` on ``inputs``.

    Args:
        inputs: an iterable of batches; each a dict with ``input_ids`` (and optionally a left-padded
            ``attention_mask``), a LongTensor (B, T) or (T,), or a list of token-id lists.
        k: keys per row; ``layer_k`` overrides it per layer, e.g. ``{0: 512, 1: 512}`` (method.md §2.3).
        placement: "post" (probability thresholds) or "pre" (scaled-logit thresholds).
        rho, head_weights: calibrate θ to Top-ρ's kept set instead of the top-k: a row of n keys keeps its
            ⌈ρ·w·n⌉ largest scores at a head of weight w (``head_weights``: one list per layer of one weight per
            query head, ``scripts/head_budget.py``; None: w = 1), so θ follows a budget that grows with the row and
            differs between heads. τ is then each row's largest score outside that set (per head); a head that keeps
            a row whole adds nothing for it. TAC runs Top-ρ; rows with n ≤ k (``layer_k``) stay whole as with
            top-k. Needs ``statistic="order"``. None: the paper's top-k budget.
        statistic: "order" = mean + σ_add·std of each row's (k + 1)-th largest score (the paper,
            method.md §2.2); "target-k" = θ whose expected kept count per row is k (MKC, method.md §4).
        sigma_add: σ_add of the "order" statistic (0.1 in every paper run; unused by "target-k").
        granularity: "layer", "layer-n", "layer-head" or "layer-head-n" (the paper's).
        tac: apply exact top-k during calibration, so deeper layers calibrate on sparsified inputs.
        compensations: the compensation the thresholds will run with, e.g. ``[SDC("exact"), VMC()]``.
        compensation: how calibration forwards apply it (with ``tac``): "run" (the run's, SDC as its
            exact mass), "reference" (the reference code: VMC, never SDC) or "none"; see
            ``calibration_compensation``.
        sample_frac, seed: each eligible row is used with probability ``sample_frac`` (seeded).
        generate_tokens: G > 0 calibrates on greedy generation of G tokens per batch, so decode rows
            (KV length N, sharing key n = N with prefill rows) are sampled too (method.md §2.4).
        phases: which rows to use, a subset of ("prefill", "decode").
        lookup, smooth_sigma: how the artefact fills uncalibrated row lengths (see ``Thresholds``).
        max_n: longest row length to calibrate; None = the longest row seen.
        metadata: provenance to record (e.g. ``{"task": "arc_challenge", "split": "train"}``).
        progress: show a tqdm bar.
        share_prefixes: sequences that share leading tokens (fixed few-shot exemplars, the choices of one question)
            run those tokens once, their rows counted once per sequence, and continue from the cached keys and
            values (:func:`_run_shared`); only for batches of one unpadded sequence, all rows used
            (``sample_frac`` = 1), no generation, and a statistic that does not depend on the order rows come in
            (not pre-softmax target-k). The thresholds are the unshared run's up to float rounding.
        progress_file: a file where the calibration saves its state every ``progress_every`` seconds (None: 300),
            after a whole batch or prefix group, and from which a rerun of the same calibration goes on where it
            stopped, with the thresholds of a run never stopped (:mod:`.progress`); removed on return. A file of another
            calibration is refused before any forward runs.

    Returns:
        a :class:`Thresholds` with values (L, H|1, N|1), per-entry sample counts, the mean dropped
        mass for calibrated SDC (pre-softmax), and the metadata.
    """
    placement = check_placement(placement)
    L, H, _ = model_shape(model)
    layer_k = {int(layer): int(v) for layer, v in (layer_k or {}).items()}
    _check_arguments(k, layer_k, L, statistic, granularity, lookup, smooth_sigma, generate_tokens, phases)
    k_per_layer = [layer_k.get(layer, k) for layer in range(L)]
    budget, budget_record = _budget_rule(rho, head_weights, k, placement, layer_k, statistic, L, H, model)
    applied = calibration_compensation(compensations, placement, compensation, tac)
    options = dict(sample_frac=sample_frac, seed=seed, phases=tuple(phases), max_n=max_n, topk_keep=tac)
    if budget is not None:
        options["keep_rule"] = budget
    if statistic == "order":
        collector = OrderStatCollector(k_per_layer, H, placement, sigma_add=sigma_add, **options)
    else:
        collector = TargetKCollector(k_per_layer, H, placement, **options)
    sparsifier = (budget or TopK(k, placement, layer_k)) if tac else Dense()

    # Pre-softmax target-k fits each layer's grid to the first rows it sees, so its θ depend on the order rows come
    # in: those calibrations run every sequence whole, in the order given.
    order_free = statistic == "order" or placement == "post"
    shareable = share_prefixes and order_free and not generate_tokens and sample_frac == 1.0
    inputs, shared = _shareable(inputs) if shareable else (inputs, None)
    identity = {}
    if progress_file is not None:  # what the sums depend on, so a saved state is only taken up by its own calibration
        inputs = list(inputs)
        identity = {"model": model_identity(model), "fingerprint": model_fingerprint(model),
                    "dtype": model_dtype(model), "weights": weights_digest(model),
                    "inputs": inputs_digest(as_batch(batch) for batch in inputs), "shared": shared is not None,
                    "k_per_layer": k_per_layer, "placement": placement, "statistic": statistic,
                    "sigma_add": sigma_add, "tac": tac, "compensation": compensation_labels(applied),
                    "options": {**options, "phases": list(phases), **budget_record}, "generate_tokens": generate_tokens}
        identity["options"].pop("keep_rule", None)
    done = Progress(progress_file, identity, progress_every)
    done.resume(collector)
    if shared is not None:
        _run_shared(model, shared, sparsifier, applied, collector, done, progress)
    else:
        _run(model, inputs, sparsifier, applied, collector, generate_tokens, done, progress)
    sequences, tokens, tokens_run = (done.counts[name] for name in ("sequences", "tokens", "tokens_run"))
    if collector.rows_sampled.sum() == 0:
        raise ValueError(
            f"no calibration row was longer than k (k per layer {sorted(set(k_per_layer))}, longest row "
            f"{collector.max_n_seen or 'shorter than k'}); use longer sequences, a smaller k, or a larger sample_frac"
        )
    values, counts, sdc_mass = collector.reduce(granularity)
    _check_meaningful(values, placement, sigma_add if statistic == "order" else None)

    provenance = {
        "model": getattr(model.config, "_name_or_path", None) or type(model).__name__,
        "revision": compat.commit_hash(model.config),
        "fingerprint": model_fingerprint(model), "dtype": model_dtype(model),
        "k": k, "layer_k": layer_k, "k_per_layer": k_per_layer, "placement": placement,
        "granularity": granularity, "statistic": statistic,
        "sigma_add": sigma_add if statistic == "order" else None, "tac": tac,
        "compensation": compensation, "calibration_compensation": compensation_labels(applied),
        "sample_frac": sample_frac, "seed": seed, "generate_tokens": generate_tokens, "phases": list(phases),
        "max_n": max_n, "sequences": sequences, "tokens": tokens, "tokens_run": tokens_run,
        "rows_eligible": collector.rows_eligible.long().tolist(),  # per layer, before sampling
        "rows_sampled": collector.rows_sampled.long().tolist(),
        "collector_bytes": collector.nbytes(),
        **budget_record,
    }
    if statistic == "target-k":
        grid = [collector.edges(layer)[[0, -1]].tolist() for layer in range(L)]  # per layer, NaN = never set
        provenance.update(grid_size=collector.grid_size, grid_range=grid,
                          grid_clamped=collector.grid_clamped, exact_n=collector.exact_n,
                          per_octave=collector.per_octave)
    # The identity is read off the model itself, whatever ``metadata`` says: Thresholds.check_model compares it.
    provenance = stamp({**provenance, **(metadata or {}), "identity": model_identity(model)})
    thresholds = Thresholds(values, k_per_layer, placement, provenance,
                            counts=counts, sdc_mass=sdc_mass, lookup=lookup, smooth_sigma=smooth_sigma)
    done.finish()
    return thresholds


def _budget_rule(rho, head_weights, k, placement: str, layer_k: dict, statistic: str, num_layers: int,
                 num_heads: int, model) -> tuple[TopRho | None, dict]:
    """(the Top-ρ rule θ is calibrated to, its provenance ``{"budget": {...}}``), or (None, {}) for the top-k budget;
    fails before any forward, naming the fix."""
    if rho is None and head_weights is None:
        return None, {}
    if rho is None:
        raise ValueError("head_weights shares a budget ρ between heads: give rho too (e.g. rho=0.05)")
    if statistic != "order":
        raise ValueError(f"a Top-ρ budget (rho) needs statistic='order'; {statistic!r} aims at k keys per row")
    if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not 0 < rho <= 1:
        raise ValueError(f"rho must be a share of each row's keys in (0, 1], got {rho!r}")
    rule = TopRho(float(rho), placement, k, layer_k, head_weights)
    name = getattr(model.config, "_name_or_path", None) or type(model).__name__
    TopRho.check_model({"head_weights": rule.head_weights}, num_layers, num_heads, name)
    # Recorded as a run's settings record it, so a set saved with save_pretrained is found by the runs that ask for it.
    return rule, run_budget_record({"budget": "toprho", "rho": rho, "head_weights": rule.head_weights})


NEGATIVE_THETA_LIMIT = 0.01  # post-softmax θ below 0 keep their rows whole: refused above this fraction


def _check_meaningful(values: torch.Tensor, placement: str, sigma_add: float | None) -> None:
    """A post-softmax θ below 0 keeps every key of its rows (probabilities are ≥ 0): a negative sigma_add can push
    mean − |σ|·std there. Refused when 1 % or more of the calibrated values are, warned about (with the count) below."""
    if placement != "post":
        return
    calibrated = ~torch.isnan(values)
    below = int((values[calibrated] < 0).sum())
    if not below:
        return
    total = int(calibrated.sum())
    message = (f"{below} of {total} post-softmax thresholds are below 0 (sigma_add={sigma_add}): their rows keep every "
               "key, so the run is dense there; use sigma_add >= 0 (the paper: 0.1)")
    if below >= NEGATIVE_THETA_LIMIT * total:
        raise ValueError(message)
    log.warning(message)


def _check_arguments(k, layer_k, num_layers, statistic, granularity, lookup, smooth_sigma, generate_tokens, phases):
    """Fail before any forward pass, naming the fix."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer ≥ 1, got {k!r}")
    outside = [layer for layer in layer_k if not 0 <= layer < num_layers]
    if outside:
        raise ValueError(f"layer_k names layers {outside}, but the model has layers 0..{num_layers - 1}")
    if any(v < 1 for v in layer_k.values()):
        raise ValueError(f"every layer_k value must be ≥ 1, got {layer_k}")
    if statistic not in STATISTICS:
        raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {list(GRANULARITIES)}, got {granularity!r}")
    if lookup not in LOOKUPS:
        raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
    if smooth_sigma < 0:
        raise ValueError(f"smooth_sigma must be ≥ 0, got {smooth_sigma}")
    if not isinstance(generate_tokens, int) or generate_tokens < 0:
        raise ValueError(f"generate_tokens must be an integer ≥ 0, got {generate_tokens!r}")
    if "decode" in phases and "prefill" not in phases and generate_tokens == 0:
        raise ValueError("phases=('decode',) needs decode rows: pass generate_tokens > 0")


def _run(model, inputs, sparsifier, compensations, collector, generate_tokens: int, done: Progress,
         progress: bool) -> None:
    """Calibration forwards (or greedy generations) under no_grad, batch by batch after the ``done.units`` first;
    ``done`` counts sequences and tokens and saves the state after each batch when due."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    skip = done.units
    skip_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    try:
        with torch.no_grad(), sparsify(model, sparsifier, compensations, stats=False, observer=collector):
            for number, batch in enumerate(tqdm(inputs, desc="calibrating", unit="batch", disable=not progress), 1):
                if number <= skip:  # a saved state holds it
                    continue
                input_ids, attention_mask = as_batch(batch)
                input_ids = input_ids.to(device)
                attention_mask = attention_mask.to(device) if attention_mask is not None else None
                if generate_tokens:
                    pad = getattr(model.generation_config, "pad_token_id", None)
                    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=generate_tokens,
                                   do_sample=False, pad_token_id=pad if pad is not None else 0,
                                   cache=growing_cache(model))
                else:  # only attention matters: skip the vocabulary projection where the model allows it
                    model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **skip_logits)
                tokens = int(attention_mask.sum()) if attention_mask is not None else input_ids.numel()
                done.counts["sequences"] += input_ids.shape[0]
                done.counts["tokens"] += tokens
                done.counts["tokens_run"] += tokens
                done.unit_done(collector, number)
    finally:
        model.train(was_training)


def _shareable(inputs) -> tuple[Iterable, list[list[int]] | None]:
    """(inputs, their token lists) when every batch holds one unpadded sequence, else (inputs, None)."""
    inputs = list(inputs)
    sequences = []
    for batch in inputs:
        ids, mask = as_batch(batch)
        if ids.shape[0] != 1 or (mask is not None and not bool(mask.all())):
            return inputs, None
        sequences.append(ids[0].tolist())
    return inputs, sequences


def _run_shared(model, sequences: list[list[int]], sparsifier, compensations, collector, done: Progress,
                progress: bool) -> None:
    """Calibration forwards that run tokens shared by several sequences once (``prefix_cache.run_shared``), the
    collector counting each row once per sequence, unit by unit after the ``done.units`` first (a unit: a group
    sharing a prefix, or one sequence); ``done`` counts sequences and tokens and saves the state when due."""
    from ..evaluation.prefix_cache import run_shared  # evaluation: not at import
    was_training = model.training
    model.eval()
    done.counts.update(sequences=len(sequences), tokens=sum(map(len, sequences)))
    bar = tqdm(total=len(sequences), initial=done.counts.get("finished", 0), desc="calibrating", unit="seq",
               disable=not progress)
    tokens_before = done.counts["tokens_run"]

    def finished() -> None:
        done.counts["finished"] = done.counts.get("finished", 0) + 1
        bar.update(1)

    def unit_done(units: int, tokens_run: int) -> None:
        done.counts["tokens_run"] = tokens_before + tokens_run
        done.unit_done(collector, units)

    try:
        with sparsify(model, sparsifier, compensations, stats=False, observer=collector):
            run_shared(model, sequences, collector.repeated, done=finished, skip_units=done.units,
                       unit_done=unit_done)
    finally:
        bar.close()
        model.train(was_training)


def as_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalise one calibration batch to (input_ids (B, T) long, attention_mask (B, T) or None).

    Lists of unequal length are left-padded (id 0, masked): padded query rows then have no valid
    key and are never sampled. A right-padded mask is refused, because its padded query rows still
    see the real tokens and would be calibrated as if they were real rows.
    """
    mask = None
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        if "input_ids" not in batch:
            raise ValueError(f"a calibration batch dict needs 'input_ids', got keys {list(batch.keys())}")
        ids, mask = batch["input_ids"], batch.get("attention_mask")
    else:
        ids = batch
    if isinstance(ids, (list, tuple)):
        if not ids:
            raise ValueError("empty calibration batch")
        seqs = [list(s) for s in ids] if isinstance(ids[0], (list, tuple, torch.Tensor)) else [list(ids)]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([[0] * (width - len(s)) + [int(t) for t in s] for s in seqs], dtype=torch.long)
        padded = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
        mask = padded if mask is None and bool((padded == 0).any()) else mask
    ids = torch.as_tensor(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be integer token ids of shape (B, T), got {ids.dtype} {tuple(ids.shape)}")
    if mask is not None:
        mask = torch.as_tensor(mask)
        mask = mask[None] if mask.ndim == 1 else mask
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(ids.shape)}")
        if bool((mask[:, -1] == 0).any()):
            raise ValueError("calibration batches must be left-padded (tokenizer.padding_side = 'left'), "
                             "so padded positions are not calibrated as rows")
    return ids.long(), mask

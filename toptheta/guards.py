"""Warnings a legal run gets when it likely did not do what was meant, once per run, with the count and the fix.

Errors belong before the work (``config.check`` at composition, ``builders.check_sparsifies`` and
``attention.backend.check_supported`` once the model is known); these come after a run, from its statistics.
"""

from __future__ import annotations

import logging

log = logging.getLogger("toptheta")

KEPT_WARNING = 0.95  # a sparse run keeping more than this fraction of attention is likely not what was meant


def warn_unintended(label: str, sparsifier: dict, calib: dict | None, stats, thresholds=None) -> None:
    """One warning each, with the count and the fix, for a legal run that likely did not do what was meant: a sparse
    run that kept nearly everything, and rows longer than any calibrated row whose θ is the longest row's
    (``calib.beyond=clamp``; under ``fit`` their count is only logged, since extrapolating was what was asked)."""
    if sparsifier["name"] == "dense":
        return
    kept, valid = float(stats.prefill_kept.sum()), float(stats.prefill_valid.sum())  # the reported fraction's counts
    if valid and kept == valid:
        log.warning("%s kept every attention element: no row was longer than its layer's k (sparsifier.k=%s, "
                    "layer_k=%s). Lower sparsifier.k or evaluate longer prompts", label, sparsifier["k"],
                    sparsifier.get("layer_k"))
    elif valid and kept / valid > KEPT_WARNING:
        fix = ("raise calib.sigma_add towards the paper's 0.1 (a negative one lowers θ), or lower sparsifier.k"
               if calib is not None and float(calib.get("sigma_add") or 0) < 0 else
               "lower sparsifier.k, free layers from sparsifier.layer_k, or evaluate longer prompts")
        log.warning("%s kept %.1f%% of the attention elements (%d of %d), above %.0f%%, for a sparse run "
                    "(sparsifier.k=%s, layer_k=%s): %s", label, 100 * kept / valid, kept, valid,
                    100 * KEPT_WARNING, sparsifier["k"], sparsifier.get("layer_k"), fix)
    clamped = int(stats.clamped_rows)
    if not clamped or thresholds is None:
        return
    if getattr(thresholds, "beyond_rule", "clamp") == "fit":
        log.info("%s: %d attention rows were longer than the longest calibrated row (%d keys); their θ came from the "
                 "law fitted over the calibrated lengths (calib.beyond=fit)", label, clamped, thresholds.max_n)
    else:
        log.warning("%s: %d attention rows were longer than the longest calibrated row (%d keys) and used its θ "
                    "(clamped rows); calibrate on longer documents (calib.task, calib.num_samples; calib.max_length "
                    "when model.max_length cuts them), extrapolate θ (calib.beyond=fit) or cap the evaluated length "
                    "(task.max_length=%d)", label, clamped, thresholds.max_n, thresholds.max_n)

"""The thresholds artefact (θ per layer, head and row length) on the package's lowest floor: it imports nothing of
toptheta but ``compat`` and ``atomic``, so the attention backends, the sparsifiers and calibration all build on it
without importing upwards. ``table.py``: ``Thresholds`` (files, lookup tables, checks); ``beyond.py``: θ for rows
longer than any calibrated one (``calib.beyond``); ``checkpoint.py``: thresholds kept in a model's own folder. ``toptheta.calibration`` re-exports what it always exported.
"""

from .table import (GRANULARITIES, LOOKUPS, DamagedThresholds, Thresholds, check_sdc_source, check_thresholds_fit,
                    model_dtype, model_fingerprint, model_identity, stamp, storage_bytes)

__all__ = [
    "GRANULARITIES", "LOOKUPS", "DamagedThresholds", "Thresholds", "check_sdc_source", "check_thresholds_fit",
    "model_dtype", "model_fingerprint", "model_identity", "stamp", "storage_bytes",
]

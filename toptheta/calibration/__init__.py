"""Threshold calibration and the thresholds artefact."""

from .thresholds import GRANULARITIES, Thresholds, model_fingerprint, storage_bytes

__all__ = ["GRANULARITIES", "Thresholds", "model_fingerprint", "storage_bytes"]

"""Threshold calibration and the thresholds artefact."""

from .calibrate import STATISTICS, calibrate
from .collector import Collector, OrderStatCollector
from .target_k import TargetKCollector
from .thresholds import GRANULARITIES, Thresholds, model_fingerprint, storage_bytes

__all__ = [
    "GRANULARITIES", "STATISTICS", "Collector", "OrderStatCollector", "TargetKCollector", "Thresholds",
    "calibrate", "model_fingerprint", "storage_bytes",
]

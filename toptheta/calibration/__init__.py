"""Threshold calibration and the thresholds artefact."""

from .calibrate import COMPENSATION_MODES, STATISTICS, calibrate, calibration_compensation, compensation_labels
from .collector import Collector, OrderStatCollector
from .target_k import TargetKCollector
from ..thresholds import (GRANULARITIES, Thresholds, check_sdc_source, check_thresholds_fit, model_fingerprint,
                         model_identity, storage_bytes)

__all__ = [
    "COMPENSATION_MODES", "GRANULARITIES", "STATISTICS", "Collector", "OrderStatCollector", "TargetKCollector",
    "Thresholds", "calibrate", "calibration_compensation", "check_sdc_source", "check_thresholds_fit",
    "compensation_labels",
    "model_fingerprint", "model_identity", "storage_bytes",
]

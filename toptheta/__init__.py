"""Top-θ attention: sparse attention by calibrated thresholds, with compensation (arXiv 2502.08363)."""

__version__ = "0.1.0"

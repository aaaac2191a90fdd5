"""Top-θ attention: sparse attention by calibrated thresholds, with compensation (arXiv 2502.08363).

Library use, no Hydra needed::

    import toptheta
    sparsifier = toptheta.TopK(k=64, placement="post", layer_k={0: 512, 1: 512})
    with toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as stats:
        model(**batch)
    stats.kept_attention_fraction, stats.kept_vrow_fraction

Importing this package changes nothing in transformers; registration happens on first use.
"""

from .attention import SparsityStats, sparse_attention, sparsify
from .calibration import Thresholds, calibrate
from .compensation import SDC, VMC
from .sparsifiers import Dense, RowBlock, Sparsifier, TopK, TopTheta

__version__ = "0.1.0"

__all__ = [
    "SDC", "VMC", "Dense", "RowBlock", "Sparsifier", "SparsityStats", "Thresholds", "TopK", "TopTheta",
    "calibrate", "sparse_attention", "sparsify",
]

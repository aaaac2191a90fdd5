"""Top-θ attention: sparse attention by calibrated thresholds, with compensation (arXiv 2502.08363).

Library use, no Hydra needed::

    import toptheta
    sparsifier = toptheta.TopK(k=64, placement="post", layer_k={0: 512, 1: 512})
    with toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as stats:
        model(**batch)
    stats.kept_attention_fraction, stats.kept_vrow_fraction

Importing this package changes nothing in transformers; registration happens on first use. It does
put one name in lm-eval's model registry, ``toptheta``, as a lazy "module:class" string (see
``_register_lm_eval_model``), so ``lm_eval.simple_evaluate(model="toptheta", ...)`` works.
"""

from .attention import SparsityStats, decoding, sparse_attention, sparsify
from .calibration import Thresholds, calibrate
from .compensation import SDC, VMC
from .sparsifiers import Dense, RowBlock, SkipSoftmax, Sparsifier, TopK, TopP, TopRho, TopTheta

__version__ = "0.1.0"


def _register_lm_eval_model() -> None:
    """Name ``toptheta`` in lm-eval's model registry, lazily: a "module:class" string, nothing imported.

    lm-eval has no plugin discovery for models, so a name must be registered before lm-eval looks it up.
    The entry costs a few milliseconds (lm-eval's registry module; its models are lazy strings too) and
    imports neither our lm-eval model nor HFLM until lm-eval resolves "toptheta". lm-eval's built-in models
    are registered first: lm-eval only fills its registry itself while it is empty.
    """
    try:
        import lm_eval.models  # noqa: F401  (registers lm-eval's own lazy entries)
        from lm_eval.api.registry import model_registry  # lm-eval: optional for the attention library
    except ImportError:  # lm-eval missing or too old: the library works without it
        return
    if "toptheta" not in model_registry:
        model_registry.register("toptheta", target="toptheta.evaluation.lm_eval_model:TopThetaLM")


_register_lm_eval_model()

__all__ = [
    "SDC", "VMC", "Dense", "RowBlock", "SkipSoftmax", "Sparsifier", "SparsityStats", "Thresholds", "TopK", "TopP",
    "TopRho", "TopTheta", "calibrate", "decoding", "sparse_attention", "sparsify",
]

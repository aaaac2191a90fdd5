"""Per-layer k that keeps, layer by layer, the attention fractions another run kept: a Top-k/Top-θ run at a
baseline's layer budget (``sparsifier.layer_k`` for every layer).

    python scripts/layer_budget.py --like RUN_ID --topk RUN_ID [--results results]

A row-adaptive rule such as skip-softmax spends its budget unevenly across layers (SmolLM2 at 1/20: 0.59 of layer
0's elements, 0.13 of layers 1-2's, 0.01-0.05 of the rest), while Top-k and Top-θ keep the same k in every layer but
the first two. Giving Top-θ the baseline's per-layer budget separates the two things the baseline changes: how much
each layer keeps, and which keys of a layer it keeps.

``--like``'s per-layer kept fractions (stats.json ``per_layer``) are turned into k with Top-k's kept fraction on the
same rows. A sequence of L tokens has L²/2 causal elements, of which k per row survive once rows are longer than
k, so a layer at k keeps about f(k) = 2k/L − (k/L)² of them; L is fitted on ``--topk``, a Top-k run of the same
setting (the layers at its common k), and each layer's k solves f(k) = kept: k = L (1 − √(1 − kept)). The law is
an approximation (rows shorter than k, sequences of unequal length): the run made with these k records the
fractions it really kept, which is what it is compared at.

Prints the ``sparsifier.layer_k`` override, the fitted L and each layer's target and predicted fraction.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from toptheta.store.rows import fitted_parameters


def per_layer_kept(results: Path, run_id: str) -> list[float]:
    """A run's kept attention fraction per layer, in layer order; a clear error where the run has none."""
    path = results / "runs" / run_id / "stats.json"
    try:
        per_layer = json.loads(path.read_text(encoding="utf-8"))["per_layer"]
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"{path}: no per-layer statistics ({err}); give a finished run of the store (--results)")
    return [float(per_layer["kept_attention_fraction"][i]) for i in sorted(range(len(per_layer["layer"])),
                                                                          key=per_layer["layer"].__getitem__)]


def kept_at(k: float, length: float) -> float:
    """f(k) = 2k/L − (k/L)²: the causal elements a layer keeps at k on sequences of L tokens (1 once k ≥ L)."""
    x = min(k / length, 1.0)
    return 2 * x - x * x


def k_for(kept: float, length: float) -> int:
    """The k whose f(k) is `kept` (f's inverse), rounded, at least 1."""
    return max(1, round(length * (1 - math.sqrt(max(0.0, 1 - min(kept, 1.0))))))


def fitted_length(results: Path, topk_run: str) -> tuple[float, int]:
    """(L, the Top-k run's common k): L from the median kept fraction of the layers at the common k."""
    config = json.loads((results / "runs" / topk_run / "config.json").read_text(encoding="utf-8"))["sparsifier"]
    if config.get("name") != "topk":
        raise SystemExit(f"--topk {topk_run} is a {config.get('name')} run; give a Top-k run of the same setting")
    stats = json.loads((results / "runs" / topk_run / "stats.json").read_text(encoding="utf-8"))
    k = int(config.get("k") or fitted_parameters(stats)["k"])  # a matched run stores the k its search found
    own = {int(layer) for layer in (config.get("layer_k") or {})}
    kept = [f for layer, f in enumerate(per_layer_kept(results, topk_run)) if layer not in own]
    x = 1 - math.sqrt(1 - statistics.median(kept))
    return k / x, k


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", required=True, help="the run whose per-layer kept fractions to match")
    parser.add_argument("--topk", required=True, help="a Top-k run of the same setting, to turn fractions into k")
    parser.add_argument("--results", default="results", help="the store holding both runs")
    args = parser.parse_args(argv)
    results = Path(args.results)
    length, k = fitted_length(results, args.topk)
    targets = per_layer_kept(results, args.like)
    ks = [k_for(f, length) for f in targets]
    print(f"L = {length:.0f} tokens (fitted on {args.topk}, k = {k})")
    for layer, (f, k_l) in enumerate(zip(targets, ks)):
        print(f"  layer {layer:>2}: kept {f:.4f} -> k = {k_l:>4} (predicted {kept_at(k_l, length):.4f})")
    print("sparsifier.layer_k={" + ",".join(f"{layer}:{k_l}" for layer, k_l in enumerate(ks)) + "}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-head weights of Top-ρ's share that spend a budget over the heads as another run did (``sparsifier.head_weights``).

    python scripts/head_budget.py --like RUN_ID [--csv results/analysis/kept_by_row.csv] [--permute SEED]

Skip-softmax's heads keep very different shares of their rows (SmolLM2 ARC-Easy 25-shot at 1/20: a coefficient of
variation of 0.55 across the heads of a layer, against 0 for Top-k, Top-θ and Top-ρ; ``results/analysis/
kept_by_row.md``). Top-ρ with ``head_weights`` keeps min(1, ρ·w[l][h]) of each row in head h of layer l; with w
proportional to the shares ``--like``'s heads kept, it spends the budget over the layers, the heads and the rows of
different length as that run did, and ``sparsifier.target_kept`` still fits ρ to the total. What is left between
the two is which rows of a head, and which keys of a row, the budget goes to.

The shares are ``kept_by_row.csv``'s ``kept_fraction`` (``scripts/kept_by_row.py``'s replay: all the causal
elements of a head, on the replayed questions). Those questions are the test set's; for weights a deployment could
measure, replay the run on the rows its λ was fitted on (``kept_by_row.py RUN --on target``) and pass
``--csv results/analysis/kept_by_row-target.csv``. The weights are those shares over their mean, so ρ is about the
kept fraction, rounded to 4 significant digits. Prints the ``head_weights`` YAML (one flow list per layer) for an
experiment file.

``--permute SEED`` shuffles each layer's weights over its heads (a seeded permutation per layer): the control that
keeps how unequal a layer's heads are and each layer's total, and loses which heads the run gave more to. If the
gain of the per-head shares comes from skip-softmax's choice of heads, the shuffled weights lose it.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd


def head_weights(csv: Path, run_id: str) -> list[list[float]]:
    """Per layer, the weight of each head: its kept share over the mean share of every (layer, head) of ``run_id``;
    a clear error where the table has no such run or misses a head."""
    try:
        table = pd.read_csv(csv, dtype={"run_id": str})
    except OSError as err:
        raise SystemExit(f"{csv}: {err}; write it with python scripts/kept_by_row.py {run_id} ...")
    rows = table[table["run_id"] == run_id]
    if rows.empty:
        raise SystemExit(f"{csv} has no run {run_id}: replay it first (python scripts/kept_by_row.py {run_id} ...)")
    shares = rows.pivot(index="layer", columns="head", values="kept_fraction").sort_index().sort_index(axis=1)
    if shares.isna().any().any() or list(shares.index) != list(range(len(shares))):
        raise SystemExit(f"{csv}: run {run_id} lacks some (layer, head) rows; replay it again")
    mean = float(shares.to_numpy().mean())
    if not mean > 0:
        raise SystemExit(f"{csv}: run {run_id} kept nothing; its shares give no weights")
    return [[float(f"{share / mean:.4g}") for share in layer] for layer in shares.to_numpy()]


def permuted(weights: list[list[float]], seed: int) -> list[list[float]]:
    """Each layer's weights in a seeded random order over its heads (random.Random(seed), one shuffle per layer in
    layer order)."""
    rng = random.Random(seed)
    out = []
    for row in weights:
        row = list(row)
        rng.shuffle(row)
        out.append(row)
    return out


def as_yaml(weights: list[list[float]], indent: str = "    ") -> str:
    """``head_weights:`` with one flow list per layer, as an experiment file's ``sparsifier`` section holds it."""
    return "\n".join([f"{indent[:-2]}head_weights:"] + [f"{indent}- [{', '.join(f'{w:g}' for w in row)}]"
                                                        for row in weights])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", required=True, help="the run whose heads' kept shares to follow")
    parser.add_argument("--csv", default="results/analysis/kept_by_row.csv", help="scripts/kept_by_row.py's table")
    parser.add_argument("--against", default=None, metavar="CSV",
                        help="also compare the weights with those another replay of the same run gives (e.g. the "
                             "questions' against the target rows')")
    parser.add_argument("--permute", type=int, default=None, metavar="SEED",
                        help="shuffle each layer's weights over its heads (the control for which heads get more)")
    args = parser.parse_args(argv)
    weights = head_weights(Path(args.csv), args.like)
    if args.permute is not None:
        weights = permuted(weights, args.permute)
    spread = [max(row) / min(row) for row in weights]
    print(f"# {len(weights)} layers × {len(weights[0])} heads from {args.like}"
          + (f", each layer's shuffled (seed {args.permute})" if args.permute is not None else "") + "; weights "
          f"{min(map(min, weights)):g}..{max(map(max, weights)):g} (largest / smallest in a layer: median "
          f"{sorted(spread)[len(spread) // 2]:.1f})")
    if args.against is not None:
        print(agreement(weights, head_weights(Path(args.against), args.like), args.against))
    print(as_yaml(weights))
    return 0


def agreement(weights: list[list[float]], other: list[list[float]], name: str) -> str:
    """One comment line: how far ``weights`` are from ``other`` (those of another replay of the run): the ratio's
    median and range over the (layer, head)s and the Pearson correlation of their logarithms."""
    ours, theirs = np.log(np.array(weights)), np.log(np.array(other))
    if ours.shape != theirs.shape:
        raise SystemExit(f"{name} holds {theirs.shape[0]} layers × {theirs.shape[1]} heads, this replay "
                         f"{ours.shape[0]} × {ours.shape[1]}: replay the same model")
    ratio = np.exp(ours - theirs)
    r = float(np.corrcoef(ours.ravel(), theirs.ravel())[0, 1])
    return (f"# against {name}: weight ratio median {np.median(ratio):.4f}, range "
            f"{ratio.min():.4f}..{ratio.max():.4f}; Pearson r of the log weights {r:.5f}")


if __name__ == "__main__":
    sys.exit(main())

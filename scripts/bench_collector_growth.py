"""A calibration collector that widens its tables exactly (GROWTH = 1, MIN_ROOM = 0: as before) against one that widens
them with room to spare (``collector.GROWTH``, ``MIN_ROOM``), side by side in one run.

    python scripts/bench_collector_growth.py                          # SmolLM2-135M, 2,048 random tokens
    python scripts/bench_collector_growth.py --model qwen2.5-coder-0.5b --table-len 12912 --seq-len 1024

A causal prefill's rows get longer chunk by chunk, so each chunk widened every table of the layer (count, Σ τ, Σ τ²;
for target-k a histogram per key) by a few keys: a copy of the whole table per chunk, what the first sequence of a
new longest length paid inside ``toptheta.calibrate``. Two measures, each way interleaved with the other:

* ``tables``: the widening alone, as a prefill of ``--table-len`` keys asks it of the order statistic's collector
  (the model's layers and heads, the plain kernel's rows per chunk on the CPU): where it matters, at the lengths of the
  long-documents calibration (12,912 Qwen tokens);
* ``forward``: calibration forwards over ``--seq-len`` random tokens with a fresh collector each round, for both
  statistics, and whether the two ways' sums are equal (they must be: only the tables' spare room differs).

Writes results/bench/collector_growth.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import toptheta
from toptheta.atomic import write_text_atomic
from toptheta.attention.kernel import default_rows_per_chunk
from toptheta.attention.backend import model_shape
from toptheta.calibration import OrderStatCollector, TargetKCollector, collector as collector_module
from toptheta.models import load_model

STATISTICS = {"order": OrderStatCollector, "target-k": TargetKCollector}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--table-len", type=int, default=12912)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--placement", default="post", choices=["pre", "post"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="results/bench/collector_growth.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, _, info = load_model(args.model)
    layers, heads, _ = model_shape(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    tac = toptheta.TopK(args.k, args.placement)
    growth_default, room_default = collector_module.GROWTH, collector_module.MIN_ROOM

    def widened(growth: float, room: int):  # the collector as a causal prefill of --table-len keys widens it
        collector_module.GROWTH, collector_module.MIN_ROOM = growth, room
        try:
            collector = OrderStatCollector([args.k] * layers, heads, args.placement)
            rows = default_rows_per_chunk(heads * args.table_len)
            start = time.perf_counter()
            for layer in range(layers):
                for end in range(rows, args.table_len + rows, rows):
                    collector._ensure(layer, min(end, args.table_len) + 1, "cpu")
            return time.perf_counter() - start, rows
        finally:
            collector_module.GROWTH, collector_module.MIN_ROOM = growth_default, room_default

    tables = {"exact": [], "growth": []}
    for _ in range(args.rounds):
        for name, settings in (("exact", (1.0, 0)), ("growth", (growth_default, room_default))):
            seconds, chunk_rows = widened(*settings)
            tables[name].append(seconds)

    def calibration(statistic: str, growth: float, room: int):
        collector_module.GROWTH, collector_module.MIN_ROOM = growth, room
        try:
            collector = STATISTICS[statistic]([args.k] * layers, heads, args.placement, topk_keep=True)
            start = time.perf_counter()
            with torch.no_grad(), toptheta.sparsify(model, tac, stats=False, observer=collector):
                model(input_ids=ids, use_cache=False)
            return time.perf_counter() - start, collector
        finally:
            collector_module.GROWTH, collector_module.MIN_ROOM = growth_default, room_default

    ways = {f"{statistic}_{name}": (statistic, *settings) for statistic in STATISTICS
            for name, settings in (("exact", (1.0, 0)), ("growth", (growth_default, room_default)))}
    times: dict[str, list[float]] = {name: [] for name in ways}
    equal = {statistic: True for statistic in STATISTICS}
    for _ in range(args.rounds):  # interleaved, so load from other processes hits every way alike
        kept = {}
        for name, (statistic, *settings) in ways.items():
            seconds, kept[name] = calibration(statistic, *settings)
            times[name].append(seconds)
        for statistic in STATISTICS:
            a, b = (kept[f"{statistic}_{way}"].stacked() for way in ("exact", "growth"))
            equal[statistic] &= all(torch.equal(a[key], b[key]) for key in a)
    median = {name: statistics.median(t) for name, t in times.items()}
    table_median = {name: statistics.median(t) for name, t in tables.items()}
    result = {"model": info.name, "layers": layers, "heads": heads, "k": args.k, "placement": args.placement,
              "rounds": args.rounds, "growth": growth_default, "min_room": room_default,
              "tables": {"table_len": args.table_len, "rows_per_chunk": chunk_rows, "median_seconds": table_median,
                         "all_seconds": tables, "ratio_exact_over_growth": table_median["exact"] / table_median["growth"]},
              "seq_len": args.seq_len, "threads": torch.get_num_threads(), "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "median_seconds": median, "all_seconds": times,
              **{f"ratio_{statistic}_exact_over_growth": median[f"{statistic}_exact"] / median[f"{statistic}_growth"]
                 for statistic in STATISTICS},
              "sums_equal": equal}
    write_text_atomic(Path(args.out), json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: v for key, v in result.items() if key != "all_seconds"}, indent=2))


if __name__ == "__main__":
    main()

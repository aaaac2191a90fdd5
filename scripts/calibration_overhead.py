"""Cost of calibration forwards over plain forwards, timed side by side in one run.

    python scripts/calibration_overhead.py                     # SmolLM2-135M, writes results/bench/calibration_overhead.json
    python scripts/calibration_overhead.py --model random      # SmolLM2's shapes with random weights

Every round runs the same batch six ways, interleaved so that load from other processes hits all of
them alike: transformers' own sdpa attention, our dense backend, our backend with exact top-k (the
TAC forward alone), and the calibration forward (TAC top-k with the streaming collector as observer,
i.e. what ``toptheta.calibrate`` runs per batch) for the "order" and the "target-k" statistics, and the
"order" one reading τ in a second pass over the keep-mask (as before the TAC selection returned it).
Reported: median times and their ratios; the collector's own cost is calibration over top-k, the
whole cost of calibrating is calibration over dense. Tokens are random ids.

    python scripts/calibration_overhead.py --seq-len 2048 --threads 1 --out results/bench/calibration_overhead_2k.json
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
from toptheta.attention.backend import model_shape
from toptheta.calibration import OrderStatCollector, TargetKCollector


def load(name: str):
    """SmolLM2-135M from the packaged GGUF, or a random model of its shapes when asked or unavailable."""
    if name != "random":
        try:
            from toptheta.models import load_model

            model, _, info = load_model(name)
            return model, info.name
        except Exception as err:  # no packaged weights here: fall back, and say so in the output
            print(f"could not load {name} ({err}); using random weights of SmolLM2's shapes")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), "random-smollm2-shapes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--k", type=int, default=64)
    parser.add_argument("--placement", default="pre", choices=["pre", "post"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="results/bench/calibration_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, model_name = load(args.model)
    layers, heads, _ = model_shape(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(args.rounds + 1)]
    k_list = [args.k] * layers
    tac = toptheta.TopK(args.k, args.placement)
    collectors = {"order": OrderStatCollector(k_list, heads, args.placement, topk_keep=True),
                  "target-k": TargetKCollector(k_list, heads, args.placement, topk_keep=True),
                  "order-keep-mask": OrderStatCollector(k_list, heads, args.placement, topk_keep=True)}
    collectors["order-keep-mask"].wants_next_index = False  # τ from a second pass over the row

    def sdpa(ids):
        model(input_ids=ids, use_cache=False)

    def backend(ids):
        with toptheta.sparsify(model, toptheta.Dense(), stats=False):
            model(input_ids=ids, use_cache=False)

    def topk(ids):
        with toptheta.sparsify(model, tac, stats=False):
            model(input_ids=ids, use_cache=False)

    def calibration(statistic):
        def run(ids):
            with toptheta.sparsify(model, tac, stats=False, observer=collectors[statistic]):
                model(input_ids=ids, use_cache=False)
        return run

    ways = {"sdpa": sdpa, "dense_backend": backend, "topk_backend": topk, "calibration_order": calibration("order"),
            "calibration_target_k": calibration("target-k"),
            "calibration_order_keep_mask": calibration("order-keep-mask")}
    times: dict[str, list[float]] = {name: [] for name in ways}
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for i, ids in enumerate(batches):
            for name, run in ways.items():
                start = time.perf_counter()
                run(ids)
                if i > 0:  # the first round warms up caches and registration
                    times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "model": model_name, "seq_len": args.seq_len, "batch_size": args.batch_size, "rounds": args.rounds,
        "k": args.k, "placement": args.placement, "threads": args.threads, "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "median_seconds": median, "all_seconds": times,
        "ratio_order_over_dense_backend": median["calibration_order"] / median["dense_backend"],
        "ratio_order_over_topk_backend": median["calibration_order"] / median["topk_backend"],
        "ratio_target_k_over_topk_backend": median["calibration_target_k"] / median["topk_backend"],
        "ratio_target_k_over_dense_backend": median["calibration_target_k"] / median["dense_backend"],
        "ratio_order_over_sdpa": median["calibration_order"] / median["sdpa"],
        "ratio_order_over_order_keep_mask": median["calibration_order"] / median["calibration_order_keep_mask"],
        "ratio_target_k_over_sdpa": median["calibration_target_k"] / median["sdpa"],
        "collector_bytes": {name: c.nbytes() for name, c in collectors.items()},
        "order_sums_equal_keep_mask_sums": all(  # the same rows, τ found two ways: the same float64 sums
            torch.equal(a, b) for name in collectors["order"].sums
            for a, b in zip(collectors["order"].sums[name], collectors["order-keep-mask"].sums[name])),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({key: v for key, v in result.items() if key != "all_seconds"}, indent=2))


if __name__ == "__main__":
    main()

"""Calibration with shared prefixes against running every sequence whole, side by side in one run.

    python scripts/bench_calibration_sharing.py     # SmolLM2-135M, the long-row protocol on 8 ARC-Easy documents
    python scripts/bench_calibration_sharing.py --model gemma3-270m --num-samples 4

The long-row protocol calibrates on 25- and 29-shot prompts with fixed exemplars: every sequence repeats one of two
exemplar blocks of ~850 tokens and each question's context is shared by its choices. ``toptheta.calibrate``
(``share_prefixes=True``, the default) runs such tokens once and counts their rows once per sequence. This script
calibrates the same sequences both ways (the same k, placement, compensations as long_rows/smol's Top-θ pre + SDC +
VMC at 1/3) and reports the times, the tokens each ran, and how far the thresholds and SDC masses of the two are
apart (row counts must be equal; values differ where a forward's cut changes float rounding, amplified through the
layers). Writes results/bench/calibration_sharing.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from toptheta.atomic import write_text_atomic
from toptheta.compensation import SDC, VMC
from toptheta.models import load_model
from toptheta.thresholds_cache import calibrate_on_task


def distance(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Where both are calibrated: max and quantiles of |a − b|, the share of bit-identical entries, max relative."""
    m = ~torch.isnan(a)
    d = (a[m] - b[m]).abs().double()
    q = torch.quantile(d, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    return {"entries": int(m.sum()), "max_abs": float(d.max()), "median_abs": q[0], "p90_abs": q[1], "p99_abs": q[2],
            "bit_identical": float((d == 0).double().mean()),
            "max_rel": float((d / a[m].abs().double().clamp_min(1e-6)).max()),
            "median_abs_value": float(a[m].abs().double().median())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-samples", type=int, default=8, help="calibration documents (calib.num_samples)")
    parser.add_argument("--k", type=int, default=134)
    parser.add_argument("--placement", default="pre", choices=["pre", "post"])
    parser.add_argument("--out", default="results/bench/calibration_sharing.json")
    args = parser.parse_args()

    model, tokenizer, info = load_model(args.model)
    comps = [SDC("exact"), VMC()] if args.placement == "pre" else [VMC()]
    runs, seconds = {}, {}
    for share in (True, False):
        start = time.perf_counter()
        runs[share] = calibrate_on_task(
            model, tokenizer, "arc_easy", data_dir="auto", num_fewshot=25, num_samples=args.num_samples,
            fewshot_sampler="first_n", cover_shots=4, k=args.k, placement=args.placement, layer_k={0: 512, 1: 512},
            compensations=comps, progress=False, share_prefixes=share)
        seconds["shared" if share else "whole"] = time.perf_counter() - start
    shared, whole = runs[True], runs[False]
    result = {
        "model": info.name, "num_samples": args.num_samples, "k": args.k, "placement": args.placement,
        "sequences": whole.metadata["sequences"], "tokens": whole.metadata["tokens"],
        "tokens_run": {"whole": whole.metadata["tokens_run"], "shared": shared.metadata["tokens_run"]},
        "seconds": seconds, "speedup": seconds["whole"] / seconds["shared"],
        "token_ratio": whole.metadata["tokens_run"] / shared.metadata["tokens_run"],
        "counts_equal": bool(torch.equal(whole.counts, shared.counts)),
        "theta": distance(whole.values, shared.values),
        "sdc_mass": distance(whole.sdc_mass, shared.sdc_mass) if whole.sdc_mass is not None else None,
        "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    write_text_atomic(Path(args.out), json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

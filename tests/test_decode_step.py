"""A whole decode step (issue 29, item 7): the per-call shortcuts give the plain numbers, and the benchmarks run.

* θ of a causal decode row comes from per-length tables (``backends/call._uniformrow_thresholds_of``): the same bits
  and clamped counts as the general lookup, at every length around k, the table's end and beyond;
* the running V sum's one-row shortcut (``decode._running_mean`` without a mask) equals its masked form;
* ``scripts/bench_decode.py --step`` measures sdpa and our model step side by side, served by the C++ decode kernel;
* the GPU benchmarks' code (``--device cpu-interpret``: Triton's interpreter on CPU tensors) runs our Triton kernels
  through the registry, and ``--device cuda`` without CUDA stops with a message that names the fix.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

import toptheta
from toptheta.attention import decode
from toptheta.attention.backends import call as lowering
from toptheta.thresholds import Thresholds

ROOT = Path(__file__).resolve().parents[1]


def script(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(f"_test_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("heads", [4, 1])
@pytest.mark.parametrize("B", [1, 3])
def test_uniform_decode_thresholds_equal_the_lookup(heads, B):
    H, N, k = 4, 300, 40
    values = torch.rand(1, heads, N, generator=torch.Generator().manual_seed(0)) * 0.1
    values[..., :20] = float("nan")  # uncalibrated short lengths
    values[0, 0, 100] = float("-inf")  # an uncalibrated θ inside the table
    sparsifier = toptheta.TopTheta(Thresholds(values, [k], "post"))
    for length in [1, 20, 39, 40, 41, 100, 255, 256, 257, 298, 299, 300, 301, 512, 5000]:
        n = torch.full((B, 1, 1), length, dtype=torch.long)
        fast = lowering.row_thresholds(sparsifier, 0, n, H, memo_k=length)
        plain = lowering.row_thresholds(sparsifier, 0, n, H)  # no memo: the general lookup
        for a, b in zip(fast[:2], plain[:2]):
            assert a.shape == b.shape == (B, H, 1) and a.is_contiguous()
            assert torch.equal(a, b), length
        assert fast[2] == plain[2], length
    assert lowering._DECODE_THETAS[sparsifier]  # the tables served these calls


def test_running_mean_one_row_shortcut_equals_the_masked_sum():
    g = torch.Generator().manual_seed(0)
    value = torch.randn(2, 3, 70, 8, generator=g)
    decode.reset()
    for ke in [50, 51, 52, 60, 61]:  # growing by one row (the shortcut), then by several
        n = torch.full((2, 1, 1), ke, dtype=torch.long)
        fast = decode._running_mean(0, value[:, :, :ke], None, ke, n)
        masked = decode._running_mean(1, value[:, :, :ke], torch.ones(2, ke, dtype=torch.bool), ke, n)
        full = (value[:, :, :ke].double().sum(2) / ke).float().unsqueeze(2)
        assert torch.equal(fast, masked), ke
        torch.testing.assert_close(fast, full, rtol=0, atol=1e-6)
    decode.reset()


def test_decode_step_benchmark_runs_both_models_side_by_side():
    step = script("bench_decode_step")
    result = step.run_step(length=300, fraction=0.1, steps=3, warmup=2)
    assert result["backend_calls"] == {"cpu-decode": 3}  # the C++ decode kernel served every timed step
    assert 0.03 < result["vrow_fraction"] < 0.3
    assert set(result["methods"]) == {"sdpa", "ours_post_vmc"}
    assert all(len(m["times_s"]) == 3 for m in result["methods"].values())
    assert result["logits_max_abs_diff"] > 0  # Top-θ did drop something


def test_gpu_decode_benchmark_dry_run_runs_the_triton_kernels(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench = script("bench_decode")
    out = tmp_path / "gpu_decode"
    assert bench.main(["--device", "cpu-interpret", "--lengths", "80", "--fractions", "0.1", "--repeats", "1",
                       "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["decode"]
    assert [r["method"] for r in rows] == ["flash", "ours_post_vmc", "skip_post_vmc", "topk_post_vmc", "topp_post_vmc",
                                           "plain_topk_post_vmc", "plain_topp_post_vmc"]
    row = {r["method"]: r for r in rows}
    ours, skip = row["ours_post_vmc"], row["skip_post_vmc"]
    assert ours["backend_calls"] == {"triton": 1} and 0.03 < ours["kept_fraction"] < 0.3
    assert skip["backend_calls"] == {"triton": 1} and 0 < skip["kept_fraction"] < 1
    for rule in ("topk_post_vmc", "topp_post_vmc"):  # Triton and the plain kernel: the same kept V rows and outputs
        ours, plain = row[rule], row[f"plain_{rule}"]
        assert ours["backend_calls"] == {"triton": 1} and plain["backend_calls"] == {"plain": 1}
        assert ours["kept_fraction"] == plain["kept_fraction"] and 0.02 < ours["kept_fraction"] < 0.5
        assert abs(ours["mean_abs_diff_to_flash"] - plain["mean_abs_diff_to_flash"]) < 1e-6
    assert "Triton interpreter" in out.with_suffix(".md").read_text()


def test_gpu_prefill_benchmark_dry_run_runs_the_triton_kernels(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench = script("bench_attention")
    out = tmp_path / "gpu_attention"
    assert bench.main(["--device", "cpu-interpret", "--sizes", "72", "--fractions", "0.1", "--repeats", "1",
                       "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["prefill"]
    assert [r["method"] for r in rows] == ["flash", "ours_pre_sdc_vmc", "ours_post_vmc", "skip_pre", "skip_post_vmc"]
    assert all(r["backend_calls"] == {"triton": 1} for r in rows[1:])
    assert all(0 < r["kept_fraction"] < 1 for r in rows[3:])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_benchmark_without_cuda_names_the_fix():
    bench = script("bench_decode")
    with pytest.raises(SystemExit, match="sees no CUDA device.*cpu-interpret"):
        bench.main(["--device", "cuda"])

"""Top-ρ (top-k with ⌈ρ·n⌉ keys per row): ⌈ρ·n⌉ is exact, short rows stay whole, and ρ reaches the config, run
ids and toptheta-eval. The kept sets against a float64 re-implementation (ties, masked keys, rows without a key),
bad arguments, the kernel's output against float64 attention, decode steps, cached generation, the fit of ρ to a
target and the pipeline run are test_baselines.py's tests, which take Top-ρ with the baselines."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cfg, qkv, sparse_rows
from test_baselines import random_rows, ref_toprho, reference_keep

import toptheta
from toptheta import pipeline
from toptheta.attention import backends
from toptheta.attention.backends.call import AttentionCall
from toptheta.calibration.target_kept import TOLERANCE
from toptheta.calibration.target_param import fit_parameter
from toptheta.registry import sparsifier_kind
from toptheta.sparsifiers.base import RowBlock
from toptheta.sparsifiers.toprho import kept_count
from toptheta.store.rows import weights_digest


def test_kept_count_is_the_exact_ceiling():
    n = torch.arange(0, 2001)
    for rho in (0.1, 0.3, 1 / 3, 0.05, 0.07, 0.034, 0.007, 1.0):
        from fractions import Fraction
        exact = [max(1, math.ceil(Fraction(str(rho)) * int(v))) for v in n]
        assert kept_count(n, rho).tolist() == exact, rho
    assert 0.07 * 100 > 7  # the float product that would add a key
    assert int(kept_count(torch.tensor(100), 0.07)) == 7


def test_rows_with_at_most_k_keys_are_kept_whole_and_a_longer_row_keeps_more():
    rows = random_rows(3, K=40, Q=9, grid=None)
    keep = toptheta.TopRho(0.3, layer_k={0: 6}).select(rows)
    short = (rows.n <= 6).squeeze(1)  # (B, Q)
    whole = (keep == rows.valid.expand_as(keep)).all(-1).permute(0, 2, 1)  # (B, Q, H)
    assert bool(whole[short].all()) and not bool(whole[~short].all())
    logits = torch.randn(1, 1, 2, 100)
    valid = torch.ones(1, 1, 2, 100, dtype=torch.bool)
    valid[0, 0, 0, 50:] = False  # a row of 50 keys and one of 100
    rows = RowBlock(0, "prefill", logits.masked_fill(~valid, float("-inf")), valid.sum(-1), valid=valid)
    assert toptheta.TopRho(0.1).select(rows).sum(-1).tolist() == [[[5, 10]]]  # Top-k would keep k of both


def test_backends_route_it_to_the_plain_kernel():
    """No fast path serves Top-ρ's prefill (decode steps: test_baselines' torch-decode test)."""
    q, k, v, valid = qkv()
    for placement in ("pre", "post"):
        call = AttentionCall(q, k, v, None, 0.5, 0, toptheta.TopRho(0.3, placement), (toptheta.VMC(),), phase="prefill")
        assert call.kind == "toprho" and backends.choose(call).name == "plain"


def test_rho_leaves_other_run_ids_alone(tmp_path):
    base = ("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}")
    topk = pipeline.plan(cfg(*base, "sparsifier=topk"))[-1]
    assert "rho" not in topk.sparsifier.settings
    a, b = (pipeline.plan(cfg(*base, "sparsifier=toprho", f"sparsifier.rho={r}"))[-1] for r in (0.1, 0.2))
    assert a.run_id != b.run_id and a.calib is None


def test_toptheta_eval_takes_rho_as_a_model_arg():
    from toptheta.spec import RunSpec

    spec, rest = RunSpec.from_model_args("tiny-llama", sparsifier="toprho", rho=0.2, batch_size=1)
    assert spec.sparsifier.settings["rho"] == 0.2 and spec.sparsifier.k is None and rest == {"batch_size": 1}
    with pytest.raises(ValueError, match=r"rho=2: a share of each row's keys"):
        RunSpec.from_model_args("tiny-llama", sparsifier="toprho", rho=2)


@pytest.mark.parametrize("target", [0.02, 0.05, 0.1, 1 / 3])
def test_the_fit_of_rho_starts_at_the_target_and_takes_two_steps(target):
    """A kept fraction a little above ρ (rows kept whole, the ceiling): the guess lands in two measures where
    bracketing [1e-3, 1] took five or more."""
    rho = sparsifier_kind("toprho").parameter
    measure = lambda v: min(1.0, 1.06 * v + 0.003)  # noqa: E731
    value, kept, tried = fit_parameter(target, rho, measure, **rho.guide(target))
    assert tried[0][0] == target and len(tried) <= 2 and abs(kept / target - 1) <= TOLERANCE
    assert len(fit_parameter(target, rho, measure)[2]) > 2  # without the guess


def test_a_guess_outside_the_range_starts_at_its_end():
    assert sparsifier_kind("toprho").parameter.guide(5.0)["start"] == 1.0
    assert sparsifier_kind("topp").parameter.guide(0.1) == {}


# ---- a share per head (sparsifier.head_weights, scripts/head_budget.py) ----------------------------------------

@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", [0.5, None])
def test_head_weights_give_each_head_the_reference_set_at_its_own_share(seed, grid):
    rows = random_rows(seed, grid=grid)  # 3 heads
    weights = [[0.5, 2.0, 40.0]]  # head 2's share is capped at 1: it keeps every key
    keep = toptheta.TopRho(0.2, head_weights=weights).select(rows)
    for h, share in enumerate((0.1, 0.4, 1.0)):
        expected = reference_keep(rows, lambda s, v: ref_toprho(s, v, share))[:, h]
        assert torch.equal(keep[:, h], expected), h
    assert not torch.equal(keep[:, 0], keep[:, 1])  # the weights reached the kernel
    assert toptheta.TopRho(0.05, head_weights=[[20.0, 30.0, 25.0]]).select(rows) is None  # every share capped at 1


@pytest.mark.parametrize("weights", [[], [[]], [[1.0, 0.0]], [[1.0, -2.0]], [[1.0, math.inf]], [[True]], "1,2",
                                     [1.0, 2.0], [{"a": 1}]])
def test_bad_head_weights_are_refused(weights):
    with pytest.raises(ValueError, match="one list per layer of positive weights"):
        toptheta.TopRho(0.1, head_weights=weights)


def test_head_weights_must_fit_the_model_before_it_evaluates(tmp_path):
    rows = random_rows(0)
    with pytest.raises(ValueError, match="layer 0 2 weights, but its attention has 3 query heads"):
        toptheta.TopRho(0.1, head_weights=[[1.0, 1.0]]).select(rows)
    with pytest.raises(ValueError, match="has 1 layers; layer 1 has none"):
        toptheta.TopRho(0.1, head_weights=[[1.0, 1.0, 1.0]]).select(RowBlock(1, "prefill", rows.logits, rows.n,
                                                                                valid=rows.valid))
    from toptheta.builders import check_sparsifies

    settings = {"name": "toprho", "k": None, "layer_k": {}, "head_weights": [[1.0] * 4] * 3}
    with pytest.raises(ValueError, match="3 layer\\(s\\) of \\[4\\] weights, but tiny has 2 layers of 4 query heads"):
        check_sparsifies(settings, 2, 100, "tiny", 4)
    check_sparsifies(dict(settings, head_weights=[[1.0] * 4] * 2), 2, 100, "tiny", 4)
    with pytest.raises(ValueError, match="head_weights=.*null: only sparsifier=toprho reads it"):
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", "sparsifier=topk",
                          "+sparsifier.head_weights=[[1.0,2.0]]"))
    with pytest.raises(ValueError, match="one list per layer of positive weights"):
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", "sparsifier=toprho",
                          "sparsifier.head_weights=[[1.0,-2.0]]"))


def test_a_run_with_head_weights_is_stored_apart_and_tagged(tmp_path):
    from toptheta.results.labels import PER_HEAD_RHO, series_label

    table = [[1.0, 1.0, 1.0, 1.0], [4.0, 0.25, 1.0, 1.0]] * 3  # tiny-llama: 6 layers of 4 query heads
    weights = str(table).replace(" ", "")
    base = ("comp=vmc", "sparsifier.placement=post", "sparsifier.layer_k=null", "sparsifier=toprho",
            "sparsifier.rho=0.4")
    rows = sparse_rows(tmp_path / "weighted", *base, f"sparsifier.head_weights={weights}")
    plain = sparse_rows(tmp_path / "plain", *base)
    assert rows[0]["run_id"] != plain[0]["run_id"]
    assert {r["head_weights"] for r in rows} == {weights_digest(table)} and \
        {r["head_weights"] for r in plain} == {""}
    assert series_label(rows[0]).endswith(f"[{PER_HEAD_RHO} {weights_digest(table)}]")
    assert PER_HEAD_RHO not in series_label(plain[0])
    from toptheta.results.run_figures import runs_table  # the per-run figures label it as summary.csv does

    tag = f"[{PER_HEAD_RHO} {weights_digest(table)}]"
    assert [label.endswith(tag) for label in runs_table(tmp_path / "weighted").query("sparsifier == 'toprho'")["series"]] \
        == [True]
    assert rows[0]["kept_attention_fraction"] != plain[0]["kept_attention_fraction"]

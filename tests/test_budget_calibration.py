"""Top-θ calibrated to Top-ρ's kept set (calibrate's rho and head_weights): a budget that grows with the row and
differs between heads, against a float64 re-implementation of the order statistic."""

import math

import pytest
import torch

import toptheta
from toptheta.calibration import OrderStatCollector, TargetKCollector, calibrate
from test_calibration import H, L, T, VOCAB, model  # noqa: F401  (the tiny model, a module-scoped fixture)

K = 4
RHO = 0.25
WEIGHTS = [[1.0, 2.0, 4.0, 0.5], [0.5, 1.0, 1.0, 2.0], [1.5, 0.7, 1.0, 4.0]]  # 4.0: share 1, a head kept whole

pytestmark = pytest.mark.usefixtures("one_thread")


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(seed))


def reference_tau(scores: torch.Tensor, share: float) -> float | None:
    """The largest of a row's valid scores (float64, 1-D) below the ⌈share·n⌉-th largest, which Top-ρ keeps with its
    ties; None when that set holds every key."""
    n = scores.numel()
    m = max(1, math.ceil(share * n - 1e-9 * n))
    ranked = sorted(scores.tolist(), reverse=True)
    below = [s for s in ranked if s < ranked[m - 1]]
    return below[0] if below else None


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("device_path", [False, True])
def test_budget_tau_is_the_largest_score_outside_top_rho(model, placement, device_path):
    """Dense rows: each (row, head) adds the largest score outside its ⌈ρ·w·n⌉ largest, as a float64 re-implementation
    finds it; a head that keeps the row whole adds nothing, its count included. The device path adds the same."""
    rule = toptheta.TopRho(RHO, placement, K, head_weights=WEIGHTS)
    collector = OrderStatCollector([K] * L, H, placement, keep_rule=rule, device_path=device_path)
    expected_tau = torch.zeros(L, H, T + 1, dtype=torch.float64)
    expected_count = torch.zeros(L, H, T + 1, dtype=torch.float64)

    def observe(rows):
        collector(rows)
        scores = rows.scores(placement).double()  # (1, H, Q, K)
        for q in range(scores.shape[2]):
            n = int(rows.n[0, 0, q])
            if n <= K:
                continue
            for h in range(H):
                tau = reference_tau(scores[0, h, q, :n], min(1.0, RHO * WEIGHTS[rows.layer][h]))
                if tau is not None:
                    expected_tau[rows.layer, h, n] += tau
                    expected_count[rows.layer, h, n] += 1

    with torch.no_grad(), toptheta.sparsify(model, toptheta.Dense(), [], observer=observe):
        model(input_ids=ids())
    sums = collector.stacked()
    assert expected_count[0, 2].sum() == 0 and expected_count.sum() > 0.5 * L * (H - 1) * (T - K)  # which rows count
    torch.testing.assert_close(sums["count"], expected_count, rtol=0, atol=0)
    torch.testing.assert_close(sums["tau"], expected_tau, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_theta_calibrated_to_top_rho_with_tac_keeps_what_top_rho_keeps(model, placement):
    """θ of one row (σ = 0) calibrated with TAC under Top-ρ keeps Top-ρ's ⌈ρ·w·n⌉ keys in every layer, the head of
    share 1 whole (θ = −inf, never calibrated); calibrated to the top-k instead it keeps k."""
    rule = toptheta.TopRho(RHO, placement, K, head_weights=WEIGHTS)
    budget = calibrate(model, [ids()], k=K, placement=placement, sigma_add=0.0, rho=RHO, head_weights=WEIGHTS,
                       progress=False)
    assert budget.metadata["budget"] == {"rule": "toprho", "rho": RHO, "head_weights": WEIGHTS}
    assert (budget.counts[0, 2] == 0).all() and torch.isnan(budget.values[0, 2]).all()  # θ = −inf at run time

    def kept(sparsifier) -> list[torch.Tensor]:
        out = []

        def observe(rows):
            long = rows.n[:, 0] > K
            out.append(rows.keep.sum(-1).permute(0, 2, 1)[long])

        with torch.no_grad(), toptheta.sparsify(model, sparsifier, [], observer=observe):
            model(input_ids=ids())
        return out

    ours, target = kept(toptheta.TopTheta(budget)), kept(rule)
    assert all(torch.equal(a, b) for a, b in zip(ours, target))
    topk = kept(toptheta.TopTheta(calibrate(model, [ids()], k=K, placement=placement, sigma_add=0.0, progress=False)))
    assert not all(torch.equal(a, b) for a, b in zip(topk, target))  # the budget is what changed the kept sets


def test_budget_without_tac_and_the_provenance(model):
    """Without TAC the collector applies the rule itself; without rho the metadata and thresholds are the top-k's."""
    dense = calibrate(model, [ids()], k=K, rho=RHO, tac=False, progress=False)
    assert dense.metadata["budget"]["rho"] == RHO and dense.metadata["budget"]["head_weights"] is None
    plain = calibrate(model, [ids()], k=K, tac=False, progress=False)
    assert "budget" not in plain.metadata
    assert not torch.equal(dense.values.nan_to_num(-7.0), plain.values.nan_to_num(-7.0))


@pytest.mark.parametrize("kwargs, message", [
    (dict(head_weights=WEIGHTS), "give rho too"),
    (dict(rho=1.5), "rho must be a share"),
    (dict(rho=RHO, statistic="target-k"), "statistic='order'"),
    (dict(rho=RHO, head_weights=[w[:3] for w in WEIGHTS]), "head_budget.py"),
    (dict(rho=RHO, head_weights=WEIGHTS[:2]), "head_budget.py"),
])
def test_bad_budgets_fail_before_any_forward(model, kwargs, message):
    def forbidden():
        raise AssertionError("a forward ran")
        yield

    with pytest.raises(ValueError, match=message):
        calibrate(model, forbidden(), k=K, progress=False, **kwargs)


def test_target_k_refuses_a_budget_rule():
    with pytest.raises(ValueError, match="order"):
        TargetKCollector([K] * L, H, "post", keep_rule=toptheta.TopRho(RHO, "post", K))


# --- through run.py: sparsifier.budget=toprho ----------------------------------------------------------------------

TINY_WEIGHTS = "[" + ",".join(["[1.0,2.0,0.5,1.0]"] * 6) + "]"  # tiny-llama: 6 layers of 4 query heads


def budget_rows(tmp_path, *overrides):
    from conftest import sparse_rows

    return sparse_rows(tmp_path, "sparsifier=toptheta", "comp=vmc", "sparsifier.placement=post",
                       "sparsifier.layer_k=null", "sparsifier.k=2", "task.fewshot_sampler=first_n",
                       "sparsifier.budget=toprho", *overrides)


def test_a_run_calibrated_to_top_rho_records_its_budget_and_gets_its_own_thresholds(tmp_path):
    import json

    from toptheta.calibration import Thresholds
    from toptheta.results.labels import series_label

    rows = budget_rows(tmp_path, "sparsifier.rho=0.3", f"sparsifier.head_weights={TINY_WEIGHTS}")
    run = tmp_path / "runs" / rows[0]["run_id"]
    budget = Thresholds.load(run / "thresholds.safetensors").metadata["budget"]
    assert budget["rule"] == "toprho" and budget["rho"] == 0.3 and budget["head_weights"][0] == [1.0, 2.0, 0.5, 1.0]
    assert json.loads((run / "config.json").read_text())["sparsifier"]["budget"] == "toprho"
    label = series_label(rows[0])
    assert "[θ for Top-ρ]" in label and "[per-head ρ w" in label, label
    assert float(rows[0]["rho"]) == 0.3
    top_k = budget_rows(tmp_path / "topk", "sparsifier.budget=null")  # the paper's budget: its own thresholds
    assert top_k[0]["run_id"] != rows[0]["run_id"] and series_label(top_k[0]) == "Top-θ post (+VMC) [layers 0-1 at k]"
    plain = tmp_path / "topk" / "runs" / top_k[0]["run_id"]
    assert "budget" not in Thresholds.load(plain / "thresholds.safetensors").metadata
    assert "budget" not in json.loads((plain / "config.json").read_text())["sparsifier"]  # run ids as they were


def test_a_matched_run_fits_rho_calibrating_each_value(tmp_path):
    import json

    rows = budget_rows(tmp_path, "sparsifier.target_kept=0.3")
    assert rows and all(abs(float(r["kept_attention_fraction"]) / 0.3 - 1) <= 0.1 for r in rows)
    from toptheta.calibration import Thresholds

    run = tmp_path / "runs" / rows[0]["run_id"]
    target = json.loads((run / "stats.json").read_text())["target"]
    assert "rho" in target and "k" not in target and float(rows[0]["rho"]) == target["rho"]
    assert Thresholds.load(run / "thresholds.safetensors").metadata["budget"]["rho"] == target["rho"]
    assert int(rows[0]["k"]) == 2  # k only keeps short rows whole


@pytest.mark.parametrize("overrides, message", [
    (("sparsifier.budget=toprho",), "needs the share it calibrates to"),
    (("sparsifier.rho=0.2",), "add sparsifier.budget=toprho,"),
    (("sparsifier.budget=topk",), "null (θ for each row's k largest"),
    (("sparsifier.budget=toprho", "sparsifier.rho=1.5"), "sparsifier.rho=1.5"),
    (("sparsifier.budget=toprho", "sparsifier.rho=0.2", "sparsifier.head_weights=[[1.0,-1.0]]"), "positive weights"),
])
def test_bad_budgets_fail_when_the_config_is_checked(tmp_path, overrides, message):
    from conftest import cfg

    from toptheta import pipeline

    with pytest.raises(ValueError, match="invalid configuration") as err:
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", "sparsifier=toptheta",
                          *overrides))
    assert message in str(err.value)


def test_head_weights_that_do_not_fit_the_model_fail_before_calibrating(tmp_path, monkeypatch):
    from toptheta import thresholds_cache

    monkeypatch.setattr(thresholds_cache.calibration, "calibrate", lambda *a, **kw: pytest.fail("calibrated"))
    with pytest.raises(ValueError, match="head_budget.py"):
        budget_rows(tmp_path, "sparsifier.rho=0.3", "sparsifier.head_weights=[[1.0,2.0]]")

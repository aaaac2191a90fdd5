"""calib.beyond (issue 30 item 2): rows longer than any calibrated row keep the θ of the longest (clamp, the default)
or follow a law of θ against n fitted per (layer, head) (fit). The fit recovers a known law, chooses between laws by
held-out error, never yields NaN or a θ the placement does not allow, leaves calibrated lengths alone, and a run
records its rule in summary.csv without moving the ids of runs that never set it."""

from __future__ import annotations

import csv
import math

import pytest
import torch

import toptheta
from conftest import cfg
from toptheta import pipeline, thresholds_cache
from toptheta.calibration import Thresholds
from toptheta.store.rows import summary_rows

LENGTHS = torch.arange(100, 1001, 25)  # calibrated row lengths


def table(laws, N=1001, lengths=LENGTHS) -> torch.Tensor:
    """(L=1, H, N) values with θ_h(n) = laws[h](n) at the calibrated lengths, NaN elsewhere."""
    values = torch.full((1, len(laws), N), float("nan"))
    for h, law in enumerate(laws):
        values[0, h, lengths] = torch.tensor([law(float(n)) for n in lengths], dtype=torch.float32)
    return values


def lookup(thresholds: Thresholds, n: list[int]) -> torch.Tensor:
    theta, _ = thresholds.lookup(0, torch.tensor(n)[None, None])  # (1, H, Q)
    return theta[0]


def test_fit_recovers_a_logarithmic_law_before_the_softmax():
    laws = [lambda n: 1.5 + 0.7 * math.log(n), lambda n: -2.0 + 0.25 * math.log(n), lambda n: 3.0]
    t = Thresholds(table(laws), [16], "pre", beyond="fit")
    far = [2000, 8000, 65536]
    got = lookup(t, far)
    expected = torch.tensor([[law(n) for n in far] for law in laws])
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-5)
    assert t._law.law[0].tolist() == [1, 1, 0]  # log, log, and flat for the constant head (a tie goes to flat)


def test_fit_recovers_a_power_law_after_the_softmax_and_prefers_it_to_a_log_law():
    laws = [lambda n: 3.0 * n ** -0.9, lambda n: 0.5 * n ** -0.3]
    t = Thresholds(table(laws), [16], "post", beyond="fit")
    far = [2000, 16000, 10 ** 6]
    torch.testing.assert_close(lookup(t, far), torch.tensor([[law(n) for n in far] for law in laws]), rtol=1e-4, atol=0)
    assert t._law.law[0].tolist() == [2, 2]  # power: the held-out lengths prefer it


def test_clamp_is_the_default_and_keeps_the_longest_theta():
    laws = [lambda n: 1.5 + 0.7 * math.log(n)]
    t = Thresholds(table(laws), [16], "pre")
    assert t.beyond_rule == "clamp"
    assert lookup(t, [2000, 8000]).tolist() == [[pytest.approx(laws[0](1000.0), abs=1e-5)] * 2]


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_calibrated_lengths_are_untouched_and_longer_rows_are_counted(placement):
    values = table([lambda n: 0.2 * n ** -0.5, lambda n: 0.01 + 1e-6 * n])
    clamp, fit = (Thresholds(values, [16], placement, beyond=rule) for rule in ("clamp", "fit"))
    inside = torch.arange(1, 1001)[None, None]
    a, ca = clamp.lookup(0, inside)
    b, cb = fit.lookup(0, inside)
    assert torch.equal(a, b) and ca == cb == 0
    outside = torch.tensor([[[999, 1000, 1001, 5000]]])
    (a, ca), (b, cb) = clamp.lookup(0, outside), fit.lookup(0, outside)
    assert ca == cb == 2 and torch.equal(a[..., :2], b[..., :2]) and not torch.equal(a[..., 2:], b[..., 2:])


def _adversarial(placement: str) -> torch.Tensor:
    """Heads the fit must survive: steep trends, a zero θ, gaps, too few lengths, nothing calibrated, noise."""
    g = torch.Generator().manual_seed(0)
    N = 1001
    values = torch.full((2, 7, N), float("nan"))
    n = LENGTHS.double()
    if placement == "post":
        rising, falling = 0.9 * n / 1000, 0.5 - 0.5 * n / 1000  # reaches 1 / 0 right past the range
        zero = torch.where(n > 900, 0.0, 1e-3)
        noisy = torch.rand(len(n), generator=g).double() * 0.1
    else:
        rising, falling = 1e6 * n.log(), -1e6 * n.log()
        zero = torch.zeros_like(n)
        noisy = torch.randn(len(n), generator=g).double() * 10
    for layer in range(2):
        for h, column in enumerate((rising, falling, zero, noisy)):
            values[layer, h, LENGTHS] = column.float()
        values[layer, 4, [200, 900]] = 0.05  # two lengths only: too few for a law
        values[layer, 6, LENGTHS[::7]] = noisy[::7].float()  # gaps
    return values  # head 5: never calibrated


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_fit_never_gives_nan_or_a_theta_the_placement_does_not_allow(placement):
    t = Thresholds(_adversarial(placement), [16, 16], placement, beyond="fit")
    n = torch.tensor([1, 50, 1000, 1001, 4096, 10 ** 5, 10 ** 7, 2 ** 31 - 1])[None, None]
    for layer in range(2):
        theta, _ = t.lookup(layer, n)  # (1, H, Q)
        assert not bool(torch.isnan(theta).any())
        beyond_rows = theta[0, [0, 1, 2, 3, 4, 6]][:, n[0, 0] > 1000]
        assert bool(torch.isfinite(beyond_rows).all())
        if placement == "post":
            assert bool((beyond_rows > 0).all() and (beyond_rows <= 1).all())
        assert bool((theta[0, 5] == float("-inf")).all())  # uncalibrated: never drops, whatever the rule
    law = t._law.law[0].tolist()
    assert law[4] == 0  # too few lengths: the clamp
    assert law[0] != 0 and law[1] != 0  # the steep trends are followed (and clipped)


def test_fit_with_one_theta_per_layer_head_or_per_layer_length():
    per_head = Thresholds(torch.tensor([[[0.1], [0.2]]]), [4], "post", beyond="fit")  # no n: nothing to fit
    assert lookup(per_head, [10, 10 ** 6]).tolist() == [[pytest.approx(0.1)] * 2, [pytest.approx(0.2)] * 2]
    per_n = Thresholds(table([lambda n: 2.0 * n ** -1.0]), [4], "post", beyond="fit")  # (L, 1, N)
    assert lookup(per_n, [4000]).item() == pytest.approx(2.0 / 4000, rel=1e-4)


def test_a_bad_rule_names_the_choices():
    with pytest.raises(ValueError, match="clamp"):
        Thresholds(table([lambda n: 1.0]), [4], "pre", beyond="extrapolate")


def test_fit_survives_save_and_load(tmp_path):
    t = Thresholds(table([lambda n: 0.3 * n ** -0.8]), [16], "post")
    t.save(tmp_path / "t.safetensors")
    loaded = Thresholds.load(tmp_path / "t.safetensors", beyond="fit")
    assert loaded.beyond_rule == "fit" and lookup(loaded, [8000]).item() == pytest.approx(0.3 * 8000 ** -0.8, rel=1e-4)


def test_top_theta_keeps_less_of_long_rows_with_the_fit():
    """Rows up to twice the longest calibrated length: a pre-softmax θ that grows with log n (as the (k+1)-th largest
    logit does) is lower when clamped, so the clamp keeps more of them than the fitted law."""
    N = 64
    law = lambda n: -1.0 + 0.5 * math.log(n)  # noqa: E731
    values = table([law] * 2, N=33, lengths=torch.arange(8, 33))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, N, 8, generator=g) * 2 for _ in range(3))
    kept = {}
    for rule in ("clamp", "fit"):
        stats = toptheta.SparsityStats(num_layers=1, num_heads=2, num_kv_heads=2)
        seen = []
        toptheta.sparse_attention(q, k, v, None, scaling=0.5, layer=0, stats=stats, observer=seen.append,
                                  sparsifier=toptheta.TopTheta(Thresholds(values, [4], "pre", beyond=rule)))
        assert stats.backend_calls == {"plain": 1} and stats.clamped_rows == N - 32  # rows 33..64 keys
        logits = torch.cat([rows.logits[..., -1, :] for rows in seen[-1:]])[0]  # (H, K) the row of n = 64
        theta = law(64.0) if rule == "fit" else law(32.0)
        expected = (logits > theta) | (logits == logits.max(-1, keepdim=True).values)
        assert torch.equal(seen[-1].keep[0, :, -1], expected)
        kept[rule] = float(stats.prefill_kept.sum())
    assert kept["fit"] < kept["clamp"]


# ---- the pipeline: the rule as a run setting -------------------------------------------------------------------

def test_beyond_enters_the_run_id_only_when_it_is_fit(tmp_path):
    base = ("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", "sparsifier=toptheta")
    default, clamp, fit = (pipeline.plan(cfg(*base, *extra))[-1] for extra in ((), ("calib.beyond=clamp",),
                                                                             ("calib.beyond=fit",)))
    assert "beyond" not in default.calib.settings and default.run_id == clamp.run_id
    assert fit.calib.beyond == "fit" and fit.run_id != default.run_id
    fingerprint = {"layers": 2}
    assert thresholds_cache.thresholds_key(fit, fingerprint) == thresholds_cache.thresholds_key(default, fingerprint)  # one file
    with pytest.raises(Exception, match="calib.beyond"):  # Hydra's schema refuses other values while composing
        cfg(*base, "calib.beyond=extrapolate")


def test_summary_rows_say_which_rule_ran():
    results = {"results": {"smoke": {"acc,none": 0.5}}}
    config = {"sparsifier": {"name": "toptheta"}, "calib": {}, "task": {"name": "smoke"}}
    assert summary_rows("a", config, results, {})[0]["calib_beyond"] == "clamp"
    config["calib"]["beyond"] = "fit"
    assert summary_rows("a", config, results, {})[0]["calib_beyond"] == "fit"
    assert summary_rows("a", {"sparsifier": {"name": "topk"}}, results, {})[0]["calib_beyond"] is None


def test_a_fit_run_records_its_rule(tmp_path):
    pipeline.run(cfg("model=tiny-llama", "task=smoke", "task.num_fewshot=2", "task.limit=4", "calib.num_samples=6",
                     f"results_dir={tmp_path}", "log_samples=false", "sparsifier=toptheta", "comp=vmc",
                     "sparsifier.placement=post", "sparsifier.k=8", "sparsifier.layer_k=null", "calib.beyond=fit"))
    with open(tmp_path / "summary.csv", newline="") as fh:
        rows = [row for row in csv.DictReader(fh) if row["sparsifier"] != "dense"]
    assert rows and {r["calib_beyond"] for r in rows} == {"fit"}
    assert all(0 < float(r["kept_attention_fraction"]) < 1 for r in rows)

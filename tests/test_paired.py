"""Paired statistics against known answers and brute force (synthetic data, no model)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from toptheta.results import comparisons, paired, pooled
from toptheta.store.samples import compress_json


def test_mcnemar_known_answer():
    # 8 questions right only in a, 2 right only in b, 90 concordant: p = 2 · P(X ≤ 2 | n=10, 1/2) = 112/1024.
    a = [1] * 8 + [0] * 2 + [1] * 50 + [0] * 40
    b = [0] * 8 + [1] * 2 + [1] * 50 + [0] * 40
    p, a_only, b_only = paired.mcnemar(a, b)
    assert (a_only, b_only) == (8, 2) and p == pytest.approx(112 / 1024)
    assert paired.mcnemar(a, a)[0] == 1.0  # no discordant question: no evidence
    assert paired.binomial_two_sided(5, 10) == 1.0


def test_mcnemar_against_brute_force():
    """The exact p-value equals the probability, under fair coins, of a split at least as lopsided."""
    for n in range(1, 12):
        for k in range(n + 1):
            extreme = abs(k - n / 2)
            brute = sum(math.comb(n, i) for i in range(n + 1) if abs(i - n / 2) >= extreme - 1e-12) / 2**n
            assert paired.binomial_two_sided(min(k, n - k), n) == pytest.approx(min(1.0, brute))


def test_bootstrap_matches_the_exact_bootstrap_distribution():
    """With 6 questions all 6^6 resamples can be enumerated: the seeded bootstrap's interval matches the exact one."""
    a = np.array([1, 1, 0, 1, 0, 1], float)
    b = np.array([1, 0, 0, 0, 0, 1], float)
    d = a - b
    exact = np.array([d[list(idx)].mean() for idx in itertools.product(range(6), repeat=6)])
    low, high = paired.paired_bootstrap(a, b, resamples=40_000, seed=1)
    step = 1 / 6  # the resampled means live on a grid of 1/6
    assert abs(low - np.quantile(exact, 0.025)) <= step + 1e-9
    assert abs(high - np.quantile(exact, 0.975)) <= step + 1e-9
    assert low <= d.mean() <= high


def test_bootstrap_is_seeded_and_paired():
    rng = np.random.default_rng(0)
    dense = (rng.random(500) < 0.6).astype(float)
    sparse = dense.copy()
    flip = rng.choice(500, 20, replace=False)  # the sparse run disagrees on 20 of 500 questions
    sparse[flip] = 1 - sparse[flip]
    one = paired.compare(sparse, dense, seed=3)
    assert one == paired.compare(sparse, dense, seed=3)  # a rerun gives the same interval
    assert one.ci_low <= one.diff <= one.ci_high and one.n == 500
    # Paired: the interval reflects 20 discordant questions, far tighter than two independent stderrs.
    se = math.sqrt(0.6 * 0.4 / 500)
    independent = paired.unpaired(sparse.mean(), se, dense.mean(), se)
    assert (one.ci_high - one.ci_low) < 0.4 * (independent.ci_high - independent.ci_low)
    same = paired.compare(dense, dense)
    assert (same.ci_low, same.ci_high, same.p_mcnemar) == (0.0, 0.0, 1.0)


def test_unpaired_normal_interval():
    diff = paired.unpaired(0.5, 0.03, 0.4, 0.04)
    assert diff.diff == pytest.approx(0.1)
    assert diff.ci_high - diff.diff == pytest.approx(1.959964 * 0.05, rel=1e-5)
    assert diff.method == "independent stderrs"


def test_scores_that_are_not_binary_get_no_mcnemar():
    diff = paired.compare([0.3, 0.5, 0.2], [0.25, 0.5, 0.1])
    assert diff.p_mcnemar is None and diff.diff == pytest.approx(0.05)
    with pytest.raises(ValueError, match="0/1 outcomes"):
        paired.mcnemar([0.3], [0.2])
    with pytest.raises(ValueError, match="equally long"):
        paired.paired_bootstrap([1, 0], [1])


def test_outcomes_from_each_sample_format(tmp_path):
    lm_eval = {"arc_easy": [{"doc_id": 3, "acc": 1.0, "acc_norm": 0.0}, {"doc_id": 1, "acc": 0.0, "acc_norm": 1.0}]}
    assert paired.question_outcomes(lm_eval, "arc_easy", "acc_norm,none") == {3: 0.0, 1: 1.0}
    humaneval = [{"task_id": "HumanEval/0", "passed": True}, {"task_id": "HumanEval/1", "passed": False}]
    assert paired.question_outcomes(humaneval, "humaneval", "pass@1,none") == {"HumanEval/0": 1.0, "HumanEval/1": 0.0}
    passkey = [{"id": "p-1", "correct": True}]
    assert paired.question_outcomes(passkey, "passkey", "accuracy,none") == {"p-1": 1.0}
    # Two run directories: compared on their common questions only, in question order of the first.
    for name, outcomes in (("sparse", {0: 1, 1: 0, 2: 1, 3: 1}), ("dense", {1: 1, 2: 1, 3: 1, 9: 0})):
        (tmp_path / name).mkdir()
        samples = {"arc_easy": [{"doc_id": q, "acc_norm": float(v)} for q, v in outcomes.items()]}
        (tmp_path / name / "samples.json.gz").write_bytes(compress_json(samples))
    diff = paired.compare_runs(tmp_path / "sparse", tmp_path / "dense", "arc_easy", "acc_norm,none")
    assert diff.n == 3 and diff.diff == pytest.approx(-1 / 3) and (diff.a_only, diff.b_only) == (0, 1)
    assert paired.compare_runs(tmp_path / "sparse", tmp_path / "nowhere", "arc_easy", "acc_norm,none") is None


# ---------------------------------------------------------------- verdicts on a synthetic store


def _store_with_verdict_cases(root, small_setting: bool = False, small_pairs: bool = False, drift: bool = False):
    """arc_easy, 800 questions (identical answers bound a difference to ±0.0055 at 98.75 %, the Bonferroni level for
    claim 6's 4 candidates): dense; Top-θ and Top-k post + VMC at k=8 agreeing with dense on all but 2
    questions (claim 1 holds, claim 6 holds: kept 0.2); Top-k post at k=8 wrong on 60 questions Top-k pre gets
    right (claim 3's pair: not claim 2's, whose Top-θ post + VMC at k=6 is wrong on those 60 where pre + SDC + VMC is
    right: claim 2 fails); layers 0-1 at k without per-sample outputs and wide stderrs (claim 5 undecided)."""
    from toptheta.store.rows import summary_rows
    from toptheta.store.runs import RunStore

    store = RunStore(root)
    rng = np.random.default_rng(0)
    dense = (rng.random(800) < 0.6).astype(float)

    def add(sparsifier, placement, k, comp, outcomes, kept, layer_k=("0", 512), stderr=None, samples=True):
        limit = len(outcomes)
        config = {"model": {"name": "tiny"}, "task": {"name": "arc_easy", "lm_eval_task": "arc_easy", "limit": limit},
                  "sparsifier": {"name": sparsifier, "placement": placement, "k": k,
                                 "layer_k": dict([layer_k]) if layer_k and sparsifier != "dense" else {}},
                  "comp": {"sdc": "exact" if "sdc" in comp else None, "sdc_scale": 1.0, "vmc": "vmc" in comp},
                  "calib": {"task": "arc_easy", "granularity": "layer-head-n"} if sparsifier == "toptheta" else None}
        run_id = store.run_id_for(config)
        value = float(outcomes.mean())
        se = stderr if stderr is not None else float(outcomes.std(ddof=1) / np.sqrt(len(outcomes)))
        results = {"results": {"arc_easy": {"acc_norm,none": value, "acc_norm_stderr,none": se}},
                   "n-shot": {"arc_easy": 0}, "config": {"limit": limit}}
        if samples:
            results["samples"] = {"arc_easy": [{"doc_id": i, "acc_norm": float(x)} for i, x in enumerate(outcomes)]}
        stats = {"kept_attention_fraction": kept}
        store.write_run(run_id, config=config, lm_eval_results=results, stats=stats, thresholds_ref=None)
        store.append_summary(summary_rows(run_id, config, results, stats, commit="c", timestamp="t"))

    add("dense", None, None, "none", dense, 1.0)
    near = dense.copy()
    near[[0, 1]] = 1 - near[[0, 1]]
    add("toptheta", "post", 8, "vmc", near, 0.2)
    add("topk", "post", 8, "vmc", dense.copy(), 0.2)
    pre = dense.copy()
    post = dense.copy()
    right = np.nonzero(dense == 1)[0][:60]
    post[right] = 0.0
    add("topk", "pre", 8, "none", pre, 0.2)
    add("topk", "post", 8, "none", post, 0.2)  # post without VMC loses 60 questions: claim 3's pair, not claim 2's
    add("toptheta", "pre", 6, "sdc+vmc", dense.copy(), 0.21)
    add("toptheta", "post", 6, "vmc", post, 0.2)  # the paper's configurations at k=6: post loses 60 (claim 2 fails)
    add("topk", "post", 8, "vmc", dense.copy(), 0.18, layer_k=None, stderr=0.05, samples=False)
    if small_setting:  # the same setting on its first 100 questions: Top-θ k=8 (also on 800) lost 30 points there;
        # Top-k post + VMC at k=4, measured on these 100 only, agrees with dense
        add("dense", None, None, "none", dense[:100], 1.0)
        worse = dense[:100].copy()
        worse[np.nonzero(worse == 1)[0][:30]] = 0.0
        add("toptheta", "post", 8, "vmc", worse, 0.1)
        add("topk", "post", 4, "vmc", dense[:100].copy(), 0.1)
    if small_pairs:  # on the first 100 too: Top-k post + VMC k=8 (also on 800) and Top-θ post + VMC k=4 (100 only)
        add("topk", "post", 8, "vmc", dense[:100].copy(), 0.2)
        add("toptheta", "post", 4, "vmc", dense[:100].copy(), 0.1)
    if drift:  # Top-θ pre + SDC + VMC at k=8: its kept fraction matches post + VMC's on the first 100 questions
        # (0.11 against 0.1, with small_setting) but not on all 800 (0.4 against 0.2)
        add("toptheta", "pre", 8, "sdc+vmc", dense.copy(), 0.4)
        add("toptheta", "pre", 8, "sdc+vmc", dense[:100].copy(), 0.11)


def test_a_configuration_measured_on_more_questions_speaks_from_the_larger_sample(tmp_path):
    from toptheta.results import verdicts
    from toptheta.results.summary import load_summary

    _store_with_verdict_cases(tmp_path, small_setting=True)
    summary = load_summary(tmp_path)
    rows = comparisons.store_rows(summary)
    small = rows[rows["g_limit"].astype(str) == "100"]
    theta_100 = small.loc[small["sparsifier"] == "toptheta", "run_id"].item()
    topk_100 = small.loc[small["sparsifier"] == "topk", "run_id"].item()
    assert comparisons.superseded_runs(rows) == {theta_100}  # Top-k k=4 was measured on the 100 questions only
    claim6 = verdicts.verdicts(summary, tmp_path)[5]
    # One setting (model, task, shots, metric) whatever the number of questions: one line, decided by the best run.
    assert claim6.verdict == "holds" and [p["group"] for p in claim6.pairs] == ["tiny · arc_easy (0-shot, limit 800) · acc_norm"]
    assert "their configuration measured on more questions: tiny · arc_easy (0-shot, limit 100) · acc_norm" in claim6.note
    assert claim6.note.startswith("settings: 1 holds;")
    candidates = claim6.pairs[0]["runs"]
    kept = comparisons.superseded_runs
    try:  # without the rule the 100-question Top-θ run would be one more candidate
        comparisons.superseded_runs = lambda rows: set()
        again = verdicts.verdicts(summary, tmp_path)[5]
        assert again.pairs[0]["runs"] == candidates + 1
    finally:
        comparisons.superseded_runs = kept
    assert topk_100 not in comparisons.superseded_runs(rows)


def test_a_pair_measured_on_more_questions_counts_once(tmp_path):
    """Top-θ and Top-k post + VMC at k=8 were compared on 800 questions and again on their first 100 (where
    Top-θ lost 30 points): claim 1 pools the 800-question pair only, else those 100 questions would weigh twice.
    The k=4 pair, measured on the 100 only, still counts."""
    from toptheta.results import verdicts
    from toptheta.results.summary import load_summary

    _store_with_verdict_cases(tmp_path, small_setting=True, small_pairs=True)
    summary = load_summary(tmp_path)
    claim1 = verdicts.verdicts(summary, tmp_path)[0]
    assert sorted((p["k"], p["group"].split("limit ")[1][:3]) for p in claim1.pairs) == [(4, "100"), (8, "800")]
    assert claim1.verdict == "holds"
    kept = comparisons.pair_superseded
    try:  # without the rule the 100-question k=8 pair enters too and drags the pooled effect below the margin
        comparisons.pair_superseded = lambda a, b, sizes, accept=None: False
        again = verdicts.verdicts(summary, tmp_path)[0]
    finally:
        comparisons.pair_superseded = kept
    assert len(again.pairs) == 3 and again.effect < claim1.effect - 0.02 and again.verdict != "holds"


def test_a_pair_the_larger_sample_rejects_speaks_from_the_smaller(tmp_path):
    """Claim 2 compares Top-θ post and pre only at kept fractions within ×1.25. Both were measured on 800 questions
    and on their first 100, but only the 100-question pair is comparable: it must count, not be left to a larger
    sample that has no pair."""
    from toptheta.results import verdicts
    from toptheta.results.summary import load_summary

    _store_with_verdict_cases(tmp_path, small_setting=True, drift=True)
    claim2 = verdicts.verdicts(load_summary(tmp_path), tmp_path)[1]
    theta = [p for p in claim2.pairs if p["a"].startswith("Top-θ")]
    assert sorted((p["k"], p["group"].split("limit ")[1][:3]) for p in theta) == [(6, "800"), (8, "100")]
    # accepting every pair, the 800-question pair supersedes the 100 one
    assert comparisons.pair_superseded(*_theta_pair(tmp_path, "100"), comparisons.sample_sizes(
        comparisons.store_rows(load_summary(tmp_path))))


def _theta_pair(root, limit: str):
    from toptheta.results import verdicts
    from toptheta.results.summary import load_summary

    rows = comparisons.store_rows(load_summary(root))
    rows = rows[(rows["g_limit"].astype(str) == limit) & (rows["sparsifier"] == "toptheta") & (rows["k"] == 8)]
    return rows[rows["placement"] == "post"].iloc[0], rows[rows["placement"] == "pre"].iloc[0]


def test_verdict_rules():
    from toptheta.results import verdicts

    assert verdicts.decide("superiority", 0.01, 0.05) == "holds"
    assert verdicts.decide("superiority", -0.05, -0.01) == "fails"
    assert verdicts.decide("superiority", -0.01, 0.05) == "undecided"
    assert verdicts.decide("non-inferiority", -0.009, 0.02) == "holds"
    assert verdicts.decide("non-inferiority", -0.05, -0.011) == "fails"
    assert verdicts.decide("non-inferiority", -0.02, 0.02) == "undecided"
    # Identical answers on n questions are not certainty: the rule of three keeps ±(−ln 0.05)/n ≈ 3/n.
    same = paired.PairedOutcomes("t", tuple(range(100)), np.zeros(100))
    mean, low, high = verdicts.pool([same])
    assert mean == 0.0 and high == pytest.approx(-math.log(0.05) / 100) and low == pytest.approx(math.log(0.05) / 100)
    # A continuous score (Rouge) gets no such floor: 3/10 would swamp a 10-document difference of 0.01.
    rouge = paired.PairedOutcomes("longbench", tuple(range(10)), np.linspace(-0.02, 0.04, 10))
    mean, low, high = verdicts.pool([rouge])
    assert mean == pytest.approx(0.01) and high - low < 0.05


def test_one_pooled_pair_matches_the_plain_paired_bootstrap():
    """The pooled bootstrap draws each universe's questions by index counts and folds whole-universe pairs into one
    product; for a single pair it must give the plain per-pair bootstrap's interval (another draw: to resampling
    noise), and a pair on part of the universe its own mean over the drawn questions it has."""
    rng = np.random.default_rng(5)
    a, b = (rng.random(600) < 0.6).astype(float), (rng.random(600) < 0.55).astype(float)
    plain = paired.paired_bootstrap(a, b)
    pair = paired.PairedOutcomes("t", tuple(range(600)), a - b)
    mean, low, high = pooled.pooled_bootstrap([pair])
    assert mean == pytest.approx((a - b).mean()) and (low, high) == pytest.approx(plain, abs=0.004)
    part = paired.PairedOutcomes("t", tuple(range(300)), (a - b)[:300])
    plain_part = paired.paired_bootstrap(a[:300], b[:300])
    other = paired.PairedOutcomes("t", tuple(range(300, 600)), np.zeros(300))  # the universe's other questions
    mean, low, high = pooled.pooled_bootstrap([part, other])
    # half the weight on a pair of zeros: the interval is half the part's own
    assert mean == pytest.approx((a - b)[:300].mean() / 2)
    assert (low, high) == pytest.approx((plain_part[0] / 2, plain_part[1] / 2), abs=0.004)
    _, intervals = pooled.pooled_intervals([pair], levels=(0.95, 0.99))
    assert intervals[0] == (low1 := pooled.pooled_bootstrap([pair])[1], pooled.pooled_bootstrap([pair])[2])
    assert intervals[1][0] < low1 and intervals[1][1] > intervals[0][1]


def test_pooling_resamples_shared_questions_together():
    """Two pairs on the same questions with the same differences carry no more evidence than one: the
    pooled interval equals the single pair's (an independent pool would shrink it by √2). Pairs on
    different universes are independent and do narrow it."""
    rng = np.random.default_rng(1)
    d = (rng.random(300) < 0.1).astype(float) - (rng.random(300) < 0.05).astype(float)
    one = paired.PairedOutcomes("arc_easy", tuple(range(300)), d)
    twin = paired.PairedOutcomes("arc_easy", tuple(range(300)), d.copy())
    other = paired.PairedOutcomes("hellaswag", tuple(range(300)), d.copy())
    _, low1, high1 = pooled.pooled_bootstrap([one])
    _, low2, high2 = pooled.pooled_bootstrap([one, twin])
    _, low3, high3 = pooled.pooled_bootstrap([one, other])
    assert (low2, high2) == pytest.approx((low1, high1), abs=1e-12)
    assert (high3 - low3) < 0.8 * (high1 - low1)
    # a pair from two stderrs joins as a normal draw around its difference, weighing 0.25/se² = 100 questions
    wide = paired.unpaired(0.5, 0.05, 0.5, 0.0)
    mean, low, high = pooled.pooled_bootstrap([one, wide])
    assert mean == pytest.approx(d.mean() * 300 / (300 + 0.25 / 0.05**2)) and low < mean < high


def test_verdicts_on_a_synthetic_store(tmp_path, monkeypatch):
    import importlib.util

    from toptheta.results import verdicts
    from toptheta.results.summary import load_summary

    _store_with_verdict_cases(tmp_path)
    found = {v.claim.split(".")[0]: v for v in verdicts.verdicts(load_summary(tmp_path), tmp_path)}
    assert found["1"].verdict == "holds" and abs(found["1"].effect) < 0.01
    assert all(p["method"] == "paired bootstrap" for p in found["1"].pairs)
    assert found["2"].verdict == "fails" and found["2"].effect == pytest.approx(-60 / 800, abs=1e-9)
    # the paper's configurations only: Top-k post − pre without compensation (also −60) is claim 3's pair
    assert [(p["a"], p["b"], p["k"]) for p in found["2"].pairs] == [("Top-θ post (+VMC)", "Top-θ pre (+SDC +VMC)", 6)]
    # VMC vs none at the smallest k: + 0.075 against Top-k post, 0 against Top-k pre (renormalised): the mean
    # effect, +0.0375, is clear of 0 (an inverse-variance pool let the zero-spread pair swamp the other)
    assert sorted(round(p["diff"], 3) for p in found["3"].pairs) == [0.0, 0.075]
    assert found["3"].effect == pytest.approx(0.0375) and found["3"].verdict == "holds"
    assert found["4"].verdict == "undecided" and not found["4"].pairs
    assert found["5"].verdict == "undecided" and found["5"].pairs[0]["method"] == "independent stderrs"
    assert found["6"].verdict == "holds" and found["6"].pairs[0]["kept"] <= 1 / 3

    spec = importlib.util.spec_from_file_location("verdicts_script", Path(__file__).parents[1] / "scripts" / "verdicts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from toptheta.results import sweeps
    # planning every experiment's sweep takes minutes: here no experiment makes these tiny runs
    monkeypatch.setattr(sweeps, "run_owners", lambda names=None, models=None: sweeps.Owners())
    readme = tmp_path / "README.md"
    readme.write_text("# Results\n\nhand-written intro\n\n<!-- verdicts:start -->\nSTALE SECTION\n<!-- verdicts:end -->\n\ntail\n")
    assert script.main(["--results", str(tmp_path)]) == 0
    text = readme.read_text()
    assert text.startswith("# Results\n\nhand-written intro") and text.rstrip().endswith("tail") and "STALE SECTION" not in text
    assert "| 2. post-softmax beats pre-softmax |" in text and "| fails |" in text
    assert "2. post-softmax beats pre-softmax: fails, measured -0.075" in text  # where the small models disagree
    assert "  - direct `python run.py` commands, in no experiment's sweep" in text  # the provenance of the runs
    first = text
    assert script.main(["--results", str(tmp_path)]) == 0 and readme.read_text() == first  # deterministic


def test_disagreements_name_failures_and_bounded_superiority_claims():
    from toptheta.results.verdicts import Verdict, disagreements

    pair = [{"group": "g"}]
    found = [Verdict("1. tracks", "non-inferiority", pair, -0.03, -0.05, -0.02, "fails", "a − b"),
             Verdict("2. beats", "superiority", pair, -0.001, -0.007, 0.005, "undecided", "post − pre"),
             Verdict("3. recovers", "superiority", pair, 0.012, -0.003, 0.027, "undecided", "c − u"),
             Verdict("5. needs", "superiority", [], None, None, None, "undecided")]
    lines = disagreements(found)
    assert len(lines) == 2
    assert lines[0].startswith("1. tracks: fails, measured -0.030 [-0.050, -0.020] over 1 pair")
    assert lines[1].startswith("2. beats: no gain of 0.01 or more here") and "at most +0.005" in lines[1]
    assert disagreements(found[2:]) == []


def test_a_claim_is_also_decided_per_setting():
    """Pooled over six settings the claim holds, yet one setting loses 5 points on its own: per_setting says so
    (also at the Bonferroni level), the one-point loss in another fails only nominally, and disagreements names
    both settings and the failing pairs."""
    from toptheta.results import verdicts

    rng = np.random.default_rng(3)

    def pair(universe, n, losses, k):
        d = np.zeros(n)
        d[rng.choice(n, losses, replace=False)] = -1.0
        return {"group": universe, "a": "Top-θ", "b": "Top-k", "k": k, "_d": paired.PairedOutcomes(universe, tuple(range(n)), d)}

    pairs = [pair("big", 2000, 0, 8), pair("big", 2000, 0, 16), pair("lossy", 400, 20, 8), pair("slight", 1000, 20, 8),
             *(pair(f"more{i}", 1000, 0, 8) for i in range(3))]
    for p in pairs:
        d = paired.compare(p["_d"].d, np.zeros(len(p["_d"].d)))
        p.update(diff=d.diff, ci_low=d.ci_low, ci_high=d.ci_high)
    v = verdicts.decided("1. Top-θ tracks Top-k", "non-inferiority", pairs)
    assert v.verdict == "holds"
    by = {s["group"]: s for s in v.settings}
    assert [by[g]["pairs"] for g in ("big", "lossy", "slight")] == [2, 1, 1]
    assert by["big"]["verdict"] == by["big"]["verdict_adjusted"] == "holds"
    assert by["lossy"]["verdict"] == by["lossy"]["verdict_adjusted"] == "fails"
    assert by["lossy"]["level_adjusted"] == pytest.approx(1 - 0.05 / 6)
    assert by["slight"]["verdict"] == "fails" and by["slight"]["verdict_adjusted"] == "undecided"
    assert by["slight"]["ci_high"] < -0.01 <= by["slight"]["ci_high_adjusted"]
    lines = verdicts.disagreements([v])
    assert any(line.startswith("1. Top-θ tracks Top-k, lossy: fails in this setting (pooled verdict: holds), -0.050")
               and "and still at 0.9917" in line for line in lines)
    assert any(line.startswith("1. Top-θ tracks Top-k, slight: fails") and "nominally: not at 0.9917" in line
               for line in lines)
    assert "2 of its 7 pairs fail on their own" in lines[-1] and "lossy: Top-θ − Top-k at k = 8 -0.050" in lines[-1]
    assert list(verdicts.settings_table([v])["group"]) == ["big", "lossy", "more0", "more1", "more2", "slight"]


def test_humaneval_transfer_is_measured_against_code_calibration(tmp_path):
    """Verdict 4 for HumanEval (no train split): ARC-Challenge thresholds against HumanEval-disjoint code's."""
    from toptheta.results import verdicts
    from toptheta.results.summary import load_summary
    from toptheta.store.rows import summary_rows
    from toptheta.store.runs import RunStore

    store = RunStore(tmp_path)
    rng = np.random.default_rng(1)
    dense = (rng.random(80) < 0.5).astype(float)
    for calib_task, outcomes in ((None, dense), ("arc_challenge", dense), ("python_code", dense)):
        theta = calib_task is not None
        config = {"model": {"name": "tiny"}, "task": {"name": "humaneval", "limit": 80},
                  "sparsifier": {"name": "toptheta" if theta else "dense", "placement": "post" if theta else None,
                                 "k": 64 if theta else None, "layer_k": {"0": 256} if theta else {}},
                  "comp": {"sdc": None, "sdc_scale": 1.0, "vmc": theta},
                  "calib": {"task": calib_task, "granularity": "layer-head-n", "num_samples": 32} if theta else None}
        run_id = store.run_id_for(config)
        results = {"results": {"humaneval": {"pass@1,none": float(outcomes.mean()), "pass@1_stderr,none": 0.05}},
                   "samples": [{"task_id": f"HumanEval/{i}", "passed": bool(x)} for i, x in enumerate(outcomes)]}
        stats = {"kept_attention_fraction": 0.3 if theta else 1.0, "kept_vrow_fraction": 0.4 if theta else 1.0}
        store.write_run(run_id, config=config, lm_eval_results=results, stats=stats, thresholds_ref=None)
        store.append_summary(summary_rows(run_id, config, results, stats, commit="c", timestamp="t"))
    claim4 = verdicts.verdicts(load_summary(tmp_path), tmp_path)[3]
    assert [(p["a"], p["b"]) for p in claim4.pairs] == [("Top-θ post (+VMC) [cal. arc_challenge]",
                                                         "Top-θ post (+VMC) [cal. python_code]")]
    assert claim4.pairs[0]["diff"] == 0.0

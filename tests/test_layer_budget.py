"""scripts/layer_budget.py: per-layer k from another run's per-layer kept fractions, by Top-k's kept fraction."""

import json
import math
from pathlib import Path

import pytest
import yaml

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    return load_script("layer_budget")


def _run(root: Path, run_id: str, sparsifier: dict, per_layer: list[float], target: dict | None = None) -> None:
    run = root / "runs" / run_id
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"sparsifier": sparsifier}))
    stats = {"per_layer": {"layer": list(range(len(per_layer))), "kept_attention_fraction": per_layer}}
    (run / "stats.json").write_text(json.dumps(stats | ({"target": target} if target else {})))


def test_the_law_and_its_inverse_agree(script):
    for length in (300.0, 827.0, 5000.0):
        for k in (1, 4, 14, 56, 295):
            assert script.k_for(script.kept_at(k, length), length) == k
    assert script.kept_at(900, 827) == 1.0 and script.k_for(1.0, 827) == 827  # k past every row keeps everything
    assert script.k_for(0.0, 827) == 1  # never below one key


def test_k_per_layer_reproduces_the_fractions_of_a_known_length(tmp_path, script, capsys):
    length = 800.0
    # a matched Top-k run (k found by its search, layers 0-1 at 128) on sequences of `length` tokens
    topk = [script.kept_at(128, length)] * 2 + [script.kept_at(14, length)] * 4
    _run(tmp_path, "topk", {"name": "topk", "k": None, "layer_k": {"0": 128, "1": 128}}, topk, {"k": 14})
    like = [0.58, 0.13, 0.13, 0.03, 0.01, 0.02]
    _run(tmp_path, "skip", {"name": "skipsoftmax", "lam": 13.9}, like)
    fitted, k = script.fitted_length(tmp_path, "topk")
    assert k == 14 and fitted == pytest.approx(length)
    assert script.main(["--like", "skip", "--topk", "topk", "--results", str(tmp_path)]) == 0
    override = capsys.readouterr().out.strip().splitlines()[-1]
    ks = yaml.safe_load(override.split("=", 1)[1].replace(":", ": "))
    assert list(ks) == list(range(6))
    for layer, f in enumerate(like):  # each k is the one whose fraction is nearest the target
        assert abs(script.kept_at(ks[layer], length) - f) <= script.kept_at(ks[layer] + 1, length) - script.kept_at(ks[layer], length)
    with pytest.raises(SystemExit, match="give a Top-k run"):
        script.fitted_length(tmp_path, "skip")
    with pytest.raises(SystemExit, match="no per-layer statistics"):
        script.per_layer_kept(tmp_path, "missing")


def test_the_layer_budget_experiment_holds_the_k_the_script_derives_from_the_store(script):
    """experiments/long_rows/smol_layer_budget.yaml's layer_k is the script's output on the committed runs."""
    header = (ROOT / "experiments" / "long_rows" / "smol_layer_budget.yaml").read_text(encoding="utf-8")
    like, topk = "60b98a8accdd4bc9", "ae93628ec00e40d0"
    assert f"--like {like} --topk {topk}" in header
    results = ROOT / "results"
    if not (results / "runs" / like).is_dir():
        pytest.skip("the committed store is not in this checkout")
    length, _ = script.fitted_length(results, topk)
    derived = {layer: script.k_for(f, length) for layer, f in enumerate(script.per_layer_kept(results, like))}
    assert yaml.safe_load(header)["sparsifier"]["layer_k"] == derived
    assert math.isclose(length, 827, abs_tol=0.5)

"""scripts/head_budget.py: Top-ρ's per-head weights from another run's per-head kept shares (kept_by_row.csv)."""

from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    return load_script("head_budget")


def _table(path: Path, run_id: str, shares: list[list[float]]) -> Path:
    rows = [{"run_id": run_id, "series": "x", "layer": layer, "head": head, "kept_fraction": f}
            for layer, row in enumerate(shares) for head, f in enumerate(row)]
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_weights_are_the_shares_over_their_mean(tmp_path, script):
    csv = _table(tmp_path / "t.csv", "0123", [[0.1, 0.3], [0.2, 0.2]])  # mean 0.2
    assert script.head_weights(csv, "0123") == [[0.5, 1.5], [1.0, 1.0]]
    assert yaml.safe_load(script.as_yaml([[0.5, 1.5], [1.0, 1.0]])) == {"head_weights": [[0.5, 1.5], [1.0, 1.0]]}


def test_a_missing_run_or_head_names_the_fix(tmp_path, script):
    csv = _table(tmp_path / "t.csv", "0123", [[0.1, 0.3], [0.2, 0.2]])
    with pytest.raises(SystemExit, match="no run 4567: replay it first"):
        script.head_weights(csv, "4567")
    table = pd.read_csv(csv, dtype={"run_id": str}).iloc[:-1]
    table.to_csv(csv, index=False)
    with pytest.raises(SystemExit, match="lacks some"):
        script.head_weights(csv, "0123")


def test_permuting_shuffles_each_layer_alone_and_is_seeded(script):
    weights = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]
    shuffled = script.permuted(weights, 0)
    assert [sorted(row) for row in shuffled] == weights and shuffled == script.permuted(weights, 0)
    assert shuffled != weights and script.permuted(weights, 1) != shuffled


@pytest.mark.parametrize("name,permute", [("smol_head_budget", None), ("smol_head_budget_shuffled", 0)])
def test_the_experiments_hold_what_the_script_prints_from_the_stored_replay(script, name, permute):
    """experiments/long_rows/smol_head_budget*'s weights are still those of skip-softmax's replayed shares (shuffled
    over each layer's heads with --permute 0 for the control)."""
    experiment = yaml.safe_load((ROOT / f"experiments/long_rows/{name}.yaml").read_text(encoding="utf-8"))
    weights = script.head_weights(ROOT / "results/analysis/kept_by_row.csv", "60b98a8accdd4bc9")
    assert experiment["sparsifier"]["head_weights"] == (weights if permute is None else script.permuted(weights, permute))


def test_agreement_reports_the_ratio_and_the_correlation_and_refuses_another_shape(script):
    weights = [[1.0, 2.0, 4.0], [0.5, 1.0, 8.0]]
    line = script.agreement([[w * 1.01 for w in row] for row in weights], weights, "other.csv")
    assert "median 1.0100, range 1.0100..1.0100" in line and "r of the log weights 1.00000" in line
    assert "r of the log weights -1.00000" in script.agreement([[1 / w for w in row] for row in weights], weights, "x")
    with pytest.raises(SystemExit, match="replay the same model"):
        script.agreement(weights, [row[:2] for row in weights], "other.csv")

"""The results store: run ids, run dir layout, exists(), summary rows, atomicity, concurrency."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from toptheta.store import runs as store_mod
from toptheta.results.summary import load_summary
from toptheta.store.provenance import git_commit
from toptheta.store.rows import SUMMARY_COLUMNS, comp_label, summary_rows
from toptheta.store.runs import RunStore

REPO = Path(__file__).resolve().parents[1]

CONFIG = {
    "model": {"name": "tiny-llama", "dtype": "float32"},
    "sparsifier": {"name": "toptheta", "placement": "pre", "k": 64, "layer_k": {}},
    "comp": {"sdc": "exact", "sdc_scale": 1.0, "vmc": True},
    "calib": {"task": "arc_challenge", "granularity": "layer-head-n"},
    "task": {"kind": "lm_eval", "lm_eval_task": "arc_easy", "num_fewshot": 0, "limit": 5},
    "phase": "eval",
    "logger": "wandb",
    "force": False,
    "results_dir": "results",
}

# The shape of lm-eval 0.4.13's results dict, trimmed.
LM_EVAL = {
    "results": {
        "arc_easy": {
            "alias": "arc_easy",
            "acc,none": 0.4,
            "acc_stderr,none": 0.24,
            "acc_norm,none": 0.6,
            "acc_norm_stderr,none": "N/A",
        },
        "smoke": {"alias": "smoke", "acc,none": 1.0, "acc_stderr,none": 0.0},
    },
    "n-shot": {"arc_easy": 0, "smoke": 0},
    "config": {"limit": 5},
    "samples": {"arc_easy": [{"doc_id": 0, "acc": 1.0}]},
}
STATS = {"kept_attention_fraction": 0.25, "arc_easy": {"kept_vrow_fraction": 0.5}}


def test_run_id_is_stable_and_ignores_only_result_neutral_keys():
    store = RunStore("unused")
    rid = store.run_id_for(CONFIG)
    assert len(rid) == 16 and int(rid, 16) >= 0
    reordered = dict(reversed(list(CONFIG.items())))
    assert store.run_id_for(reordered) == rid
    assert store.run_id_for(CONFIG | {"logger": None, "force": True, "results_dir": "/elsewhere"}) == rid
    assert store.run_id_for(CONFIG | {"sparsifier": CONFIG["sparsifier"] | {"k": 32}}) != rid
    assert store.run_id_for(CONFIG | {"calib": {"task": "arc_challenge", "granularity": "layer-head-n"}}) == rid
    assert RunStore("x", ignored_keys=("logger", "force", "results_dir", "sparsifier.k")).run_id_for(
        CONFIG | {"sparsifier": CONFIG["sparsifier"] | {"k": 32}}
    ) == RunStore("x", ignored_keys=("logger", "force", "results_dir", "sparsifier.k")).run_id_for(CONFIG)
    with pytest.raises(TypeError, match="OmegaConf.to_container"):
        store.run_id_for({"model": object()})


def test_write_run_layout_and_exists(tmp_path):
    store = RunStore(tmp_path / "results")
    rid = store.run_id_for(CONFIG)
    assert not store.exists(rid)
    run_dir = store.write_run(
        rid, config=CONFIG, lm_eval_results=LM_EVAL, stats=STATS, thresholds_ref="thr/abc.pt", extra={"wall_s": 1.5}
    )
    assert run_dir == tmp_path / "results" / "runs" / rid
    assert store.exists(rid)
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == ["DONE", "config.json", "lm_eval.json", "meta.json", "samples.json.gz", "stats.json"]
    assert json.loads((run_dir / "config.json").read_text()) == CONFIG
    lm = json.loads((run_dir / "lm_eval.json").read_text())
    assert "samples" not in lm and lm["results"] == LM_EVAL["results"]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["thresholds_ref"] == "thr/abc.pt" and meta["extra"] == {"wall_s": 1.5} and meta["run_id"] == rid
    assert [p.name for p in (tmp_path / "results" / "runs").iterdir()] == [rid]  # no temp dirs left

    # A directory without DONE is not a complete run.
    (tmp_path / "results" / "runs" / "partial").mkdir()
    assert not store.exists("partial")
    with pytest.raises(ValueError, match="invalid run id"):
        store.exists("../escape")

    # Rewriting replaces the run as a whole.
    store.write_run(rid, config=CONFIG, lm_eval_results={"results": {}}, stats={}, thresholds_ref=None)
    assert not (run_dir / "samples.json.gz").exists() and store.exists(rid)


def test_write_run_leaves_nothing_on_error(tmp_path, monkeypatch):
    store = RunStore(tmp_path)
    real_write = store_mod._write_text_atomic
    calls = []

    def failing_write(path, text):
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError("disk full (simulated)")
        real_write(path, text)

    monkeypatch.setattr(store_mod, "_write_text_atomic", failing_write)
    with pytest.raises(OSError, match="simulated"):
        store.write_run("r1", config=CONFIG, lm_eval_results=LM_EVAL, stats=STATS, thresholds_ref=None)
    assert not store.exists("r1")
    assert list((tmp_path / "runs").iterdir()) == []


def test_summary_rows_one_per_task_metric():
    rows = summary_rows("rid", CONFIG, LM_EVAL, STATS, commit="abc", timestamp="t0")
    pairs = [(r["task"], r["metric"]) for r in rows]
    assert pairs == [("arc_easy", "acc,none"), ("arc_easy", "acc_norm,none"), ("smoke", "acc,none")]
    first = rows[0]
    assert set(SUMMARY_COLUMNS) <= set(first)
    assert {k: first[k] for k in ("run_id", "model", "sparsifier", "placement", "k", "comp", "granularity")} == {
        "run_id": "rid", "model": "tiny-llama", "sparsifier": "toptheta", "placement": "pre", "k": 64,
        "comp": "sdc=exact+vmc", "granularity": "layer-head-n",
    }
    assert (first["value"], first["stderr"], first["num_fewshot"], first["limit"]) == (0.4, 0.24, 0, 5)
    assert rows[1]["stderr"] is None  # lm-eval's "N/A"
    assert (first["kept_attention_fraction"], first["kept_vrow_fraction"]) == (0.25, 0.5)  # global, per task
    assert rows[2]["kept_vrow_fraction"] is None
    assert (first["git_commit"], first["timestamp"], first["phase"]) == ("abc", "t0", "eval")


def test_summary_rows_for_a_dense_baseline_and_overrides():
    dense = CONFIG | {"sparsifier": {"name": "dense", "placement": None, "k": None}, "calib": None,
                      "comp": {"sdc": None, "sdc_scale": 1.0, "vmc": False}}
    row = summary_rows("rid", dense, LM_EVAL, {}, commit="abc")[0]
    labels = (row["sparsifier"], row["placement"], row["k"], row["comp"], row["granularity"])
    assert labels == ("dense", None, None, "none", None)
    assert row["kept_attention_fraction"] is None
    assert summary_rows("rid", dense, LM_EVAL, {}, commit="abc", overrides={"phase": "baseline"})[0]["phase"] == "baseline"
    assert comp_label({"sdc": "calibrated", "sdc_scale": 0.9, "vmc": False}) == "sdc=calibrated*0.9"


def test_append_summary_and_load(tmp_path):
    store = RunStore(tmp_path)
    assert list(load_summary(tmp_path).columns) == list(SUMMARY_COLUMNS)
    store.append_summary(summary_rows("0123456789e12345", CONFIG, LM_EVAL, STATS, commit="abc"))
    store.append_summary([{"run_id": "r2", "task": "smoke", "metric": "acc,none", "value": 0.5, "new_col": "x"}])
    df = load_summary(tmp_path)
    assert len(df) == 4 and list(df.columns) == [*SUMMARY_COLUMNS, "new_col"]
    assert df["run_id"].tolist()[0] == "0123456789e12345"  # not parsed as a float
    assert df["value"].tolist() == [0.4, 0.6, 1.0, 0.5]


def test_append_summary_is_atomic_on_error(tmp_path):
    store = RunStore(tmp_path)
    store.append_summary([{"run_id": "r1", "value": 1.0}])
    before = (tmp_path / "summary.csv").read_text()

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot format (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        store.append_summary([{"run_id": "r2", "value": Unprintable()}])
    assert (tmp_path / "summary.csv").read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind
    assert {"summary.csv", "summary.csv.lock"} <= {p.name for p in tmp_path.iterdir()}


def test_concurrent_appends_from_two_processes_keep_every_row(tmp_path):
    n = 40
    # The children import the store as users do (the store imports its claims module, so it no
    # longer loads on its own by path).
    script = (
        "import sys\n"
        "from toptheta.store.runs import RunStore\n"
        "store = RunStore(sys.argv[1])\n"
        f"for i in range({n}):\n"
        "    store.append_summary([{'run_id': f'{sys.argv[2]}-{i}', 'value': i}])\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(tmp_path), tag], cwd=REPO) for tag in ("a", "b")
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    df = load_summary(tmp_path)
    assert sorted(df["run_id"]) == sorted(f"{t}-{i}" for t in ("a", "b") for i in range(n))


def test_git_commit(tmp_path):
    commit = git_commit(REPO)
    if commit is not None:  # the tests may run from an exported tree
        assert len(commit.removesuffix("-dirty")) == 40
    assert git_commit(tmp_path) is None


def test_runs_record_the_commit_their_process_started_with(monkeypatch, tmp_path):
    """A checkout that moves on while a sweep runs (a pull) does not relabel the runs that process still makes."""
    from toptheta.store import provenance, runs

    heads = iter(["a" * 40, "b" * 40])
    monkeypatch.setattr(provenance, "git_commit", lambda path=None: next(heads))
    provenance.code_commit.cache_clear()
    try:
        assert provenance.code_commit() == "a" * 40  # the pipeline asks when a run starts
        store = runs.RunStore(tmp_path)
        store.write_run("r1", config={"x": 1}, lm_eval_results={"results": {}}, stats={}, thresholds_ref=None)
        assert json.loads((tmp_path / "runs" / "r1" / "meta.json").read_text())["git_commit"] == "a" * 40
    finally:
        provenance.code_commit.cache_clear()


def test_summary_rows_say_what_separates_the_series():
    config = CONFIG | {
        "sparsifier": {"name": "toptheta", "placement": "post", "k": 16, "layer_k": {"0": 512, "1": 512},
                       "empty_rows": "reference"},
        "calib": {"task": "arc_challenge", "granularity": "layer-n", "statistic": "order", "sigma_add": 0.1,
                  "tac": True, "num_samples": 64, "compensation": "run"},
    }
    stats = {"kept_attention_fraction": 0.3, "clamped_rows": 12, "empty_rows": 5}
    row = summary_rows("rid", config, LM_EVAL, stats, commit="c", timestamp="t")[0]
    assert {k: row[k] for k in ("granularity", "layer_k", "calib_task", "calib_statistic", "sigma_add", "tac",
                                "calib_documents", "calib_compensation", "empty_rows")} == {
        "granularity": "layer-n", "layer_k": "0=512,1=512", "calib_task": "arc_challenge", "calib_statistic": "order",
        "sigma_add": 0.1, "tac": True, "calib_documents": 64, "calib_compensation": "run", "empty_rows": "reference"}
    assert (row["clamped_rows"], row["empty_row_count"], row["stats_scope"]) == (12, 5, "run")
    dense = config | {"sparsifier": {"name": "dense", "placement": None, "k": None, "layer_k": {}}, "calib": None}
    row = summary_rows("rid", dense, LM_EVAL, {}, commit="c")[0]
    assert all(row[c] is None for c in ("placement", "k", "layer_k", "empty_rows", "calib_task", "calib_documents"))


def test_sub_task_rows_get_only_their_own_statistics():
    """A passkey length is a sub-task: the run's pooled kept fractions are not its own."""
    config = {"model": {"name": "m"}, "task": {"name": "passkey", "kind": "passkey"},
              "sparsifier": {"name": "topk", "placement": "post", "k": 64, "layer_k": {}}, "comp": {"vmc": True}}
    results = {"results": {"passkey": {"accuracy,none": 0.5, "accuracy_stderr,none": 0.1},
                           "passkey_2048": {"accuracy,none": 1.0}, "passkey_8192": {"accuracy,none": 0.0}}}
    stats = {"kept_attention_fraction": 0.1, "passkey_8192": {"kept_attention_fraction": 0.05}}
    rows = {r["task"]: r for r in summary_rows("rid", config, results, stats, commit="c")}
    assert (rows["passkey"]["kept_attention_fraction"], rows["passkey"]["stats_scope"]) == (0.1, "run")
    assert (rows["passkey_2048"]["kept_attention_fraction"], rows["passkey_2048"]["stats_scope"]) == (None, None)
    assert (rows["passkey_8192"]["kept_attention_fraction"], rows["passkey_8192"]["stats_scope"]) == (0.05, "task")
    assert rows["passkey"]["limit"] is None  # no lengths and depths in this config: the count is unknown
    sized = config | {"task": {**config["task"], "lengths": [2048, 8192], "depths": [0.1, 0.5, 0.9]}}
    rows = summary_rows("rid", sized, results, stats, commit="c")
    assert {r["limit"] for r in rows} == {6}  # the prompts it evaluated: 6-prompt and 60-prompt runs do not mix
    limited = sized | {"task": {**sized["task"], "limit": 4}}
    assert {r["limit"] for r in summary_rows("rid", limited, results, stats, commit="c")} == {4}


def test_an_old_summary_still_loads_and_migrates(tmp_path):
    """A summary.csv written before the new columns loads (empty columns); the migration command rebuilds its
    rows from the run directories (passkey accuracy in percent becomes a fraction), keeping orphan rows."""
    from toptheta.store.migrate import migrate

    old_columns = ["run_id", "model", "sparsifier", "placement", "k", "comp", "granularity", "task", "num_fewshot",
                   "limit", "metric", "value", "stderr", "kept_attention_fraction", "kept_vrow_fraction",
                   "git_commit", "phase", "timestamp"]
    store = RunStore(tmp_path)
    config = {"model": {"name": "m"}, "task": {"name": "passkey", "kind": "passkey"},
              "sparsifier": {"name": "toptheta", "placement": "post", "k": 64, "layer_k": {"0": 256}},
              "comp": {"sdc": None, "vmc": True}, "calib": {"task": "arc_challenge", "num_samples": 32}}
    run_id = store.run_id_for(config)
    results = {"results": {"passkey": {"accuracy,none": 100.0, "accuracy_stderr,none": 0.0},
                           "passkey_2048": {"accuracy,none": 50.0}}}
    # As older pipelines wrote it: per-layer lists under the scalar's name.
    store.write_run(run_id, config=config, lm_eval_results=results,
                    stats={"kept_attention_fraction": [1.0, 0.2], "clamped_rows": 3}, thresholds_ref=None)
    lines = [",".join(old_columns),
             f'{run_id},m,toptheta,post,64,vmc,layer-head-n,passkey,0,,"accuracy,none",100.0,0.0,0.25,0.5,abc,,t1',
             f'{run_id},m,toptheta,post,64,vmc,layer-head-n,passkey_2048,0,,"accuracy,none",50.0,,0.25,0.5,abc,,t1',
             'orphan,m,dense,,,none,,arc_easy,0,5,"acc,none",0.4,0.1,1.0,,abc,,t0']
    (tmp_path / "summary.csv").write_text("\n".join(lines) + "\n")
    old = load_summary(tmp_path)
    assert set(SUMMARY_COLUMNS) <= set(old.columns) and old["calib_task"].isna().all() and len(old) == 3
    assert migrate(tmp_path) == 3
    new = load_summary(tmp_path).set_index("task")
    assert new.loc["passkey", "value"] == 1.0 and new.loc["passkey_2048", "value"] == 0.5  # fractions
    assert new.loc["passkey", "kept_attention_fraction"] == 0.25  # restored from the old row, not the list
    assert pd.isna(new.loc["passkey_2048", "kept_attention_fraction"])  # pooled numbers not copied onto a length
    assert new.loc["passkey", "calib_task"] == "arc_challenge" and new.loc["passkey", "clamped_rows"] == 3
    assert new.loc["arc_easy", "run_id"] == "orphan"  # no run directory: kept as it was


def test_per_sample_logs_are_gzipped(tmp_path):
    """Runs write samples.json.gz: the same samples give the same bytes, and they read back unchanged."""
    from toptheta.store.samples import read_samples, samples_path

    samples = {"arc_easy": [{"doc_id": i, "acc_norm": float(i % 2), "arguments": "Question: " * 50} for i in range(200)]}
    store = RunStore(tmp_path)
    new = store.write_run("new", config=CONFIG, lm_eval_results={**LM_EVAL, "samples": samples}, stats={},
                          thresholds_ref=None)
    first = (new / "samples.json.gz").read_bytes()
    assert read_samples(samples_path(new)) == samples and len(first) < len(json.dumps(samples)) / 5
    store.write_run("new", config=CONFIG, lm_eval_results={**LM_EVAL, "samples": samples}, stats={},
                    thresholds_ref=None)
    assert (new / "samples.json.gz").read_bytes() == first  # no timestamp in the gzip header
    assert samples_path(store.write_run("none", config=CONFIG, lm_eval_results={"results": {}}, stats={},
                                        thresholds_ref=None)) is None


def test_a_matched_run_records_what_its_target_is_a_fraction_of():
    """target_measure: vrows when the run says so, attention (the default) for any other matched run, empty without a
    target; the run id's config holds the measure only when it was set."""
    def measure(**sparsifier):
        config = {**CONFIG, "sparsifier": {**CONFIG["sparsifier"], **sparsifier}}
        return summary_rows("rid", config, LM_EVAL, STATS, commit="abc")[0]["target_measure"]

    assert measure(target_kept=0.1, target_measure="vrows") == "vrows"
    assert measure(target_kept=0.1) == "attention"
    assert measure() is None


def test_the_committed_summary_is_what_its_run_directories_rebuild():
    """The store round trip on the committed store: summary.csv is, byte for byte, what store/migrate.py rebuilds
    from results/runs/ (so a refactor that changes no number regenerates the same file)."""
    from toptheta.store.migrate import rebuilt_summary

    results = Path(__file__).resolve().parents[1] / "results"
    text, counts = rebuilt_summary(results)
    assert counts["kept"] == 0  # every row has its run directory
    assert text == (results / "summary.csv").read_text(encoding="utf-8"), (
        "results/summary.csv differs from its rebuild: run python -m toptheta.store.migrate and commit it")


def test_fitted_parameters_takes_what_a_matched_search_chose():
    from toptheta.store.rows import fitted_parameters

    assert fitted_parameters({"target": {"target_kept": 0.05, "k": 14, "tried": []}}) == {"k": 14}
    assert fitted_parameters({"target": {"target_kept": 0.05, "lam": 13.9, "calibration_kept": 0.05}}) == {"lam": 13.9}
    assert fitted_parameters({"kept_attention_fraction": 0.3}) == {} == fitted_parameters({"target": None})


def test_per_head_columns_lays_layer_major_rows():
    import torch

    from toptheta.attention.stats import per_head_columns

    table = per_head_columns(a=torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), b=torch.zeros(2, 3))
    assert table["layer"] == [0, 0, 0, 1, 1, 1] and table["head"] == [0, 1, 2, 0, 1, 2]
    assert table["a"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and table["b"] == [0.0] * 6

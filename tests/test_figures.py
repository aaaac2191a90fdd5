"""Figures and tables from the results store: a synthetic store written through RunStore, then make_figures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.figure import Figure

from toptheta.results import figures, labels, run_figures, selection
from toptheta.results.summary import load_summary
from toptheta.store.rows import summary_rows
from toptheta.store.runs import RunStore

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "ablations.ipynb"
COMP = {"none": {"sdc": None, "sdc_scale": 1.0, "vmc": False}, "vmc": {"sdc": None, "sdc_scale": 1.0, "vmc": True},
        "sdc+vmc": {"sdc": "exact", "sdc_scale": 1.0, "vmc": True}}
QA = "tradeoff-tiny-llama-arc_easy-0shot-limit5-acc_norm"
HE = "tradeoff-tiny-llama-humaneval-0shot-full-pass_1"

# (sparsifier, placement, k, comp, granularity, acc_norm, stderr, kept attention) on arc_easy, 0-shot, limit 5.
QA_RUNS = [
    ("dense", None, None, "none", None, 0.60, 0.05, 1.0),
    ("toptheta", "pre", 16, "sdc+vmc", "layer-head-n", 0.58, 0.05, 0.125),
    ("toptheta", "pre", 32, "sdc+vmc", "layer-head-n", 0.59, 0.05, 0.25),
    ("toptheta", "post", 16, "vmc", "layer-head-n", 0.55, 0.05, 0.1),
    ("toptheta", "post", 32, "vmc", "layer-head-n", 0.57, 0.05, 0.2),
    ("topk", "pre", 16, "sdc+vmc", None, 0.56, 0.04, 0.16),
    ("topk", "post", 16, "vmc", None, 0.40, 0.04, 0.5),  # rerun below with the value that must win
    ("toptheta", "post", 16, "vmc", "layer", 0.50, 0.05, 0.4),  # granularity ablation
]


def _config(sparsifier, placement, k, comp, granularity, task, limit=5):
    return {
        "model": {"name": "tiny-llama", "dtype": "float32"},
        "task": {"name": task, "kind": "lm_eval" if task != "humaneval" else "humaneval", "limit": limit},
        "sparsifier": {"name": sparsifier, "placement": placement, "k": k,
                       "layer_k": {} if sparsifier == "dense" else {"0": 512, "1": 512}},
        "comp": COMP[comp],
        "calib": {"granularity": granularity, "task": "arc_easy"} if granularity else None,
    }


def _add(store, run, *, task="arc_easy", metric="acc_norm", limit=5, vrow=None, per_layer=None, popularity=None,
         stamp=0, clamped=None, acc=True):
    sparsifier, placement, k, comp, granularity, value, stderr, attn = run
    config = _config(sparsifier, placement, k, comp, granularity, task, limit)
    run_id = store.run_id_for(config)
    lm_eval = {"results": {task: {f"{metric},none": value, f"{metric}_stderr,none": stderr,
                                  **({"acc,none": value - 0.1, "acc_stderr,none": stderr} if acc else {})}},
               "n-shot": {task: 0}, "config": {"limit": limit}}
    stats = {"kept_attention_fraction": attn, "kept_vrow_fraction": vrow}
    if clamped is not None:
        stats["clamped_rows"] = clamped
    if per_layer is not None or popularity is not None:  # as the pipeline does: scalars, per-layer lists, records
        extra = {"per_layer": per_layer} if per_layer is not None else {}
        extra |= {"vrow_popularity": popularity} if popularity is not None else {}
        store.write_run(run_id, config=config, lm_eval_results=lm_eval, stats=stats | extra, thresholds_ref=None)
    store.append_summary(summary_rows(run_id, config, lm_eval, stats, commit="abc123",
                                      timestamp=f"2025-01-01T00:00:{stamp:02d}+00:00"))
    return run_id


# Two decode steps of a 2-head KV group: step 0 saw 3 keys, step 1 saw 4.
POPULARITY = {"layer": 1, "group": 0, "heads_per_group": 2, "steps": 2, "counts": [[2, 0, 1, 0], [2, 1, 0, 2]]}


@pytest.fixture(scope="module", autouse=True)
def render_record(tmp_path_factory):
    """make_figures keeps what it drew in the cache directory: this module's own, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOPTHETA_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """A store with a QA trade-off (+ a rerun and a granularity ablation), HumanEval, and two per-layer runs."""
    root = tmp_path_factory.mktemp("store") / "results"
    store = RunStore(root)
    layers = {"layer": [0, 1, 2], "kept_attention_fraction": [1.0, 0.3, 0.1],
              "kept_vrow_fraction": [float("nan")] * 3, "mean_dropped_mass": [0.0, 0.02, 0.05]}
    for i, run in enumerate(QA_RUNS):
        per_layer = None
        if run[:4] == ("toptheta", "post", 16, "vmc") and run[4] == "layer-head-n":
            per_layer = layers
        if run[:4] == ("toptheta", "post", 32, "vmc"):
            per_layer = layers | {"kept_attention_fraction": [1.0, 0.5, 0.2]}
        _add(store, run, per_layer=per_layer, stamp=i)
    _add(store, ("topk", "post", 16, "vmc", None, 0.52, 0.04, 0.16), stamp=30)  # force=true rerun: latest wins
    for i, run in enumerate([("dense", None, None, "none", None, 0.30, 0.0, 1.0),
                             ("toptheta", "post", 64, "vmc", "layer-head-n", 0.25, 0.0, 0.3)]):
        _add(store, run, task="humaneval", metric="pass@1", limit=None, vrow=1.0 if i == 0 else 0.2, stamp=40 + i,
             popularity=POPULARITY if i == 1 else None)
    return root


def _load_script():
    spec = importlib.util.spec_from_file_location("make_figures", REPO / "scripts" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def made(results):
    out = results / "figures"
    assert _load_script().main(["--results", str(results), "--out", str(out)]) == 0
    return out


def test_series_labels():
    label = labels.series_label
    assert label({"sparsifier": "dense"}) == "Baseline"
    assert label({"sparsifier": "toptheta", "placement": "pre", "comp": "sdc=exact+vmc"}) == "Top-θ pre (+SDC +VMC)"
    assert label({"sparsifier": "toptheta", "placement": "post", "comp": "vmc"}) == "Top-θ post (+VMC)"
    assert label({"sparsifier": "topk", "placement": "pre", "comp": "sdc=exact+vmc"}) == "Top-k pre (+SDC +VMC)"
    assert label({"sparsifier": "topk", "placement": "post", "comp": "vmc"}) == "Top-k post (+VMC)"
    assert label({"sparsifier": "topk", "placement": "post", "comp": "none"}) == "Top-k post"
    assert label({"sparsifier": "toptheta", "placement": "pre", "comp": "sdc=calibrated*0.9"}) == \
        "Top-θ pre (+SDC[calibrated×0.9])"
    row = {"sparsifier": "toptheta", "placement": "post", "comp": "vmc", "granularity": "layer"}
    assert label(row) == "Top-θ post (+VMC) [θ per layer]"
    assert label(row, granularity=False) == "Top-θ post (+VMC)"
    fit = {"sparsifier": "toptheta", "placement": "post", "comp": "vmc", "calib_beyond": "fit"}
    assert label(fit) == "Top-θ post (+VMC) [θ fitted past calibration]"  # never merged with the clamp run
    assert label({**fit, "calib_beyond": "clamp"}) == "Top-θ post (+VMC)"
    assert label({**fit, "sparsifier": "topk"}) == "Top-k post (+VMC)"  # no θ to fit
    assert not labels.main_series(label(fit))


def test_metric_of_interest():
    summary = pd.DataFrame({"task": ["arc_easy", "arc_easy", "humaneval", "longbench_qmsum", "passkey"],
                            "metric": ["acc,none", "acc_norm,none", "pass@1,none", "rouge_score,none", "accuracy,none"]})
    assert [selection.metric_of_interest(summary, t) for t in ("arc_easy", "humaneval", "longbench_qmsum", "passkey")] \
        == ["acc_norm,none", "pass@1,none", "rouge_score,none", "accuracy,none"]


def test_expected_files_and_commands(made):
    names = {p.name for p in made.iterdir()}
    for stem in (QA, HE):
        assert {f"{stem}.csv", f"{stem}.md", f"{stem}-kept_attn.png", f"{stem}-kept_attn.md"} <= names
    assert f"{HE}-kept_vrow.png" in names  # generation: V rows measured
    assert f"{QA}-kept_vrow.png" not in names  # QA prefill only: no V-row figure
    for stem in (QA, HE):  # every table in csv, Markdown and LaTeX; every figure in PNG and PDF
        assert {f"{stem}.tex", f"{stem}-kept_attn.pdf"} <= names
    gran = "ablation-granularity-tiny-llama-arc_easy-0shot-limit5-acc_norm"
    assert {f"{gran}.csv", f"{gran}.tex", f"{gran}-fig.png", f"{gran}-fig.pdf", "index.md", "manifest.txt"} <= names
    assert {"threshold_storage.csv", "threshold_storage.tex", "verdicts.md", "verdicts.tex"} <= names
    assert "per_layer-tiny-llama-arc_easy-Top-theta_post_VMC-kept_attn.png" in names
    assert {"vrow_popularity-tiny-llama.csv", "vrow_popularity-tiny-llama-Top-theta_post_VMC_k_64-layer1-group0.png"} <= names
    for md in made.glob("*.md"):
        assert "python scripts/make_figures.py --results" in md.read_text(), md.name
    for tex in made.glob("*.tex"):
        text = tex.read_text()
        assert "\\begin{tabular}" in text and "\\bottomrule" in text and "python scripts/make_figures.py" in text
    assert all((made / n).read_bytes().startswith(b"%PDF") for n in names if n.endswith(".pdf"))
    assert all((made / n).stat().st_size > 1000 for n in names if n.endswith(".png"))


def test_vrow_popularity_heatmap_greys_out_keys_not_yet_generated():
    """Step 0 saw 3 keys and step 1 saw 4: the 4th key at step 0 is masked (grey), not drawn as 'no head keeps it'."""
    image = run_figures.vrow_popularity_figure(POPULARITY).axes[0].images[0].get_array()
    assert image.mask.tolist() == [[False, False, False, True], [False, False, False, False]]
    assert image.filled(-1).tolist() == [[2, 0, 1, -1], [2, 1, 0, 2]]


def test_vrow_popularity_table_numbers(made):
    row = pd.read_csv(made / "vrow_popularity-tiny-llama.csv").iloc[0]
    assert (row["layer"], row["group"], row["heads_per_group"], row["decode_steps"]) == (1, 0, 2, 2)
    assert row["mean_keys"] == 3.5  # 3 then 4 keys
    assert row["mean_vrows_read"] == 2.5 and row["mean_vrows_per_head"] == 2.0  # unions 2, 3; per head 1.5, 2.5
    assert row["union_over_per_head"] == 1.25


def test_tradeoff_table_numbers(made):
    table = pd.read_csv(made / f"{QA}.csv")
    assert list(table["series"]) == ["Baseline", "Top-θ pre (+SDC +VMC)", "Top-θ pre (+SDC +VMC)", "Top-θ post (+VMC)",
                                     "Top-θ post (+VMC)", "Top-k pre (+SDC +VMC)", "Top-k post (+VMC)",
                                     "Top-θ post (+VMC) [θ per layer]"]
    assert table["metric"].eq("acc_norm,none").all() and table["limit"].eq(5).all()
    expected = {(r[0], r[1] or "", r[4] or "", r[2]): (r[5], r[6], r[7]) for r in QA_RUNS}
    expected[("topk", "post", "", 16)] = (0.52, 0.04, 0.16)  # the rerun's row
    for row in table.fillna({"placement": "", "granularity": ""}).itertuples():
        k = None if pd.isna(row.k) else int(row.k)
        value, stderr, attn = expected[(row.sparsifier, row.placement, row.granularity, k)]
        assert (row.value, row.stderr, row.kept_attention_fraction) == pytest.approx((value, stderr, attn))
        assert row.attention_reduction == pytest.approx(1 / attn)
    assert table.loc[1, "value_pm_stderr"] == "0.5800 ± 0.0500"
    humaneval = pd.read_csv(made / f"{HE}.csv")
    assert humaneval["vrow_reduction"].tolist() == pytest.approx([1.0, 5.0])


def test_figure_and_granularity(results):
    summary = load_summary(results)
    fig = figures.tradeoff_figure(summary, model="tiny-llama", task="arc_easy", metric="acc_norm")
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_xlim()[1] > 1 and ax.get_xlim()[0] < 0.1  # down to the lowest x
    legend = ax.get_legend_handles_labels()[1]
    # The paper's series only (the granularity ablation has its own figure); Top-k post (+VMC) is also the pre
    # (+SDC +VMC) computation, said in its label; the title uses the paper's names.
    assert legend[0] == "Baseline (dense)" and "Top-k post (+VMC) ≡ pre (+SDC +VMC)" in legend and len(legend) == 5
    assert not any("θ per layer" in label for label in legend)
    assert sorted(t.get_text() for t in ax.texts) == sorted(["16", "32", "16", "32", "16", "16"])
    assert "Top-θ" in ax.get_title() and "Top-k" in ax.get_title()
    assert len(ax.containers) == 4  # one curve with error bars per sparse series
    colors = [c.lines[0].get_color() for c in ax.containers]
    assert len(set(colors)) == 4
    # Series left out of the figure take no colour: ten others still get ten colours of their own.
    others = [f"series {i}" for i in range(10)]
    assert len(set(labels.series_colors(others).values()) - set(labels.SERIES_COLORS.values())) == 10
    gran = figures.granularity_table(summary, model="tiny-llama", task="arc_easy", metric="acc_norm")
    assert list(gran["granularity"].fillna("")) == ["", "layer", "layer-head-n", "layer-head-n"]
    assert list(gran["series"]) == ["Baseline"] + ["Top-θ post (+VMC)"] * 3 and list(gran["k"][1:]) == [16, 16, 32]


def test_log_axes_get_plain_labels_at_1_2_5_steps():
    """Kept fractions often span less than a decade: still several plain labels, none in 10^x notation."""
    fig = Figure()
    ax = fig.add_subplot()
    ax.plot([0.2, 0.35, 0.8], [1, 2, 3])
    ax.set_xscale("log")
    figures.label_log_axis(ax.xaxis)
    fig.canvas.draw()
    low, high = ax.get_xlim()
    major = [(t.get_position()[0], t.get_text()) for t in ax.get_xticklabels() if low <= t.get_position()[0] <= high]
    assert [text for _, text in major] == ["0.2", "0.5"] and all(float(text) == x for x, text in major)
    assert not any(t.get_text() for t in ax.xaxis.get_minorticklabels())


def test_ambiguous_setting_is_refused(results, tmp_path):
    store = RunStore(tmp_path)
    store.append_summary(load_summary(results).to_dict("records"))
    _add(store, ("dense", None, None, "none", None, 0.7, 0.01, 1.0), limit=200, stamp=50)
    summary = load_summary(tmp_path)
    with pytest.raises(ValueError, match="pass num_fewshot= and limit="):
        figures.tradeoff_table(summary, model="tiny-llama", task="arc_easy", metric="acc_norm")
    assert len(figures.tradeoff_table(summary, model="tiny-llama", task="arc_easy", metric="acc_norm",
                                      num_fewshot=0, limit=5)) == 8


def test_ablation_table_compares_each_run_with_its_reference(results):
    from toptheta.results import ablations

    summary = load_summary(results)
    table = ablations.ablation_table(summary, "granularity", model="tiny-llama", task="arc_easy", metric="acc_norm")
    assert list(table["setting"]) == ["dense", "layer", "layer-head-n"]
    layer = table[table["setting"] == "layer"].iloc[0]
    assert layer["reference"] == "layer-head-n" and layer["diff"] == pytest.approx(0.50 - 0.55)
    assert layer["diff_method"] == "independent stderrs"  # no per-sample outputs in this store
    assert layer["ci_high"] - layer["diff"] == pytest.approx(1.959964 * (0.05**2 * 2) ** 0.5, rel=1e-4)
    assert ablations.ablation_groups(summary, "compensation") == []  # nothing varies compensation alone


def test_threshold_storage_matches_the_papers_figure():
    from toptheta.results import storage

    table = storage.computed_table()
    llama70 = table[(table["model"] == "llama3-70b") & (table["row_lengths"] == 1200)].iloc[0]
    assert llama70["bytes_fp16"] == 80 * 64 * 1200 * 2 and 11.5 < llama70["MB"] < 12.5  # "~12 MB" (method.md §8)
    assert {"smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m", "llama2-7b", "llama3-8b"} <= set(table["model"])


def test_rerun_changes_no_file(made, results):
    """Rerunning on the same store, in a fresh process, drawing every figure again, rewrites every file with the
    same bytes."""
    before = {p.name: p.read_bytes() for p in made.iterdir()}
    proc = subprocess.run([sys.executable, "scripts/make_figures.py", "--results", str(results), "--out", str(made),
                           "--redraw"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " 0 current from an earlier run" in proc.stdout
    after = {p.name: p.read_bytes() for p in made.iterdir()}
    assert after.keys() == before.keys()
    assert [n for n in before if before[n] != after[n]] == []


def test_a_rerun_draws_only_the_figures_whose_inputs_changed(results, tmp_path, monkeypatch):
    """Figures drawn from files (thresholds, per-layer statistics) are drawn again only when those files, the drawing
    code or the figure's own files changed; the files are the same bytes as a full redraw."""
    import shutil

    import torch

    from toptheta.calibration import Thresholds

    store = tmp_path / "results"
    shutil.copytree(results, store)
    run = store / "runs" / "thr0"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"model": {"name": "tiny-llama"}}))
    Thresholds(torch.linspace(0.1, 0.5, 3 * 2 * 4).reshape(3, 2, 4), [8, 8, 8], "post").save(
        run / "thresholds.safetensors")
    script = _load_script()
    drawn = []
    save = script.save_figure
    monkeypatch.setattr(script, "save_figure", lambda fig, path, fmt: (drawn.append(path.name), save(fig, path, fmt)))

    def build(*extra):
        drawn.clear()
        assert script.main(["--results", str(store), "--out", str(tmp_path / "figs"), *extra]) == 0
        return {p.name: p.read_bytes() for p in (tmp_path / "figs").iterdir()}, sorted(drawn)

    first, drawn_first = build()
    keyed = {n for n in drawn_first if n.startswith(("thresholds-thr0-", "per_layer-"))}
    assert {"thresholds-thr0-hist.png", "thresholds-thr0-by_length.pdf"} <= keyed
    assert len(keyed) == 6  # the two threshold figures and the one per-layer figure, png and pdf
    again, drawn_again = build()
    assert again == first and set(drawn_again) == set(drawn_first) - keyed  # trade-offs etc. are always drawn
    Thresholds(torch.linspace(0.2, 0.6, 3 * 2 * 4).reshape(3, 2, 4), [8, 8, 8], "post").save(
        run / "thresholds.safetensors")
    (tmp_path / "figs" / next(n for n in keyed if n.startswith("per_layer-"))).write_bytes(b"edited")
    _, drawn_changed = build()
    changed = set(drawn_changed) & keyed
    assert {n for n in changed if n.startswith("thresholds-")} == {n for n in keyed if n.startswith("thresholds-")}
    assert len({n for n in changed if n.startswith("per_layer-")}) == 2  # the edited figure's png and pdf
    redrawn, drawn_all = build("--redraw")
    assert set(drawn_all) >= keyed and redrawn == build()[0]


def test_per_layer(results):
    groups = run_figures.per_layer_groups(results)
    assert [g["series"] for g in groups] == ["Top-θ post (+VMC)"]
    table = run_figures.per_layer_table(groups[0]["run_dirs"])
    assert list(table["label"].unique()) == ["Top-θ post (+VMC), k=16", "Top-θ post (+VMC), k=32"]
    assert table["kept_attention_fraction"].tolist() == [1.0, 0.3, 0.1, 1.0, 0.5, 0.2]
    fig = run_figures.per_layer_figure(groups[0]["run_dirs"])
    assert len(fig.axes[0].lines) == 2


def test_per_run_figures_name_each_run_as_the_summary_does(results, tmp_path):
    """runs_table reads config.json, the tables read summary.csv: one run, one series (a run at k in layers 0-1
    included, which the per-run figures once merged into the paper protocol's series)."""
    mine = tmp_path / "results"
    store = RunStore(mine)
    at_k = _config("topk", "post", 16, "vmc", None, "arc_easy")
    at_k["sparsifier"] = dict(at_k["sparsifier"], layer_k={})
    run_id = store.run_id_for(at_k)
    lm_eval = {"results": {"arc_easy": {"acc_norm,none": 0.5}}, "config": {"limit": 5}}
    store.write_run(run_id, config=at_k, lm_eval_results=lm_eval, stats={"per_layer": {"layer": [0]}},
                    thresholds_ref=None)
    store.append_summary(summary_rows(run_id, at_k, lm_eval, {}, commit="c", timestamp="t"))
    for root in (results, mine):
        summary = load_summary(root).drop_duplicates("run_id", keep="last")
        expected = {row["run_id"]: labels.series_label(row) for row in summary.to_dict("records")}
        table = run_figures.runs_table(root)
        assert len(table) and dict(zip(table["run_id"], table["series"])) == \
            {run: expected[run] for run in table["run_id"]}
    assert expected[run_id] == "Top-k post (+VMC) [layers 0-1 at k]"


def test_empty_results_say_so(tmp_path, capsys):
    script = _load_script()
    assert script.main(["--results", str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 0
    assert "nothing to plot" in capsys.readouterr().out and not (tmp_path / "out").exists()
    RunStore(tmp_path / "dense_only").append_summary(
        summary_rows("r1", _config("dense", None, None, "none", None, "arc_easy"),
                     {"results": {"arc_easy": {"acc_norm,none": 0.5}}}, {}, commit="x"))
    assert script.main(["--results", str(tmp_path / "dense_only")]) == 0
    assert "no (model, task) has both a dense baseline and a sparse run" in capsys.readouterr().out


def test_stale_outputs_are_removed(results, tmp_path):
    out = tmp_path / "figs"
    out.mkdir()
    (out / "manifest.txt").write_text("old.png\nkeep.txt\n")
    (out / "old.png").write_bytes(b"x")
    (out / "mine.txt").write_text("not listed: left alone")
    assert _load_script().main(["--results", str(results), "--out", str(out)]) == 0
    assert not (out / "old.png").exists() and (out / "mine.txt").exists()


NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_is_committed_without_outputs_and_runs(notebook, results, monkeypatch):
    """Each notebook's code runs top to bottom on the tiny store (cells executed in one namespace, no kernel)."""
    import matplotlib

    matplotlib.use("Agg")
    nb = json.loads(notebook.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)
    monkeypatch.setenv("TOPTHETA_RESULTS_DIR", str(results))
    shown = []
    namespace = {"__name__": "__notebook__"}
    import IPython.display

    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.extend(objs))
    for cell in code:
        source = "".join(cell["source"])
        exec(compile("\n".join(l for l in source.splitlines() if not l.startswith("%")), notebook.name, "exec"),
             namespace)
    assert shown or notebook.stem in ("compensation", "transfer", "vrow_popularity", "thresholds")
    if notebook.stem == "granularity":  # the fixture holds a granularity ablation: a table and its figure
        assert len(shown) == 2


def test_notebook_is_committed_without_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)
    assert "TOPTHETA_RESULTS_DIR" in "".join("".join(c["source"]) for c in nb["cells"]) or \
        "results_dir_from_env" in "".join("".join(c["source"]) for c in code)


@pytest.mark.slow
def test_notebook_executes_headless(results, tmp_path):
    pytest.importorskip("nbconvert")
    pytest.importorskip("ipykernel")
    out = tmp_path / "out.ipynb"
    env = dict(os.environ, TOPTHETA_RESULTS_DIR=str(results))
    proc = subprocess.run([sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", str(NOTEBOOK),
                           "--output", str(out), "--ExecutePreprocessor.timeout=300"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cells = json.loads(out.read_text())["cells"]
    outputs = [o for c in cells if c["cell_type"] == "code" for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4  # QA + HumanEval x2 + granularity + per-layer
    assert any("Top-θ pre (+SDC +VMC)" in json.dumps(o.get("data", {}), ensure_ascii=False) for o in outputs)


def test_threshold_files_in_run_directories(tmp_path):
    """A run's copy of its thresholds: per-layer summary, histogram and θ-vs-n figures, measured storage."""
    import torch

    from toptheta.calibration import Thresholds
    from toptheta.results import storage, threshold_plots

    values = torch.full((3, 2, 41), float("nan"))
    values[:, :, 10:41] = torch.linspace(0.1, 0.01, 31)  # calibrated for n = 10..40
    values[0] = 0.5
    run = tmp_path / "runs" / "abc"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"name": "tiny-llama"}}))
    Thresholds(values, [8, 8, 8], "post").save(run / "thresholds.safetensors")
    [path] = threshold_plots.threshold_files(tmp_path)
    table = threshold_plots.summary_table(path)
    assert list(table["max_n"]) == [40, 40, 40] and table.loc[1, "theta_max"] == pytest.approx(0.1)
    assert table.loc[0, "entries"] == 2 * 41 and table.loc[2, "entries"] == 2 * 31
    assert len(threshold_plots.histogram_figure(path).axes) >= 2
    assert len(threshold_plots.theta_vs_length_figure(path).axes[0].lines) == 2  # one line per head
    measured = storage.measured_table(tmp_path)
    assert measured.loc[0, "model"] == "tiny-llama" and measured.loc[0, "row_lengths"] == 40
    assert measured.loc[0, "MB"] == pytest.approx(3 * 2 * 41 * 4 / 1e6)  # float32 as stored


def test_passkey_runs_over_other_prompt_sets_are_their_own_lines():
    from toptheta.results import ablations

    rows = []
    for run, sparsifier, k, prompts, lengths in (("a", "dense", None, 6, (2048, 8192)), ("b", "topk", 64, 6, (2048, 8192)),
                                                 ("c", "dense", None, 60, (2048, 4096, 8192)),
                                                 ("d", "topk", 64, 60, (2048, 4096, 8192))):
        for n in lengths:
            rows.append({"run_id": run, "model": "m", "sparsifier": sparsifier, "placement": None if k is None else "post",
                         "k": k, "comp": "vmc", "task": f"passkey_{n}", "limit": prompts, "metric": "accuracy,none",
                         "value": 1.0, "timestamp": run})
    table = ablations.passkey_table(pd.DataFrame(rows), "m")
    assert set(table["prompts"]) == {6, 60}
    fig = ablations.passkey_figure(table, "m")
    labels = sorted(fig.axes[0].get_legend_handles_labels()[1])
    assert labels == sorted(["Baseline (6 prompts)", "Baseline (60 prompts)", "Top-k post (+VMC), k=64 (6 prompts)",
                             "Top-k post (+VMC), k=64 (60 prompts)"])
    one = ablations.passkey_figure(table[table["prompts"] == 60], "m")
    assert sorted(one.axes[0].get_legend_handles_labels()[1]) == ["Baseline", "Top-k post (+VMC), k=64"]


def test_passkey_figure_draws_kept_fractions_per_length_where_runs_recorded_them():
    from toptheta.results import ablations

    rows = []
    for run, sparsifier, k, scope in (("a", "dense", None, ""), ("b", "topk", 64, "task"), ("c", "toptheta", 64, "")):
        for n, kept in ((2048, 0.05), (8192, 0.02)):
            rows.append({"run_id": run, "model": "m", "sparsifier": sparsifier, "placement": None if k is None else "post",
                         "k": k, "comp": "vmc", "task": f"passkey_{n}", "limit": 40, "metric": "accuracy,none",
                         "value": 1.0, "timestamp": run, "stats_scope": scope,
                         "kept_attention_fraction": kept if scope else None,
                         "kept_vrow_fraction": 2 * kept if scope else None})
    table = ablations.passkey_table(pd.DataFrame(rows), "m")
    fig = ablations.passkey_figure(table, "m")
    assert len(fig.axes) == 2
    kept = fig.axes[1]
    assert kept.get_legend_handles_labels()[1] == ["Top-k post (+VMC), k=64"]  # only the run with per-length numbers
    solid, dashed = kept.lines
    assert list(solid.get_ydata()) == [0.05, 0.02] and list(dashed.get_ydata()) == [0.1, 0.04]
    assert list(solid.get_xdata()) == [2048, 8192]
    fig.canvas.draw()
    low, high = kept.get_ylim()
    labelled = [t.get_text() for t in kept.get_yticklabels() if t.get_text() and low <= t.get_position()[1] <= high]
    assert len(labelled) >= 3, labelled  # less than a decade of data still gets readable ticks
    none = table.assign(kept_attention_fraction=None, kept_vrow_fraction=None)
    assert len(ablations.passkey_figure(none, "m").axes) == 1  # no per-length statistics: accuracy alone


def test_passkey_counts_and_wilson_intervals_come_from_the_samples(tmp_path):
    from toptheta.results import ablations
    from toptheta.store.runs import RunStore

    # 19 of 20 keys found at 2048 tokens, 20 of 20 at 4096; an older run's samples name only the real length.
    samples = ([{"target_tokens": 2048, "length_tokens": 2040, "correct": i > 0} for i in range(20)]
               + [{"target_tokens": 4096, "length_tokens": 4090, "correct": True} for _ in range(20)])
    old = [{"length_tokens": 2030, "correct": True}, {"length_tokens": 4100, "correct": False}]
    store = RunStore(tmp_path)
    rows = []
    for run, these in (("new", samples), ("old", old)):
        store.write_run(run, config={"model": {"name": "m"}}, lm_eval_results={"samples": these},
                        stats={}, thresholds_ref=None)
        for n in (2048, 4096):
            rows.append({"run_id": run, "model": "m", "sparsifier": "dense", "placement": None, "k": None, "comp": "none",
                         "task": f"passkey_{n}", "limit": len(these),
                         "metric": "accuracy,none", "value": 1.0, "timestamp": run})
    table = ablations.passkey_table(pd.DataFrame(rows), "m", results_dir=tmp_path).set_index(["run_id", "length"])
    assert table.loc[("new", 2048), ["correct", "prompts_at_length"]].tolist() == [19, 20]
    assert table.loc[("old", 4096), ["correct", "prompts_at_length"]].tolist() == [0, 1]
    low, high = table.loc[("new", 4096), ["ci_low", "ci_high"]]
    assert low == pytest.approx(0.8389, abs=1e-4) and high == 1.0  # Wilson, 20 of 20
    assert ablations.wilson_interval(19, 20) == pytest.approx((0.7639, 0.9911), abs=1e-4)
    assert ablations.passkey_table(pd.DataFrame(rows), "m")["ci_low"].isna().all()  # no store, no counts


def test_ablation_reference_ties_are_broken_the_same_way_every_time():
    from toptheta.results import ablations

    transfer = ablations.ABLATIONS["transfer"]
    for order in (["arc_easy", "arc_challenge"], ["arc_challenge", "arc_easy"]):  # neither is HellaSwag's own
        cell = pd.DataFrame({"setting": order, "task": ["hellaswag"] * 2})
        assert ablations._reference(cell, transfer) == "arc_challenge"


def test_generation_glance_shows_each_generation_task_on_its_most_documents(tmp_path):
    store = RunStore(tmp_path / "results")
    _add(store, QA_RUNS[0])  # a QA setting: not a generation task
    _add(store, QA_RUNS[1])
    for limit, values in ((5, (0.2, 0.4)), (80, (0.6, 0.55))):
        _add(store, ("dense", None, None, "none", None, values[0], 0.05, 1.0), task="humaneval", metric="pass@1",
             limit=limit, vrow=1.0)
        _add(store, ("topk", "post", 32, "vmc", None, values[1], 0.05, 0.25), task="humaneval", metric="pass@1",
             limit=limit, vrow=0.125, clamped=0)
    _add(store, ("toptheta", "post", 32, "vmc", "layer-head-n", 0.5, 0.05, 0.3), task="humaneval", metric="pass@1",
         limit=80, vrow=0.2, clamped=151234)
    _add(store, ("dense", None, None, "none", None, 0.54, 0.03, 1.0), task="ruler", metric="score", limit=100, vrow=1.0,
         acc=False)
    _add(store, ("topk", "post", 181, "vmc", None, 0.53, 0.03, 0.06), task="ruler", metric="score", limit=100, vrow=0.1,
         acc=False)
    glance = figures.generation_glance(load_summary(tmp_path / "results"))
    ruler = glance[glance["setting"].str.contains("ruler")]
    assert ruler[["series", "score"]].values.tolist() == [["Baseline", "0.5400 ± 0.0300"],  # the ruler suite's score
                                                          ["Top-k post (+VMC)", "0.5300 ± 0.0300"]]
    glance = glance[~glance.index.isin(ruler.index)]
    assert glance["setting"].tolist() == ["tiny-llama · humaneval (0-shot, limit 80) · pass@1"] * 3
    assert glance["series"].tolist() == ["Baseline", "Top-k post (+VMC)", "Top-θ post (+VMC) [cal. arc_easy]"]
    assert glance["score"].tolist() == ["0.6000 ± 0.0500", "0.5500 ± 0.0500", "0.5000 ± 0.0500"]
    assert glance[["k", "kept attention", "kept V rows"]].values.tolist() == [["", "1.000", "1.000"],
                                                                              [32, "0.250", "0.125"],
                                                                              [32, "0.300", "0.200"]]
    assert glance["rows past calibration"].tolist() == ["", "", "151,234"]  # Top-θ only: Top-k has no θ to clamp

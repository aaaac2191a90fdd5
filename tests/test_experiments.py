"""The paper's artefacts as experiments: every file is documented, every sweep job composes and plans, and a fast
mode of each runs end to end on tiny-llama with the smoke task."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
from conftest import load_script
from hydra import compose, initialize_config_dir

from toptheta import pipeline
from toptheta.results import experiments as E
from toptheta.store.runs import RunStore

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
EXPERIMENTS = E.list_experiments()
ARTEFACTS = sorted({name.split("/")[0] for name in EXPERIMENTS})

# Fast mode: the tiny random model, the project's own multiple-choice task, a handful of questions.
FAST = ["model=tiny-llama", "task=smoke", "task.limit=4", "sparsifier.k=4", "sparsifier.layer_k={0:8}",
        "calib.num_samples=4", "calib.task=null", "calib.num_fewshot=null"]
# Experiments on our generation tasks run fast on a short passkey task instead (their decoding options and decode-step
# recordings need one); calibration on smoke.
FAST_GENERATION = ["model=tiny-llama", "task=passkey", "task.lengths=[300]", "task.depths=[0.3,0.7]", "task.limit=null",
                   "sparsifier.k=4", "sparsifier.layer_k={0:8}", "calib.num_samples=4", "calib.task=smoke",
                   "calib.num_fewshot=null"]
GENERATION_EXPERIMENTS = ("humaneval_decode/smol", "passkey/smol", "vrow_popularity/smol")


def _register_schema():
    try:
        from toptheta.config import register
    except ImportError:  # a checkout without typed configs
        return
    register()


def compose_job(overrides, tmp_path=None):
    _register_schema()
    extra = [f"results_dir={tmp_path}"] if tmp_path is not None else []
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*overrides, *extra])


def _empty_rows_option_exists() -> bool:
    return "empty_rows" in (CONF / "sparsifier" / "toptheta.yaml").read_text(encoding="utf-8")


def _skip_unavailable(name):
    if name.startswith("empty_rows/") and not _empty_rows_option_exists():
        pytest.skip("sparsifier.empty_rows is not an option yet (the empty-row rule, issue 10 item 13)")


def test_conf_experiment_is_the_experiments_folder():
    assert (CONF / "experiment").resolve() == (ROOT / "experiments").resolve()
    assert len(EXPERIMENTS) >= 20


@pytest.mark.parametrize("artefact", ARTEFACTS)
def test_every_artefact_has_a_paper_and_a_smol_protocol(artefact):
    protocols = {name.split("/")[1] for name in EXPERIMENTS if name.startswith(artefact + "/")}
    assert {"paper", "smol"} <= protocols


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_header_command_cost_and_feeds(name):
    header = E.read_header(name)
    assert header["package"] == "@package _global_"  # Hydra reads the package from the first line
    assert header["command"] == f"python run.py -m experiment={name}"
    for field in ("artefact", "protocol", "feeds", "cost"):
        assert header.get(field), f"{name}: no '# {field}:' line"
    assert "results/figures/" in header["feeds"]
    if name.endswith("/smol") or "smol" in name or "archs" in name:
        assert re.search(r"CPU-hours?\b", header["cost"]), header["cost"]
    assert E.read_config(name)["results_dir"] == "results"  # the committed store


def _check_jobs(name, jobs, tmp_path):
    """Each job composes and passes the pipeline's checks (impossible combinations fail here, in seconds)."""
    _skip_unavailable(name)
    seen = set()
    # The paper protocols calibrate on train splits that only the hub has (HellaSwag): plan them against the hub.
    data = ["data_dir=hub"] if name.endswith("/paper") else []
    for job in jobs:
        cfg = compose_job([*job, *data], tmp_path)
        assert cfg.results_dir == str(tmp_path)
        specs = pipeline.plan(cfg)
        for spec in specs:
            seen.add(spec.run_id)
        sparse = specs[-1]
        method = next(o.split("=", 1)[1] for o in job if o.startswith("+experiment/method="))
        assert sparse.sparsifier.name == method.split("-")[0]
        assert sparse.sparsifier.placement == method.split("-")[1]
        assert bool(sparse.comp.vmc) == method.endswith("vmc")
    return seen


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_plans(name, tmp_path):
    """One job of each experiment (composing costs ~1 s here; the slow test below covers every swept value)."""
    assert len(_check_jobs(name, E.jobs(name)[:1], tmp_path)) == 2  # the dense baseline and the sparse run


@pytest.mark.slow
@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_swept_value_composes_and_plans(name, tmp_path):
    jobs = E.covering_jobs(name)
    for axis in range(1, len(jobs[0])):  # every value of every axis appears in some job
        assert {j[axis] for j in E.jobs(name)} <= {j[axis] for j in jobs}
    _check_jobs(name, jobs, tmp_path)


def test_method_files_are_the_paper_series():
    methods = E.list_methods()
    # Top-k pre + exact SDC (+ VMC) is Top-k post (+ VMC): one file, run once.
    assert "topk-pre-sdc-vmc" not in methods and {"topk-post", "topk-post-vmc"} <= set(methods)
    for method in methods:
        cfg = compose_job([f"experiment={METHOD_ONLY}", f"+experiment/method={method}", "model=tiny-llama",
                           "task=smoke"])
        assert cfg.sparsifier.name == method.split("-")[0] and cfg.sparsifier.placement == method.split("-")[1]
    cfg = compose_job(["+experiment/method=toptheta-pre-sdc-exp", "task=smoke"])
    assert cfg.comp.sdc == "exp-threshold" and not cfg.comp.vmc


METHOD_ONLY = "granularity/smol"


def test_smol_protocols_are_sized_to_decide():
    """≥ 500 questions at 0-shot, ≥ 5 k from heavy to light pruning, layers 0-1 at a larger k (issue 10)."""
    cfg = compose_job(["experiment=qa_tradeoff/smol"])
    assert cfg.model.name == "smollm2-135m" and cfg.task.num_fewshot == 0 and cfg.task.limit >= 500
    ks = [int(k) for k in E.split_choices(E.sweep_params("qa_tradeoff/smol")["sparsifier.k"])]
    assert len(ks) >= 5 and max(ks) / min(ks) >= 8
    assert min(cfg.sparsifier.layer_k.values()) > max(ks)
    five_shot = compose_job(["experiment=qa_tradeoff/smol_5shot"])
    assert five_shot.task.num_fewshot == 5 and five_shot.task.limit >= 300
    assert len(E.split_choices(E.sweep_params("qa_tradeoff/smol_5shot")["sparsifier.k"])) >= 4
    assert compose_job(["experiment=humaneval_decode/smol"]).task.limit >= 80
    assert compose_job(["experiment=longbench/smol"]).task.limit >= 10
    passkey = compose_job(["experiment=passkey/smol"])
    assert len(passkey.task.depths) >= 20 and min(passkey.task.lengths) == 2048
    for name in ("compensation/smol", "granularity/smol", "first_layers/smol", "placement/smol", "calib_size/smol",
                 "transfer/smol", "empty_rows/smol"):
        job = compose_job([f"experiment={name}"])
        assert job.task.limit >= 500 and job.task.num_fewshot == 0, name


@pytest.mark.slow
def test_shared_runs_are_computed_once(tmp_path):
    """Ablations reuse qa_tradeoff/smol's runs: the same configuration gives the same run id (checked at k = 4)."""
    def run_ids(name, *extra):
        ids = set()
        for job in E.jobs(name, ["sparsifier.k=4", *extra]):
            ids.update(s.run_id for s in pipeline.plan(compose_job(job, tmp_path)))
        return ids
    tradeoff = run_ids("qa_tradeoff/smol", "task=arc_easy")
    for name, shared in (("placement/smol", 5), ("granularity/smol", 2), ("first_layers/smol", 3),
                         ("calib_size/smol", 2)):
        assert len(run_ids(name) & tradeoff) == shared, name


def test_jobs_follow_hydras_override_rule():
    jobs = E.jobs("first_layers/smol", ["sparsifier.k=4"])
    assert len(jobs) == 4 and all("sparsifier.k=4" in j for j in jobs)
    assert E.split_choices("{0:512,1:512},null") == ["{0:512,1:512}", "null"]
    assert E.jobs("qa_tradeoff/smol", ["sparsifier.k=4,8", "task=arc_easy"])[0][-2:] == ["sparsifier.k=4", "task=arc_easy"]


def test_feeds_name_the_experiment_of_a_file():
    assert E.experiments_feeding("tradeoff-smollm2-135m-arc_easy-0shot-limit500-acc_norm-kept_attn.png") == \
        ["python run.py -m experiment=qa_tradeoff/smol"]
    assert "python run.py -m experiment=granularity/smol" in \
        E.experiments_feeding("ablation-granularity-smollm2-135m-arc_easy-0shot-limit500-acc_norm.tex")
    assert E.experiments_feeding("tradeoff-other-model-arc_easy-0shot-limit7-acc_norm.csv") == []


# ---------------------------------------------------------------- fast mode: end to end on tiny-llama


def fast_overrides(name):
    if name.startswith("long_rows/"):  # a matched kept fraction: tiny-llama's two layers, neither held at a larger k
        return [*FAST, "sparsifier.layer_k=null"]
    if name == "vrow_popularity/smol":  # its swept layers are Qwen's; tiny-llama has 2
        return [*FAST_GENERATION, "task.vrow_popularity.layer=1"]
    return FAST_GENERATION if name in GENERATION_EXPERIMENTS else FAST


def fast_jobs(name):
    """The distinct jobs of an experiment in fast mode (swept model/task/k/limits replaced by FAST)."""
    return E.jobs(name, fast_overrides(name))


def _run_fast(name, tmp_path):
    from toptheta.results.summary import load_summary

    _skip_unavailable(name)
    for job in fast_jobs(name):
        pipeline.run(compose_job(job, tmp_path))
    summary = load_summary(tmp_path)
    sparse = summary[summary["sparsifier"] != "dense"]
    assert len(sparse["run_id"].unique()) == len(fast_jobs(name)) - _duplicates(name, tmp_path)
    assert (summary["sparsifier"] == "dense").any()
    assert sparse["kept_attention_fraction"].astype(float).lt(1.0).all()
    return summary


def _duplicates(name, tmp_path):
    ids = [pipeline.plan(compose_job(job, tmp_path))[-1].run_id for job in fast_jobs(name)]
    return len(ids) - len(set(ids))


@pytest.mark.slow  # ~5 min on 2 busy cores: each run loads lm-eval's task index
def test_fast_mode_qa_tradeoff_runs_end_to_end(tmp_path):
    summary = _run_fast("qa_tradeoff/smol", tmp_path)
    series = {(r.sparsifier, r.placement, r.comp) for r in summary.itertuples() if r.sparsifier != "dense"}
    assert series == {("topk", "pre", "none"), ("topk", "post", "none"), ("topk", "post", "vmc"),
                      ("toptheta", "pre", "none"), ("toptheta", "pre", "sdc=exact+vmc"),
                      ("toptheta", "post", "none"), ("toptheta", "post", "vmc")}
    theta = summary[summary["sparsifier"] == "toptheta"]
    assert theta["calib_task"].eq("smoke").all() and theta["calib_documents"].astype(float).eq(4).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in EXPERIMENTS if n.endswith("/smol") and n != "qa_tradeoff/smol"])
def test_fast_mode_runs_end_to_end(name, tmp_path):
    _run_fast(name, tmp_path)


def test_fast_mode_covers_every_swept_dimension():
    """Fast mode keeps each experiment's own ablation axis (granularity, layer_k aside, ...), not just the model."""
    for name in EXPERIMENTS:
        if not name.endswith("/smol"):
            continue
        kept = {E.override_key(o) for job in fast_jobs(name) for o in job[1:]} - {E.override_key(o) for o in fast_overrides(name)}
        assert "experiment/method" in kept, name
    assert len(fast_jobs("granularity/smol")) == 4 and len(fast_jobs("compensation/smol")) == 5


def _product_size(name):
    params = E.sweep_params(name)
    return len(list(itertools.product(*(E.split_choices(v) for v in params.values()))))


def test_jobs_are_the_cartesian_product():
    assert len(E.jobs("qa_tradeoff/paper")) == _product_size("qa_tradeoff/paper") == 2 * 3 * 7 * 6


def test_readme_lists_every_experiment():
    text = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    assert all(f"`{name}`" in text for name in EXPERIMENTS)
    rows = {cells[1].strip("` "): cells[2].strip() for line in text.splitlines() if line.startswith("| `")
            for cells in [line.split("|")]}
    assert {name: rows.get(name) for name in EXPERIMENTS} == {name: str(len(E.jobs(name))) for name in EXPERIMENTS}


def _sweep_status_script():
    return load_script("sweep_status")


def test_sweep_status_counts_the_runs_a_sweep_plans_and_finds_in_the_store(tmp_path, capsys):
    script, name = _sweep_status_script(), "longbench/smol"
    _register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        empty = script.status(name, str(tmp_path))
        assert empty["runs"] == 7 and empty["done"] == 0 and len(empty["jobs_left"]) == len(E.jobs(name)) == 6
        dense = [run_id for label, run_id in empty["left"] if label == "dense"]
        assert len(dense) == 1  # one baseline shared by every job
        (tmp_path / "runs" / dense[0]).mkdir(parents=True)
        (tmp_path / "runs" / dense[0] / "DONE").write_text("")
        (tmp_path / "runs" / dense[0] / "stats.json").write_text('{"seconds": 600.0}')
        after = script.status(name, str(tmp_path))
    assert after["done"] == 1 and len(after["left"]) == 6 and len(after["jobs_left"]) == 6
    assert after["seconds"] == [600.0] and script.time_left(after) == "; ≈ 1.0 h left at the 10.0-min median of 1 finished run"
    assert script.time_left(empty) == ""  # nothing finished to time it by
    assert script.main([name, "--results", str(tmp_path), "--jobs"]) == 0
    out = capsys.readouterr().out
    assert "1/7" in out and "≈ 1.0 h left" in out and out.count("python run.py experiment=longbench/smol") == 6
    assert script.main(["no_such/smol"]) == 2


def test_sweep_status_lists_each_run_left_in_one_job(tmp_path):
    # passkey/beyond sweeps calib.beyond over both methods; only Top-θ's run depends on it, so Top-k's fit job
    # repeats its clamp job's run and is not listed again.
    script = _sweep_status_script()
    _register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        s = script.status("passkey/beyond", str(tmp_path))
        ruler = script.status("ruler/smol", str(tmp_path))
    assert len(E.jobs("passkey/beyond")) == 4 and s["runs"] == 4 and len(s["left"]) == 4
    assert len(s["jobs_left"]) == 3  # dense rides along with the first; Top-θ's clamp and fit are two runs
    beyond = [next(o for o in job if o.startswith("calib.beyond=")) for job in s["jobs_left"]]
    methods = [next(o for o in job if o.startswith("+experiment/method=")) for job in s["jobs_left"]]
    assert beyond.count("calib.beyond=fit") == 1 and methods.count("+experiment/method=toptheta-post-vmc") == 2
    # ruler/smol's rows lie within Top-θ's calibrated lengths, where fit is clamp: no calib.beyond sweep there
    assert len(E.jobs("ruler/smol")) == 4 and ruler["runs"] == 5 and len(ruler["jobs_left"]) == 4
    assert not any(o.startswith("calib.beyond=") for job in ruler["jobs_left"] for o in job)
    run_id = ruler["left"][1][1]  # a run cut short: a length saved whole, the next one's first batches
    partial = RunStore(tmp_path).partial_dir(run_id)
    (partial / "ruler_8192.parts").mkdir(parents=True)
    for name in ("ruler_4096.json", "ruler_8192.parts/vt_0.json", "ruler_8192.parts/cwe_0.json"):
        (partial / name).write_text("{}")
    assert script.saved_parts(RunStore(tmp_path), run_id) == "ruler_4096; 2 batches of ruler_8192"
    assert script.saved_parts(RunStore(tmp_path), ruler["left"][0][1]) == ""

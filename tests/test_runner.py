"""The experiment runner: every config composes, bad input fails fast, a run is stored and resumable."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import cfg
from toptheta import builders, pipeline
from toptheta.spec import RunSpec
from toptheta.store.migrate import migrate

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("sparsifier", options("sparsifier"))
@pytest.mark.parametrize("comp", options("comp"))
@pytest.mark.parametrize("calib", options("calib"))
def test_sparsifier_comp_calib_grid_plans_or_explains(sparsifier, comp, calib, tmp_path):
    """Each combination either plans runs whose objects build, or is refused with a reason."""
    c = cfg("model=tiny-llama", "task=smoke", f"sparsifier={sparsifier}", f"comp={comp}", f"calib={calib}",
            f"results_dir={tmp_path}")
    try:
        specs = pipeline.plan(c)
    except ValueError as err:
        assert "needs pre-softmax" in str(err) or "β is always 0" in str(err), err
        return
    for spec in specs:
        assert spec.run_id
        comps = builders.compensation_objects(spec.comp.settings, thresholds=None)
        if spec.sparsifier.settings["name"] != "toptheta":
            builders.build_sparsifier(spec.sparsifier.settings)
        assert len(comps) == bool(spec.comp.settings["sdc"]) + bool(spec.comp.settings["vmc"])


@pytest.mark.parametrize("task", options("task"))
def test_every_task_plans(task, tmp_path):
    name = ["task.lm_eval_task=smoke"] if task == "lm_eval" else []  # the generic task needs a name
    for data_dir in ("hub", "auto"):  # the shipped data serves every offline task
        c = cfg("model=tiny-llama", f"task={task}", f"results_dir={tmp_path}", f"data_dir={data_dir}",
                "calib.task=smoke", *name)
        if task == "hellaswag_split" and data_dir == "hub":  # an offline construction: refused, naming the stock task
            with pytest.raises(ValueError, match="no hub version"):
                pipeline.plan(c)
            continue
        specs = pipeline.plan(c)
    assert specs[-1].task.settings["name"] == task


def test_placement_auto_follows_sdc():
    assert pipeline.plan(cfg("model=tiny-llama", "task=smoke", "comp=sdc+vmc"))[-1].sparsifier.settings["placement"] == "pre"
    assert pipeline.plan(cfg("model=tiny-llama", "task=smoke", "comp=vmc"))[-1].sparsifier.settings["placement"] == "post"


@pytest.mark.parametrize("overrides,message", [
    (["sparsifier.placement=post", "comp=sdc"], "needs pre-softmax"),
    (["sparsifier.placement=pre", "comp=vmc"], "β is always 0"),
    (["sparsifier=topk", "comp.sdc=exp-threshold", "sparsifier.placement=pre"], "threshold sparsifier"),
    (["sparsifier.k=0"], "positive integer"),
    (["data_dir=/nonexistent/dir"], "not a directory"),
    (["task=lm_eval"], "task.lm_eval_task=None: an lm-eval task name"),
    (["task=lm_eval", "task.lm_eval_task=smoke", "task.include_path=/no/such/dir", "task.kind=passkey"],
     "only lm_eval tasks read task YAMLs"),
])
def test_bad_configurations_fail_before_any_model_loads(overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", *overrides))


def run_cli(*args: str, cwd=ROOT, timeout=600):
    return subprocess.run([sys.executable, "run.py", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["sparsifier=nonesuch"], "Available options in 'sparsifier'"),
    (["comp=sdc", "sparsifier.placement=post"], "needs pre-softmax"),
    (["sparsifier.kk=3"], "kk"),
    (["calib.granularity=layerhead"], "expected one of [layer, layer-n, layer-head, layer-head-n]"),
    (["sparsifier.placement=middle"], "expected one of [pre, post, auto]"),
    (["task.batch_size=-1"], "task.batch_size=-1: an integer >= 1 or auto"),
])
def test_cli_errors_are_fast_and_name_the_fix(args, message, tmp_path):
    result = run_cli("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", *args, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr + result.stdout


def test_end_to_end_tiny_run_writes_store_and_skips_repeat(tmp_path):
    args = ["model=tiny-llama", "task=smoke", "task.limit=8", "sparsifier.k=4", "sparsifier.layer_k=null",
            "calib.num_samples=4", f"results_dir={tmp_path}", "hydra.run.dir=" + str(tmp_path / "hydra")]
    env_cache = {"TOPTHETA_CACHE": str(tmp_path / "cache")}
    first = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env={**os.environ, **env_cache})
    assert first.returncode == 0, first.stderr[-3000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2  # dense baseline + top-θ
    assert f"results: {tmp_path / 'summary.csv'}" in first.stdout  # the run says where it wrote
    for run in runs:  # log_samples is on by default: per-sample outputs in each run dir, of a sane size
        samples = run / "samples.json.gz"
        assert samples.is_file() and samples.stat().st_size < 1_000_000
    summary = pd.read_csv(tmp_path / "summary.csv")
    for column in ["run_id", "model", "sparsifier", "placement", "k", "comp", "granularity", "task", "num_fewshot",
                   "limit", "metric", "value", "stderr", "kept_attention_fraction", "kept_vrow_fraction", "git_commit"]:
        assert column in summary.columns, column
    assert set(summary["sparsifier"]) == {"dense", "toptheta"}
    sparse = summary[summary["sparsifier"] == "toptheta"].iloc[0]
    assert 0 < sparse["kept_attention_fraction"] < 1
    assert (tmp_path / "cache" / "thresholds").is_dir()
    second = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, **env_cache})
    assert second.returncode == 0 and "already finished" in second.stdout + second.stderr
    assert len(pd.read_csv(tmp_path / "summary.csv")) == len(summary)
    # The store round trip: summary.csv rebuilt from the run directories is the file the runs appended, byte for byte
    written = (tmp_path / "summary.csv").read_bytes()
    migrate(tmp_path)
    assert (tmp_path / "summary.csv").read_bytes() == written


def test_readme_quickstart_commands_are_what_ci_runs():
    import re

    readme = (ROOT / "README.md").read_text()
    section = re.search(r"## Quickstart\n(.*?)\n## ", readme, re.S).group(1)
    commands = [l.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S) for l in b.splitlines() if l.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("python run.py")
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("task,extra", [
    ("passkey", ["task.lengths=[300,400]", "task.depths=[0.5]", "task.vrow_popularity={layer:3,group:1,max_steps:3}"]),
    ("humaneval", ["task.limit=1", "task.max_length=560"]),
])
def test_generation_tasks_run_through_the_pipeline(task, extra, tmp_path, monkeypatch):
    """Decode steps happen inside sparsify: the sparse run reports a kept V-row fraction."""

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    c = cfg("model=tiny-llama", f"task={task}", "sparsifier=topk", "sparsifier.k=8", "sparsifier.layer_k=null",
            "comp=vmc", f"results_dir={tmp_path}", *extra)
    pipeline.run(c)
    everything = pd.read_csv(tmp_path / "summary.csv")
    summary = everything[everything["task"] == task]
    sparse = summary[summary["sparsifier"] == "topk"]
    assert not sparse.empty and set(summary["sparsifier"]) == {"dense", "topk"}
    assert (0 < sparse["kept_vrow_fraction"]).all() and (sparse["kept_vrow_fraction"] < 1).all()
    assert summary[summary["sparsifier"] == "dense"]["kept_vrow_fraction"].eq(1.0).all()
    assert (summary["generated_tokens"] > 0).all()  # how long the model talked, dense and sparse
    if task == "passkey":  # each length has its own statistics; together they make the run's
        lengths = everything[everything["task"].isin(["passkey_300", "passkey_400"]) & (everything["sparsifier"] == "topk")]
        assert len(lengths) == 2 and lengths["stats_scope"].eq("task").all()
        fractions = sorted(lengths["kept_vrow_fraction"])
        assert fractions[0] <= sparse["kept_vrow_fraction"].iloc[0] <= fractions[1] and fractions[0] < fractions[1]
    if task == "passkey":  # the V rows of the first generation's decode steps, as the notebook reads them
        stats = json.loads((tmp_path / "runs" / sparse["run_id"].iloc[0] / "stats.json").read_text())
        record = stats["vrow_popularity"]
        assert (record["layer"], record["group"], record["steps"], len(record["counts"])) == (3, 1, 3, 3)
        assert 0 < max(max(step) for step in record["counts"]) <= record["heads_per_group"]
        dense = json.loads((tmp_path / "runs" / summary.loc[summary["sparsifier"] == "dense", "run_id"].iloc[0]
                            / "stats.json").read_text())
        assert "vrow_popularity" not in dense  # dense keeps every V row: nothing to record


def test_an_interrupted_passkey_run_resumes_at_its_length_with_the_same_numbers(tmp_path, monkeypatch):
    """Each finished length is saved beside the runs; a run interrupted in its second length generates only that
    one when run again, and stores what an uninterrupted run stores (statistics included)."""

    from toptheta.evaluation import generation

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    overrides = ("model=tiny-llama", "task=passkey", "task.lengths=[300,400]", "task.depths=[0.25,0.75]",
                 "task.filler=shared", "task.share_prefix=true",  # passkey/smol's layout
                 "sparsifier=topk", "sparsifier.k=8", "sparsifier.layer_k=null", "comp=vmc")
    pipeline.run(cfg(*overrides, f"results_dir={tmp_path / 'whole'}"))

    plain, calls = generation.generate_all, []

    def interrupted(model, tokenizer, prompts, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 4:  # the Top-k run's second length (the dense run came first and finished)
            raise KeyboardInterrupt
        return plain(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(generation, "generate_all", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run(cfg(*overrides, f"results_dir={tmp_path / 'resumed'}"))
    parts = list((tmp_path / "resumed" / "runs").glob(".partial-*/passkey_*.json"))
    assert [p.name for p in parts] == ["passkey_300.json"]
    calls.clear()
    monkeypatch.setattr(generation, "generate_all", lambda *a, **k: calls.append(len(a[2])) or plain(*a, **k))
    pipeline.run(cfg(*overrides, f"results_dir={tmp_path / 'resumed'}"))
    assert calls == [2]  # Top-k's 400 only: dense is stored, Top-k's 300 read back
    assert not list((tmp_path / "resumed" / "runs").glob(".partial-*"))  # removed once the run is stored

    whole, resumed = (pd.read_csv(tmp_path / d / "summary.csv").drop(columns=["timestamp"]).sort_values(["run_id", "task"])
                      .reset_index(drop=True) for d in ("whole", "resumed"))
    pd.testing.assert_frame_equal(whole, resumed)
    for run_id in whole["run_id"].unique():
        a, b = (json.loads((tmp_path / d / "runs" / run_id / "stats.json").read_text()) for d in ("whole", "resumed"))
        for stats in (a, b):
            stats.pop("seconds")
            for part in stats.values():
                if isinstance(part, dict):
                    part.pop("seconds", None)
        assert b.pop("resumed_parts", None) == (["passkey_300"] if whole.loc[whole["run_id"] == run_id, "sparsifier"]
                                                .iloc[0] == "topk" else None)
        assert a == b
        samples = [(tmp_path / d / "runs" / run_id / "samples.json.gz").read_bytes() for d in ("whole", "resumed")]
        assert samples[0] == samples[1] or _samples(samples[0]) == _samples(samples[1])


def test_a_stop_file_pauses_a_passkey_run_between_lengths(tmp_path, monkeypatch):
    """STOP appearing while a passkey run generates its first length: the run pauses before the second (the first
    saved, nothing stored, no other run started); removing STOP and rerunning generates the second only."""
    from toptheta.evaluation import generation

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    overrides = ("model=tiny-llama", "task=passkey", "task.lengths=[300,400]", "task.depths=[0.5]",
                 "sparsifier=topk", "sparsifier.k=8", "sparsifier.layer_k=null", "comp=vmc", "baseline=false",
                 f"results_dir={tmp_path}")
    plain, calls = generation.generate_all, []

    def generate_then_stop(model, tokenizer, prompts, **kwargs):
        calls.append(len(prompts))
        pipeline.stop_file(tmp_path).touch()
        return plain(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(generation, "generate_all", generate_then_stop)
    pipeline.run(cfg(*overrides))
    assert calls == [1] and not list((tmp_path / "runs").glob("*/DONE"))
    assert [p.name for p in (tmp_path / "runs").glob(".partial-*/*.json")] == ["passkey_300.json"]
    pipeline.stop_file(tmp_path).unlink()
    monkeypatch.setattr(generation, "generate_all", lambda *a, **k: calls.append(len(a[2])) or plain(*a, **k))
    pipeline.run(cfg(*overrides))
    assert calls == [1, 1] and len(list((tmp_path / "runs").glob("*/DONE"))) == 1


def _samples(raw: bytes) -> list:
    import gzip

    return json.loads(gzip.decompress(raw))


def test_runs_recording_popularity_at_other_layers_share_one_dense_baseline():
    def ids(layer):
        return [s.run_id for s in pipeline.plan(cfg("model=tiny-llama", "task=humaneval", "sparsifier=topk",
                                                    "comp=vmc", f"task.vrow_popularity={{layer:{layer}}}"))]
    (dense_a, sparse_a), (dense_b, sparse_b) = ids(1), ids(2)
    assert dense_a == dense_b and sparse_a != sparse_b
    assert dense_a == pipeline.plan(cfg("model=tiny-llama", "task=humaneval", "sparsifier=topk", "comp=vmc"))[0].run_id


def test_wandb_logger_writes_an_offline_run(tmp_path, monkeypatch):
    from toptheta import SparsityStats
    from toptheta.results.wandb_logger import make_logger

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = make_logger({"name": "wandb", "mode": "offline", "project": "toptheta-test"}, {"k": 4})
    stats = SparsityStats(num_layers=2, num_heads=4, num_kv_heads=2)
    spec = RunSpec.from_identity({}, run_id="abc", label="topk-post")
    logger.log_run(spec, [{"task": "smoke", "metric": "acc,none", "value": 0.5}], stats)
    logger.finish()
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


# ---- no silent no-ops ----------------------------------------------------------------------------------------

def test_the_smoke_command_records_sparse_rows(tmp_path, monkeypatch):
    """`python run.py model=tiny-llama sparsifier=toptheta comp=sdc+vmc task=smoke` with its defaults (k = 64,
    layer_k {0: 512, 1: 512}) sparsifies tiny-llama's other layers; fewer documents keep it fast."""

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    pipeline.run(cfg("model=tiny-llama", "sparsifier=toptheta", "comp=sdc+vmc", "task=smoke", "task.limit=4",
                     "calib.num_samples=3", f"results_dir={tmp_path}"))
    summary = pd.read_csv(tmp_path / "summary.csv")
    sparse = summary[summary["sparsifier"] == "toptheta"]
    assert not sparse.empty and (sparse["kept_attention_fraction"] < 1).all() and (sparse["k"] == 64).all()


@pytest.mark.slow
def test_the_smoke_command_runs_as_written(tmp_path):


    result = run_cli("model=tiny-llama", "sparsifier=toptheta", "comp=sdc+vmc", "task=smoke", f"results_dir={tmp_path}",
                     f"hydra.run.dir={tmp_path / 'hydra'}", timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert (summary[summary["sparsifier"] == "toptheta"]["kept_attention_fraction"] < 1).all()
    assert os.path.isfile(tmp_path / "summary.csv")


@pytest.mark.parametrize("overrides", [["sparsifier=topk", "sparsifier.k=512", "sparsifier.layer_k=null"],
                                       ["sparsifier=toptheta", "sparsifier.k=600"],
                                       ["sparsifier=topk", "sparsifier.k=512"]])
def test_a_run_that_cannot_sparsify_is_refused_before_evaluating(overrides, tmp_path, monkeypatch):
    """tiny-llama's rows are at most 512 tokens (model.max_length): k >= 512 on every layer drops nothing."""
    monkeypatch.setattr(pipeline, "execute", lambda *a, **k: pytest.fail("evaluated a no-op configuration"))
    with pytest.raises(ValueError, match="nothing would be sparsified.*Lower sparsifier.k"):
        pipeline.run(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", *overrides))


def test_layer_k_covering_every_layer_is_warned_about(caplog):
    sparsifier = {"name": "topk", "k": 64, "layer_k": {0: 8, 1: 8}}
    builders.check_sparsifies(sparsifier, num_layers=2, longest_row=512, model_name="m")  # k = 8 still drops
    assert "applies to none" in caplog.text
    with pytest.raises(ValueError, match="nothing would be sparsified"):
        builders.check_sparsifies({**sparsifier, "layer_k": {0: 512, 1: 512}}, 2, 512, "m")
    builders.check_sparsifies({**sparsifier, "layer_k": {0: 512, 1: 512}}, 6, 512, "m")  # layers 2-5 at k = 64


def test_a_stop_file_finishes_the_run_in_hand_and_starts_no_other(tmp_path, monkeypatch):
    """`touch <results_dir>/STOP`: a long sweep stops at a run boundary, losing nothing; removing it goes on."""
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    overrides = ("model=tiny-llama", "sparsifier=topk", "sparsifier.k=4", "sparsifier.layer_k=null", "task=smoke",
                 "task.limit=2", f"results_dir={tmp_path}")
    executed = []
    real = pipeline.execute

    def execute_then_stop(spec, *args, **kwargs):
        real(spec, *args, **kwargs)
        executed.append(spec.run_id)
        pipeline.stop_file(tmp_path).touch()  # asked to stop while the first run (the dense baseline) ran

    monkeypatch.setattr(pipeline, "execute", execute_then_stop)
    pipeline.run(cfg(*overrides))
    assert len(executed) == 1 and (tmp_path / "runs" / executed[0] / "DONE").is_file()
    import toptheta.models

    with monkeypatch.context() as m:
        m.setattr(toptheta.models, "load_model", lambda *a, **k: pytest.fail("loaded a model while stopped"))
        pipeline.run(cfg(*overrides))  # still stopped: nothing starts, nothing loads
    assert len(executed) == 1
    pipeline.stop_file(tmp_path).unlink()
    monkeypatch.setattr(pipeline, "execute", real)
    pipeline.run(cfg(*overrides))
    assert len(list((tmp_path / "runs").glob("*/DONE"))) == 2


def test_generated_tokens_count_generation_texts_only():
    class Tokenizer:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    ours = pipeline._count_generated({"samples": [{"generation": "a b c"}, {"generation": "d"}]}, Tokenizer())
    assert ours["generated_tokens"] == 2.0
    lm_eval = {"samples": {"longbench": [{"resps": [["one two three four"]]}, {"resps": [["five six"]]}]}}
    assert pipeline._count_generated(lm_eval, Tokenizer())["generated_tokens"] == 3.0
    choices = {"samples": {"arc_easy": [{"resps": [[[-1.5, False]], [[-0.5, True]]]}]}}  # log-likelihoods
    assert "generated_tokens" not in pipeline._count_generated(choices, Tokenizer())
    assert "generated_tokens" not in pipeline._count_generated({}, Tokenizer())

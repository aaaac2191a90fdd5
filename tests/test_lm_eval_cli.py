"""The lm-eval model "toptheta" and the `toptheta-eval` command: registration, model_args, statistics in the results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import smoke_manager

ROOT = Path(__file__).resolve().parents[1]
TOPK = "pretrained=tiny-llama,sparsifier=topk,k=8,layer_k=none,comp=vmc"


def test_import_toptheta_registers_the_model_without_importing_it():
    code = (
        "import sys, toptheta\n"
        "assert 'toptheta.evaluation.lm_eval_model' not in sys.modules\n"
        "assert 'lm_eval.models.huggingface' not in sys.modules\n"
        "from lm_eval.api.registry import get_model\n"
        "assert get_model('toptheta').__name__ == 'TopThetaLM'\n"
        "assert get_model('hf').__name__ == 'HFLM'  # lm-eval's own models are still there\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"sparsifier": "topq"}, "one of dense, skipsoftmax, topk, topp, toprho, toptheta"),
        ({"k": 0}, "positive integer"),
        ({"comp": "sdc+vmcc"}, "from sdc, vmc"),
        ({"layer_k": "0-512"}, "layer_k=0:512\\+1:512"),
        ({"placement": "pre", "comp": "vmc"}, "VMC"),
        ({"placement": "middle"}, "pre, post or auto"),
        ({"decode_batch": 0}, "decode_batch must be None \\(batch_size\\) or an int >= 1, got 0"),
        ({"calib_sampler": "last_n"}, "calib_sampler='last_n': use first_n"),
        ({"calib_cover_shots": -1}, "calib_cover_shots=-1: give 0 or a positive number"),
        ({"calib_max_length": 1}, "calib_max_length=1: give the tokens a calibration sequence is cut to"),
        ({"beyond": "extrapolate"}, "beyond='extrapolate': use clamp .* or fit"),
        ({"budget": "toprho"}, "budget=toprho needs the share it calibrates to: rho=0.05"),
    ],
)
def test_bad_model_args_fail_before_the_model_loads(monkeypatch, args, message):
    from toptheta import models
    from toptheta.evaluation.lm_eval_model import TopThetaLM

    def no_loading(*a, **k):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", no_loading)
    with pytest.raises(ValueError, match=message):
        TopThetaLM(pretrained="tiny-llama", **args)


def test_toptheta_eval_calibrates_to_top_rho_with_budget_and_rho(tmp_path, monkeypatch):
    """model_args budget=toprho,rho=... give run.py's sparsifier.budget and sparsifier.rho: thresholds calibrated to
    Top-ρ's kept sets, under a key of their own."""
    from toptheta.evaluation.lm_eval_model import TopThetaLM

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path))
    args = dict(pretrained="tiny-llama", k=2, layer_k="none", placement="post", comp="vmc", calib_samples=2)
    budget = TopThetaLM(**args, budget="toprho", rho=0.2)
    budget._build(["smoke"])
    assert budget.thresholds.metadata["budget"] == {"rule": "toprho", "rho": 0.2, "head_weights": None}
    plain = TopThetaLM(**args)
    plain._build(["smoke"])
    assert "budget" not in plain.thresholds.metadata and plain.thresholds_path != budget.thresholds_path


def test_cuda_without_cuda_is_an_error_and_device_map_passes_through(monkeypatch):
    import torch

    from toptheta import models
    from toptheta.evaluation.lm_eval_model import TopThetaLM

    seen = {}

    def loading(*a, **k):
        seen.update(k)
        raise RuntimeError("stop after the arguments")

    monkeypatch.setattr(models, "load_model", loading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available on this machine.*device=cpu"):
        TopThetaLM(pretrained="tiny-llama", sparsifier="dense", device="cuda")
    assert not seen  # refused before loading, never a silent CPU run
    with pytest.raises(RuntimeError, match="stop after the arguments"):
        TopThetaLM(pretrained="tiny-llama", sparsifier="dense", device="cpu", device_map="auto")
    assert seen["device_map"] == "auto" and seen["device"] == "cpu"


def test_simple_evaluate_by_name_matches_the_sparsified_model_and_reports_statistics():
    """model="toptheta" gives what HFLM on the same model inside sparsify gives, statistics included."""
    import lm_eval

    import toptheta
    from toptheta.evaluation.lm_eval_adapter import evaluate_tasks
    from toptheta.models import load_model

    results = lm_eval.simple_evaluate(model="toptheta", model_args=TOPK, tasks=["smoke"], limit=2, log_samples=True,
                                      task_manager=smoke_manager())
    report = results["config"]["toptheta"]
    assert report["sparsifier"] == {"name": "topk", "k": 8, "layer_k": {}, "placement": "post"}
    assert report["comp"]["vmc"] is True and report["calibration"] is None
    stats = report["stats"]["smoke"]
    assert 0 < stats["kept_attention_fraction"] < 0.9

    model, tokenizer, _ = load_model("tiny-llama")
    with toptheta.sparsify(model, toptheta.TopK(8, "post"), [toptheta.VMC()]) as reference:
        expected = evaluate_tasks(model, tokenizer, ["smoke"], data_dir=None, num_fewshot=None, limit=2,
                                  log_samples=True)
    assert stats["kept_attention_fraction"] == pytest.approx(reference.kept_attention_fraction)
    loglik = lambda res: [ll for s in res["samples"]["smoke"] for ll, _ in s["filtered_resps"]]  # noqa: E731
    assert loglik(results) == pytest.approx(loglik(expected), rel=1e-5)  # float32 summation order may differ
    assert json.dumps(report)  # lands in the results JSON as it is


def test_toptheta_calibrates_on_the_evaluated_task_once_and_caches(tmp_path, monkeypatch):
    from toptheta import calibration
    from toptheta.evaluation.lm_eval_model import TopThetaLM

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path))
    args = dict(pretrained="tiny-llama", k=16, layer_k="none", placement="post", comp="vmc", calib_samples=2)
    first = TopThetaLM(**args)
    first._build(["smoke"])  # what the first request does
    path = Path(first.thresholds_path)
    assert path.is_file() and path.is_relative_to(tmp_path)
    assert first.toptheta_report()["calibration"]["task"] == "smoke"

    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    second = TopThetaLM(**args)
    second._build(["smoke"])
    assert second.thresholds_path == str(path)
    third = TopThetaLM(**args, thresholds=str(path))  # a thresholds file given: no calibration either
    assert third._build(["smoke"])[0].thresholds.placement == "post"


def test_console_script_merges_our_offline_tasks_into_one_include_path(tmp_path):
    from lm_eval.tasks import TaskManager

    from toptheta.cli import include_dir

    user = tmp_path / "mine"
    user.mkdir()
    shutil.copy(ROOT / "toptheta/evaluation/tasks/static/smoke.yaml", user / "my_smoke.yaml")
    (user / "my_smoke.yaml").write_text((user / "my_smoke.yaml").read_text().replace("task: smoke", "task: my_smoke"))
    shutil.copy(ROOT / "toptheta/evaluation/tasks/static/smoke_data.py", user / "smoke_data.py")
    target = tmp_path / "include"
    target.mkdir()
    assert include_dir(["hellaswag_x"], "auto", None, target) is None  # not ours: lm-eval's own task
    path = include_dir(["smoke", "arc_challenge", "my_smoke"], "auto", str(user), target)
    manager = TaskManager(include_path=path, include_defaults=False)
    assert {"smoke", "arc_challenge", "my_smoke"} <= set(manager.all_tasks)
    assert "arc_challenge/test.jsonl" in (target / "arc_challenge.yaml").read_text()  # the shipped offline copy
    with pytest.raises(FileNotFoundError, match="data dir"):
        include_dir(["arc_easy"], str(tmp_path / "nowhere"), None, target)


@pytest.mark.slow
def test_console_script_runs_the_smoke_task_on_tiny_llama(tmp_path):
    exe = shutil.which("toptheta-eval") or pytest.skip("toptheta-eval is not installed (pip install -e .)")
    subprocess.run([exe, "--model", "toptheta", "--model_args", TOPK, "--tasks", "smoke", "--limit", "2",
                    "--output_path", str(tmp_path)], check=True, cwd=tmp_path,
                   env={**os.environ, "TOPTHETA_FUSED": "0"}, capture_output=True)
    (result,) = tmp_path.glob("tiny-llama/results_*.json")
    results = json.loads(result.read_text())
    assert "acc_norm,none" in results["results"]["smoke"]
    assert 0 < results["config"]["toptheta"]["stats"]["smoke"]["kept_attention_fraction"] < 0.9


def test_toptheta_eval_warns_once_per_task_about_nearly_dense_runs_and_rows_past_calibration(tmp_path, monkeypatch,
                                                                                             caplog):
    """run.py's warnings (guards.py) in toptheta-eval too: a sparse task that kept every element, rows longer than
    any calibrated row; each once, however often lm-eval asks for the report."""
    import logging

    import lm_eval

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        dense_like = lm_eval.simple_evaluate(model="toptheta", model_args=TOPK.replace("k=8", "k=512"),
                                             tasks=["smoke"], limit=2, task_manager=smoke_manager())
    assert dense_like["config"]["toptheta"]["stats"]["smoke"]["kept_attention_fraction"] == 1.0
    assert caplog.text.count("toptheta-eval smoke kept every attention element") == 1

    from toptheta.evaluation.lm_eval_model import TopThetaLM

    caplog.clear()
    lm = TopThetaLM(pretrained="tiny-llama", k=2, layer_k="none", placement="post", comp="vmc", calib_samples=1)
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        results = lm_eval.simple_evaluate(model=lm, tasks=["smoke"], limit=4, task_manager=smoke_manager())
        lm.get_model_info()  # asked again: no second warning
    clamped = results["config"]["toptheta"]["stats"]["smoke"]["clamped_rows"]
    assert clamped > 0  # one short calibration document: the evaluated rows run past it
    message = f"toptheta-eval smoke: {clamped} attention rows were longer than the longest calibrated row"
    assert caplog.text.count(message) == 1

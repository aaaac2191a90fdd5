"""What a careful user hits with bad or unusual input (issue 31): clear errors before expensive work, warnings
once per run with the fix, nothing lost after a kill, and the hand-written decoding loop of the README."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import cfg
from toptheta import pipeline

ROOT = Path(__file__).resolve().parents[1]


# ---- item 6: layer_k from the command line, and layers the model does not have --------------------------------

def test_layer_k_override_may_name_layers_the_default_does_not():
    composed = cfg("model=tiny-llama", "task=smoke", "sparsifier.layer_k={0:512,1:512,2:512}")
    assert dict(composed.sparsifier.layer_k) == {0: 512, 1: 512, 2: 512}
    spec = pipeline.plan(composed)[-1]
    assert spec.sparsifier.settings["layer_k"] == {0: 512, 1: 512, 2: 512}
    assert dict(cfg("sparsifier.layer_k={2:64}").sparsifier.layer_k) == {0: 512, 1: 512, 2: 64}  # merged, as README says
    assert cfg("sparsifier.layer_k=null").sparsifier.layer_k is None
    assert dict(cfg("sparsifier=dense", "sparsifier.layer_k={3:8}").sparsifier.layer_k) == {3: 8}


def test_default_layer_k_still_changes_no_run_id():
    """The schema type changed (Any on an open node); the default configuration's sparse run id did not."""
    default = pipeline.plan(cfg("model=tiny-llama", "task=smoke"))[-1]
    spelled = pipeline.plan(cfg("model=tiny-llama", "task=smoke", "sparsifier.layer_k={0:512,1:512}"))[-1]
    assert default.run_id == spelled.run_id
    assert default.sparsifier.settings["layer_k"] == {0: 512, 1: 512}


@pytest.mark.parametrize("value", ["{a:3}", "{0:x}"])
def test_layer_k_of_the_wrong_type_still_fails_at_composition(value):
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        cfg(f"sparsifier.layer_k={value}")


def test_layer_k_that_is_no_mapping_is_refused_at_planning():
    with pytest.raises(ValueError, match="sparsifier.layer_k=5: a mapping of layer index to k"):
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", "sparsifier.layer_k=5"))


@pytest.mark.parametrize("sparsifier", ["topk", "toptheta"])
def test_a_layer_beyond_the_model_is_refused_before_any_evaluation(sparsifier, tmp_path, monkeypatch):
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pipeline, "execute", lambda *a, **k: pytest.fail("evaluated before refusing layer 99"))
    with pytest.raises(ValueError, match=r"layer\(s\) \[99\].*has 6 layers \(0..5\)"):
        pipeline.run(cfg("model=tiny-llama", "task=smoke", f"sparsifier={sparsifier}", f"results_dir={tmp_path}",
                         "sparsifier.layer_k={99:512}"))


def test_the_library_refuses_a_layer_beyond_the_model():
    import toptheta
    from conftest import tiny_model

    model = tiny_model()  # 2 layers
    with pytest.raises(ValueError, match=r"layer\(s\) \[2\].*has 2 layers"):
        with toptheta.sparsify(model, toptheta.TopK(4, "post", layer_k={2: 8})):
            pass
    with toptheta.sparsify(model, toptheta.TopK(4, "post", layer_k={1: 8})):  # layer 1 exists
        pass


# ---- item 4: the README's hand-written decoding loop ----------------------------------------------------------

def _hand_written_loop(model, prompt, steps: int, mark_decode: bool):
    """The README's loop: one prefill forward, then one forward per token on the KV cache."""
    import contextlib

    import torch

    import toptheta

    tokens = []
    with toptheta.sparsify(model, toptheta.TopK(k=4, placement="post"), [toptheta.VMC()]) as stats, torch.no_grad():
        out = model(prompt, use_cache=True)                          # the prompt: prefill
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        tokens.append(token)
        with toptheta.decoding(model) if mark_decode else contextlib.nullcontext():  # each step: a decode step
            for _ in range(steps):
                out = model(token, cache=cache, use_cache=True)
                cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                tokens.append(token)
    return torch.cat(tokens, dim=1), stats


def test_the_readme_decoding_loop_records_what_generate_records():
    import torch
    from conftest import tiny_model

    import toptheta

    assert "decoding" in toptheta.__all__ and toptheta.decoding is not None
    readme = (ROOT / "README.md").read_text()
    assert "with toptheta.decoding(model):" in readme and "cache=cache" in readme
    model, steps = tiny_model(), 6
    prompt = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    tokens, stats = _hand_written_loop(model, prompt, steps, mark_decode=True)
    assert stats.summary()["decode_steps"] == steps and stats.decode_kept_attention_fraction < 1
    with toptheta.sparsify(model, toptheta.TopK(k=4, placement="post"), [toptheta.VMC()]) as reference, torch.no_grad():
        generated = model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
    assert torch.equal(generated[:, prompt.shape[1]:], tokens)
    assert reference.summary()["decode_steps"] == steps
    assert stats.decode_kept_attention_fraction == pytest.approx(reference.decode_kept_attention_fraction)
    assert stats.kept_vrow_fraction == pytest.approx(reference.kept_vrow_fraction)
    _, unmarked = _hand_written_loop(model, prompt, steps, mark_decode=False)  # without decoding(model): all prefill
    assert unmarked.summary()["decode_steps"] == 0


# ---- item 5: nothing lost or stuck after a kill --------------------------------------------------------------

SMALL_RUN = ("model=tiny-llama", "task=smoke", "task.limit=2", "sparsifier=toptheta", "sparsifier.k=8",
             "sparsifier.layer_k=null", "calib.num_samples=2", "log_samples=false")


def test_a_resumed_sweep_restores_a_stored_runs_missing_summary_rows(tmp_path, monkeypatch, caplog):
    import logging

    import pandas as pd

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    pipeline.run(cfg(*SMALL_RUN, f"results_dir={tmp_path}"))
    summary = tmp_path / "summary.csv"
    before = pd.read_csv(summary)
    assert set(before["sparsifier"]) == {"dense", "toptheta"}
    # A kill between write_run and append_summary: the sparse run is stored, its rows are not.
    kept = before[before["sparsifier"] == "dense"]
    kept.to_csv(summary, index=False)
    monkeypatch.setattr(pipeline, "execute", lambda *a, **k: pytest.fail("recomputed a stored run"))
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        pipeline.run(cfg(*SMALL_RUN, f"results_dir={tmp_path}"))
    after = pd.read_csv(summary)
    assert len(after) == len(before) and set(after["sparsifier"]) == {"dense", "toptheta"}
    restored = after[after["sparsifier"] == "toptheta"].set_index("metric")
    original = before[before["sparsifier"] == "toptheta"].set_index("metric")
    for column in ("run_id", "value", "kept_attention_fraction", "k", "placement"):
        assert restored[column].tolist() == original[column].tolist(), column
    assert caplog.text.count("summary.csv lacked its rows") == 1
    pipeline.run(cfg(*SMALL_RUN, f"results_dir={tmp_path}"))  # nothing missing now: no duplicate rows
    assert len(pd.read_csv(summary)) == len(before)


def test_a_damaged_cached_thresholds_file_is_moved_aside_and_recalibrated(tmp_path, monkeypatch, caplog):
    import logging

    from toptheta.calibration import Thresholds

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    pipeline.run(cfg(*SMALL_RUN, "baseline=false", f"results_dir={tmp_path / 'a'}"))
    cached = next(p for p in (tmp_path / "cache" / "thresholds").rglob("*.safetensors") if p.parent.name != "sequences")
    good = Thresholds.load(cached)
    cached.write_bytes(cached.read_bytes()[:100])  # truncated, as a kill mid-write by a non-atomic writer leaves it
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        pipeline.run(cfg(*SMALL_RUN, "baseline=false", f"results_dir={tmp_path / 'b'}"))
    assert caplog.text.count("is damaged") == 1 and "calibrating again" in caplog.text
    aside = list(cached.parent.glob(f"{cached.name}.damaged-*"))
    assert len(aside) == 1 and aside[0].stat().st_size == 100
    import torch

    assert torch.equal(torch.nan_to_num(Thresholds.load(cached).values), torch.nan_to_num(good.values))


def test_thresholds_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    import os

    import torch

    from toptheta.calibration import Thresholds

    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    path = Thresholds(torch.rand(2, 1, 1), [4, 4], "post").save(tmp_path / "t.safetensors")
    assert any(".t.safetensors." in p and p.endswith(".tmp") for p in synced)  # the temporary file, before rename
    assert str(tmp_path) in synced and path.is_file()  # then the directory entry


# ---- item 1: clear errors before expensive work, warnings once per run ------------------------------------------

@pytest.mark.parametrize("sigma", ["-50", "4"])
def test_a_sigma_add_that_makes_theta_meaningless_is_refused_at_planning(sigma):
    with pytest.raises(ValueError, match=r"calib.sigma_add=.*in \[-3, 3\] \(the paper: 0.1"):
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"calib.sigma_add={sigma}"))
    pipeline.plan(cfg("model=tiny-llama", "task=smoke", "calib.sigma_add=-0.5"))  # inside the range: planned


def test_post_softmax_thresholds_below_zero_are_refused_after_calibration(caplog):
    import torch
    from conftest import tiny_model

    import toptheta

    model = tiny_model(initializer_range=0.5)  # peaked attention: the (k+1)-th largest scores vary between rows
    inputs = [torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.raises(ValueError, match=r"\d+ of 448 post-softmax thresholds are below 0 \(sigma_add=-3.0\).*"
                                         r"keep every key.*use sigma_add >= 0"):
        toptheta.calibrate(model, inputs, k=4, placement="post", sigma_add=-3.0)
    thresholds = toptheta.calibrate(model, inputs, k=4, placement="post", sigma_add=0.1)  # the paper's: all ≥ 0
    assert float(torch.nan_to_num(thresholds.values, nan=0.0).min()) >= 0
    toptheta.calibrate(model, inputs, k=4, placement="pre", sigma_add=-3.0)  # logit thresholds may be negative


def _stats(kept: float, clamped: int = 0):
    from toptheta import SparsityStats

    stats = SparsityStats(2, 1, 1)
    stats.prefill_valid[:] = 1000.0
    stats.prefill_kept[:] = kept * 1000.0
    stats.clamped_rows = clamped
    return stats


def test_a_sparse_run_keeping_nearly_everything_and_clamped_rows_are_warned_once_with_the_fix(caplog):
    import logging
    from types import SimpleNamespace

    from toptheta.guards import warn_unintended

    sparse = {"name": "toptheta", "k": 64, "layer_k": {}}
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        warn_unintended("toptheta-post", sparse, {"sigma_add": -2.0}, _stats(0.998, clamped=7), SimpleNamespace(max_n=300))
    assert len(caplog.records) == 2
    assert "kept 99.8% of the attention elements (1996 of 2000), above 95%" in caplog.records[0].message
    assert "raise calib.sigma_add" in caplog.records[0].message
    assert "7 attention rows were longer than the longest calibrated row (300 keys)" in caplog.records[1].message
    assert "and used its θ" in caplog.records[1].message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="toptheta"):  # under fit the rows were extrapolated, as asked
        warn_unintended("toptheta-post", sparse, None, _stats(0.5, clamped=7), SimpleNamespace(max_n=300, beyond_rule="fit"))
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert "7 attention rows were longer" in caplog.records[0].message and "calib.beyond=fit" in caplog.records[0].message
    assert "used its θ" not in caplog.records[0].message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        warn_unintended("topk-post", {**sparse, "name": "topk"}, None, _stats(0.5))  # a sparse run as meant
        warn_unintended("dense", {"name": "dense", "k": None}, None, _stats(1.0))
    assert not caplog.records


def _bypassing_model():
    """A tiny Llama whose attention modules compute eager attention whatever implementation the model is set to
    (as custom modeling code that never asks transformers' attention interface does)."""
    import copy

    from conftest import tiny_model

    model = tiny_model()
    for layer in model.model.layers:
        layer.self_attn.config = copy.copy(model.config)
        layer.self_attn.config._attn_implementation = "eager"
    return model


def test_a_model_whose_attention_bypasses_the_interface_is_refused_before_evaluating():
    import torch
    from conftest import tiny_model

    import toptheta
    from toptheta.attention.backend import check_supported

    model = _bypassing_model()
    with toptheta.sparsify(model, toptheta.TopK(2, "post")) as stats:  # today: runs dense, silently
        model(torch.randint(0, 256, (1, 16)))
    assert stats.kept_attention_fraction is None
    with pytest.raises(ValueError, match=r"layer\(s\) \[0, 1\] of 2 does not go through transformers' attention"):
        check_supported(model)
    check_supported(tiny_model())  # a model that does: accepted


def test_the_pipeline_checks_the_model_before_the_dense_baseline(tmp_path, monkeypatch):
    from toptheta import models

    real = models.load_model
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (_bypassing_model(), *real(*a, **k)[1:]))
    monkeypatch.setattr(pipeline, "execute", lambda *a, **k: pytest.fail("evaluated a model toptheta cannot see"))
    with pytest.raises(ValueError, match="does not go through transformers' attention interface"):
        pipeline.run(cfg("model=tiny-llama", "task=smoke", "sparsifier=topk", f"results_dir={tmp_path}"))


def test_a_model_with_attention_sinks_is_refused_on_entering_sparsify():
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    import toptheta
    from toptheta.attention.backend import check_supported

    config = GptOssConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                          num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(config).eval()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(NotImplementedError, match=r"has attention sinks \(GptOssAttention.sinks, 2 layers\)"):
        with toptheta.sparsify(model, toptheta.TopK(2, "post")):
            model(torch.randint(0, 256, (1, 8)))
    assert not calls  # refused before the first forward
    with pytest.raises(NotImplementedError, match="attention sinks"):
        check_supported(model)


# ---- item 8: the cluster path, through the submitit plugin's local executor ----------------------------------------

@pytest.mark.slow  # two job processes, each importing torch, transformers and lm-eval: minutes on 2 shared cores
def test_a_submitit_sweep_stores_one_run_per_configuration_and_one_shared_baseline(tmp_path):
    """scripts/slurm_local.sh's sweep (two configurations, one job each) through hydra/launcher=submitit_local: the
    same plugin as submitit_slurm, jobs started by submitit in their own processes, sharing results_dir and the cache."""
    import json
    import os
    import subprocess
    import sys

    import pandas as pd

    results = tmp_path / "results"
    env = {**os.environ, "TOPTHETA_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "run.py", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=15",
               "hydra.launcher.cpus_per_task=1", f"hydra.sweep.dir={tmp_path / 'multirun'}", "model=tiny-llama",
               "task=smoke", "task.limit=4", "sparsifier=topk", "sparsifier.k=4,8", "sparsifier.layer_k=null",
               "comp=vmc", "log_samples=false", f"results_dir={results}"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [d for d in (results / "runs").iterdir() if (d / "DONE").is_file()]
    configs = [json.loads((d / "config.json").read_text()) for d in runs]
    assert sorted((c["sparsifier"]["name"], c["sparsifier"]["k"]) for c in configs) == [
        ("dense", None), ("topk", 4), ("topk", 8)]
    jobs = {json.loads((d / "invocation.json").read_text()).get("job") for d in runs}
    assert jobs <= {0, 1} and len(list((tmp_path / "multirun").rglob("*_log.out"))) == 2  # two submitit jobs ran them
    summary = pd.read_csv(results / "summary.csv")
    assert sorted(set(summary["run_id"])) == sorted(d.name for d in runs)
    assert not summary.duplicated(["run_id", "task", "metric"]).any()  # the baseline was computed once


# ---- item 7: the README's module tree and setup match the code ------------------------------------------------------

def test_the_readme_module_tree_names_every_module_and_setup_builds_what_it_says():
    readme = (ROOT / "README.md").read_text()
    tree = readme[readme.index("run.py -> toptheta.pipeline.run(cfg)"):]
    tree = tree[:tree.index("```")]
    package = ROOT / "toptheta"
    missing = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
               if p.name != "__init__.py" and not {"data", "static"} & set(p.parts)  # task data: "static/"
               and p.name not in tree]
    assert not missing, f"README's module tree omits {missing}"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "of 3 CPU attention kernels built" in setup and "three optional C++ CPU attention" in readme
    assert "triton" in setup and "installs Triton (the GPU kernels" in readme

"""Thresholds beside the checkpoint (thresholds/checkpoint.py), their dtype, and files whose settings disagree with
the run's (issue 31, items 2 and 3)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import toptheta
from conftest import cfg, tiny_model, tiny_tokenizer
from toptheta.calibration import Thresholds
from toptheta.thresholds.checkpoint import INDEX, matching, settings_of


def _folder(tmp_path, name: str, seed: int = 0, **overrides):
    """A Hugging Face model folder of a tiny Llama, and the model loaded from it (as load_model loads folders)."""
    from toptheta.models import load_model

    tokenizer = tiny_tokenizer()
    folder = tmp_path / name
    tiny_model(tokenizer, seed=seed, **overrides).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model, tokenizer, _ = load_model(str(folder))
    return folder, model.eval(), tokenizer


def _calibrate(model, k=4, placement="post"):
    torch.manual_seed(1)
    inputs = [torch.randint(0, 256, (1, 40)) for _ in range(3)]
    return toptheta.calibrate(model, inputs, k=k, placement=placement)


def test_save_pretrained_round_trip_and_another_model_refused(tmp_path):
    folder, model, _ = _calibrate_folder(tmp_path)
    thresholds = _calibrate(model)
    written = thresholds.save_pretrained(folder)
    assert written.parent == folder and written.is_file()
    index = json.loads((folder / INDEX).read_text())
    assert index["model"]["fingerprint"]["layers"] == 2 and index["thresholds"][0]["settings"]["k_per_layer"] == [4, 4]

    loaded = Thresholds.from_pretrained(folder, model=model)
    assert torch.equal(torch.nan_to_num(loaded.values), torch.nan_to_num(thresholds.values))
    assert loaded.k == thresholds.k and loaded.placement == "post"
    with toptheta.sparsify(model, toptheta.TopTheta(loaded)) as stats:  # usable as loaded
        model(torch.randint(0, 256, (1, 40)))
    assert stats.kept_attention_fraction < 1

    _, other, _ = _calibrate_folder(tmp_path, "other", seed=3)  # same shape, another checkpoint
    with pytest.raises(ValueError, match="thresholds are for .*'ckpt'.*this model is other"):
        Thresholds.from_pretrained(folder, model=other)
    _calibrate_folder(tmp_path, "wider", head_dim=8)
    with pytest.raises(ValueError, match="holds a model with .*'head_dim': 8"):
        thresholds.save_pretrained(tmp_path / "wider")  # refused on save too: another shape


def _calibrate_folder(tmp_path, name="ckpt", **kw):
    return _folder(tmp_path, name, **kw)


def test_a_second_set_is_kept_beside_the_first_and_chosen_by_settings(tmp_path):
    folder, model, _ = _calibrate_folder(tmp_path)
    _calibrate(model, k=4).save_pretrained(folder)
    _calibrate(model, k=6).save_pretrained(folder)
    _calibrate(model, k=6).save_pretrained(folder)  # same settings: replaces, no third entry
    assert len(json.loads((folder / INDEX).read_text())["thresholds"]) == 2
    with pytest.raises(ValueError, match="2 threshold sets matching any settings"):
        Thresholds.from_pretrained(folder, model=model)
    assert Thresholds.from_pretrained(folder, model=model, settings={"k_per_layer": [6, 6]}).k == [6, 6]
    found = matching(folder, {**settings_of(_calibrate(model, k=4))}, model)
    assert found is not None and found[0].k == [4, 4]
    assert matching(folder, {"k_per_layer": [5, 5], "placement": "post"}, model) is None
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        Thresholds.from_pretrained(tmp_path / "nothing-here")


def test_run_py_uses_the_thresholds_a_model_folder_carries(tmp_path, monkeypatch, caplog):
    """`run.py model.source=<folder>`: the first run calibrates and the thresholds are saved into the folder; a
    second store with that folder reads them (one log line) and calibrates nothing."""
    from toptheta import calibration, pipeline

    folder, _, _ = _calibrate_folder(tmp_path)
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    overrides = ["model=tiny-llama", f"model.source={folder}", "task=smoke", "task.limit=2", "sparsifier.k=8",
                 "sparsifier.layer_k=null", "calib.num_samples=2", "baseline=false", "log_samples=false"]
    pipeline.run(cfg(*overrides, f"results_dir={tmp_path / 'a'}"))
    cached = next((tmp_path / "cache" / "thresholds").rglob("*.safetensors"))
    Thresholds.load(cached).save_pretrained(folder)

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache2"))  # nothing cached: only the folder has them
    monkeypatch.setattr(calibration, "calibrate", lambda *a, **k: pytest.fail("calibrated although the folder has them"))
    with caplog.at_level(logging.INFO, logger="toptheta"):
        pipeline.run(cfg(*overrides, f"results_dir={tmp_path / 'b'}"))
    assert "thresholds: from the model folder" in caplog.text
    run = next((tmp_path / "b" / "runs").iterdir())
    assert (run / "thresholds.safetensors").is_file()


def test_dtype_is_recorded_and_another_dtype_is_said_once(tmp_path, caplog):
    model = tiny_model()
    thresholds = _calibrate(model)
    assert thresholds.metadata["dtype"] == "float32"
    path = thresholds.save(tmp_path / "t.safetensors")
    loaded = Thresholds.load(path)
    assert loaded.metadata["dtype"] == "float32"
    half = tiny_model().to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        loaded.check_model(half)
        with toptheta.sparsify(half, toptheta.TopTheta(loaded)):
            half(torch.randint(0, 256, (1, 20)))
    said = [r for r in caplog.records if "calibrated on a float32 model are applied to a bfloat16" in r.message]
    assert len(said) == 1 and "calibrate in bfloat16" in said[0].message
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        Thresholds.load(path).check_model(model)  # same dtype: nothing to say
    assert "applied to a" not in caplog.text


def test_toptheta_eval_refuses_a_thresholds_file_for_other_settings(tmp_path):
    from toptheta.evaluation.lm_eval_model import TopThetaLM
    from toptheta.models import load_model

    model, _, _ = load_model("tiny-llama")
    path = _calibrate(model, k=4).save(tmp_path / "t.safetensors")
    base = dict(pretrained="tiny-llama", layer_k="none", comp="vmc", thresholds=str(path))
    TopThetaLM(**base, k=4, placement="post")  # the file's settings: accepted
    with pytest.raises(ValueError, match=r"k per layer \[4, 4, 4, 4, 4, 4\].*asks k per layer \[8, .*k=4,layer_k=none"):
        TopThetaLM(**base, k=8, placement="post")
    with pytest.raises(ValueError, match="placement='post'.*asks.*placement='pre'"):
        TopThetaLM(**{**base, "comp": "sdc+vmc"}, k=4, placement="pre")
    with pytest.raises(ValueError, match=r"asks k per layer \[512, 512, 4"):
        TopThetaLM(**{**base, "layer_k": "0:512+1:512"}, k=4, placement="post")


def test_toptheta_eval_uses_the_thresholds_of_its_pretrained_folder(tmp_path, monkeypatch, caplog):
    from toptheta.evaluation.lm_eval_model import TopThetaLM

    folder, model, _ = _calibrate_folder(tmp_path)
    thresholds = _calibrate(model, k=4)
    thresholds.metadata.update(granularity="layer-head-n", sigma_add=0.1, calibration_documents=120)
    thresholds.save_pretrained(folder)
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.INFO, logger="toptheta"):
        lm = TopThetaLM(pretrained=str(folder), k=4, layer_k="none", placement="post", comp="vmc")
    assert lm.thresholds is not None and lm.thresholds.k == [4, 4]
    assert lm.thresholds_path.startswith(str(folder)) and "from the model folder" in caplog.text
    other = TopThetaLM(pretrained=str(folder), k=5, layer_k="none", placement="post", comp="vmc")
    assert other.thresholds is None  # other settings: calibrated at the first request, as without a folder


def test_cover_shots_and_sampler_are_settings_and_older_sets_read_as_zero_and_default(tmp_path):
    """A set saved before calib.cover_shots / fewshot_sampler existed (its metadata lacks them) serves runs at 0
    and the default sampler only; a set calibrated with cover_shots=4 on first_n exemplars serves only such runs."""
    from toptheta.thresholds.checkpoint import run_settings
    from toptheta.spec import CalibSpec, SparsifierSpec

    folder, model, _ = _calibrate_folder(tmp_path)
    _calibrate(model, k=4).save_pretrained(folder)  # no cover_shots, no sampler in its metadata
    longer = _calibrate(model, k=6)
    longer.metadata.update(cover_shots=4, fewshot_sampler="first_n")
    longer.save_pretrained(folder)
    sparsifier = {"k": 4, "placement": "post", "layer_k": {}}

    def found(k, **calib):
        want = run_settings(SparsifierSpec.from_settings({**sparsifier, "k": k}),
                            CalibSpec.from_settings({"statistic": "order", **calib}), [], 2)
        return {key: want[key] for key in ("k_per_layer", "placement", "cover_shots", "fewshot_sampler")}

    assert matching(folder, found(4), model) is not None
    assert matching(folder, found(4, cover_shots=4), model) is None
    assert matching(folder, found(4, fewshot_sampler="first_n"), model) is None
    assert matching(folder, found(6), model) is None
    hit = matching(folder, found(6, cover_shots=4, fewshot_sampler="first_n"), model)
    assert hit is not None and hit[0].k == [6, 6]


def test_a_set_calibrated_to_a_top_rho_budget_is_found_by_the_runs_that_ask_for_it(tmp_path):
    """toptheta.calibrate(rho=, head_weights=) records its budget as checkpoint.budget_record writes a run's: a set
    saved with save_pretrained serves `sparsifier.budget=toprho` runs of the same ρ and weights, and no other run
    (the top-k set beside it serves the paper's budget)."""
    from toptheta.spec import CalibSpec, SparsifierSpec
    from toptheta.thresholds.checkpoint import run_settings

    folder, model, _ = _calibrate_folder(tmp_path)
    heads = model.config.num_attention_heads
    weights = [[1.0 + h for h in range(heads)], [2.0] * heads]
    torch.manual_seed(1)
    inputs = [torch.randint(0, 256, (1, 40)) for _ in range(3)]
    toptheta.calibrate(model, inputs, k=4, placement="post", rho=0.25, head_weights=weights).save_pretrained(folder)
    _calibrate(model, k=4).save_pretrained(folder)

    def found(**budget):
        """The budget recorded by the set a run of these sparsifier settings is given (None: the top-k budget), or
        "no set" when none matches."""
        settings = run_settings(SparsifierSpec.from_settings({"k": 4, "placement": "post", "layer_k": {}, **budget}),
                                CalibSpec.from_settings({"statistic": "order"}), [], 2)
        hit = matching(folder, settings, model)
        return "no set" if hit is None else hit[0].metadata.get("budget")

    assert found(budget="toprho", rho=0.25, head_weights=weights) == {"rule": "toprho", "rho": 0.25,
                                                                      "head_weights": weights}
    assert found() is None  # the top-k set: its metadata has no budget
    for other in (dict(rho=0.3, head_weights=weights), dict(rho=0.25, head_weights=None),
                  dict(rho=0.25, head_weights=[[1.0] * heads, [2.0] * heads])):
        assert found(budget="toprho", **other) == "no set", other

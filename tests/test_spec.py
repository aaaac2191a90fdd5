"""RunSpec: typed sections read from a run's settings, and the identity its run id hashes, unchanged by the typing."""

from __future__ import annotations

import dataclasses
import enum

import pytest
from conftest import cfg

from toptheta import config, pipeline
from toptheta.spec import CalibSpec, CompSpec, ModelSpec, RunSpec, SparsifierSpec, TaskSpec
from toptheta.store.runs import RunStore


@pytest.mark.parametrize("overrides", [
    ("sparsifier=toptheta", "comp=sdc+vmc", "task=smoke"),
    ("sparsifier=topk", "sparsifier.target_kept=0.3", "task=smoke"),
    ("sparsifier=toptheta", "calib.beyond=fit", "task=passkey"),
])
def test_planned_specs_hash_to_their_run_ids_and_read_back_from_the_store(tmp_path, overrides):
    store = RunStore(tmp_path)
    for spec in pipeline.plan(cfg("model=tiny-llama", f"results_dir={tmp_path}", *overrides)):
        assert store.run_id_for(spec.identity()) == spec.run_id
        again = RunSpec.from_identity(spec.stored_config(), run_id=spec.run_id)  # config.json as written
        assert again.identity() == spec.identity() and again.task.prefix_cache == spec.task.prefix_cache
        assert again.sparsifier == spec.sparsifier and again.calib == spec.calib and again.model == spec.model


def test_typed_fields_read_the_settings_and_absent_ones_stay_out_of_the_identity(tmp_path):
    spec = pipeline.plan(cfg("model=tiny-llama", f"results_dir={tmp_path}", "sparsifier=toptheta", "comp=sdc+vmc",
                             "calib.sigma_add=0.3", "sparsifier.k=5"))[-1]
    assert (spec.sparsifier.name, spec.sparsifier.k, spec.sparsifier.placement) == ("toptheta", 5, "pre")
    assert spec.calib.sigma_add == 0.3 and spec.comp.sdc == "exact" and spec.comp.vmc is True
    assert isinstance(spec.model, ModelSpec) and spec.model.name == "tiny-llama"
    assert "beyond" not in spec.identity()["calib"] and spec.calib.beyond == "clamp"  # default, not in the id
    assert "prefix_cache" not in spec.identity()["task"] and spec.task.prefix_cache is True
    resolved = spec.with_sparsifier(k=7)  # matched sparsity resolves k this way
    assert resolved.sparsifier.k == 7 and spec.sparsifier.k == 5 and resolved.identity()["sparsifier"]["k"] == 7
    assert resolved.run_id == spec.run_id  # a resolved spec keeps the planned run's id


@pytest.mark.parametrize("section, schema", [(CalibSpec, config.CalibConfig), (CompSpec, config.CompConfig),
                                             (ModelSpec, config.ModelConfig), (TaskSpec, config.TaskConfig),
                                             (SparsifierSpec, config.SparsifierConfig)])
def test_section_defaults_are_the_schemas(section, schema):
    """A setting absent from a run's settings reads as the Hydra schema's default: one default per setting."""
    typed = section.from_settings({})
    defaults = {f.name: f.default for f in dataclasses.fields(schema)
                if f.default is not dataclasses.MISSING and f.default != "???"}
    compared = [name for name in defaults if name in {f.name for f in dataclasses.fields(section)}]
    assert compared, "no field shared with the schema"
    for name in compared:
        want = defaults[name].value if isinstance(defaults[name], enum.Enum) else defaults[name]
        if section is CalibSpec and name == "num_samples":
            continue  # the schema's 120 is always in a planned spec; absent means a caller's own (None: all)
        assert getattr(typed, name) == want, f"{section.__name__}.{name}: {getattr(typed, name)!r} != schema {want!r}"


@pytest.mark.parametrize("run_py, model_args", [
    (("sparsifier=toptheta", "sparsifier.k=16", "comp=sdc+vmc"),
     {"sparsifier": "toptheta", "k": 16, "comp": "sdc+vmc"}),
    (("sparsifier=toptheta", "comp=vmc", "calib.beyond=fit", "calib.sigma_add=0.3"),
     {"sparsifier": "toptheta", "comp": "vmc", "beyond": "fit", "sigma_add": 0.3}),
    (("sparsifier=topp", "sparsifier.p=0.9", "comp=none"), {"sparsifier": "topp", "p": 0.9, "comp": "none"}),
    (("sparsifier=dense",), {"sparsifier": "dense"}),
])
def test_toptheta_eval_and_run_py_read_the_same_settings_into_the_same_spec(tmp_path, run_py, model_args):
    """One spec from both entry points: the same sparsifier, comp and calib sections, and so one thresholds file."""
    from toptheta.calibration import model_fingerprint
    from toptheta.thresholds_cache import thresholds_key
    from transformers import LlamaConfig

    planned = pipeline.plan(cfg("model=tiny-llama", "task=smoke", "calib.task=smoke", "calib.num_samples=8",
                                f"results_dir={tmp_path}", *run_py))[-1]
    spec, rest = RunSpec.from_model_args("tiny-llama", calib_task="smoke", calib_samples=8, calib_fewshot=0,
                                         device="cpu", data_dir_path=planned.data_dir_path, batch_size=4, **model_args)
    assert rest == {"batch_size": 4}  # HFLM's own
    # the typed fields (a spec's settings may leave a default out: run.py's YAML spells empty_rows=keep-max)
    assert spec.sparsifier == planned.sparsifier and spec.comp == planned.comp
    assert spec.comp.objects() == planned.comp.objects()
    if spec.calib is None:  # builds without thresholds: the same object
        assert repr(spec.sparsifier.build()) == repr(planned.sparsifier.build())
    assert (spec.calib is None) == (planned.calib is None)
    if spec.calib is not None:
        assert spec.calib == planned.calib
        alone = RunSpec.for_thresholds(model=planned.model.settings, sparsifier=spec.sparsifier.settings,
                                       comp=spec.comp.settings, calib=spec.calib.settings,
                                       data_dir_path=spec.data_dir_path)
        fingerprint = model_fingerprint(LlamaConfig())
        assert thresholds_key(alone, fingerprint) == thresholds_key(planned, fingerprint)


def test_data_source_round_trips_to_a_data_dir_setting():
    """A run id records local or hub; reading the run's data again maps local to this machine's copy."""
    from toptheta.evaluation.tasks.catalog import SHIPPED_DATA_DIR, resolve_data_dir
    from toptheta.spec import data_dir_setting, data_source

    assert data_source("/data") == "local" and data_source(None) == "hub"
    assert data_dir_setting("hub") == "hub" and resolve_data_dir(data_dir_setting("hub")) is None
    assert data_dir_setting("local") == "auto"
    import os
    if not os.environ.get("TOPTHETA_DATA_DIR"):
        assert resolve_data_dir(data_dir_setting("local")) == SHIPPED_DATA_DIR

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

"""Typed configuration (toptheta/config.py): every YAML composes into the schema, the command on each file's
first line composes, and a bad type or value fails at composition (or, for ranges, in pipeline.plan's first
step) with the valid values listed. Parametrised over the files and the schema, so new options are covered."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import typing
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from conftest import cfg
from toptheta import config, pipeline

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
YAMLS = sorted(p.relative_to(CONF) for p in CONF.rglob("*.yaml") if p.parent != CONF)
GROUPS = {"model": config.ModelConfig, "sparsifier": config.SparsifierConfig, "comp": config.CompConfig,
          "calib": config.CalibConfig, "task": config.TaskConfig, "logger": config.LoggerConfig}


def first_command(path: Path) -> list[str]:
    """The overrides of the `# python run.py ...` line a YAML starts with (sweep lists left out)."""
    line = next(l for l in path.read_text().splitlines() if l.startswith("# python run.py"))
    return [a for a in line.removeprefix("# python run.py").split() if a != "-m" and "," not in a]


@pytest.mark.parametrize("path", YAMLS, ids=str)
def test_every_yaml_composes_into_the_schema_as_its_first_line_says(path):
    group, option = path.parts[0], str(path.relative_to(path.parts[0]).with_suffix(""))
    c = cfg(f"{group}={option}")
    if group in GROUPS:
        assert c[group]._metadata.object_type is GROUPS[group], "the group is typed by its schema"
    overrides = first_command(CONF / path)
    assert f"{group}={option}" in overrides or option == "paper", f"{path}: its first line must run it"
    c = cfg(*overrides)
    config.check(c)  # in range, as written


def enum_fields() -> list[tuple[str, str, type]]:
    out = []
    for group, schema in GROUPS.items():
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            kinds = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if isinstance(t, type)]
            choice = next((t for t in kinds if issubclass(t, config.Choice)), None)
            if choice is not None:
                out.append((group, f.name, choice))
    return out


def test_the_schema_has_the_choices_the_issue_names():
    fields = {f"{g}.{n}" for g, n, _ in enum_fields()}
    assert {"calib.granularity", "sparsifier.placement", "comp.sdc",
            "model.dtype", "calib.lookup", "calib.statistic", "logger.name"} <= fields
    assert "task.kind" not in fields  # registered task kinds, checked by config.check (tests/test_registry.py)


@pytest.mark.parametrize("group,name,choice", enum_fields(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_bad_choice_fails_at_composition_listing_the_valid_ones(group, name, choice):
    base = ["logger=wandb"] if group == "logger" else []
    with pytest.raises(ConfigCompositionException) as err:
        cfg(*base, f"{group}.{name}=not-a-{name}")
    message = str(err.value.__cause__)
    assert f"Invalid value 'not-a-{name}'" in message
    assert "expected one of [" + ", ".join(m.value for m in choice) + "]" in message
    for member in choice:  # and every listed value composes
        cfg(*base, f"{group}.{name}={member.value}")


@pytest.mark.parametrize("override", ["sparsifier.k=abc", "comp.vmc=maybe", "calib.sigma_add=lots",
                                      "sparsifier.layer_k={a:1}", "model.max_length=long", "sparsifier.kk=3"])
def test_a_wrong_type_or_unknown_key_fails_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        cfg(override)


@pytest.mark.parametrize("override,message", [
    ("task.batch_size=-1", "task.batch_size=-1: an integer >= 1 or auto"),
    ("task.batch_size=0", "task.batch_size=0"),
    ("task.batch_size=many", "an integer >= 1 or auto"),
    ("task.limit=1.5", "a float in (0, 1)"),
    ("task.limit=0", "task.limit=0"),
    ("task.num_fewshot=-1", "task.num_fewshot=-1"),
    ("sparsifier.k=0", "sparsifier.k=0: give a positive integer"),
    ("sparsifier.layer_k={0:0}", "map a layer index >= 0 to a k >= 1"),
    ("calib.sample_frac=0", "calib.sample_frac=0.0"),
    ("calib.num_samples=0", "calib.num_samples=0"),
    ("comp.sdc_scale=0", "comp.sdc_scale=0.0"),
    ("chunk_size=0", "chunk_size=0"),
    ("model.max_length=1", "model.max_length=1"),
    ("task.vrow_popularity={layer:0}", "only generation tasks"),  # smoke is a multiple-choice task
    ("task.vrow_popularity={layer:-1}", "task.vrow_popularity.layer=-1: an integer >= 0"),
    ("task.decode_batch=0", "null (one generation request at a time) or an integer >= 1"),
    ("task.share_prefix=true", "null for lm_eval tasks (multiple-choice contexts are shared by task.batch_size)"),
    ("task.filler=shared", "task.filler='shared': null, independent or shared, for passkey tasks only"),
])
def test_out_of_range_values_fail_before_anything_loads(override, message, tmp_path):
    c = cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", override)
    with pytest.raises(ValueError, match="invalid configuration") as err:
        pipeline.plan(c)
    assert message in str(err.value)


def test_lm_eval_generation_batches_with_decode_batch_in_the_run_id(tmp_path, monkeypatch):
    """task=longbench_multi_news: task.decode_batch=4 decodes 4 documents together (evaluate_tasks gets it; unset,
    1: generation never follows task.batch_size, which is not in the run id); set, it changes the run id."""
    from toptheta.evaluation import lm_eval_adapter

    base = ("model=tiny-llama", "task=longbench_multi_news", f"results_dir={tmp_path}")
    plain, batched = pipeline.plan(cfg(*base, "task.batch_size=8")), pipeline.plan(cfg(*base, "task.decode_batch=4"))
    assert "decode_batch" not in plain[-1].task.settings and batched[-1].task.settings["decode_batch"] == 4
    assert batched[-1].run_id != plain[-1].run_id
    assert plain[-1].run_id == pipeline.plan(cfg(*base))[-1].run_id  # batch_size: not part of the id
    seen = []
    monkeypatch.setattr(lm_eval_adapter, "evaluate_tasks", lambda *a, **kw: seen.append(kw["decode_batch"]) or {})
    for task, expected in ((plain[-1].task, 1), (batched[-1].task, 4)):
        pipeline.evaluate(task, None, None, None, plain[-1].model)
        assert seen[-1] == expected


@pytest.mark.parametrize("overrides,message", [
    (["task.batch_size=4"], "task.batch_size=4: 1 for passkey (to decode prompts together, set task.decode_batch=16)"),
    (["task.decode_batch=0"], "task.decode_batch=0: null (one prompt at a time) or an integer >= 1"),
    (["task.decode_batch=4", "task.vrow_popularity={layer:0}"], "null with task.vrow_popularity"),
    (["task.decode_batch=4", "task.share_prefix=true"], "null with task.share_prefix=true"),
    (["task.filler=same"], "task.filler='same': null, independent or shared"),
])
def test_generation_tasks_batch_with_decode_batch(overrides, message, tmp_path):
    c = cfg("model=tiny-llama", "task=passkey", f"results_dir={tmp_path}", *overrides)
    with pytest.raises(ValueError, match="invalid configuration") as err:
        pipeline.plan(c)
    assert message in str(err.value)
    batched = pipeline.plan(cfg("model=tiny-llama", "task=passkey", f"results_dir={tmp_path}", "task.decode_batch=4"))
    plain = pipeline.plan(cfg("model=tiny-llama", "task=passkey", f"results_dir={tmp_path}"))
    assert "decode_batch" not in plain[-1].task.settings  # unset: run ids stay those of before the option
    assert batched[-1].run_id != plain[-1].run_id  # part of the run id: batched greedy tokens may differ
    shared = pipeline.plan(cfg("model=tiny-llama", "task=passkey", f"results_dir={tmp_path}", "task.filler=shared",
                               "task.share_prefix=true"))
    assert "share_prefix" not in plain[-1].task.settings and "filler" not in plain[-1].task.settings
    assert shared[-1].task.settings["filler"] == "shared" and shared[-1].run_id != plain[-1].run_id


def test_batch_size_auto_and_fractional_limits_are_allowed(tmp_path):
    c = cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", "task.batch_size=auto", "task.limit=0.5")
    assert pipeline.plan(c)[-1].task.settings["batch_size"] == "auto"


def test_plan_sees_plain_strings_not_enums(tmp_path):
    spec = pipeline.plan(cfg("model=tiny-llama", "task=smoke", "comp=sdc+vmc", f"results_dir={tmp_path}"))[-1]
    assert type(spec.sparsifier.settings["name"]) is str and type(spec.calib.granularity) is str
    assert spec.sparsifier.settings["placement"] == "pre" and type(spec.comp.settings["sdc"]) is str


def test_choices_print_as_their_values():
    c = cfg("calib.granularity=layer-head")
    assert f"{c.calib.granularity}" == str(c.calib.granularity) == "layer-head" == c.calib.granularity


def test_run_ids_did_not_change_with_the_schema(tmp_path):
    """Fields the schema added to every task (include_path, ...) stay out of the run id when unset: the
    default run's task identity has exactly the keys of the committed store's run of it."""
    import json

    specs = pipeline.plan(cfg(f"results_dir={tmp_path}"))
    stored = json.loads((ROOT / "results" / "runs" / "1ab878e002fa755b" / "config.json").read_text())
    # task.prefix_cache rides along after the id is computed (how scoring runs, not what it scores)
    assert specs[0].label == "dense" and set(specs[0].task.settings) - {"prefix_cache"} == set(stored["task"])
    assert specs[0].run_id == "2e56db9915929e68"  # the default dense run's id before fewshot_sampler, prefix_cache, target_kept
    assert set(specs[0].sparsifier.settings) == set(stored["sparsifier"])
    with_path = pipeline.plan(cfg(f"results_dir={tmp_path}", "task.include_path=/somewhere"))
    assert with_path[0].run_id != specs[0].run_id  # when set, it is part of the identity


def test_default_results_dir_is_local_and_git_ignored():
    c = cfg()
    assert c.results_dir == "outputs/results" and c.log_samples is True and c.data_dir == "auto"
    ignored = subprocess.run(["git", "check-ignore", "-q", "outputs/results/summary.csv"], cwd=ROOT)
    assert ignored.returncode == 0


def test_nothing_reads_the_shared_folder_beside_the_checkout():
    """Code, configs and tests use the shipped data (toptheta/data), never the team folder beside the checkout."""
    pattern = re.compile(r"\.\./shared|\"shared\" */ *\"data\"|parents\[\d\] */ *\"shared\"")
    offenders = [str(p.relative_to(ROOT)) for folder in ("toptheta", "conf", "tests", "scripts")
                 for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".yaml", ".sh") and p.name != Path(__file__).name
                 and pattern.search(p.read_text(encoding="utf-8", errors="replace"))]
    assert not offenders

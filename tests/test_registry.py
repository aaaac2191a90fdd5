"""Sparsifiers and compensations are found by name (toptheta/registry.py): a sparsifier and a compensation defined in
this file alone run through run.py's pipeline and through toptheta-eval, with no other file edited, and give there
what the library objects give; a name nobody registered fails with the list of known ones."""

from __future__ import annotations

import csv
import gzip
import json
from dataclasses import dataclass, replace

import pytest
import torch
from hydra.errors import ConfigCompositionException

import toptheta
from conftest import cfg, smoke_manager
from toptheta import pipeline, registry
from toptheta.compensation import KernelCompensation
from toptheta.builders import searched_parameter
from toptheta.registry import Parameter
from toptheta.sparsifiers.base import RowBlock, Sparsifier, check_budgets, check_placement, keep_whole_short_rows


class Recent(Sparsifier):
    """Sliding-window attention: each row keeps its ``window`` most recent valid keys (its own parameter, no budget)."""

    def __init__(self, window: int, placement: str = "post", k: int | None = None, layer_k=None):
        self.window, self.placement = int(window), check_placement(placement)
        self.k, self.layer_k = check_budgets("Recent", k, layer_k)

    @classmethod
    def from_config(cls, settings: dict, thresholds=None) -> "Recent":
        return cls(settings["window"], settings["placement"], settings.get("k"), settings.get("layer_k"))

    def k_for(self, layer: int) -> int:
        return self.layer_k.get(layer, self.k or 0)

    def select(self, rows: RowBlock) -> torch.Tensor:
        valid = rows.valid.expand_as(rows.logits)  # (B, H, Q, K)
        later = valid.flip(-1).cumsum(-1).flip(-1)  # valid keys at or after each position
        return keep_whole_short_rows(valid & (later <= self.window), rows, self.k_for(rows.layer))


@dataclass
class HalfSDC:
    """Half of the dropped mass back into the denominator: what SDC('exact', scale=0.5) asks of a kernel."""

    label = "HalfSDC"

    @classmethod
    def from_config(cls, comp: dict, thresholds=None) -> "HalfSDC | None":
        return cls() if comp.get("halfsdc") else None

    def lower(self, into: KernelCompensation, placement):
        return replace(into, sdc=toptheta.SDC("exact", scale=0.5)) if placement == "pre" else into

    def check(self, sparsifier, compensations):
        if sparsifier.placement != "pre":
            raise ValueError("HalfSDC needs pre-softmax selection")


WINDOW = Parameter("window", 1, 4096, log=True, keeps_more_when_higher=True, valid="a number of keys >= 1")


@pytest.fixture(scope="module", autouse=True)
def registered():
    """Registered for this module only: other tests list the built-in names."""
    registry.register_sparsifier("recent", label="Recent", parameter=WINDOW)(Recent)
    registry.register_compensation("halfsdc", label="HalfSDC", prefers="pre")(HalfSDC)
    yield
    registry.unregister("recent")
    registry.unregister("halfsdc")


# The new sparsifier and compensation as a command line: run.py sparsifier.name=recent +sparsifier.window=4 ...
RECENT = ("sparsifier=topk", "sparsifier.name=recent", "sparsifier.window=4", "sparsifier.k=null",
          "sparsifier.layer_k=null", "sparsifier.placement=auto")
RUN = ("model=tiny-llama", "task=smoke", "task.limit=4", "baseline=false", "log_samples=false")


def test_the_registry_knows_the_built_ins_and_what_they_need():
    assert {"dense", "topk", "toptheta", "topp", "skipsoftmax", "recent"} <= set(registry.sparsifier_names())
    assert registry.sparsifier_kind("toptheta").needs_thresholds and registry.sparsifier_kind("topk").parameter is None
    assert searched_parameter({"name": "topp"}).key == "p" and searched_parameter({"name": "skipsoftmax"}).key == "lam"
    assert searched_parameter({"name": "toptheta"}) is None  # the budget k
    assert searched_parameter({"name": "toptheta", "budget": "toprho"}).key == "rho"  # calibrated to Top-ρ
    assert not registry.sparsifier_kind("dense").drops
    assert registry.labels()["toptheta"] == "Top-θ" and registry.labels()["recent"] == "Recent"
    assert [kind.name for kind in registry.active_compensations({"sdc": "exact", "vmc": True})] == ["sdc", "vmc"]
    assert registry.name_of(toptheta.TopK(4)) == "topk" and registry.name_of(Recent(4)) == "recent"
    assert registry.name_of(type("Sub", (toptheta.TopK,), {})(4)) == "other"  # a subclass may select differently
    with pytest.raises(ValueError, match="'recent' is registered already"):
        registry.register_sparsifier("recent", label="Again")(type("Again", (Recent,), {"from_config": classmethod(
            lambda cls, settings, thresholds=None: cls(1))}))
    with pytest.raises(ValueError, match="'topp' is registered already"):  # an inherited from_config is no alibi
        registry.register_sparsifier("topp", label="Again")(type("Again", (toptheta.TopP,), {}))


def test_a_typo_fails_before_anything_loads_listing_the_known_names(tmp_path):
    with pytest.raises(ValueError, match="sparsifier.name='recnet': one of dense, recent, skipsoftmax, topk"):
        pipeline.plan(cfg(*RUN, "sparsifier=topk", "sparsifier.name=recnet", f"results_dir={tmp_path}"))
    with pytest.raises(ValueError, match="comp.halfsd=True: a registered compensation: halfsdc, sdc, sdc_scale, vmc"):
        pipeline.plan(cfg(*RUN, "sparsifier=topk", "+comp.halfsd=true", f"results_dir={tmp_path}"))
    with pytest.raises(ConfigCompositionException):  # the schema has the registered keys only
        cfg(*RUN, "sparsifier=topk", "comp.halfsd=true")
    with pytest.raises(ValueError, match="sparsifier.window=None: a number of keys >= 1"):
        pipeline.plan(cfg(*RUN, *RECENT[:2], f"results_dir={tmp_path}"))
    with pytest.raises(ValueError, match="sparsifier.p=0.9: null: only sparsifier=topp reads it"):
        pipeline.plan(cfg(*RUN, *RECENT, "sparsifier.p=0.9", f"results_dir={tmp_path}"))


def test_the_new_kinds_plan_as_their_registrations_say(tmp_path):
    (spec,) = pipeline.plan(cfg(*RUN, *RECENT, "comp=vmc", "comp.halfsdc=true", f"results_dir={tmp_path}"))
    assert spec.sparsifier.settings["window"] == 4 and spec.comp.settings["halfsdc"] is True
    assert spec.sparsifier.settings["placement"] == "pre"  # placement=auto: HalfSDC prefers pre-softmax
    assert spec.label == "recent-pre" and spec.calib is None  # no thresholds: none asked for
    fitted = pipeline.plan(cfg(*RUN, *RECENT, "sparsifier.target_kept=0.5", f"results_dir={tmp_path}"))[-1]
    assert fitted.sparsifier.settings["window"] is None  # sparsifier.target_kept fits the rule's own parameter


def test_their_yaml_files_compose_into_the_schema(tmp_path):
    """conf/sparsifier/recent.yaml and conf/comp/halfsdc+vmc.yaml, here in a folder on Hydra's search path."""
    (tmp_path / "sparsifier").mkdir()
    (tmp_path / "comp").mkdir()
    (tmp_path / "sparsifier" / "recent.yaml").write_text(
        "# python run.py sparsifier=recent comp=halfsdc+vmc\nname: recent\nplacement: auto\nwindow: 4\nk: null\n"
        "layer_k: null\n")
    (tmp_path / "comp" / "halfsdc+vmc.yaml").write_text("sdc: null\nsdc_scale: 1.0\nvmc: true\nhalfsdc: true\n")
    c = cfg(*RUN, f"hydra.searchpath=[file://{tmp_path}]", "sparsifier=recent", "comp=halfsdc+vmc",
            f"results_dir={tmp_path / 'results'}")
    (spec,) = pipeline.plan(c)
    (expected,) = pipeline.plan(cfg(*RUN, *RECENT, "comp=vmc", "comp.halfsdc=true", f"results_dir={tmp_path / 'results'}"))
    assert spec.run_id == expected.run_id and spec.sparsifier.settings["window"] == 4


def _stored(results_dir) -> tuple[dict, dict, list]:
    """(summary rows by metric, the run's config, its per-sample log-likelihoods) of a results folder with one run."""
    with open(results_dir / "summary.csv", newline="") as fh:
        rows = {row["metric"]: row for row in csv.DictReader(fh)}
    (run,) = (results_dir / "runs").iterdir()
    samples = json.loads(gzip.decompress((run / "samples.json.gz").read_bytes()))
    loglik = [ll for s in samples["smoke"] for ll, _ in s["filtered_resps"]]
    return rows, json.loads((run / "config.json").read_text()), loglik


def test_a_new_sparsifier_and_compensation_run_through_run_py_as_the_library_objects_do(tmp_path):
    """recent + HalfSDC + VMC through the pipeline gives what recent + SDC('exact', 0.5) + VMC gives."""
    run = (*RUN[:-1], "log_samples=true")
    pipeline.run(cfg(*run, *RECENT, "comp=vmc", "comp.halfsdc=true", f"results_dir={tmp_path / 'new'}"))
    pipeline.run(cfg(*run, *RECENT, "comp=sdc+vmc", "comp.sdc_scale=0.5", f"results_dir={tmp_path / 'sdc'}"))
    (new, stored, new_loglik), (sdc, _, sdc_loglik) = _stored(tmp_path / "new"), _stored(tmp_path / "sdc")
    assert stored["sparsifier"]["window"] == 4 and stored["comp"]["halfsdc"] is True
    assert stored["sparsifier"]["placement"] == "pre"
    assert new_loglik == sdc_loglik and len(new_loglik) == 16  # the same kernel inputs: the same bits
    for metric, row in new.items():
        assert row["sparsifier"] == "recent" and row["run_id"] != sdc[metric]["run_id"]
        assert row["comp"] == "vmc+halfsdc" and sdc[metric]["comp"] == "sdc=exact*0.5+vmc"  # the summary names it
        for column in ("value", "kept_attention_fraction"):
            assert row[column] == sdc[metric][column], column
        assert 0 < float(row["kept_attention_fraction"]) < 1


def test_a_new_sparsifier_and_compensation_run_through_toptheta_eval():
    import lm_eval

    from toptheta.evaluation.lm_eval_adapter import evaluate_tasks
    from toptheta.models import load_model

    results = lm_eval.simple_evaluate(
        model="toptheta", model_args="pretrained=tiny-llama,sparsifier=recent,window=4,layer_k=none,comp=halfsdc+vmc",
        tasks=["smoke"], limit=2, log_samples=True, task_manager=smoke_manager())
    report = results["config"]["toptheta"]
    assert report["sparsifier"] == {"name": "recent", "k": None, "layer_k": {}, "placement": "pre", "window": 4}
    assert report["comp"] == {"sdc": None, "sdc_scale": 1.0, "vmc": True, "halfsdc": True}
    model, tokenizer, _ = load_model("tiny-llama")
    with toptheta.sparsify(model, Recent(4, "pre"), [toptheta.SDC("exact", scale=0.5), toptheta.VMC()]) as reference:
        expected = evaluate_tasks(model, tokenizer, ["smoke"], data_dir=None, num_fewshot=None, limit=2,
                                  log_samples=True)
    assert report["stats"]["smoke"]["kept_attention_fraction"] == pytest.approx(reference.kept_attention_fraction)
    assert report["stats"]["smoke"]["kept_attention_fraction"] < 1
    loglik = lambda res: [ll for s in res["samples"]["smoke"] for ll, _ in s["filtered_resps"]]  # noqa: E731
    assert loglik(results) == pytest.approx(loglik(expected), rel=1e-5)


@pytest.mark.parametrize("args,kind,value", [("sparsifier=topp,p=0.8", "TopP", 0.8),
                                             ("sparsifier=skipsoftmax,lam=0.5", "SkipSoftmax", 0.5)])
def test_toptheta_eval_serves_the_baselines_with_their_parameter(args, kind, value):
    """issue 30: toptheta-eval accepts topp (p) and skipsoftmax (lam), and runs them as the library objects."""
    import lm_eval

    from toptheta.evaluation.lm_eval_adapter import evaluate_tasks
    from toptheta.models import load_model

    results = lm_eval.simple_evaluate(model="toptheta", model_args=f"pretrained=tiny-llama,{args},layer_k=none,comp=vmc",
                                      tasks=["smoke"], limit=2, task_manager=smoke_manager())
    report = results["config"]["toptheta"]
    key = args.split(",")[1].split("=")[0]
    assert report["sparsifier"][key] == value and report["sparsifier"]["k"] is None
    assert report["calibration"] is None  # no thresholds: the rule has its own parameter
    model, tokenizer, _ = load_model("tiny-llama")
    with toptheta.sparsify(model, getattr(toptheta, kind)(value, "post"), [toptheta.VMC()]) as reference:
        evaluate_tasks(model, tokenizer, ["smoke"], data_dir=None, num_fewshot=None, limit=2)
    assert report["stats"]["smoke"]["kept_attention_fraction"] == pytest.approx(reference.kept_attention_fraction)
    assert report["stats"]["smoke"]["kept_attention_fraction"] < 1


# ---- a generation task registered here alone ----------------------------------------------------------------------

def _first_tokens(task: dict, model, tokenizer, *, chat_template: bool, stats=None, **_) -> dict:
    """A task of our own: greedy first token of three fixed prompts; scores 1 where it is the prompt's last token."""
    hits = []
    for prompt in ([1, 5, 6, 7], [1, 8, 9, 10, 11], [1, 12, 13]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
        hits.append(float(int(logits.argmax()) == prompt[-1]))
    mean = sum(hits) / len(hits)
    assert stats is not None  # called inside the run's sparsify block
    return {"results": {task["name"]: {"acc,none": mean, "acc_stderr,none": 0.0}}, "samples": []}


def test_a_new_generation_task_runs_through_run_py_by_its_kind(tmp_path):
    registry.register_task_kind("first-tokens", before_load=lambda task: seen.append(task["kind"]))(_first_tokens)
    seen = []
    try:
        assert "first-tokens" in registry.task_kind_names()
        pipeline.run(cfg(*RUN, "sparsifier=topk", "task.kind=first-tokens", "task.name=first_tokens", "task.batch_size=1",
                         "task.metric=acc", f"results_dir={tmp_path}"))
        assert seen == ["first-tokens"]  # asked before the model loaded
        rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
        assert [r["task"] for r in rows] == ["first_tokens"] and rows[0]["sparsifier"] == "topk"
        assert 0.0 <= float(rows[0]["value"]) <= 1.0
    finally:
        registry.unregister_task_kind("first-tokens")
    with pytest.raises(ValueError, match="task.kind='first-tokens': one of lm_eval, humaneval, passkey, ruler"):
        pipeline.plan(cfg(*RUN, "sparsifier=topk", "task.kind=first-tokens", f"results_dir={tmp_path}"))


class LayerWindows(Recent):
    """Recent with a window per layer (option ``windows``): its own checks run where the built-ins' do."""

    @classmethod
    def check_options(cls, options: dict) -> None:
        windows = options.get("windows")
        if windows is not None and not all(isinstance(w, int) and w > 0 for w in windows):
            raise ValueError(f"sparsifier.windows must be positive integers, e.g. [4, 8]; got {list(windows)}")

    @classmethod
    def check_model(cls, settings: dict, num_layers: int, num_heads, model_name: str) -> None:
        if settings.get("windows") is not None and len(settings["windows"]) != num_layers:
            raise ValueError(f"sparsifier.windows needs one window per layer: {model_name} has {num_layers}")


def test_a_rules_own_checks_run_before_the_work(tmp_path):
    from toptheta.builders import check_sparsifies

    registry.register_sparsifier("windows", label="Windows", parameter=WINDOW, options=("windows",))(LayerWindows)
    try:
        args = (*RUN, *RECENT[:1], "sparsifier.name=windows", "sparsifier.window=4", *RECENT[3:],
                f"results_dir={tmp_path}")
        with pytest.raises(ValueError, match=r"sparsifier.windows must be positive integers, e.g. \[4, 8\]; got \[4, -1\]"):
            pipeline.plan(cfg(*args, "sparsifier.windows=[4,-1]"))
        (spec,) = pipeline.plan(cfg(*args, "sparsifier.windows=[4,8]"))
        with pytest.raises(ValueError, match="one window per layer: tiny has 3"):
            check_sparsifies(dict(spec.sparsifier.settings), 3, 100, "tiny", 4)
        check_sparsifies(dict(spec.sparsifier.settings), 2, 100, "tiny", 4)
        with pytest.raises(ValueError, match="sparsifier.windows=.*null: only sparsifier=windows reads it"):
            pipeline.plan(cfg(*RUN, *RECENT, "sparsifier.windows=[4,8]", f"results_dir={tmp_path}"))
    finally:
        registry.unregister("windows")

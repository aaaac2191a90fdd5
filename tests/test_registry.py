"""Sparsifiers and compensations are found by name (toptheta/registry.py): one defined in this file alone runs through
run.py's pipeline and through toptheta-eval, with nothing else edited, and gives what the built-in pieces it mirrors
give: a Top-k that keeps half its budget (k = 8 keeps 4) with a twin of VMC equals Top-k at k = 4 with VMC."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

import toptheta
from test_experiments import compose_job
from test_lm_eval_cli import _smoke_manager
from toptheta import pipeline
from toptheta.compensation import KernelCompensation
from toptheta.registry import COMPENSATIONS, SPARSIFIERS, Registry
from toptheta.results.summary import load_summary


class HalfTopK(toptheta.TopK):
    """Top-k keeping half of its budget: k = 8 keeps the 4 largest."""

    label = "Top-k/2"

    @classmethod
    def from_settings(cls, settings: dict, thresholds=None) -> "HalfTopK":
        return cls(max(1, settings["k"] // 2), settings["placement"], settings.get("layer_k"))


@dataclass
class VMCTwin:
    """VMC under another name and type: what it asks of a kernel is all the kernels read."""

    label = "VMC twin"

    def lower(self, into: KernelCompensation, placement):
        return replace(into, vmc=placement is not None)

    def check(self, sparsifier, compensations):
        if sparsifier.placement != "post":
            raise ValueError("VMCTwin: post-softmax selection only")


@pytest.fixture
def registered():
    SPARSIFIERS.register("test_half_topk")(HalfTopK)
    COMPENSATIONS.register("test_vmc_twin")(VMCTwin)
    yield
    SPARSIFIERS.unregister("test_half_topk")
    COMPENSATIONS.unregister("test_vmc_twin")


def test_a_registry_names_what_it_knows_and_refuses_a_second_class_under_one_name():
    kinds = Registry("widget")
    kinds.register("a")(type("A", (), {}))
    with pytest.raises(ValueError, match="unknown widget 'b'; known: a"):
        kinds.get("b")
    with pytest.raises(ValueError, match="registered already"):
        kinds.register("a")(type("A2", (), {}))
    assert SPARSIFIERS.names()[:1] == ["dense"] and {"topk", "toptheta", "topp", "skipsoftmax"} <= set(SPARSIFIERS.names())
    assert SPARSIFIERS.get("toptheta").needs_thresholds and SPARSIFIERS.get("topp").parameter == "p"


def test_a_sparsifier_and_a_compensation_of_this_file_run_through_run_py(registered, tmp_path):
    common = ["model=tiny-llama", "task=smoke", "task.limit=4", "sparsifier=topk", "sparsifier.layer_k=null"]
    pipeline.run(compose_job([*common, "sparsifier.name=test_half_topk", "sparsifier.k=8", "comp=none",
                              "comp.extra=[test_vmc_twin]"], tmp_path))
    pipeline.run(compose_job([*common, "sparsifier.k=4", "comp=vmc"], tmp_path))
    summary = load_summary(tmp_path)
    ours, builtin = summary[summary["sparsifier"] == "test_half_topk"], summary[summary["sparsifier"] == "topk"]
    assert len(ours) and len(ours) == len(builtin)
    assert set(ours["comp"]) == {"test_vmc_twin"} and set(builtin["comp"]) == {"vmc"}
    for column in ("value", "kept_attention_fraction"):
        assert list(ours[column].astype(float)) == list(builtin[column].astype(float)), column
    assert float(ours["kept_attention_fraction"].iloc[0]) < 1.0
    with pytest.raises(ValueError, match="comp.extra='nothing'"):
        pipeline.plan(compose_job([*common, "comp.extra=[nothing]"], tmp_path))


def test_a_sparsifier_and_a_compensation_of_this_file_run_through_toptheta_eval(registered):
    import lm_eval

    from toptheta.evaluation.lm_eval_model import TopThetaLM

    def run(**args):
        lm = TopThetaLM(pretrained="tiny-llama", layer_k="none", **args)
        results = lm_eval.simple_evaluate(model=lm, tasks=["smoke"], limit=4, task_manager=_smoke_manager())
        stats = results["config"]["toptheta"]["stats"]["smoke"]
        return results["results"]["smoke"], stats["kept_attention_fraction"]

    ours = run(sparsifier="test_half_topk", k=8, comp="test_vmc_twin")
    builtin = run(sparsifier="topk", k=4, comp="vmc")
    assert ours == builtin and ours[1] < 1.0

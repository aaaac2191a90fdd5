"""Matched sparsity (sparsifier.target_kept, issue 28) and fixed exemplars (task.fewshot_sampler, issue 27) as run
settings: Top-k's kept fraction from row lengths is exactly what the kernel counts, targets land within their
tolerance, unreachable targets are refused before evaluation, and both settings enter the run id only when set."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import toptheta
from conftest import cfg, sparse_rows
from toptheta import pipeline
from toptheta.calibration import target_kept
from toptheta.models import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("k,layer_k", [(1, None), (3, {0: 9}), (8, {1: 2}), (40, None)])
def test_topk_fraction_from_lengths_is_what_the_kernel_counts(k, layer_k):
    model = build_tiny_model("llama")
    lengths = [5, 17, 33, 12]
    torch.manual_seed(0)
    with toptheta.sparsify(model, toptheta.TopK(k=k, placement="post", layer_k=layer_k), []) as stats:
        for n in lengths:
            model(input_ids=torch.randint(0, 250, (1, n)))
    assert target_kept.topk_kept_fraction(lengths, k, layer_k, 2) == pytest.approx(stats.kept_attention_fraction,
                                                                                   abs=1e-12)


@pytest.mark.parametrize("k,layer_k", [(1, None), (3, {0: 12}), (6, {1: 2}), (40, None)])
def test_topk_fraction_counts_sliding_window_layers_as_the_kernel_does(k, layer_k):
    """Gemma-3's sliding-window layers hold a row to the window's keys: the closed form takes each layer's window
    (model_facts.layer_windows), as the statistics count them; without the windows it would count too few."""
    from toptheta.evaluation.model_facts import layer_windows

    model = build_tiny_model("gemma3", num_layers=4)
    windows = layer_windows(model)
    assert any(w is not None for w in windows) and any(w is None for w in windows)
    lengths = [5, 17, 33, 12]
    torch.manual_seed(0)
    with toptheta.sparsify(model, toptheta.TopK(k=k, placement="post", layer_k=layer_k), []) as stats:
        for n in lengths:
            model(input_ids=torch.randint(0, 250, (1, n)))
    kept = target_kept.topk_kept_fraction(lengths, k, layer_k, 4, windows)
    assert kept == pytest.approx(stats.kept_attention_fraction, abs=1e-12)
    if k < max(w for w in windows if w):
        assert target_kept.topk_kept_fraction(lengths, k, layer_k, 4) < kept


def test_topk_k_for_lands_on_the_target_or_refuses():
    lengths = [800, 860, 900]
    for target, layer_k in ((1 / 3, {0: 512, 1: 512}), (1 / 10, {0: 512, 1: 512}), (1 / 20, {0: 128, 1: 128})):
        k = target_kept.topk_k_for(lengths, target, layer_k, 30)
        assert abs(target_kept.topk_kept_fraction(lengths, k, layer_k, 30) / target - 1) < 0.05
    with pytest.raises(target_kept.Unreachable, match="layer_k"):  # layers 0-1 at 512 alone keep ~0.056
        target_kept.topk_k_for(lengths, 1 / 20, {0: 512, 1: 512}, 30)


def test_resolve_k_corrects_for_a_method_that_keeps_more():
    lengths = [300, 320]
    keeps_more = lambda k: 1.3 * target_kept.topk_kept_fraction(lengths, k, None, 4)  # noqa: E731 (like Top-θ pre)
    k, kept, tried = target_kept.resolve_k(0.1, lengths, None, 4, keeps_more)
    assert abs(kept / 0.1 - 1) <= target_kept.TOLERANCE and len(tried) >= 2
    assert k < target_kept.topk_k_for(lengths, 0.1, None, 4)
    windows = [64, None, 64, None]  # with sliding windows: the same correction, from the windowed Top-k fraction
    keeps_more = lambda k: 1.3 * target_kept.topk_kept_fraction(lengths, k, None, 4, windows)  # noqa: E731
    k, kept, tried = target_kept.resolve_k(0.1, lengths, None, 4, keeps_more, windows=windows)
    assert abs(kept / 0.1 - 1) <= target_kept.TOLERANCE


@pytest.mark.parametrize("sparsifier", [("sparsifier=topk", "comp=vmc", "sparsifier.placement=post"),
                                        ("sparsifier=toptheta", "comp=vmc", "sparsifier.placement=post")])
def test_target_kept_run_lands_within_ten_percent(tmp_path, sparsifier):
    rows = sparse_rows(tmp_path, *sparsifier, "sparsifier.target_kept=0.3", "sparsifier.layer_k=null",
                "task.fewshot_sampler=first_n")
    assert rows and all(abs(float(r["kept_attention_fraction"]) / 0.3 - 1) <= 0.1 for r in rows)
    assert {r["target_kept"] for r in rows} == {"0.3"} and all(int(r["k"]) >= 1 for r in rows)
    assert {r["fewshot_sampler"] for r in rows} == {"first_n"}
    stats = json.loads((tmp_path / "runs" / rows[0]["run_id"] / "stats.json").read_text())
    assert stats["target"]["k"] == int(rows[0]["k"]) and stats["target"]["target_kept"] == 0.3
    assert float(rows[0]["kept_attention_fraction_sparsified"]) == pytest.approx(float(rows[0]["kept_attention_fraction"]))


def test_unreachable_target_is_refused_before_evaluating(tmp_path, monkeypatch):
    evaluated = []
    monkeypatch.setattr(pipeline, "evaluate", lambda *a, **kw: evaluated.append(1))
    with pytest.raises(target_kept.Unreachable, match="cannot be reached"):
        sparse_rows(tmp_path, "sparsifier=topk", "comp=vmc", "sparsifier.placement=post", "sparsifier.target_kept=0.05",
             "sparsifier.layer_k={0:512}", "baseline=false")
    assert not evaluated


@pytest.mark.parametrize("override,message", [("sparsifier.target_kept=1.5", "a fraction in (0, 1)"),
                                              ("sparsifier.target_kept=0", "a fraction in (0, 1)")])
def test_bad_targets_fail_before_anything_loads(tmp_path, override, message):
    with pytest.raises(ValueError, match="invalid configuration") as err:
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", "sparsifier=topk", override))
    assert message in str(err.value)


MULTIPLE_CHOICE = sorted(p.stem for p in (ROOT / "conf" / "task").glob("*.yaml")
                         if "kind: lm_eval" in p.read_text() and "longbench" not in p.stem and p.stem != "lm_eval")


@pytest.mark.parametrize("task", MULTIPLE_CHOICE)
def test_first_n_composes_in_every_multiple_choice_task_and_changes_the_run_id(tmp_path, task):
    base = ("model=tiny-llama", f"task={task}", f"results_dir={tmp_path}", "data_dir=auto")
    plain = pipeline.plan(cfg(*base))
    fixed = pipeline.plan(cfg(*base, "task.fewshot_sampler=first_n"))
    assert "fewshot_sampler" not in plain[-1].task.settings
    assert fixed[-1].task.settings["fewshot_sampler"] == "first_n"
    assert all(a.run_id != b.run_id for a, b in zip(plain, fixed))
    if fixed[-1].calib is not None:  # Top-θ calibrates on rows built the same way
        assert fixed[-1].calib.fewshot_sampler == "first_n"
    off = pipeline.plan(cfg(*base, "task.prefix_cache=false"))
    assert [s.run_id for s in off] == [s.run_id for s in plain]  # how scoring runs, not what it scores
    assert off[-1].task.settings["prefix_cache"] is False


def test_a_v_row_target_is_met_in_decode_steps_and_names_its_measure(tmp_path):
    """sparsifier.target_measure=vrows: k is fitted on the V rows read while decoding after the calibration rows
    (the generation tasks' measure), recorded with the run, and part of the run id; null keeps the old ids."""
    overrides = ("model=tiny-llama", "task=smoke", "sparsifier=topk", "comp=vmc", "sparsifier.placement=post",
                 "sparsifier.layer_k=null", "sparsifier.target_kept=0.4", "baseline=false", "log_samples=false")
    (vrow_spec,) = pipeline.plan(cfg(*overrides, "sparsifier.target_measure=vrows", f"results_dir={tmp_path}"))
    (attention_spec,) = pipeline.plan(cfg(*overrides, f"results_dir={tmp_path}"))
    assert vrow_spec.run_id != attention_spec.run_id and "target_measure" not in attention_spec.sparsifier.settings
    pipeline.run(cfg(*overrides, "sparsifier.target_measure=vrows", f"results_dir={tmp_path}"))
    stats = json.loads((tmp_path / "runs" / vrow_spec.run_id / "stats.json").read_text())
    record = stats["target"]
    assert record["target_measure"] == "vrows" and record["k"] >= 1
    assert abs(record["calibration_kept"] / 0.4 - 1) <= 2 * target_kept.TOLERANCE, record
    with pytest.raises(ValueError, match="sparsifier.target_measure"):
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", "sparsifier=topk", "sparsifier.target_measure=vrows",
                          f"results_dir={tmp_path}"))


V_ROW_SEARCH = ("model=tiny-llama", "task=smoke", "sparsifier=toptheta", "comp=vmc", "sparsifier.placement=post",
                "sparsifier.layer_k=null", "sparsifier.target_kept=0.4", "sparsifier.target_measure=vrows",
                "calib.num_samples=12", "baseline=false", "log_samples=false")


def _top_theta_v_row_search(tmp_path, monkeypatch):
    """(Top-θ's spec, the Top-k spec of the same setting, tiny-llama, its tokenizer) for a V-row target of 0.4 on 4
    decoded rows, with the thresholds and measures cached under tmp_path."""
    from toptheta import matched
    from toptheta.models.loading import load_model

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(matched, "VROW_SEQUENCES", 4)
    overrides = (*V_ROW_SEARCH, f"results_dir={tmp_path}")
    (spec,) = pipeline.plan(cfg(*overrides))
    (topk,) = pipeline.plan(cfg(*overrides, "sparsifier=topk"))
    model, tokenizer, _ = load_model("tiny-llama")
    return spec, topk, model, tokenizer


def test_top_theta_v_row_search_starts_where_top_k_lands(tmp_path, monkeypatch):
    """Each k a Top-θ V-row search tries is a calibration (hours on long documents), so Top-k's fit (decodes only)
    gives its first k and slope: the first calibration is at Top-k's k, and the record keeps Top-k's fit. Measures
    are kept (matched.measure_file), so Top-k's tries are read back from the Top-k run's, never decoded twice."""
    from toptheta import matched, thresholds_cache

    spec, topk, model, tokenizer = _top_theta_v_row_search(tmp_path, monkeypatch)
    calibrated = []
    obtain = thresholds_cache.obtain_thresholds

    def counted(spec, model, tokenizer):
        calibrated.append(spec.sparsifier.k)
        return obtain(spec, model, tokenizer)
    monkeypatch.setattr(matched, "obtain_thresholds", counted)
    decodes = []
    decode_after = matched.decode_after
    monkeypatch.setattr(matched, "decode_after", lambda *a, **kw: decodes.append(1) or decode_after(*a, **kw))
    _, topk_record = matched.resolve_target(topk, model, tokenizer)  # the Top-k run of the same setting
    assert len(decodes) == len(topk_record["tried"]) and not calibrated
    resolved, record = matched.resolve_target(spec, model, tokenizer)
    start = record["start"]
    assert start["from"] == "topk" and start["k"] in [k for k, _ in start["tried"]] and start["slope"] > 0
    assert start["tried"] == topk_record["tried"]  # read back, not decoded again: only Top-θ's tries decode
    assert len(decodes) == len(topk_record["tried"]) + len(record["tried"])
    assert calibrated[0] == start["k"] == record["tried"][0][0]  # Top-θ's first calibration: Top-k's k
    assert calibrated == [k for k, _ in record["tried"]]  # no calibration for Top-k's tries
    assert resolved.sparsifier.k == record["k"] and abs(record["calibration_kept"] / 0.4 - 1) <= 2 * target_kept.TOLERANCE
    # resolved again (a rerun, the clamp and fit runs of one setting): every measure is read back
    assert matched.resolve_target(spec, model, tokenizer)[1] == record
    assert len(decodes) == len(topk_record["tried"]) + len(record["tried"]) and len(calibrated) == len(record["tried"])


def test_target_task_names_the_rows_a_target_is_resolved_on(tmp_path):
    """sparsifier.target_task: the rows target_kept is resolved on, apart from the thresholds' calibration task
    (HumanEval with ARC-calibrated Top-θ fitted on HumanEval-disjoint code); unset, the ids stay as they were."""
    base = ("model=tiny-llama", "task=humaneval", "sparsifier=toptheta", "comp=vmc", "sparsifier.target_kept=0.3",
            "sparsifier.target_measure=vrows", "calib.task=arc_challenge", "calib.num_fewshot=5",
            f"results_dir={tmp_path}", "task.allow_unsafe_code=true")
    plain = pipeline.plan(cfg(*base))[-1]
    code = pipeline.plan(cfg(*base, "sparsifier.target_task=python_code"))[-1]
    # unset on HumanEval: its own prompt shape (registry.TaskKindEntry.target_prompts), not the calibration task's rows
    assert (plain.target.task, plain.target.kind) == ("humaneval", "humaneval")
    assert "target_task" not in plain.sparsifier.settings
    assert code.target.task == "python_code" and code.calib.task == "arc_challenge" and code.run_id != plain.run_id
    assert code.target.num_fewshot == 5  # built as the calibration rows are
    with pytest.raises(ValueError, match="sparsifier.target_task"):
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", "sparsifier=topk", "sparsifier.target_task=python_code",
                          f"results_dir={tmp_path}"))
    with pytest.raises((ValueError, FileNotFoundError), match="no_such_task"):
        pipeline.plan(cfg(*base, "sparsifier.target_task=no_such_task"))


def test_humaneval_target_prompts_are_shaped_as_its_own_and_none_is_a_problem():
    """HumanEval's target rows: python_code functions (signature and docstring) in HumanEval's instruction, as long
    as HumanEval's prompts (quantile by quantile), never one of the 164 problems."""
    from toptheta.evaluation.generation import HUMANEVAL_INSTRUCTION, humaneval_prompts, humaneval_target_prompts
    from toptheta.evaluation.greedy import encode_prompt
    from toptheta.evaluation.humaneval import load_problems
    from toptheta.evaluation.tasks.static.python_code_data import python_code_documents
    from toptheta.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    chat = humaneval_target_prompts({}, tok, 16, 0, chat_template=True)
    bare = humaneval_target_prompts({}, tok, 16, 0, chat_template=False)
    assert all(p.startswith("def ") and p.count("\n") >= 2 for p in bare), bare  # a signature, then its docstring
    assert all(c.startswith(HUMANEVAL_INSTRUCTION.split("{")[0]) for c in chat) and len(set(chat)) == 16
    assert humaneval_target_prompts({}, tok, 16, 0, chat_template=True) == chat  # deterministic
    problems = [p.prompt for p in load_problems().values()]
    assert not set(problems) & set(bare)

    def tokens(prompts):
        return sorted(len(encode_prompt(tok, p, chat_template=True)) for p in prompts)
    ours, theirs = np.array(tokens(chat)), np.array(tokens(humaneval_prompts(problems, chat_template=True)))
    everything = np.array(tokens(humaneval_prompts([d["prompt"] for d in python_code_documents("train")],
                                                   chat_template=True)))
    assert abs(np.median(ours) - np.median(theirs)) < abs(np.median(everything) - np.median(theirs)) / 2
    assert abs(ours.mean() / theirs.mean() - 1) < 0.15
    with pytest.raises(ValueError, match="python_code's train split has"):
        humaneval_target_prompts({}, tok, 1000, 0, chat_template=True)


def test_a_matched_humaneval_run_decodes_its_target_rows_as_the_task_does(tmp_path, monkeypatch):
    """target_measure=vrows on HumanEval: the V rows are counted while its target prompts are decoded to the end of
    each answer (registry.TaskKindEntry.target_decode), not for 8 tokens, and the record says so."""
    from toptheta import matched, registry
    from toptheta.evaluation import generation
    from toptheta.evaluation.greedy import encode_prompt
    from toptheta.models.loading import load_model

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(matched, "VROW_SEQUENCES", 1)  # one prompt: task.max_length sets its new tokens
    model, tokenizer, _ = load_model("tiny-llama")
    overrides = ["model=tiny-llama", "task=humaneval", "sparsifier=topk", "comp=vmc", "sparsifier.placement=post",
                 "sparsifier.layer_k=null", "sparsifier.target_kept=0.5", "sparsifier.target_measure=vrows",
                 "baseline=false", "task.allow_unsafe_code=true", f"results_dir={tmp_path}"]
    (spec,) = pipeline.plan(cfg(*overrides))
    chat = spec.model.chat_template
    prompts = generation.humaneval_target_prompts({}, tokenizer, 1, 0, chat_template=chat)
    longest = max(len(encode_prompt(tokenizer, p, chat_template=chat)) for p in prompts)
    (spec,) = pipeline.plan(cfg(*overrides, f"task.max_length={longest + 20}"))  # ≤ 20 new tokens each
    assert (spec.target.task, spec.target.kind) == ("humaneval", "humaneval")
    entry, decoded = registry.task_kind("humaneval"), []

    def watched(task, model, tokenizer, prompts, *, chat_template):
        out = generation.humaneval_decode(task, model, tokenizer, prompts, chat_template=chat_template)
        decoded.append((prompts, [o["prompt_tokens"] for o in out], [len(tokenizer.encode(o["text"])) for o in out]))
    monkeypatch.setitem(registry._TASK_KINDS, "humaneval", dataclasses.replace(entry, target_decode=watched))
    resolved, record = matched.resolve_target(spec, model, tokenizer)
    assert decoded and all(p == prompts for p, _, _ in decoded)
    prompt_tokens, new_tokens = decoded[0][1], decoded[0][2]
    assert max(prompt_tokens) == longest and max(new_tokens) > matched.VROW_TOKENS  # past the 8 tokens of before
    assert record["decoded"] == "as the task" and record["target_measure"] == "vrows"
    assert resolved.sparsifier.k == record["k"] >= 1 and record["calibration_sequences"] == 1, record
    (short,) = pipeline.plan(cfg(*overrides, f"task.max_length={longest}"))  # no room for a token: said, with the fix
    with pytest.raises(ValueError, match="raise task.max_length"):
        matched.resolve_target(short, model, tokenizer)


@pytest.mark.parametrize("overrides,message", [
    (("sparsifier.target_tolerance=0.02",), "with sparsifier.target_kept"),
    (("sparsifier.target_kept=0.3", "sparsifier.target_tolerance=0.5"), "a relative tolerance in (0, 0.5)"),
    (("sparsifier.target_kept=0.3", "sparsifier.target_tolerance=0"), "a relative tolerance in (0, 0.5)")])
def test_a_bad_target_tolerance_fails_before_anything_loads(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="sparsifier.target_tolerance") as err:
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", "sparsifier=topk", *overrides))
    assert message in str(err.value)


def test_target_tolerance_is_how_close_the_fit_comes_and_enters_the_run_id_only_when_set(tmp_path, monkeypatch):
    """sparsifier.target_tolerance: the search is given it (and records it), it changes the run id only when set, and
    the kept fractions a search measures are shared with searches at another tolerance (matched.measure_file)."""
    from toptheta import matched

    base = ("model=tiny-llama", "task=smoke", "sparsifier=topk", "comp=vmc", "sparsifier.placement=post",
            "sparsifier.layer_k=null", "sparsifier.target_kept=0.3", "task.fewshot_sampler=first_n",
            f"results_dir={tmp_path}")
    (default,), (tight,) = (pipeline.plan(cfg(*base, *extra))[-1:] for extra in ((), ("sparsifier.target_tolerance=0.03",)))
    assert "target_tolerance" not in default.sparsifier.settings and tight.run_id != default.run_id
    model = build_tiny_model()
    assert matched.measure_file(tight.with_sparsifier(k=5), model, False) == \
        matched.measure_file(default.with_sparsifier(k=5), model, False)
    given = []
    resolve_k = matched.resolve_k
    monkeypatch.setattr(matched, "resolve_k", lambda *a, **kw: given.append(kw["tolerance"]) or resolve_k(*a, **kw))
    rows = sparse_rows(tmp_path, *base[2:-1], "sparsifier.target_tolerance=0.03", "baseline=false")
    record = json.loads((tmp_path / "runs" / rows[0]["run_id"] / "stats.json").read_text())["target"]
    assert given == [0.03] and record["target_tolerance"] == 0.03
    assert abs(record["calibration_kept"] / 0.3 - 1) <= 0.03


def test_top_theta_v_row_search_starts_at_a_calibrated_k_near_top_ks(tmp_path, monkeypatch):
    """Thresholds already calibrated at a k within a factor 1.5 of Top-k's (another run's, a killed search's) start
    Top-θ's search there: that try decodes without calibrating. A k farther off, or none, leaves Top-k's k first."""
    from toptheta import matched, thresholds_cache

    spec, topk, model, tokenizer = _top_theta_v_row_search(tmp_path, monkeypatch)
    k0 = matched.resolve_target(topk, model, tokenizer)[1]["k"]
    assert k0 >= 2  # so that k0 + 1 is within the factor
    near, far = k0 + 1, math.floor(k0 * matched.NEAR_START) + 1
    for k in (near, far):  # another run calibrated these
        thresholds_cache.obtain_thresholds(spec.with_sparsifier(k=k), model, tokenizer)
    calibrated = []
    calibrate = thresholds_cache.calibrate_on_task
    monkeypatch.setattr(thresholds_cache, "calibrate_on_task",
                        lambda *a, **kw: calibrated.append(kw["k"]) or calibrate(*a, **kw))
    resolved, record = matched.resolve_target(spec, model, tokenizer)
    assert record["start"]["k"] == k0 and record["start"]["calibrated"] == near == record["tried"][0][0]
    assert near not in calibrated and far not in calibrated
    assert len(calibrated) == len({k for k, _ in record["tried"]} - {near, far})
    assert abs(record["calibration_kept"] / 0.4 - 1) <= 2 * target_kept.TOLERANCE


def test_top_theta_v_row_search_starts_at_a_k_calibrated_under_another_spelling(tmp_path, monkeypatch):
    """Thresholds filed only under their sequences (a run with calib.max_length spelled out as tiny-llama's 512
    calibrated them) count as calibrated for the start: the search begins there and loads them, no forward."""
    from toptheta import matched, thresholds_cache

    spec, topk, model, tokenizer = _top_theta_v_row_search(tmp_path, monkeypatch)
    k0 = matched.resolve_target(topk, model, tokenizer)[1]["k"]
    near = k0 + 1
    (spelled,) = pipeline.plan(cfg(*V_ROW_SEARCH, "calib.max_length=512", f"results_dir={tmp_path}"))
    spelled = spelled.with_sparsifier(k=near)
    assert thresholds_cache.thresholds_path(spelled, model) != thresholds_cache.thresholds_path(
        spec.with_sparsifier(k=near), model)
    thresholds_cache.obtain_thresholds(spelled, model, tokenizer)
    assert not thresholds_cache.thresholds_path(spec.with_sparsifier(k=near), model).is_file()
    calibrated = []
    calibrate = thresholds_cache.calibrate_on_task
    monkeypatch.setattr(thresholds_cache, "calibrate_on_task",
                        lambda *a, **kw: calibrated.append(kw["k"]) or calibrate(*a, **kw))
    record = matched.resolve_target(spec, model, tokenizer)[1]
    assert record["start"]["calibrated"] == near == record["tried"][0][0] and near not in calibrated


def test_calibrated_start_takes_the_nearest_ready_k_within_the_factor(monkeypatch):
    from types import SimpleNamespace

    from toptheta import matched
    from toptheta.registry import Parameter

    for ready, expected in [((), 40), ((40, 44), 40), ((44, 37), 37), ((26, 61, 100), 40), ((55, 29), 55), ((52, 31), 31),
                            ((36, 44), 44)]:
        monkeypatch.setattr(matched, "measure_file", lambda spec, model, as_task: Path("/nonexistent/x.json"))
        start = matched.calibrated_start(40, Parameter("k", 1, 500, log=True, keeps_more_when_higher=True),
                                         lambda k: SimpleNamespace(k=k), None, False,
                                         lambda spec, ready=ready: spec.k in ready)
        assert start == expected, (ready, start)

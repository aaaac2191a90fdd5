"""The ruler suite (evaluation/ruler.py, ruler_run.py): deterministic for a seed, prompts at their target length,
every planted answer in its prompt, haystacks shared by their prompts, scorers that accept the planted answer and
refuse a near miss, and a tiny-llama run through the pipeline with statistics per length and sub-task."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter

import pytest
import torch

import toptheta
from conftest import cfg
from toptheta.evaluation.passkey import FILLER_SENTENCES
from toptheta.evaluation.ruler import SUBTASKS, RulerSettings, build_ruler_records, named_items, score_ruler


class WordPieceTokenizer:
    """Offline stand-in for a real tokenizer: words and punctuation marks are tokens, plus a BOS."""

    def encode(self, text: str) -> list[int]:
        return [0] + [hash(t) % 50_000 + 1 for t in re.findall(r"\w+|[^\w\s]", text)]


TOK = WordPieceTokenizer()
# Few planted items, so that prompts of a few hundred byte-level tokens hold them.
SMALL = {"queries_per_haystack": 2, "distractors": 2, "keys": 2, "values": 2, "chains": 2, "hops": 1, "words": 2,
         "word_repeats": 4, "rare_repeats": 1}


def records(length=1024, n=8, seed=0, **knobs):
    return build_ruler_records(TOK, lengths=(length,), prompts_per_length=n, seed=seed, settings=RulerSettings(**knobs))


def by(recs, subtask):
    return [r for r in recs if r["subtask"] == subtask]


def body(record) -> str:
    """The prompt before its question (the haystack: introduction, filler and planted statements)."""
    return record["prompt"][:record["prompt"].rindex("\n\n")]


def test_same_seed_same_prompts_other_seed_other_prompts():
    a, b, c = records(seed=3), records(seed=3), records(seed=4)
    assert a == b
    assert [r["id"] for r in a] == [r["id"] for r in c]  # ids name the length, sub-task, haystack and query
    for x, y in zip(a, c):
        assert x["prompt"] != y["prompt"] and x["answer"] != y["answer"]
    assert len({r["id"] for r in a}) == len(a) == 8


def test_prompts_of_a_length_are_dealt_to_the_subtasks_in_turn_and_grouped_by_haystack():
    recs = records(length=2048, n=50)
    assert [len(by(recs, s)) for s in SUBTASKS] == [13, 13, 12, 12]  # 50 prompts per length
    haystacks = Counter(r["haystack"] for r in recs)
    assert sorted(haystacks[h] for h in haystacks if "multikey" in h) == [1, 4, 4, 4]  # 4 queries per haystack
    assert set(haystacks[h] for h in haystacks if "cwe" in h) == {1}  # a list is its own answer: never shared
    assert [r["new_tokens"] for r in recs[:1]] == [RulerSettings().new_tokens("niah_multikey")]
    only = build_ruler_records(TOK, lengths=(1024, 2048), prompts_per_length=3, settings=RulerSettings(subtasks=["vt"]))
    assert [(r["target_tokens"], r["subtask"]) for r in only] == [(1024, "vt")] * 3 + [(2048, "vt")] * 3


@pytest.mark.parametrize("target", [1024, 4096, 16384])
def test_prompts_hit_their_target_length_within_a_sentence(target):
    for record in records(length=target):
        assert record["length_tokens"] == len(TOK.encode(record["prompt"]))
        assert target - 16 <= record["length_tokens"] <= target, record["id"]
        assert record["target_tokens"] == target


def test_every_planted_answer_is_in_its_prompt_and_the_distractors_too():
    settings = RulerSettings()
    recs = records(length=4096, n=16)
    for r in by(recs, "niah_multikey"):
        needles = re.findall(r"One of the special magic numbers for (\w+) is: (\d{7})\.", r["prompt"])
        assert len(needles) == settings.distractors + 1 == len({k for k, _ in needles})  # one per key
        key = re.search(r"magic number for (\w+) mentioned", r["prompt"]).group(1)
        assert dict(needles)[key] == r["answer"][0] and sorted(v for _, v in needles) == sorted(r["universe"])
    for r in by(recs, "niah_multivalue"):
        needles = re.findall(r"magic numbers for (\w+) is: (\d{7})\.", r["prompt"])
        assert Counter(k for k, _ in needles) == Counter({k: settings.values for k, _ in needles})
        assert len(set(k for k, _ in needles)) == settings.keys
        key = re.search(r"magic numbers for (\w+) mentioned", r["prompt"]).group(1)
        assert sorted(r["answer"]) == sorted(v for k, v in needles if k == key) and len(r["answer"]) == settings.values
    for r in by(recs, "vt"):
        value = re.search(r"assigned the value (\d+) in the text", r["prompt"]).group(1)
        chain = r["answer"]
        assert len(chain) == settings.hops + 1
        at = [body(r).index(f"VAR {chain[0]} = {value}.")]  # the chain's assignments, in order
        at += [body(r).index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
        assert at == sorted(at)
        assert len(re.findall(r"VAR [A-Z]{5} = ", r["prompt"])) == settings.chains * (settings.hops + 1)
    for r in by(recs, "cwe"):
        words = Counter(re.findall(r"\d+\. ([a-z]+)", r["prompt"]))
        assert {w: words[w] for w in r["answer"]} == {w: settings.word_repeats for w in r["answer"]}
        assert set(words.values()) == {settings.word_repeats, settings.rare_repeats}
        assert len(r["answer"]) == settings.words and set(words) == set(r["universe"])
    assert not re.search(r"\d|\b[A-Z]{5}\b", " ".join(FILLER_SENTENCES))  # nothing in the filler can be an item


def test_a_haystack_is_the_shared_prefix_of_its_prompts_with_needles_over_its_whole_depth():
    recs = records(length=4096, n=16)
    for subtask in ("niah_multikey", "niah_multivalue", "vt"):
        group = [r for r in by(recs, subtask) if r["haystack"] == by(recs, subtask)[0]["haystack"]]
        queries = RulerSettings().queries(subtask)
        assert queries >= 3 and len(group) == queries  # one haystack for every queries_per_haystack prompts
        assert len({body(r) for r in group}) == 1 and len({r["prompt"] for r in group}) == queries
        assert len(TOK.encode(body(group[0]))) > 0.97 * group[0]["length_tokens"]  # all but the question shared
        text = body(group[0])
        planted = [text.index(item) / len(text) for r in group for item in r["answer"]]
        assert min(planted) < 0.3 and max(planted) > 0.7, subtask  # asked items far from the end too
    multikey = by(recs, "niah_multikey")[:4]
    depths = [body(r).index(r["answer"][0]) for r in multikey]
    assert depths == sorted(depths) and len(set(depths)) == 4  # the queries ask about needles at different depths
    assert [r["depth"] for r in multikey] == sorted(r["depth"] for r in multikey)
    assert 0 < multikey[0]["depth"] < 0.25 and 0.75 < multikey[-1]["depth"] < 1
    assert all(0 <= r["depth"] <= 1 for r in recs if r["subtask"] != "cwe")
    assert {r["depth"] for r in by(recs, "cwe")} == {None}


def test_settings_out_of_range_and_lengths_too_short_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"task.ruler.hops=0: an integer >= 1"):
        records(hops=0)
    with pytest.raises(ValueError, match=r"task.ruler.subtasks=\['niah'\]: a non-empty list"):
        records(subtasks=["niah"])
    with pytest.raises(ValueError, match="word_repeats=2: more than task.ruler.rare_repeats=2"):
        records(word_repeats=2)
    with pytest.raises(ValueError, match=r"longer length \(task.lengths\) or fewer planted items"):
        records(length=100)
    with pytest.raises(ValueError, match="prompts_per_length must be an integer >= 1"):
        build_ruler_records(TOK, prompts_per_length=0)
    assert RulerSettings(distractors=1, queries_per_haystack=4).queries("niah_multikey") == 2  # 2 needles to ask


def _record(subtask: str, **knobs) -> dict:
    return by(records(length=2048, n=4, **knobs), subtask)[0]


def test_multikey_scorer_takes_the_first_planted_number_and_refuses_a_distractor_value():
    r = _record("niah_multikey")
    value, distractor = r["answer"][0], next(v for v in r["universe"] if v != r["answer"][0])
    assert score_ruler(f" {value}.", r) == 1.0
    assert score_ruler(f"The special magic number is {value}, as stated in line 3.", r) == 1.0  # 3: never planted
    assert score_ruler(f" {distractor}.", r) == 0.0
    assert score_ruler(f" {distractor}, or maybe {value}.", r) == 0.0  # the first planted number decides
    assert score_ruler(f" {value[:-1]}.", r) == 0.0 and score_ruler(f" {value}1.", r) == 0.0  # whole numbers only
    assert score_ruler("I cannot find it.", r) == 0.0
    assert score_ruler(f" {int(value):,}.", r) == 1.0  # digits grouped in thousands
    assert score_ruler(f" {value},{distractor}", r) == 1.0 and score_ruler(f" {distractor},{value}", r) == 0.0


def test_multivalue_scorer_needs_every_value_and_no_distractor():
    r = _record("niah_multivalue")
    values, distractor = r["answer"], next(v for v in r["universe"] if v not in r["answer"])
    n = len(values)
    assert n >= 2
    assert score_ruler(" " + ", ".join(reversed(values)) + ".", r) == 1.0  # any order
    assert score_ruler(" " + ", ".join(values[:-1]) + ".", r) == pytest.approx((n - 1) / n)  # one missing
    assert score_ruler(" " + ", ".join([*values[:-1], distractor]) + ".", r) == pytest.approx((n - 1) / n)  # one wrong
    assert score_ruler(" " + ", ".join([*values, distractor]) + ".", r) == pytest.approx(n / (n + 1))  # one too many
    assert score_ruler(" " + ", ".join([*values, values[0]]) + ".", r) == 1.0  # named twice: once


def test_vt_scorer_refuses_a_wrong_variable():
    r = _record("vt")
    chain, other = r["answer"], next(v for v in r["universe"] if v not in r["answer"])
    assert score_ruler(" " + " ".join(chain), r) == 1.0
    assert score_ruler(" VAR " + ", VAR ".join(chain) + ".", r) == 1.0
    near = (len(chain) - 1) / len(chain)
    assert score_ruler(" " + " ".join([*chain[:-1], other]), r) == pytest.approx(near)  # a wrong variable
    assert score_ruler(" " + " ".join(chain[:-1]), r) == pytest.approx(near)  # a missing one
    assert score_ruler(" " + " ".join([*chain, other]), r) == pytest.approx(len(chain) / (len(chain) + 1))
    assert score_ruler(" " + " ".join(c.lower() for c in chain), r) == 0.0  # names are capitals


def test_cwe_scorer_refuses_a_missing_or_a_rare_word():
    r = _record("cwe")
    words, rare = r["answer"], next(w for w in r["universe"] if w not in r["answer"])
    listed = "\n".join(f"{i + 1}. {w.capitalize()}" for i, w in enumerate(words))
    assert score_ruler(listed, r) == 1.0  # any case, numbered or not
    n = len(words)
    assert score_ruler(", ".join(words[1:]), r) == pytest.approx((n - 1) / n)  # a missing word
    assert score_ruler(", ".join([*words[1:], rare]), r) == pytest.approx((n - 1) / n)  # a rare word instead
    assert score_ruler(", ".join(words) + " are the most common words", r) == 1.0  # prose names no list word
    assert named_items("Lugu, tasu", "cwe", ["lugu", "tasu", "ledo"]) == ["lugu", "tasu"]


def test_lengths_beyond_the_models_context_are_refused_with_the_lengths_that_fit():
    from toptheta.evaluation.generation import check_context

    task = {"kind": "ruler", "lengths": [4096, 8192, 16384]}
    with pytest.raises(ValueError, match=r"context of 8192.*task.lengths=\[4096\]"):
        check_context(task, 8192, "smollm2-135m")
    check_context(task, 32768, "qwen2.5-coder-0.5b")


def _tiny():
    from toptheta.models import build_tiny_model, build_tiny_tokenizer

    return build_tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2), build_tiny_tokenizer()


def test_shared_haystacks_run_once_with_each_prompts_tokens_and_statistics(tmp_path, monkeypatch):
    """task.share_prefix: each haystack's prompts share it as a prefix that runs once; the generations and the
    per-length statistics are those of one prompt at a time, and a checkpointed length reads back the same."""
    from toptheta.evaluation import prefix_sharing, ruler_run
    from toptheta.evaluation.ruler_run import ruler_records, run_ruler

    model, tokenizer = _tiny()
    n = torch.arange(1025).clamp(min=1).float()
    thresholds = toptheta.Thresholds((torch.full((2, 4, 1), 1.5) / n).contiguous(), [3, 3], "post")
    task = {"kind": "ruler", "lengths": [600], "prompts_per_length": 4, "seed": 0,
            "ruler": {**SMALL, "subtasks": ["niah_multikey", "vt"]}}
    groups, seen = [], []
    plain = prefix_sharing.generate_shared
    monkeypatch.setattr(prefix_sharing, "generate_shared",
                        lambda m, ids, **kw: groups.append(len(ids)) or plain(m, ids, **kw))
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    runs, tokens = [], []
    for share in (None, True):
        seen.clear()
        with toptheta.sparsify(model, toptheta.TopTheta(thresholds), [toptheta.VMC()]) as stats:
            runs.append(run_ruler({**task, "share_prefix": share}, model, tokenizer, chat_template=False, stats=stats,
                                  checkpoint=tmp_path / str(share)))
        tokens.append(sum(seen))
    hook.remove()
    one, shared = runs
    assert groups == [2, 2]  # the shared path ran, one call per haystack
    pairs = [[tokenizer(r["prompt"]).input_ids for r in ruler_records(task, tokenizer) if r["haystack"] == h]
             for h in ("600-niah_multikey-0", "600-vt-0")]
    common = sum(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in pairs)  # into the question
    haystacks = sum(len(tokenizer(body(r)).input_ids) for r in ruler_records(task, tokenizer) if r["id"].endswith("-1"))
    assert haystacks <= common and 0.9 * common <= tokens[0] - tokens[1] <= common  # the second ran its own rest only
    assert [s["generation"] for s in shared["samples"]] == [s["generation"] for s in one["samples"]]
    assert shared["results"] == one["results"]
    a, b = one["task_stats"]["ruler_600"], shared["task_stats"]["ruler_600"]
    assert b["prefill_attention_elements"] == a["prefill_attention_elements"]  # as if every prompt ran whole
    assert b["kept_vrow_fraction"] == pytest.approx(a["kept_vrow_fraction"], rel=1e-3)
    assert 0 < a["kept_vrow_fraction"] < 1
    assert [p.name for p in (tmp_path / "True").iterdir()] == ["ruler_600.json"]
    monkeypatch.setattr(ruler_run, "generate_all", lambda *a, **k: pytest.fail("a saved length is generated again"))
    with toptheta.sparsify(model, toptheta.TopTheta(thresholds), [toptheta.VMC()]) as stats:
        again = run_ruler({**task, "share_prefix": True}, model, tokenizer, chat_template=False, stats=stats,
                          checkpoint=tmp_path / "True")
    assert again["samples"] == shared["samples"] and list(again["resumed"]) == ["ruler_600"]
    assert again["task_stats"] == shared["task_stats"]  # sub-task statistics read back too
    assert set(shared["task_stats"]) == {"ruler_600", "ruler_600_niah_multikey", "ruler_600_vt", "ruler_niah_multikey",
                                         "ruler_vt"}


def test_a_run_cut_inside_a_length_resumes_at_the_haystack_it_was_in(tmp_path, monkeypatch):
    """Each haystack's batch is saved as it finishes: a run stopped after the first of a length's two haystacks
    generates only the second when it resumes, and ends with the samples and statistics of an uninterrupted run."""
    from toptheta.evaluation import ruler_run
    from toptheta.evaluation.ruler_run import run_ruler

    model, tokenizer = _tiny()
    n = torch.arange(1025).clamp(min=1).float()
    thresholds = toptheta.Thresholds((torch.full((2, 4, 1), 1.5) / n).contiguous(), [3, 3], "post")
    task = {"kind": "ruler", "lengths": [600], "prompts_per_length": 4, "seed": 0, "share_prefix": True,
            "ruler": {**SMALL, "subtasks": ["niah_multikey", "vt"]}}

    def run(checkpoint):
        with toptheta.sparsify(model, toptheta.TopTheta(thresholds), [toptheta.VMC()]) as stats:
            return run_ruler(task, model, tokenizer, chat_template=False, stats=stats, checkpoint=checkpoint)

    whole = run(tmp_path / "whole")
    plain, batches = ruler_run.generate_all, []

    def cut_after_one(*args, **kwargs):
        if batches:
            raise KeyboardInterrupt("the session ended")
        batches.append(args[2])
        return plain(*args, **kwargs)

    monkeypatch.setattr(ruler_run, "generate_all", cut_after_one)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut")
    assert [p.name for p in (tmp_path / "cut" / "ruler_600.parts").iterdir()] == ["niah_multikey_0.json"]
    monkeypatch.setattr(ruler_run, "generate_all", lambda *a, **k: batches.append(a[2]) or plain(*a, **k))
    resumed = run(tmp_path / "cut")
    assert len(batches) == 2 and batches[1] != batches[0]  # the second haystack only
    assert resumed["samples"] == whole["samples"] and resumed["results"] == whole["results"]
    for view, numbers in whole["task_stats"].items():
        got = resumed["task_stats"][view]
        assert {k: v for k, v in got.items() if k != "mean_dropped_mass"} == \
            {k: v for k, v in numbers.items() if k != "mean_dropped_mass"}, view
        assert got["mean_dropped_mass"] == pytest.approx(numbers["mean_dropped_mass"], rel=1e-12)  # summed in pieces
    assert [p.name for p in (tmp_path / "cut").iterdir()] == ["ruler_600.json"]  # the parts go once the length is


def test_a_tiny_llama_run_through_the_pipeline_reports_scores_per_length_and_subtask(tmp_path, monkeypatch):
    import pandas as pd

    from toptheta import pipeline

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    knobs = ",".join(f"{k}:{v}" for k, v in SMALL.items())
    pipeline.run(cfg("model=tiny-llama", "task=ruler", "task.lengths=[500,700]", "task.prompts_per_length=2",
                     f"task.ruler={{{knobs},subtasks:[niah_multikey,vt]}}", "sparsifier=topk", "sparsifier.k=8",
                     "sparsifier.layer_k=null", "comp=vmc", "baseline=false", f"results_dir={tmp_path}"))
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert set(summary["sparsifier"]) == {"topk"} and set(summary["metric"]) == {"score,none"}
    views = {"ruler", "ruler_500", "ruler_700", "ruler_niah_multikey", "ruler_vt", "ruler_500_niah_multikey",
             "ruler_500_vt", "ruler_700_niah_multikey", "ruler_700_vt"}
    assert set(summary["task"]) == views and len(summary) == len(views)
    assert summary["value"].between(0, 1).all()
    sparse = summary[summary["sparsifier"] == "topk"].set_index("task")
    assert (sparse.drop(index="ruler")["stats_scope"] == "task").all()  # each view has its own statistics
    for pooled, parts in (("ruler", ["ruler_500", "ruler_700"]), ("ruler_vt", ["ruler_500_vt", "ruler_700_vt"]),
                          ("ruler_500", ["ruler_500_vt", "ruler_500_niah_multikey"])):
        low, high = sorted(sparse.loc[parts, "kept_vrow_fraction"])
        assert 0 < low < high < 1 and low <= sparse.loc[pooled, "kept_vrow_fraction"] <= high, pooled
    stats = json.loads((tmp_path / "runs" / sparse.loc["ruler", "run_id"] / "stats.json").read_text())
    assert stats["ruler_500"]["prefill_attention_elements"] == sum(
        stats[f"ruler_500_{t}"]["prefill_attention_elements"] for t in ("niah_multikey", "vt"))
    assert (summary.loc[summary["task"] == "ruler", "generated_tokens"] > 0).all()  # how long the model talked
    samples = json.loads(gzip.decompress((tmp_path / "runs" / sparse.loc["ruler", "run_id"] / "samples.json.gz")
                                         .read_bytes()))
    assert len(samples) == 4 and {s["subtask"] for s in samples} == {"niah_multikey", "vt"}
    assert sparse.loc["ruler", "value"] == pytest.approx(sum(s["score"] for s in samples) / 4)


def test_the_store_counts_a_runs_prompts_and_paired_outcomes_keep_each_views_own():
    from toptheta.results.paired import question_outcomes
    from toptheta.store.rows import summary_rows

    config = {"model": {"name": "m"}, "task": {"name": "ruler", "kind": "ruler", "lengths": [500, 700],
                                               "prompts_per_length": 2}, "sparsifier": {"name": "dense"}}
    results = {"results": {"ruler": {"score,none": 0.5, "score_stderr,none": 0.1},
                           "ruler_500": {"score,none": 1.0, "score_stderr,none": 0.0}}}
    rows = summary_rows("r", config, results, {"ruler_500": {"kept_vrow_fraction": 1.0}}, commit="c", timestamp="t")
    assert {row["task"]: row["limit"] for row in rows} == {"ruler": 4, "ruler_500": 4}  # 2 lengths x 2 prompts
    samples = [{"id": "ruler-500-vt-0-1", "score": 0.5}, {"id": "ruler-500-niah_multikey-0-0", "score": 1.0},
               {"id": "ruler-700-vt-1-0", "score": 0.0}]
    views = {task: sorted(question_outcomes(samples, task, "score,none")) for task in
             ("ruler", "ruler_500", "ruler_vt", "ruler_500_niah_multikey", "ruler_700_vt")}
    assert views == {"ruler": sorted(s["id"] for s in samples), "ruler_500": ["ruler-500-niah_multikey-0-0",
                                                                             "ruler-500-vt-0-1"],
                     "ruler_vt": ["ruler-500-vt-0-1", "ruler-700-vt-1-0"],
                     "ruler_500_niah_multikey": ["ruler-500-niah_multikey-0-0"], "ruler_700_vt": ["ruler-700-vt-1-0"]}
    assert question_outcomes(samples, "ruler_500_vt", "score,none") == {"ruler-500-vt-0-1": 0.5}


def test_verdicts_compare_a_ruler_run_once_not_once_per_view():
    """The per-length and per-sub-task rows are views of the run's prompts: the verdicts' comparisons take the
    `ruler` row only (as they take `passkey`, not `passkey_<n>`). The store's passkey rows, renamed, are the runs."""
    from pathlib import Path

    import pandas as pd

    from toptheta.results import comparisons

    summary = pd.read_csv(Path(__file__).resolve().parents[1] / "results" / "summary.csv")
    rows = summary[summary["task"].astype(str).str.fullmatch(r"passkey(_\d+)?")].copy()
    assert {"passkey", "passkey_2048"} <= set(rows["task"]) and set(rows["sparsifier"]) >= {"dense", "topk"}
    rows["task"] = rows["task"].str.replace("passkey", "ruler").str.replace("ruler_2048", "ruler_2048_vt")
    rows["metric"] = "score,none"
    assert set(comparisons.store_rows(rows)["g_task"]) == {"ruler"}


def test_a_matched_ruler_run_resolves_k_on_ruler_prompts_of_another_draw(tmp_path, monkeypatch):
    """sparsifier.target_kept on the ruler task: the rows k is fitted on are ruler prompts of the run's lengths and
    layout from another seed (registry.TaskKindEntry.target_prompts), never an evaluated prompt."""
    from toptheta import matched, pipeline, registry
    from toptheta.evaluation.ruler_run import ruler_records, ruler_target_prompts

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    knobs = ",".join(f"{k}:{v}" for k, v in SMALL.items())
    overrides = ("model=tiny-llama", "task=ruler", "task.lengths=[500,700]", "task.prompts_per_length=2",
                 f"task.ruler={{{knobs},subtasks:[niah_multikey,vt]}}", "sparsifier=topk", "sparsifier.layer_k=null",
                 "comp=vmc", "sparsifier.placement=post", "sparsifier.target_kept=0.5",
                 "sparsifier.target_measure=vrows", "baseline=false", "log_samples=false", f"results_dir={tmp_path}")
    (spec,) = pipeline.plan(cfg(*overrides))
    assert (spec.target.task, spec.target.kind) == ("ruler", "ruler")
    prompts = ruler_target_prompts(spec.task.settings, TOK, matched.VROW_SEQUENCES, spec.target.seed)
    evaluated = {r["prompt"] for r in ruler_records(spec.task.settings, TOK)}
    assert len(prompts) == matched.VROW_SEQUENCES and not evaluated & set(prompts)
    lengths = [len(TOK.encode(p)) for p in prompts]
    assert min(lengths[::2]) > 400 and min(lengths[1::2]) > 600  # both lengths, interleaved
    assert ruler_target_prompts(spec.task.settings, TOK, 4, 1) != prompts[:4]  # calib.seed draws other rows
    used = []
    entry = registry.task_kind("ruler")
    registry.unregister_task_kind("ruler")
    try:  # the same entry, its target prompts watched
        registry.register_task_kind("ruler", check_context=entry.check_context, before_load=entry.before_load,
                                    target_prompts=lambda *a, **kw: used.append(a[2:]) or ruler_target_prompts(*a, **kw)
                                    )(entry.run)
        pipeline.run(cfg(*overrides))
    finally:
        registry.unregister_task_kind("ruler")
        registry.register_task_kind("ruler", check_context=entry.check_context, before_load=entry.before_load,
                                    target_prompts=entry.target_prompts)(entry.run)
    assert used == [(matched.VROW_SEQUENCES, 0)]  # the rows k was fitted on: ruler prompts, draw calib.seed
    record = json.loads((tmp_path / "runs" / spec.run_id / "stats.json").read_text())["target"]
    assert record["target_measure"] == "vrows" and record["k"] >= 1
    assert record["calibration_sequences"] == matched.VROW_SEQUENCES

"""Batched and shared-context multiple-choice scoring against lm-eval's stock HFLM at batch size 1.

Every fast path must give stock HFLM's log-likelihoods, greedy flags, accuracy and sparsity statistics
(kept attention, kept V rows, dropped mass: the same rows counted the same number of times) on the
smoke task's few-shot requests, whose contexts and continuations have mixed lengths, so every batch
is padded.
"""

from __future__ import annotations

import pytest
from lm_eval.models.huggingface import HFLM

import toptheta
from conftest import accuracy, load_tasks, score
from toptheta.evaluation import lm_eval_adapter as adapter
from toptheta.evaluation import shared_context_lm
from toptheta.evaluation.calibration_inputs import build_requests
from toptheta.evaluation.shared_context_lm import BatchedHFLM, SharedContextHFLM
from toptheta.models import build_tiny_model

COUNTS = ("prefill_attention_elements", "decode_steps", "clamped_rows")  # the same rows, counted as often
# A score within a few ulps of θ may land on either side with another (equally valid) summation order.
FRACTIONS = ("kept_attention_fraction", "kept_vrow_fraction", "mean_dropped_mass")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def requests():
    """smoke, 2-shot, 6 documents: 24 requests, contexts of ~120 tokens, continuations of 2-4 tokens."""
    task = load_tasks(["smoke"], None)["smoke"]
    build_requests(task, num_fewshot=2, limit=6, seed=0)
    return task.instances


@pytest.fixture(scope="module")
def models():
    # gemma3: sliding-window layers (window 8, far shorter than the contexts) beside global ones.
    return {arch: build_tiny_model(arch) for arch in ("llama", "qwen2", "gemma3")}


def _sparsifiers(model, tokenizer, requests):
    """Every sparsifier × placement × compensation family.

    Top-θ is calibrated on other text: calibrating on an evaluated row puts θ exactly on one of its scores,
    and such a tie flips on a last-bit difference between two equally valid summation orders.
    """
    text = "Calibration text, not a smoke question. " * 4
    ids = [[tokenizer.encode(text)], [tokenizer.encode(text[::-1])]]
    theta = {p: toptheta.calibrate(model, ids, k=8, placement=p, progress=False) for p in ("pre", "post")}
    return {
        "dense": (toptheta.Dense(), []),
        "topk-pre-sdc-vmc": (toptheta.TopK(k=8, placement="pre"), [toptheta.SDC("exact"), toptheta.VMC()]),
        "topk-post-vmc": (toptheta.TopK(k=8, placement="post"), [toptheta.VMC()]),
        "toptheta-post-vmc": (toptheta.TopTheta(theta["post"]), [toptheta.VMC()]),
        "toptheta-pre-sdc-vmc": (toptheta.TopTheta(theta["pre"]), [toptheta.SDC("exact"), toptheta.VMC()]),
    }


def _assert_same(reference, candidate, requests):
    (ref, ref_stats), (out, out_stats) = reference, candidate
    assert len(out) == len(ref)
    assert max(abs(a[0] - b[0]) for a, b in zip(ref, out)) < 1e-4
    assert [a[1] for a in ref] == [b[1] for b in out]
    assert accuracy(out, requests) == accuracy(ref, requests)
    for name in COUNTS:
        assert out_stats[name] == ref_stats[name], name
    for name in FRACTIONS:
        if ref_stats[name] is None:  # e.g. kept V rows of a run without decode steps
            assert out_stats[name] is None, name
        else:
            assert out_stats[name] == pytest.approx(ref_stats[name], rel=1e-4, abs=1e-9), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_fast_paths_match_stock_hflm_for_every_sparsifier(models, tokenizer, requests, arch):
    model = models[arch]
    sparsifiers = _sparsifiers(model, tokenizer, requests)
    if arch != "llama":  # the other architectures: one post- and one pre-softmax configuration
        sparsifiers = {name: sparsifiers[name] for name in ("topk-post-vmc", "toptheta-pre-sdc-vmc")}
    for name, (sparsifier, comps) in sparsifiers.items():
        reference = score(HFLM, model, tokenizer, requests, sparsifier, comps, batch_size=1)
        assert reference[1]["kept_attention_fraction"] < 1.0 or name == "dense"
        for lm_class, batch_size in ((BatchedHFLM, 5), (SharedContextHFLM, 1), (SharedContextHFLM, "auto")):
            candidate = score(lm_class, model, tokenizer, requests, sparsifier, comps, batch_size=batch_size)
            _assert_same(reference, candidate, requests)


def test_batched_auto_and_truncated_requests_match_stock(models, tokenizer, requests):
    """batch_size="auto", and max_length short enough that some requests are cut from the left
    (SharedContextHFLM scores those through the batched path)."""
    model = models["llama"]
    sparsifier, comps = toptheta.TopK(k=8, placement="post"), [toptheta.VMC()]
    lengths = sorted(len(tokenizer.encode(r.args[0] + r.args[1])) for r in requests)
    max_length = lengths[len(lengths) // 2]
    for kwargs in ({}, {"max_length": max_length}):
        reference = score(HFLM, model, tokenizer, requests, sparsifier, comps, batch_size=1, **kwargs)
        for lm_class in (BatchedHFLM, SharedContextHFLM):
            candidate = score(lm_class, model, tokenizer, requests, sparsifier, comps, batch_size="auto", **kwargs)
            _assert_same(reference, candidate, requests)


def test_stock_hflm_right_padding_would_count_padded_rows(models, tokenizer, requests):
    """Why the batched path exists: stock HFLM at batch 4 right-pads without a mask, so its statistics
    count the padded rows (its log-likelihoods are right). BatchedHFLM does not."""
    model = models["llama"]
    sparsifier, comps = toptheta.TopK(k=8, placement="post"), [toptheta.VMC()]
    one = score(HFLM, model, tokenizer, requests, sparsifier, comps, batch_size=1)
    stock = score(HFLM, model, tokenizer, requests, sparsifier, comps, batch_size=4)
    assert stock[1]["prefill_attention_elements"] > one[1]["prefill_attention_elements"]
    _assert_same(one, score(BatchedHFLM, model, tokenizer, requests, sparsifier, comps, batch_size=4), requests)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_shared_context_runs_each_context_once(models, tokenizer, requests, prefix_cache):
    """The speed-up itself: one context forward per document, not one per choice; with the prefix cache, the
    smoke task's shared description and "Question:" run once, then each context's own tokens."""
    model = models["llama"]
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append((args or [kwargs["input_ids"]])[0].shape),
                                             with_kwargs=True)
    try:
        score(SharedContextHFLM, model, tokenizer, requests, toptheta.Dense(), [], batch_size=1,
              prefix_cache=prefix_cache)
    finally:
        handle.remove()
    documents = len({r.doc_id for r in requests})
    # contexts; continuation forwards are ≤ 3 tokens a choice, padded to MIN_GEMM_ROWS positions
    long_calls = [shape for shape in calls if shape[1] > max(8, shared_context_lm.MIN_GEMM_ROWS)]
    assert len(long_calls) == documents + prefix_cache and all(shape[0] == 1 for shape in long_calls)
    if prefix_cache:
        contexts = {r.args[0] for r in requests}
        assert sum(shape[1] for shape in long_calls) < sum(len(tokenizer.encode(c)) for c in contexts)  # the prefix once, not once per context


def test_repeated_statistics_scale_only_what_the_block_adds():
    stats = toptheta.SparsityStats(1, 2, 1)
    stats.prefill_kept += 1.0
    with stats.repeated(3):
        stats.prefill_kept += 2.0
    assert stats.prefill_kept.tolist() == [[7.0, 7.0]]
    with pytest.raises(ValueError, match="times"):
        with stats.repeated(0):
            pass


def test_evaluate_tasks_defaults_to_shared_context_and_matches_stock(models, tokenizer):
    """The runner's path: same acc/acc_norm and per-sample log-likelihoods as stock HFLM."""
    model = models["qwen2"]
    sparsifier, comps = toptheta.TopK(k=8, placement="post"), [toptheta.VMC()]
    results, stats = {}, {}
    for scoring, batch_size in (("stock", 1), ("shared", "auto")):
        with toptheta.sparsify(model, sparsifier, comps) as st:
            results[scoring] = adapter.evaluate_tasks(model, tokenizer, ["smoke"], data_dir=None, num_fewshot=1,
                                                      limit=4, scoring=scoring, batch_size=batch_size,
                                                      log_samples=True)
        stats[scoring] = st.summary()
    for metric in ("acc,none", "acc_norm,none"):
        assert results["shared"]["results"]["smoke"][metric] == results["stock"]["results"]["smoke"][metric]
    lls = {s: [r[0][0] for doc in results[s]["samples"]["smoke"] for r in doc["resps"]] for s in results}
    assert lls["shared"] == pytest.approx(lls["stock"], abs=1e-4)
    assert stats["shared"]["kept_attention_fraction"] == pytest.approx(stats["stock"]["kept_attention_fraction"])
    with pytest.raises(ValueError, match="scoring"):
        adapter.evaluate_tasks(None, None, ["smoke"], data_dir=None, num_fewshot=0, limit=1, scoring="fast")
    with pytest.raises(ValueError, match="auto"):
        adapter.evaluate_tasks(None, None, ["smoke"], data_dir=None, num_fewshot=0, limit=1, batch_size="max")


@pytest.mark.parametrize("arch,key_block", [("llama", None), ("qwen2", None), ("llama", 16)])
def test_fast_paths_make_stocks_top_theta_decisions_even_on_ties(monkeypatch, models, tokenizer, requests, arch,
                                                                 key_block):
    """θ calibrated on the evaluated requests themselves sits exactly on some of their scores, so a last-bit
    difference in a row would flip decisions. The prefill kernel gives a row the same bits alone, left-padded
    or packed after a cached context, so batched and shared scoring keep exactly what stock HFLM keeps, and
    the log-likelihoods differ only by the LM head's rounding (issue 9 asks for 1e-4). With 16-key blocks most
    contexts leave too little room in their last block to pack their continuations: those go one per row."""
    if key_block is not None:
        from toptheta.attention import prefill

        monkeypatch.setattr(prefill, "KEY_BLOCK", key_block)
    model = models[arch]
    ids = [[tokenizer.encode(r.args[0] + r.args[1])] for r in requests[:8]]
    for placement, comps in (("post", [toptheta.VMC()]), ("pre", [toptheta.SDC("exact"), toptheta.VMC()])):
        sparsifier = toptheta.TopTheta(toptheta.calibrate(model, ids, k=8, placement=placement, progress=False))
        reference, ref_stats = score(HFLM, model, tokenizer, requests, sparsifier, comps, batch_size=1)
        for lm_class, batch_size in ((BatchedHFLM, 5), (SharedContextHFLM, 1), (SharedContextHFLM, "auto")):
            answers, stats = score(lm_class, model, tokenizer, requests, sparsifier, comps, batch_size=batch_size)
            assert max(abs(a[0] - b[0]) for a, b in zip(reference, answers)) < 1e-5
            for name in ("kept_attention_fraction", "kept_vrow_fraction"):  # ratios of counts: exactly
                assert stats[name] == ref_stats[name], name
            assert stats["mean_dropped_mass"] == pytest.approx(ref_stats["mean_dropped_mass"], rel=1e-6)  # a float sum

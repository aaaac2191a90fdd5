"""The prefix cache of multiple-choice scoring: few-shot contexts with fixed exemplars share their exemplars, which
run once; everything else must be what scoring each request alone gives (issue 27).

Reference: lm-eval's stock HFLM at batch 1 (each request one forward over context + continuation), and
SharedContextHFLM without the cache. The smoke task made few-shot with ``first_n`` exemplars: every context
shares the description and the same exemplars, then has its own question.
"""

from __future__ import annotations

import gc

import pytest
from lm_eval.models.huggingface import HFLM

import toptheta
from conftest import accuracy, load_tasks, score
from toptheta.compat import replace_sampler
from toptheta.evaluation import lm_eval_adapter as adapter
from toptheta.evaluation import prefix_cache
from toptheta.evaluation.calibration_inputs import build_requests
from toptheta.evaluation.shared_context_lm import SharedContextHFLM
from toptheta.models import build_tiny_model

COUNTS = ("prefill_attention_elements", "clamped_rows", "empty_rows")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def requests():
    """smoke, 3 fixed exemplars, 6 documents: contexts of ~300 tokens sharing ~250."""
    task = load_tasks(["smoke"], None)["smoke"]
    replace_sampler(task, "first_n")
    build_requests(task, num_fewshot=3, limit=6, seed=0)
    return task.instances


@pytest.fixture(scope="module")
def models():
    return {arch: build_tiny_model(arch) for arch in ("llama", "qwen2")}


def _spy_groups(monkeypatch):
    """Record (prefix length, contexts, live prefix caches at entry) of every prefix group scored."""
    seen = []
    original = SharedContextHFLM._score_prefix_group

    def spy(self, requests, shared, group, *args, **kwargs):
        gc.collect()
        seen.append((shared, len(group), prefix_cache.live_prefixes()))
        return original(self, requests, shared, group, *args, **kwargs)

    monkeypatch.setattr(SharedContextHFLM, "_score_prefix_group", spy)
    return seen


def test_first_n_contexts_share_their_exemplars(tokenizer, requests):
    contexts = sorted({tuple(tokenizer.encode(r.args[0])) for r in requests})
    groups = prefix_groups = prefix_cache.prefix_groups(contexts)
    assert len(groups) == 1 and sorted(groups[0][1]) == list(range(len(contexts)))
    shared = prefix_groups[0][0]
    assert shared > 200 and all(c[:shared] == contexts[0][:shared] for c in contexts)
    exemplars = requests[0].args[0].rsplit("Question:", 1)[0]
    assert shared >= len(tokenizer.encode(exemplars))  # the description and all three exemplars


def _sparsifiers(model, tokenizer):
    text = "Calibration text, not a smoke question. " * 8
    ids = [[tokenizer.encode(text)], [tokenizer.encode(text[::-1])]]
    theta = {p: toptheta.calibrate(model, ids, k=8, placement=p, progress=False) for p in ("pre", "post")}
    sdc = {name: toptheta.SDC(name) for name in ("exact", "exp-threshold")}
    return {
        "dense": (toptheta.Dense(), []),
        "topk-post-vmc": (toptheta.TopK(k=8, placement="post"), [toptheta.VMC()]),
        "topk-pre-sdc-vmc": (toptheta.TopK(k=8, placement="pre"), [sdc["exact"], toptheta.VMC()]),
        "toptheta-post": (toptheta.TopTheta(theta["post"]), []),
        "toptheta-post-vmc": (toptheta.TopTheta(theta["post"]), [toptheta.VMC()]),
        "toptheta-pre-sdc": (toptheta.TopTheta(theta["pre"]), [sdc["exact"]]),
        "toptheta-pre-exp-sdc-vmc": (toptheta.TopTheta(theta["pre"]), [sdc["exp-threshold"], toptheta.VMC()]),
        "toptheta-pre-sdc-vmc": (toptheta.TopTheta(theta["pre"]), [sdc["exact"], toptheta.VMC()]),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefix_cache_gives_stocks_numbers_for_every_sparsifier(monkeypatch, models, tokenizer, requests, arch):
    model = models[arch]
    sparsifiers = _sparsifiers(model, tokenizer)
    if arch != "llama":
        sparsifiers = {name: sparsifiers[name] for name in ("topk-post-vmc", "toptheta-pre-sdc-vmc", "toptheta-post-vmc")}
    seen = _spy_groups(monkeypatch)
    for name, (sparsifier, comps) in sparsifiers.items():
        reference, ref_stats = score(HFLM, model, tokenizer, requests, sparsifier, comps, batch_size=1)
        for kwargs in ({"batch_size": 1}, {"batch_size": "auto"}, {"batch_size": "auto", "prefix_cache": False}):
            before = len(seen)
            answers, stats = score(SharedContextHFLM, model, tokenizer, requests, sparsifier, comps, **kwargs)
            assert len(seen) == before + kwargs.get("prefix_cache", True), name  # the cache ran (or not)
            tolerance = 1e-4 if name.startswith("topk") else 1e-5
            assert max(abs(a[0] - b[0]) for a, b in zip(reference, answers)) < tolerance, (name, kwargs)
            assert [a[1] for a in reference] == [b[1] for b in answers], name
            assert accuracy(answers, requests) == accuracy(reference, requests), name
            for key in COUNTS:
                assert stats[key] == ref_stats[key], (name, key)
            for key in ("kept_attention_fraction", "kept_vrow_fraction"):
                if ref_stats[key] is None:  # kept V rows: a run without decode steps has none
                    assert stats[key] is None, (name, key)
                elif name.startswith("topk"):  # torch's chunks: a score within rounding of the k-th may trade places
                    assert stats[key] == pytest.approx(ref_stats[key], rel=1e-4), (name, key)
                else:
                    assert stats[key] == ref_stats[key], (name, key)
            if name != "dense":
                assert stats["kept_attention_fraction"] < 1.0


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_thresholds_on_the_evaluated_rows_keep_the_same_elements(monkeypatch, models, tokenizer, requests, placement):
    """θ calibrated on the evaluated sequences sits exactly on some of their scores: any last-bit difference
    between the cached and the whole-sequence rows would flip a decision and change a count. The continuations run
    on the contexts' own cache (written into its room, dropped after: no copy), as they do on ARC."""
    from toptheta.evaluation import shared_context_lm

    in_place = []
    original = shared_context_lm.dropping_appends
    monkeypatch.setattr(shared_context_lm, "dropping_appends", lambda cache: in_place.append(1) or original(cache))
    model = models["llama"]
    ids = [[tokenizer.encode(r.args[0] + r.args[1])] for r in requests[:8]]
    comps = [toptheta.VMC()] if placement == "post" else [toptheta.SDC("exact"), toptheta.VMC()]
    sparsifier = toptheta.TopTheta(toptheta.calibrate(model, ids, k=8, placement=placement, progress=False))
    reference, ref_stats = score(HFLM, model, tokenizer, requests, sparsifier, comps, batch_size=1)
    answers, stats = score(SharedContextHFLM, model, tokenizer, requests, sparsifier, comps, batch_size="auto")
    assert in_place, "the continuations were scored on copies of the cache"
    assert max(abs(a[0] - b[0]) for a, b in zip(reference, answers)) < 1e-5
    for key in ("kept_attention_fraction", "kept_vrow_fraction", "prefill_attention_elements"):
        assert stats[key] == ref_stats[key], key
    assert stats["mean_dropped_mass"] == pytest.approx(ref_stats["mean_dropped_mass"], rel=1e-6)


def test_cache_holds_one_prefix_at_a_time(monkeypatch, models, tokenizer):
    """Many distinct prefixes: each group's cache is gone before the next group's prefix runs."""
    model = models["llama"]
    seen = _spy_groups(monkeypatch)
    requests = []
    for g in range(6):  # six different 80-token prefixes, three questions and two choices each
        head = f"Group {g}: " + "".join(chr(97 + (g * 7 + i) % 26) for i in range(80))
        for q in range(3):
            context = f"{head}\nQuestion {q}: what follows {q}?\nAnswer:"
            requests += [(context, " yes"), (context, f" no {q}")]
    lm = SharedContextHFLM(pretrained=model, tokenizer=tokenizer, batch_size="auto")
    from lm_eval.api.instance import Instance

    instances = [Instance("loglikelihood", {}, args, idx, ("t", 0, 1)) for idx, args in enumerate(requests)]
    with toptheta.sparsify(model, toptheta.Dense(), []):
        lm.loglikelihood(instances, disable_tqdm=True)
    assert len(seen) == 6 and all(n == 3 for _, n, _ in seen)
    assert max(live for _, _, live in seen) == 0
    gc.collect()
    assert prefix_cache.live_prefixes() == 0


def test_prefix_groups_split_where_little_is_shared():
    a = tuple(range(200)) + (1,)
    b = tuple(range(200)) + (2, 3)
    c = tuple(range(70)) + (5,) * 40  # shares 70 tokens: with a and b it would save 2 × 70 of their 200
    d = (9,) * 200  # shares nothing
    assert prefix_cache.prefix_groups([c, a, d, b]) == [(200, [1, 3])]
    e = tuple(range(150)) + (4,)  # 150 with a and b: 3 × 150 saves more than 2 × 200 (one 150-token prefix)
    assert [(n, sorted(g)) for n, g in prefix_cache.prefix_groups([c, a, d, b, e])] == [(150, [1, 3, 4])]
    # each member keeps a token of its own, so its last logits come from its own forward
    assert prefix_cache.prefix_groups([a, a[:-1] + (7,)], min_prefix=8) == [(200, [0, 1])]
    assert prefix_cache.prefix_groups([a[:50] + (1,), a[:50] + (2,)]) == []  # below MIN_PREFIX


def test_calibration_with_first_n_leaves_the_exemplars_out(tokenizer):
    seqs = adapter.calibration_requests(tokenizer, "smoke", data_dir=None, num_fewshot=3, limit=4, max_length=None,
                                        fewshot_sampler="first_n")
    task = load_tasks(["smoke_calibration"], None)["smoke_calibration"]
    exemplars = [task.doc_to_text(d) for d in list(task.fewshot_docs())[:3]]
    texts = [tokenizer.decode(s) for s in seqs]
    assert len({t.split("Question:")[1] for t in texts}) == 1 == len({t[:200] for t in texts})  # one prefix
    for text in texts:  # every row: the three exemplars, then a question that is none of them
        assert all(e.split("\n")[0] in text for e in exemplars)
        assert text.rsplit("Question:", 1)[1].split("\n")[0] not in " ".join(exemplars)
    with pytest.raises(ValueError, match="first_n"):
        adapter.calibration_requests(tokenizer, "smoke", data_dir=None, num_fewshot=3, limit=4, max_length=None,
                                     fewshot_sampler="firstn")


def test_calibration_draws_share_no_document(tokenizer):
    """calib.seed s > 0 calibrates on the s-th block of documents after the exemplars: draws are disjoint."""
    def questions(draw):
        seqs = adapter.calibration_requests(tokenizer, "smoke", data_dir=None, num_fewshot=3, limit=4,
                                            max_length=None, fewshot_sampler="first_n", draw=draw)
        return {tokenizer.decode(s).rsplit("Question:", 1)[1].split("\n")[0] for s in seqs}
    draws = [questions(d) for d in range(3)]
    assert all(len(q) == 4 for q in draws)
    assert not (draws[0] & draws[1]) and not (draws[0] & draws[2]) and not (draws[1] & draws[2])
    assert questions(0) == draws[0]  # draw 0 is today's calibration set
    with pytest.raises(ValueError, match="calib.seed or calib.num_samples"):
        questions(10_000)
    with pytest.raises(ValueError, match="whole number of calibration documents"):
        adapter.calibration_requests(tokenizer, "smoke", data_dir=None, num_fewshot=3, limit=0.5, max_length=None,
                                     fewshot_sampler="first_n", draw=1)


def test_cover_shots_calibrates_the_same_documents_at_more_shots_so_longer_rows_are_calibrated(tokenizer, monkeypatch):
    """calib.cover_shots: the calibration documents again at num_fewshot + cover_shots shots; the first
    num_fewshot + cover_shots documents are the exemplars of both passes, so no calibration document is one."""
    from toptheta import thresholds_cache
    from toptheta.models import build_tiny_model

    def questions(seqs):
        return {tokenizer.decode(s).rsplit("Question:", 1)[1].split("\n")[0] for s in seqs}

    model = build_tiny_model()
    build = dict(data_dir=None, num_fewshot=2, num_samples=3, max_length=None, fewshot_sampler="first_n")
    seen = []
    with monkeypatch.context() as patch:
        patch.setattr("toptheta.calibration.calibrate", lambda model, batches, **k: seen.append([b[0] for b in batches]))
        thresholds_cache.calibrate_on_task(model, tokenizer, "smoke", **build)
        thresholds_cache.calibrate_on_task(model, tokenizer, "smoke", cover_shots=2, **build)
    plain, covered = seen
    at_two = adapter.calibration_requests(tokenizer, "smoke", data_dir=None, num_fewshot=2, limit=3, max_length=None,
                                          fewshot_sampler="first_n", reserve=2)
    at_four = adapter.calibration_requests(tokenizer, "smoke", data_dir=None, num_fewshot=4, limit=3, max_length=None,
                                           fewshot_sampler="first_n")
    assert covered == at_two + at_four
    assert questions(at_two) == questions(at_four) != questions(plain)  # the same documents in both passes
    first_four = questions(adapter.calibration_requests(tokenizer, "smoke", data_dir=None, num_fewshot=0, limit=4,
                                                        max_length=None))
    assert len(first_four) == 4 and not first_four & questions(covered)  # the exemplars of either pass
    assert max(map(len, at_four)) > max(map(len, plain))

    longest = {cover: thresholds_cache.calibrate_on_task(model, tokenizer, "smoke", cover_shots=cover, k=2,
                                                         placement="post", layer_k={}, **build).max_n
               for cover in (0, 2)}
    assert longest == {0: max(map(len, plain)), 2: max(map(len, covered))}  # rows up to the longest are calibrated


def test_run_shared_counts_each_row_once_per_sequence(models, tokenizer, requests):
    """Matched sparsity measures its kept fraction with ``run_shared`` (shared tokens once, counted per sequence):
    the same counts as running every sequence whole, for Top-θ (the prefill kernel) and Top-k."""
    import torch

    model = models["llama"]
    ids = [tokenizer.encode(r.args[0] + r.args[1]) for r in requests[:12]]
    theta = toptheta.TopTheta(toptheta.calibrate(model, [[s] for s in ids], k=8, placement="post", progress=False))
    for sparsifier in (theta, toptheta.TopK(8, "post")):
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as whole:
            for s in ids:
                model(input_ids=torch.tensor([s]))
        with toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as shared:
            tokens_run = prefix_cache.run_shared(model, ids, shared.repeated)
        assert tokens_run < 0.5 * sum(map(len, ids))
        assert torch.equal(shared.prefill_valid, whole.prefill_valid)
        assert torch.equal(shared.prefill_kept, whole.prefill_kept), type(sparsifier).__name__
        assert 0 < shared.kept_attention_fraction < 1


def test_vrow_measure_decodes_shared_prompts_as_generate_does(models, tokenizer, requests):
    """matched.decode_after (the V-row measure of sparsifier.target_measure=vrows) runs prompts' shared prefixes once;
    its prefill and decode counters are those of decoding each prompt through ``generate``."""
    import torch

    from toptheta.matched import decode_after

    model = models["llama"]
    prompts = [tokenizer.encode(r.args[0]) for r in requests[:8:2]]  # four contexts sharing the exemplars
    theta = toptheta.TopTheta(toptheta.calibrate(model, [[p] for p in prompts], k=8, placement="post", progress=False))
    for sparsifier in (theta, toptheta.TopK(8, "post")):
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as whole:
            for ids in prompts:
                model.generate(torch.tensor([ids]), max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as shared:
            decode_after(model, prompts, 5, pad_token_id=0)
        for name in ("prefill_valid", "prefill_kept", "decode_valid", "decode_kept", "vrow_valid", "vrow_kept",
                     "decode_steps"):
            assert torch.equal(getattr(shared, name), getattr(whole, name)), (type(sparsifier).__name__, name)
        assert 0 < shared.kept_vrow_fraction < 1


def test_an_interrupted_vrow_measure_resumes_with_the_counts_of_a_whole_one(models, tokenizer, requests, tmp_path,
                                                                             monkeypatch):
    """decode_after with a progress file: stopped after two of four prompts, then called again, it runs the two left
    (the shared exemplars again, uncounted) and ends with every counter of an uninterrupted call."""
    import json

    import torch

    from toptheta.evaluation import prefix_sharing
    from toptheta.matched import decode_after

    model = models["llama"]
    prompts = [tokenizer.encode(r.args[0]) for r in requests[:8:2]]
    theta = toptheta.TopTheta(toptheta.calibrate(model, [[p] for p in prompts], k=8, placement="post", progress=False))
    plain, generated = prefix_sharing.greedy_generate_batch, []

    def counting(*args, stop_at=None, **kwargs):
        if len(generated) == stop_at:
            raise KeyboardInterrupt("the session ended")
        generated.append(args[1][0][:4])
        return plain(*args, **kwargs)

    for sparsifier in (theta, toptheta.TopK(8, "post")):
        progress = tmp_path / f"{type(sparsifier).__name__}.progress.json"
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as whole:
            decode_after(model, prompts, 5, pad_token_id=0)
        monkeypatch.setattr(prefix_sharing, "greedy_generate_batch", lambda *a, **kw: counting(*a, stop_at=2, **kw))
        generated.clear()
        with pytest.raises(KeyboardInterrupt), torch.no_grad(), \
                toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as first:
            decode_after(model, prompts, 5, pad_token_id=0, stats=first, progress=progress)
        assert len(json.loads(progress.read_text())["done"]) == 2
        monkeypatch.setattr(prefix_sharing, "greedy_generate_batch", counting)
        generated.clear()
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, [toptheta.VMC()]) as resumed:
            decode_after(model, prompts, 5, pad_token_id=0, stats=resumed, progress=progress)
        assert len(generated) == 2  # the prompts left only
        for name in ("prefill_valid", "prefill_kept", "decode_valid", "decode_kept", "vrow_valid", "vrow_kept",
                     "decode_steps"):
            assert torch.equal(getattr(resumed, name), getattr(whole, name)), (type(sparsifier).__name__, name)
        assert 0 < resumed.kept_vrow_fraction < 1
        monkeypatch.setattr(prefix_sharing, "greedy_generate_batch", plain)
    with pytest.raises(ValueError, match="progress needs the sparsify block's stats"):
        decode_after(model, prompts, 5, pad_token_id=0, progress=progress)

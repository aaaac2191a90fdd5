"""Attention correctness (issue 11 items 1, 2, 5; issue 10 item 13): causal alignment from the cache, the
exp-threshold SDC bound, the phase of a forward, and the selectable empty-row rule."""

import copy
import functools

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, StaticCache

import conftest
import toptheta
from toptheta.attention import fused
from toptheta.attention.backend import decoding
from toptheta.calibration import Thresholds


def tiny_llama() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def prompt(length: int = 12) -> torch.Tensor:
    return torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(1))


# ---- item 1: a static cache's prefill is upper-left aligned ---------------------------------------------------

def make_cache(model, kind: str):
    return StaticCache(config=model.config, max_cache_len=32) if kind == "static" else DynamicCache(config=model.config)


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_prefill_and_decode_with_static_and_dynamic_caches_equal_sdpa(kind):
    """Prefill of 12 tokens into a 32-slot static cache must not see the 20 empty slots after the prompt."""
    model, ids = tiny_llama(), prompt()
    options = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True,
                   pad_token_id=0, cache_implementation="static" if kind == "static" else None)
    with torch.no_grad():
        expected_prefill = model(input_ids=ids, cache=make_cache(model, kind), use_cache=True).logits
        expected = model.generate(ids, **options)
        with toptheta.sparsify(model, toptheta.Dense()):
            got_prefill = model(input_ids=ids, cache=make_cache(model, kind), use_cache=True).logits
            got = model.generate(ids, **options)
    torch.testing.assert_close(got_prefill, expected_prefill, atol=1e-5, rtol=1e-5)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), atol=1e-5, rtol=1e-5)


def test_sparse_run_with_a_static_cache_never_attends_to_empty_slots():
    model, ids = tiny_llama(), prompt()
    sparsifier, comp = toptheta.TopK(4, "post"), [toptheta.VMC()]  # VMC's v̄ would also average the empty slots
    lengths, logits = {}, {}
    for kind in ("static", "dynamic"):
        seen = []
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp, observer=seen.append):
            logits[kind] = model(input_ids=ids, cache=make_cache(model, kind), use_cache=True).logits
        lengths[kind] = seen[0].n.flatten().tolist()  # valid keys of each prefill row of layer 0
    assert lengths["static"] == lengths["dynamic"] == list(range(1, 13))
    torch.testing.assert_close(logits["static"], logits["dynamic"], atol=1e-5, rtol=1e-5)


# ---- item 2: exp-threshold SDC on rows where nothing beats θ -------------------------------------------------

qkv = functools.partial(conftest.qkv, B=1, left_pad=0)  # one sequence by default; several without padding


def logits_of(q, k, valid, scale=0.5):
    """(B, H, Q, K) float64 scaled logits, -inf where invalid."""
    G = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)) * scale
    return s.masked_fill(~valid, float("-inf"))


@pytest.fixture(params=["plain", "fast"])
def path(request, monkeypatch):
    """Kernel-level tests run on the plain kernel (the reference) and through the fast paths where they apply."""
    from toptheta.attention import decode, prefill

    if request.param == "plain":
        monkeypatch.setattr(decode, "ENABLED", False)
        monkeypatch.setattr(prefill, "ENABLED", False)
    return request.param


def run(sparsifier, comp=(), data=None, stats=None, observer=None, chunk=None):
    q, k, v, valid = data or qkv()
    return toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier, compensations=comp,
                                     stats=stats, observer=observer, chunk_size=chunk)


@pytest.mark.parametrize("rows", ["prefill", "decode"])
def test_exp_threshold_sdc_on_rows_where_nothing_beats_theta(rows, path):
    """θ above every logit: each row keeps its maximum m; each dropped key is ≤ m, so E ≤ (n − 1)·exp(0)."""
    q, k, v, valid = data = qkv()
    if rows == "decode":  # one query over all 12 keys
        q, valid = q[:, :, -1:], valid[:, :, -1:]
        data = q, k, v, valid
    s = logits_of(q, k, valid)  # (1, H, Q, K)
    thresholds = Thresholds(torch.full((1, 4, 1), 50.0), [1], "pre")
    got = run(toptheta.TopTheta(thresholds), [toptheta.SDC("exp-threshold")], data=data).double()  # (1, Q, H, D)
    n = valid.sum(-1, keepdim=True)  # (1, 1, Q, 1)
    top = s.argmax(-1, keepdim=True)  # (1, H, Q, 1)
    weights = torch.zeros_like(s).scatter_(-1, top, 1.0) / n  # kept max: exp(0) / (1 + (n − 1)·1)
    expected = (weights @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_exp_threshold_sdc_is_the_paper_bound_capped_at_the_row_maximum(path):
    """E = (n − |S|)·exp(min(θ, m) − m): the paper's (n − |S|)·exp(θ − m) on rows whose maximum beats θ."""
    q, k, v, valid = data = qkv()
    theta = -0.5
    seen = []
    sparsifier = toptheta.TopTheta(Thresholds(torch.full((1, 4, 1), theta), [1], "pre"))
    got = run(sparsifier, [toptheta.SDC("exp-threshold")], data=data, observer=seen.append).double()
    s = logits_of(q, k, valid)
    m = s.amax(-1, keepdim=True)  # (1, H, Q, 1)
    sparsified = valid.sum(-1, keepdim=True) > 1
    assert ((m > theta) & sparsified).any() and ((m <= theta) & sparsified).any()  # both kinds of row
    keep = seen[0].keep
    e = (s - m).exp() * keep
    dropped = (valid & ~keep).sum(-1, keepdim=True)  # (1, H, Q, 1) valid dropped keys
    denom = e.sum(-1, keepdim=True) + dropped * torch.exp(torch.clamp(theta - m, max=0.0))
    expected = ((e / denom) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# ---- item 5: the phase is what the model is doing -----------------------------------------------------------

def phases_seen(model, action, sparsifier=None):
    """[(phase, Q)] of every layer-0 block the kernel ran during ``action()``."""
    seen = []
    record = lambda rows: seen.append((rows.phase, rows.logits.shape[2])) if rows.layer == 0 else None  # noqa: E731
    with torch.no_grad(), toptheta.sparsify(model, sparsifier or toptheta.TopK(4, "post"), observer=record) as stats:
        action()
    return seen, stats


def test_one_token_prompt_and_scoring_against_a_cached_context_are_prefill():
    model, ids = tiny_llama(), prompt()
    seen, stats = phases_seen(model, lambda: model(input_ids=ids[:, :1]))
    assert seen == [("prefill", 1)] and stats.decode_valid.sum() == 0 and stats.prefill_valid.sum() > 0

    def continuation():  # a context once, then a 1-token and a 3-token continuation scored against its cache
        cache = model(input_ids=ids[:, :8], use_cache=True).cache
        model(input_ids=ids[:, 8:9], cache=copy.deepcopy(cache), use_cache=True)
        model(input_ids=ids[:, 8:11], cache=cache, use_cache=True)

    seen, stats = phases_seen(model, continuation)
    assert [phase for phase, _ in seen] == ["prefill"] * 3 and stats.kept_vrow_fraction is None


def test_generate_steps_after_the_prompt_are_decode_and_the_wrapper_is_removed():
    model, ids = tiny_llama(), prompt()
    seen, stats = phases_seen(model, lambda: model.generate(ids[:, :1], max_new_tokens=4, do_sample=False,
                                                            pad_token_id=0))
    assert seen == [("prefill", 1)] + [("decode", 1)] * 3
    assert stats.summary()["decode_steps"] == 3 and stats.kept_vrow_fraction is not None
    assert "generate" not in vars(model)  # sparsify's wrapper is gone
    # a chunked prefill is all prefill; the forward after it is a decode step
    seen, _ = phases_seen(model, lambda: model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
                                                       prefill_chunk_size=5))
    assert seen == [("prefill", 5), ("prefill", 5), ("prefill", 2), ("decode", 1)]
    # outside generate, forwards are prefill again
    seen, _ = phases_seen(model, lambda: model(input_ids=ids[:, :1]))
    assert seen == [("prefill", 1)]


def test_multi_token_generation_steps_are_decode():
    model, ids = tiny_llama(), prompt()
    assistant = copy.deepcopy(model)  # assisted decoding: the model verifies several candidate tokens per step
    seen, stats = phases_seen(model, lambda: model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                                            assistant_model=assistant))
    assert seen[0][0] == "prefill" and all(phase == "decode" for phase, _ in seen[1:])
    assert any(q > 1 for _, q in seen[1:]) and stats.kept_vrow_fraction is not None

    def hand_written_step():  # a hand-written loop marks its steps
        cache = model(input_ids=ids[:, :8], use_cache=True).cache
        with decoding(model):
            model(input_ids=ids[:, 8:11], cache=cache, use_cache=True)

    seen, _ = phases_seen(model, hand_written_step)
    assert seen == [("prefill", 8), ("decode", 3)]


# ---- issue 10 item 13: the empty-row rule ---------------------------------------------------------------------

def empty_rows_brute_force(data, theta, placement, k=1):
    """(B, H, Q) rows with n > k where no valid score passes θ."""
    q, k_, v, valid = data
    s = logits_of(q, k_, valid)
    x = s if placement == "pre" else torch.softmax(s, -1)
    n = valid.sum(-1)  # (B, 1, Q)
    return (x.amax(-1) <= theta) & (n > k)


THETA = {"pre": 1.2, "post": 0.45}  # some rows of qkv() pass, some are empty


@pytest.mark.parametrize("placement", ["pre", "post"])
@pytest.mark.parametrize("rule", ["keep-max", "reference"])
def test_empty_rows_are_counted_per_layer_and_in_the_summary(placement, rule, path):
    data = qkv(B=2, Q=16, K=16)
    expected = empty_rows_brute_force(data, THETA[placement], placement)
    assert 0 < int(expected.sum()) < expected.numel()
    sparsifier = toptheta.TopTheta(Thresholds(torch.full((1, 4, 1), THETA[placement]), [1], placement),
                                   empty_rows=rule)
    stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
    run(sparsifier, data=data, stats=stats, chunk=5)
    assert torch.equal(stats.empty_rows[0], expected.sum((0, 2)).double())
    assert stats.summary()["empty_rows"] == int(expected.sum()) and stats.per_layer()["empty_rows"] == [expected.sum()]


def test_keep_max_rows_keep_exactly_their_maximum(path):
    data = qkv()
    sparsifier = toptheta.TopTheta(Thresholds(torch.full((1, 4, 1), THETA["post"]), [1], "post"))
    rows = []
    run(sparsifier, data=data, observer=rows.append)
    empty = rows[0].empty  # (B, H, Q)
    assert empty.any() and torch.equal(rows[0].keep.sum(-1)[empty], torch.ones(int(empty.sum()), dtype=torch.long))


def test_reference_post_softmax_empty_rows_are_zero_rows_and_vmc_gives_them_the_mean_v_row(path):
    q, k, v, valid = data = qkv()
    empty = empty_rows_brute_force(data, THETA["post"], "post")[0]  # (H, Q)
    sparsifier = toptheta.TopTheta(Thresholds(torch.full((1, 4, 1), THETA["post"]), [1], "post"), empty_rows="reference")
    plain = run(sparsifier, data=data)[0].transpose(0, 1)  # (H, Q, D)
    assert torch.equal(plain[empty], torch.zeros_like(plain[empty]))
    with_vmc = run(sparsifier, [toptheta.VMC()], data=data)[0].transpose(0, 1)
    v_mean = (valid[0, 0].float() @ v[0].float()) / valid[0, 0].sum(-1, keepdim=True)  # (Hkv, Q, D) causal mean
    v_mean = v_mean.repeat_interleave(2, 0)  # (H, Q, D)
    torch.testing.assert_close(with_vmc[empty], v_mean[empty], atol=1e-5, rtol=1e-5)
    keep_max = toptheta.TopTheta(Thresholds(torch.full((1, 4, 1), THETA["post"]), [1], "post"))
    assert not torch.equal(run(keep_max, data=data)[0].transpose(0, 1)[empty], plain[empty])


def test_reference_pre_softmax_empty_rows_attend_uniformly_to_the_whole_padded_row(path):
    q, k, v, valid = data = qkv()
    empty = empty_rows_brute_force(data, THETA["pre"], "pre")[0]  # (H, Q)
    assert empty[:, :-1].any()  # rows that are not the last one: the uniform average includes future keys
    thresholds = Thresholds(torch.full((1, 4, 1), THETA["pre"]), [1], "pre")
    got = run(toptheta.TopTheta(thresholds, empty_rows="reference"), data=data)[0].transpose(0, 1)  # (H, Q, D)
    every_key = v[0].mean(1).repeat_interleave(2, 0)[:, None].expand(4, 12, 8)  # (H, Q, D): mean of all K V rows
    torch.testing.assert_close(got[empty], every_key[empty], atol=1e-6, rtol=1e-5)
    # with SDC the kept mass is 0 (a zero row), and VMC gives it the (causal) mean V row
    sdc = run(toptheta.TopTheta(thresholds, empty_rows="reference"), [toptheta.SDC("exact")], data=data)
    sdc = sdc[0].transpose(0, 1)
    assert torch.equal(sdc[empty], torch.zeros_like(sdc[empty]))
    # rows with something above θ are the same under both rules
    keep_max = run(toptheta.TopTheta(thresholds), data=data)[0].transpose(0, 1)
    torch.testing.assert_close(got[~empty], keep_max[~empty])


def test_reference_pre_softmax_uniform_rows_get_no_vmc_and_decode_steps_follow_the_rule(path):
    """A uniform row's weights sum to 1: VMC adds nothing to it. A decode step (one query) obeys the same rule."""
    q, k, v, valid = data = qkv()
    empty = empty_rows_brute_force(data, THETA["pre"], "pre")[0]  # (H, Q)
    sparsifier = toptheta.TopTheta(Thresholds(torch.full((1, 4, 1), THETA["pre"]), [1], "pre"), empty_rows="reference")
    plain = run(sparsifier, data=data)[0].transpose(0, 1)
    with_vmc = run(sparsifier, [toptheta.VMC()], data=data)[0].transpose(0, 1)
    torch.testing.assert_close(with_vmc[empty], plain[empty], atol=1e-6, rtol=1e-5)
    j = int(empty.any(0).nonzero()[0])  # an empty row, replayed as a decode step over its j + 1 keys
    step = (q[:, :, j:j + 1], k[:, :, :j + 1], v[:, :, :j + 1], valid[:, :, j:j + 1, :j + 1])
    got = run(sparsifier, [toptheta.VMC()], data=step)[0, 0]  # (H, D)
    expected = v[0, :, :j + 1].mean(1).repeat_interleave(2, 0)  # (H, D): uniform over the step's keys
    torch.testing.assert_close(got[empty[:, j]], expected[empty[:, j]], atol=1e-6, rtol=1e-5)


def test_fused_kernel_counts_the_same_empty_rows(monkeypatch):
    if not fused.enabled():
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?); the torch path is in use")
    data = qkv(B=2, Q=40, K=40, seed=3)
    sparsifier = toptheta.TopTheta(Thresholds(torch.full((1, 4, 1), THETA["post"]), [4], "post"))

    def once():
        stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
        return run(sparsifier, [toptheta.VMC()], data=data, stats=stats), stats

    fast, fast_stats = once()
    monkeypatch.setattr(fused, "extension", lambda: None)
    slow, slow_stats = once()
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    assert torch.equal(fast_stats.empty_rows, slow_stats.empty_rows) and fast_stats.empty_rows.sum() > 0


def test_empty_row_rule_is_checked_and_passed_by_the_pipeline():
    from types import SimpleNamespace

    from toptheta.builders import build_sparsifier

    thresholds = Thresholds(torch.zeros(1, 4, 1), [1], "post")
    with pytest.raises(ValueError, match="empty_rows must be one of"):
        toptheta.TopTheta(thresholds, empty_rows="uniform")
    spec = {"name": "toptheta", "placement": "post", "k": 1, "layer_k": {}}
    assert build_sparsifier(spec, thresholds).empty_rows == "keep-max"
    assert build_sparsifier({**spec, "empty_rows": "reference"}, thresholds).empty_rows == "reference"
    assert SimpleNamespace(**build_sparsifier(spec, thresholds).describe()).empty_rows == "keep-max"


# ---- item 5: no finite-math assumptions in the compiled kernels ---------------------------------------------------

def test_every_compiled_kernel_is_built_without_fast_math(monkeypatch):
    """Masked keys are -inf: -ffast-math (-ffinite-math-only) would let the compiler assume they never occur."""
    import torch.utils.cpp_extension as cpp_extension

    from toptheta.attention import fused_prefill

    seen = {}
    monkeypatch.setenv("TOPTHETA_FUSED", "1")
    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kw: seen.setdefault(kw["name"], kw["extra_cflags"]))
    for module in (fused, fused_prefill):
        module.extension.cache_clear()
    try:
        assert fused.extension() is not None and fused_prefill.extension() is not None
    finally:
        for module in (fused, fused_prefill):
            module.extension.cache_clear()  # the next caller loads the real build
    assert len(seen) == 2
    for name, flags in seen.items():
        assert not {"-ffast-math", "-ffinite-math-only", "-Ofast"} & set(flags), (name, flags)
        assert "-fno-finite-math-only" in flags or "-funsafe-math-optimizations" in flags  # still vectorisable

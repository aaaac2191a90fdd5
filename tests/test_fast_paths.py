"""Fast paths (attention/decode.py, attention/prefill.py) against the plain kernel, the reference.

Each test runs the same inputs through the fast path and through ``kernel.sparse_attention`` with the fast
paths switched off, and asks for the same outputs (float tolerance), the same keep decisions and the same
statistics.
"""

import logging

import pytest
import torch

import toptheta
from conftest import H, HKV, assert_same_stats, configs, decode_data, prefill_data, random_thresholds, tiny_6heads
from toptheta.attention import decode, prefill
from toptheta.calibration import Thresholds

CONFIGS = list(configs())


def _run(fast: bool, monkeypatch, data, sparsifier, comp, **kw):
    """(output, keep masks seen, stats) of one kernel call with the fast paths on or off."""
    monkeypatch.setattr(decode, "ENABLED", fast)
    monkeypatch.setattr(prefill, "ENABLED", fast)
    q, k, v, valid = data
    stats = toptheta.SparsityStats(num_layers=1, num_heads=q.shape[1], num_kv_heads=k.shape[1])
    seen = []
    out = toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier,
                                    compensations=comp, stats=stats,
                                    observer=(lambda rows: seen.append(rows.keep)) if kw.pop("observe", False) else None,
                                    **kw)
    return out, seen, stats


# ---- sparse decode -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("masked", [True, False])
def test_decode_equals_the_plain_kernel(monkeypatch, name, masked):
    decode.reset()
    sparsifier, comp = configs()[name]
    q, k, v, valid = decode_data()
    data = (q, k, v, valid if masked else None)
    fast, fast_keep, fast_stats = _run(True, monkeypatch, data, sparsifier, comp, observe=True)
    slow, slow_keep, slow_stats = _run(False, monkeypatch, data, sparsifier, comp, observe=True)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    assert (fast_keep[0] is None) == (slow_keep[0] is None)
    if fast_keep[0] is not None:
        assert torch.equal(fast_keep[0], slow_keep[0])
    assert_same_stats(fast_stats, slow_stats)
    if name != "dense":
        assert 0 < fast_stats.kept_vrow_fraction < 1


@pytest.mark.parametrize("name", ["theta-post-vmc", "topk-pre-sdc-vmc", "theta-pre-expsdc-vmc"])
def test_decode_steps_with_a_growing_cropped_and_edited_cache(monkeypatch, name):
    """The running V sum follows a growing cache and is rebuilt after a crop or an edit."""
    decode.reset()
    sparsifier, comp = configs()[name]
    q, k, v, valid = decode_data(K=60, seed=1)
    lengths = [30, 31, 32, 33, 28, 29, 29, 45]  # grow, crop, grow, same length again, jump
    for step, K in enumerate(lengths):
        kk, vv = k[:, :, :K].clone(), v[:, :, :K].clone()
        if step == 6:
            vv[:, :, 10] += 1.0  # an edited row in the prefix (same length as before)
            vv[:, :, K - 1] += 1.0
        data = (q, kk, vv, valid[..., -K:])
        fast, _, fs = _run(True, monkeypatch, data, sparsifier, comp)
        slow, _, ss = _run(False, monkeypatch, data, sparsifier, comp)
        torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5, msg=f"step {step}, K={K}")
        assert_same_stats(fs, ss)


def test_decode_gathers_only_the_kept_value_rows(monkeypatch):
    """V rows nobody kept are never read: poisoning them with NaN leaves the output finite and unchanged."""
    decode.reset()
    sparsifier, comp = configs()["theta-post-vmc"]
    q, k, v, valid = decode_data(B=1, K=64)
    seen = []
    toptheta.sparse_attention(q, k, v, None, scaling=0.5, layer=0, sparsifier=sparsifier,
                              observer=lambda rows: seen.append(rows.keep))
    union = seen[0].view(1, HKV, H // HKV, 64).any(2)  # (1, Hkv, K)
    assert union.float().mean() < decode.DENSE_ABOVE
    clean = toptheta.sparse_attention(q, k, v, None, scaling=0.5, layer=0, sparsifier=sparsifier)
    poisoned = v.masked_fill(~union[..., None], float("nan"))
    got = toptheta.sparse_attention(q, k, poisoned, None, scaling=0.5, layer=0, sparsifier=sparsifier)
    torch.testing.assert_close(got, clean)


def test_decode_low_precision_cache_matches_within_rounding(monkeypatch):
    decode.reset()
    sparsifier, comp = configs()["topk-post-vmc"]
    data = decode_data(dtype=torch.bfloat16)
    monkeypatch.setattr(decode, "BLOCK_KEYS", 16)  # several conversion blocks
    fast, fast_keep, fs = _run(True, monkeypatch, data, sparsifier, comp, observe=True)
    slow, slow_keep, ss = _run(False, monkeypatch, data, sparsifier, comp, observe=True)
    assert fast.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), slow.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(fast_keep[0], slow_keep[0])
    assert_same_stats(fs, ss)


@pytest.mark.parametrize("arch,name", [("llama", "theta-post-vmc"), ("llama", "topk-pre-sdc-vmc"),
                                       ("qwen2", "theta-pre-sdc-vmc"), ("qwen2", "dense")])
def test_generate_with_fast_decode_gives_the_same_tokens_and_stats(monkeypatch, arch, name):
    model = tiny_6heads(arch)
    sparsifier, comp = configs(layers=2)[name]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    results = []
    for fast in (True, False):
        decode.reset()
        monkeypatch.setattr(decode, "ENABLED", fast)
        monkeypatch.setattr(prefill, "ENABLED", fast)
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        results.append((out, stats))
    (fast_out, fast_stats), (slow_out, slow_stats) = results
    assert torch.equal(fast_out.sequences, slow_out.sequences)
    torch.testing.assert_close(torch.stack(fast_out.scores), torch.stack(slow_out.scores), atol=1e-4, rtol=1e-4)
    assert_same_stats(fast_stats, slow_stats)
    assert fast_stats.decode_steps.max() == 5
    if name != "dense":
        assert 0 < fast_stats.kept_vrow_fraction < 1


@pytest.mark.parametrize("arch,name", [("llama", "theta-post-vmc"), ("qwen2", "theta-pre-sdc-vmc"),
                                       ("llama", "dense"), ("qwen2", None)])
def test_a_growing_cache_generates_what_the_dynamic_cache_does(arch, name):
    """GrowingLayer writes tokens into spare room instead of re-concatenating the cache: same tokens, same scores,
    same statistics as transformers' DynamicCache, sparsified (fast decode reading kept V rows of the strided
    views) or not (sdpa); it grows past its first buffer and starts over after a crop."""
    from toptheta.attention import cache as kv

    model = tiny_6heads(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    results = []
    for growing in (True, False):
        decode.reset()
        past = kv.growing_cache(model) if growing else None
        with torch.no_grad(), (toptheta.sparsify(model, *configs(layers=2)[name]) if name else _no_stats()) as stats:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                                 output_scores=True, return_dict_in_generate=True, cache=past)
        results.append((out, stats, past))
    (a, sa, past), (b, sb, _) = results
    assert torch.equal(a.sequences, b.sequences)
    torch.testing.assert_close(torch.stack(a.scores), torch.stack(b.scores), atol=1e-5, rtol=1e-5)
    if name:
        assert_same_stats(sa, sb)
    layer = past.layers[0]
    assert isinstance(layer, kv.GrowingLayer) and layer._kbuf.shape[-2] > layer.keys.shape[-2] == 31
    assert not layer.keys.is_contiguous() and layer._owns_views()  # views of the buffer, no per-step copy

    # Growth past the first buffer, and a crop (which replaces the views), keep the cache's content exact.
    plain = torch.randn(1, HKV, 0, 8)
    k_all, v_all = torch.randn(1, HKV, 700, 8), torch.randn(1, HKV, 700, 8)
    layer = kv.GrowingLayer()
    for a0 in range(0, 600, 100):
        layer.update(k_all[:, :, a0:a0 + 100], v_all[:, :, a0:a0 + 100])
    assert torch.equal(layer.keys, k_all[:, :, :600]) and torch.equal(layer.values, v_all[:, :, :600])
    layer.crop(-50)
    keys, values = layer.update(k_all[:, :, 550:551], v_all[:, :, 550:551])
    assert torch.equal(keys, k_all[:, :, :551]) and torch.equal(values, v_all[:, :, :551]) and plain.numel() == 0


class _no_stats:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


DECODE_KERNEL_CONFIGS = ["dense", "theta-post", "theta-post-vmc", "theta-pre", "theta-pre-sdc-vmc",
                         "theta-pre-expsdc-vmc", "theta-pre-calsdc-vmc"]


@pytest.mark.parametrize("name", DECODE_KERNEL_CONFIGS)
@pytest.mark.parametrize("masked", [True, False])
def test_decode_kernel_equals_the_plain_kernel(monkeypatch, torch_threads, name, masked):
    """The C++ decode kernel (no observer: the observer path keeps the torch ops), split in key blocks of 8."""
    from toptheta.attention import fused_decode

    if fused_decode.extension() is None:
        pytest.skip("the decode kernel could not be built here (no C++ compiler?)")
    decode.reset()
    monkeypatch.setattr(decode, "MIN_KEYS_PER_TASK", 8)
    sparsifier, comp = configs()[name]
    q, k, v, valid = decode_data()
    stats = _kernel_equals_plain(monkeypatch, fused_decode, (q, k, v, valid if masked else None), sparsifier, comp)
    if name != "dense":
        assert 0 < stats.kept_vrow_fraction < 1


def test_decode_kernel_empty_rows_and_low_precision_caches(monkeypatch):
    """Rows where nothing passes θ keep their maximum (pre and post); a bfloat16 cache takes the torch ops."""
    from toptheta.attention import fused_decode

    if fused_decode.extension() is None:
        pytest.skip("the decode kernel could not be built here (no C++ compiler?)")
    monkeypatch.setattr(decode, "MIN_KEYS_PER_TASK", 8)
    values = torch.full((1, H, 41), 1.0)
    values[:, :3] = 40.0
    probs = torch.full((1, H, 41), 0.05)
    probs[:, :3] = 1.5
    for thresholds, comp in ((Thresholds(values, [3], "pre"), [toptheta.SDC("exact"), toptheta.VMC()]),
                             (Thresholds(probs, [3], "post"), [toptheta.VMC()])):
        decode.reset()
        data = decode_data(seed=3)
        sparsifier = toptheta.TopTheta(thresholds)
        fast, _, fs = _run(True, monkeypatch, data, sparsifier, comp)
        slow, _, ss = _run(False, monkeypatch, data, sparsifier, comp)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
        assert_same_stats(fs, ss)
        assert fs.empty_rows.sum() > 0
    calls = []
    monkeypatch.setattr(fused_decode, "extension", _counting(fused_decode.extension, calls))
    sparsifier, comp = configs()["theta-post-vmc"]
    _run(True, monkeypatch, decode_data(dtype=torch.bfloat16), sparsifier, comp)
    assert not calls


# ---- one-pass prefill ----------------------------------------------------------------------------------

PREFILL_CONFIGS = ["dense", "theta-pre", "theta-pre-sdc", "theta-pre-sdc-vmc", "theta-pre-expsdc-vmc",
                   "theta-pre-calsdc-vmc", "theta-post", "theta-post-vmc", "skip-pre-sdc-vmc", "skip-post-vmc"]


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def torch_threads(request):
    """torch on one and on two threads: the kernel splits its (head, query block) tasks among them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield
    torch.set_num_threads(threads)


def _needs_kernel():
    from toptheta.attention import fused_prefill

    if fused_prefill.extension() is None:
        pytest.skip("the one-pass prefill kernel could not be built here (no C++ compiler?)")


@pytest.mark.parametrize("name", PREFILL_CONFIGS)
@pytest.mark.parametrize("shape", ["causal", "masked", "context"])
def test_prefill_equals_the_plain_kernel(monkeypatch, torch_threads, name, shape):
    _needs_kernel()
    monkeypatch.setattr(prefill, "KEY_BLOCK", 16)  # several key blocks: the online softmax rescales
    sparsifier, comp = configs()[name]
    q, k, v, valid = prefill_data(K=70 if shape == "context" else 50)  # context: 20 cached keys before the queries
    data = (q, k, v, valid if shape == "masked" else None)
    assert prefill.attention(*data, scaling=0.5, layer=0, sparsifier=sparsifier, compensations=comp) is not None
    stats = _kernel_equals_plain(monkeypatch, prefill.fused_prefill, data, sparsifier, comp)
    if name != "dense":
        assert 0 < stats.kept_attention_fraction < 1


def _kernel_equals_plain(monkeypatch, module, data, sparsifier, comp):
    """One call with the fast paths, which must reach ``module``'s compiled kernel, equals the plain kernel's
    (output within float tolerance, statistics exactly); returns the fast call's statistics."""
    calls = []
    monkeypatch.setattr(module, "extension", _counting(module.extension, calls))
    fast, _, fast_stats = _run(True, monkeypatch, data, sparsifier, comp)
    assert calls, f"{module.__name__} did not run"
    slow, _, slow_stats = _run(False, monkeypatch, data, sparsifier, comp)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    assert_same_stats(fast_stats, slow_stats)
    return fast_stats


def _counting(fn, calls):
    def wrapped():
        calls.append(1)
        return fn()
    return wrapped


def test_prefill_empty_and_clamped_rows_match(monkeypatch, torch_threads):
    """Rows where nothing passes θ keep their maximum; rows longer than any calibrated length clamp θ."""
    _needs_kernel()
    monkeypatch.setattr(prefill, "KEY_BLOCK", 16)
    values = torch.full((1, H, 31), 1.0)
    values[:, :3] = 40.0  # far above every logit: empty rows on half the heads
    probs = torch.full((1, H, 31), 0.02)
    probs[:, :3] = 1.5  # above every probability
    pre = Thresholds(values, [3], "pre", sdc_mass=torch.ones(1, H, 31))
    post = Thresholds(probs, [3], "post")
    for thresholds, comp in ((pre, []), (pre, [toptheta.SDC("exact"), toptheta.VMC()]),
                             (pre, [toptheta.SDC("exp-threshold"), toptheta.VMC()]), (post, []),
                             (post, [toptheta.VMC()])):
        data = prefill_data(seed=3)
        sparsifier = toptheta.TopTheta(thresholds)
        for _ in range(2):  # the second call reads the cached θ lookup of the first
            fast, _, fs = _run(True, monkeypatch, data, sparsifier, comp)
            slow, _, ss = _run(False, monkeypatch, data, sparsifier, comp)
            torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
            assert_same_stats(fs, ss)
            assert fs.empty_rows.sum() > 0 and fs.clamped_rows > 0


@pytest.mark.parametrize("lam", [0.5, 2.0, 6.0, 40.0, 1e3])
def test_skip_softmax_prefill_cuts_tied_logits_as_the_plain_kernel(monkeypatch, lam):
    """Integer queries and keys give exact, heavily tied logits in both kernels: every key tied with a row's maximum
    or with another kept key is decided alike, at λ from a loose cut to one above every row's maximum (λ > n)."""
    _needs_kernel()
    monkeypatch.setattr(prefill, "KEY_BLOCK", 16)
    g = torch.Generator().manual_seed(5)
    q, k, v, valid = prefill_data(K=70, seed=5)
    q, k = (torch.randint(-2, 3, x.shape, generator=g).float() for x in (q, k))
    for placement, comp in (("pre", []), ("pre", [toptheta.SDC("exact")]), ("post", [toptheta.VMC()])):
        sparsifier = toptheta.SkipSoftmax(lam, placement, k=2)
        for data in ((q, k, v, None), (q, k, v, valid)):
            stats = _kernel_equals_plain(monkeypatch, prefill.fused_prefill, data, sparsifier, comp)
            assert 0 < stats.kept_attention_fraction < 1
            assert (stats.empty_rows.sum() > 0) == (lam > 16)  # rows hold 16-70 keys: λ > n empties some


def test_masked_value_means_are_the_direct_float64_means():
    """v̄ of masked rows (VMC's mean V row over each row's valid keys), the keys shared by a sequence's rows summed
    once: the same float32 bits as the direct float64 mean, with padding, packed rows, rows without keys, sequences
    whose rows share no key and a mask that every row shares whole."""
    g = torch.Generator().manual_seed(0)
    B, Q, K = 3, 12, 70
    value = torch.randn(B, HKV, K, 16, generator=g)
    context = torch.zeros(B, 1, Q, K, dtype=torch.bool)
    context[..., 5:60] = True  # a cached context after left padding...
    context[..., 60:] = torch.rand(B, 1, Q, K - 60, generator=g) < 0.4  # ...then each row's own keys
    context[0, 0, 3] = False  # a padded query row: no key
    scattered = torch.rand(B, 1, Q, K, generator=g) < 0.5  # nothing shared
    whole = torch.ones(B, 1, Q, K, dtype=torch.bool)
    for valid in (context, scattered, whole, torch.zeros_like(whole)):
        n = valid.sum(-1)
        direct = ((valid.double() @ value.double()) / n.clamp_min(1).unsqueeze(-1)).float()
        assert torch.equal(prefill._value_means(value, valid, n), direct)


def test_paths_the_one_pass_kernel_does_not_serve_run_the_plain_kernel(monkeypatch):
    pre = random_thresholds("pre")
    assert not prefill.supports(toptheta.TopK(3, "pre"))
    assert not prefill.supports(toptheta.TopTheta(random_thresholds("post"), empty_rows="reference"))
    assert not prefill.supports(toptheta.TopTheta(pre), observer=print)
    assert not prefill.supports(toptheta.TopTheta(pre, empty_rows="reference"))
    assert not prefill.supports(toptheta.TopTheta(pre), phase="decode")  # decode stats need the keep mask
    assert prefill.supports(toptheta.TopTheta(pre)) and prefill.supports(toptheta.Dense())
    skip = toptheta.SkipSoftmax(2.0, "pre")
    assert prefill.supports(skip) and prefill.supports(skip, [toptheta.SDC("exact"), toptheta.VMC()])
    assert not prefill.supports(skip, phase="decode") and not prefill.supports(toptheta.TopP(0.9, "post"))
    assert not prefill.supports(skip, [toptheta.SDC("exp-threshold")])  # needs a calibrated θ
    q, k, v, _ = prefill_data()
    assert prefill.attention(q, k, v, None, scaling=0.5, layer=0, sparsifier=toptheta.TopK(3, "pre")) is None


def test_every_compiled_kernel_runs_on_torchs_threads():
    """ATen's parallel_for is an OpenMP pragma in a header: built without -fopenmp, a kernel runs serially."""
    from toptheta.attention import fused, fused_prefill

    threads = torch.get_num_threads()
    try:
        for ext in (fused.extension(), fused_prefill.extension()):
            if ext is None:
                pytest.skip("no C++ compiler here: the kernels are not built")
            torch.set_num_threads(2)
            assert ext.parallel_threads(64) == 2
            torch.set_num_threads(1)
            assert ext.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(threads)


def test_a_kernel_that_cannot_be_built_falls_back_with_one_log_line(monkeypatch, caplog, torch_threads):
    """No compiler: one warning, then the plain kernel's numbers, never a crash."""
    import torch.utils.cpp_extension as cpp

    from toptheta.attention import fused_prefill

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++ not found")

    fused_prefill.extension.cache_clear()
    monkeypatch.setattr(cpp, "load_inline", no_compiler)
    try:
        sparsifier, comp = configs()["theta-pre-sdc-vmc"]
        data = prefill_data()
        with caplog.at_level(logging.INFO, logger="toptheta"):
            first, _, _ = _run(True, monkeypatch, data, sparsifier, comp)
            second, _, _ = _run(True, monkeypatch, data, sparsifier, comp)
        slow, _, _ = _run(False, monkeypatch, data, sparsifier, comp)
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "could not be built" in warnings[0].getMessage()
        assert torch.equal(first, slow) and torch.equal(second, slow)
    finally:
        fused_prefill.extension.cache_clear()  # the next caller loads the real build again


@pytest.mark.parametrize("arch,name", [("llama", "theta-pre-sdc-vmc"), ("qwen2", "theta-pre-expsdc-vmc"),
                                       ("qwen2", "dense"), ("llama", "theta-post-vmc"),
                                       ("qwen2", "skip-pre-sdc-vmc")])
def test_model_forward_with_one_pass_prefill_equals_the_plain_kernel(monkeypatch, torch_threads, arch, name):
    _needs_kernel()
    model = tiny_6heads(arch)
    sparsifier, comp = configs(layers=2)[name]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (2, 30), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :6] = 0
    results = []
    for fast in (True, False):
        monkeypatch.setattr(prefill, "ENABLED", fast)
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
            logits = model(input_ids=ids, attention_mask=mask).logits
        results.append((logits, stats))
    (a, sa), (b, sb) = results
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=1e-4, rtol=1e-4)
    assert_same_stats(sa, sb)
    assert set(sa.summary()["backend_calls"]) == {"cpu-prefill"}  # which kernel ran, each way
    assert "cpu-prefill" not in sb.summary()["backend_calls"]


@pytest.mark.parametrize("name", PREFILL_CONFIGS)
def test_prefill_rows_do_not_depend_on_batch_padding_or_packing(monkeypatch, torch_threads, name):
    """A sequence's rows have the same bits alone (causal), left-padded in a batch beside a longer sequence, and
    as continuation rows packed after a cached context: so batched and shared-context scoring make the same
    Top-θ decisions as scoring one request at a time (issue 9: log-likelihoods equal, not merely close)."""
    _needs_kernel()
    monkeypatch.setattr(prefill, "KEY_BLOCK", 16)  # several key blocks
    sparsifier, comp = configs()[name]
    g = torch.Generator().manual_seed(3)
    C, first, second = 36, 3, 4  # context, then two continuations; both inside the context's last key block
    L = C + second
    q, k, v = (torch.randn(1, h, C + first + second, 8, generator=g) * s for h, s in ((H, 2), (HKV, 2), (HKV, 1)))
    own = torch.cat([torch.arange(C), torch.arange(C + first, C + first + second)])  # context + second continuation
    call = dict(scaling=0.5, layer=0, sparsifier=sparsifier, compensations=comp)
    alone = prefill.attention(q[:, :, own], k[:, :, own], v[:, :, own], None, **call)[0]  # (L, H, D)

    pad = 7  # left-padded beside a sequence longer by `pad`
    def padded(x):
        other = torch.randn(1, x.shape[1], L + pad, x.shape[-1], generator=g)
        return torch.cat([other, torch.cat([torch.randn(1, x.shape[1], pad, x.shape[-1], generator=g), x], 2)])
    valid = torch.ones(L + pad, L + pad, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    valid[1, ..., :pad] = False
    batched = prefill.attention(padded(q[:, :, own]), padded(k[:, :, own]), padded(v[:, :, own]), valid, **call)
    assert torch.equal(batched[1, pad:], alone)

    # packed: queries are both continuations, keys the context and both continuations, each attending to its own
    Q = first + second
    packed_valid = torch.zeros(1, 1, Q, C + Q, dtype=torch.bool)
    packed_valid[..., :C] = True
    packed_valid[..., :first, C:C + first] = torch.ones(first, first, dtype=torch.bool).tril()
    packed_valid[..., first:, C + first:] = torch.ones(second, second, dtype=torch.bool).tril()
    packed = prefill.attention(q[:, :, C:], k, v, packed_valid, **call)[0]
    assert torch.equal(packed[first:], alone[C:])

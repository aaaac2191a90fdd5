"""The sparse attention backend: equivalences a wrong implementation cannot pass."""

import pytest
import torch

import toptheta
from conftest import ARCHS, qkv, tiny_4heads
from toptheta.calibration import Thresholds


def batch(left_pad: int = 3):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :left_pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("reference", ["sdpa", "eager"])
@pytest.mark.parametrize("left_pad", [0, 3])
def test_dense_backend_equals_transformers(arch, reference, left_pad):
    model, inputs = tiny_4heads(arch), batch(left_pad)
    model.set_attn_implementation(reference)
    with torch.no_grad():
        expected = model(**inputs).logits
        with toptheta.sparsify(model, toptheta.Dense()):
            got = model(**inputs).logits
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[real], expected[real], atol=2e-5, rtol=1e-5)
    assert model.config._attn_implementation == reference  # restored


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("sparsifier,comp", [
    (toptheta.Dense(), []),
    (toptheta.TopK(5, "post"), [toptheta.VMC()]),
    (toptheta.TopK(5, "pre"), [toptheta.SDC("exact"), toptheta.VMC()]),
])
def test_cached_decode_equals_full_forward(arch, sparsifier, comp):
    """Prefill row of length n and the decode step with KV length n see the same keys and rule."""
    model, inputs = tiny_4heads(arch), batch()
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp):
        full = model(**inputs).logits
        out = model(input_ids=ids[:, :-4], attention_mask=mask[:, :-4], use_cache=True)
        cache, steps = out.cache, []
        for t in range(ids.shape[1] - 4, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, -4:], atol=5e-5, rtol=1e-4)


def test_topk_with_k_at_least_n_equals_dense():
    model, inputs = tiny_4heads("llama"), batch()
    with torch.no_grad():
        with toptheta.sparsify(model):
            dense = model(**inputs).logits
        with toptheta.sparsify(model, toptheta.TopK(24, "pre"), []) as stats:
            sparse = model(**inputs).logits
    torch.testing.assert_close(sparse, dense)
    assert stats.kept_attention_fraction == 1.0


def test_generate_with_every_sparsifier_and_compensation():
    model, inputs = tiny_4heads("qwen2"), batch()
    v = torch.zeros(2, 4, 64)  # a threshold sparsifier with fixed θ per layer/head/n
    thresholds = Thresholds(v, [4, 4], "post")
    for sparsifier, comp in [(toptheta.TopK(4, "post"), [toptheta.VMC()]),
                             (toptheta.TopK(4, "pre"), [toptheta.SDC("exact")]),
                             (toptheta.TopTheta(Thresholds(v + 0.05, [4, 4], "post")), [toptheta.VMC()]),
                             (toptheta.TopTheta(Thresholds(v - 1.0, [4, 4], "pre")), [toptheta.SDC("exp-threshold"), toptheta.VMC()])]:
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
            out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.shape == (2, 30)
        assert 0 < stats.kept_vrow_fraction <= 1 and 0 < stats.kept_attention_fraction <= 1
    assert thresholds.max_n == 63


# ---- kernel-level properties on random tensors ------------------------------------------------------

def reference_probs(q, k, valid, scale):
    """Dense probabilities in float64, the brute-force reference. (B, H, Q, K)"""
    G = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~valid, float("-inf"))
    return torch.softmax(s, -1).nan_to_num(0.0), s


def run(sparsifier, comp=(), chunk=None, observer=None, stats=None, data=None):
    q, k, v, valid = data or qkv()
    return toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier,
                                     compensations=comp, chunk_size=chunk, observer=observer, stats=stats)


def collect_keep(sparsifier, comp=(), data=None):
    seen = []
    run(sparsifier, comp, observer=lambda rows: seen.append(rows), data=data)
    return seen[0]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_topk_keeps_min_k_n_and_never_a_masked_key(k):
    rows = collect_keep(toptheta.TopK(k, "post"))
    kept = rows.keep.sum(-1)  # (B, H, Q)
    assert torch.equal(kept, rows.n.expand_as(kept).clamp(max=k))
    assert not (rows.keep & ~rows.valid).any()


def test_threshold_at_k_plus_1th_largest_keeps_exactly_k():
    k, data = 4, qkv(B=1)
    rows = collect_keep(toptheta.Dense(), data=data)
    for placement in ("pre", "post"):
        tau = rows.kth_largest(k + 1, placement)[0]  # (H, Q): row i has n = i + 1
        values = torch.full((1, 4, 13), float("nan"))
        values[0, :, 1:] = tau
        thresholds = Thresholds(values, [k], placement)
        got = collect_keep(toptheta.TopTheta(thresholds), data=data).keep.sum(-1)[0]  # (H, Q)
        expected = torch.arange(1, 13).clamp(max=k).expand_as(got)
        assert torch.equal(got, expected), placement


def test_exact_sdc_gives_kept_elements_their_dense_probabilities():
    q, k, v, valid = data = qkv()
    p, _ = reference_probs(q, k, valid, 0.5)
    rows = collect_keep(toptheta.TopK(3, "pre"), data=data)
    expected = torch.einsum("bhqk,bhkd->bqhd", p * rows.keep, v.double().repeat_interleave(2, 1))
    got = run(toptheta.TopK(3, "pre"), [toptheta.SDC("exact")], data=data)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_vmc_beta_is_the_dropped_mass_times_the_mean_v_row():
    q, k, v, valid = data = qkv()
    p, _ = reference_probs(q, k, valid, 0.5)
    keep = collect_keep(toptheta.TopK(3, "post"), data=data).keep
    vr = v.double().repeat_interleave(2, 1)  # (B, H, K, D)
    beta = (p * ~keep).sum(-1, keepdim=True)  # (B, H, Q, 1)
    v_mean = (valid.double() @ vr) / valid.sum(-1, keepdim=True).clamp(min=1)
    expected = ((p * keep) @ vr + beta * v_mean).transpose(1, 2)
    got = run(toptheta.TopK(3, "post"), [toptheta.VMC()], data=data)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_topk_post_vmc_equals_topk_pre_exact_sdc_vmc():
    a = run(toptheta.TopK(4, "post"), [toptheta.VMC()])
    b = run(toptheta.TopK(4, "pre"), [toptheta.SDC("exact"), toptheta.VMC()])
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_pre_without_sdc_renormalises_over_the_kept_set():
    q, k, v, valid = data = qkv()
    p, _ = reference_probs(q, k, valid, 0.5)
    keep = collect_keep(toptheta.TopK(2, "pre"), data=data).keep
    renorm = (p * keep) / (p * keep).sum(-1, keepdim=True).clamp_min(1e-30)
    expected = (renorm @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(run(toptheta.TopK(2, "pre"), data=data).double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk", [1, 2, 5, 7])
@pytest.mark.parametrize("placement", ["pre", "post"])
def test_chunked_equals_unchunked(chunk, placement):
    thresholds = Thresholds(torch.full((1, 4, 1), -0.5 if placement == "pre" else 0.08), [2], placement)
    comp = [toptheta.SDC("exact"), toptheta.VMC()] if placement == "pre" else [toptheta.VMC()]
    for sparsifier in (toptheta.TopK(3, placement), toptheta.TopTheta(thresholds)):
        torch.testing.assert_close(run(sparsifier, comp, chunk=chunk), run(sparsifier, comp, chunk=100))


def test_statistics_equal_brute_force_counts():
    data = qkv()
    stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
    run(toptheta.TopK(3, "post"), stats=stats, data=data)
    n = data[3].sum(-1)  # (B, 1, Q)
    kept = n.clamp(max=3).sum() * 4
    assert stats.prefill_kept.sum() == kept and stats.prefill_valid.sum() == n.sum() * 4
    assert stats.kept_attention_fraction == pytest.approx(float(kept / (n.sum() * 4)))
    # decode: one query row over all 12 keys; V rows kept = union over the 2 heads of each group
    q, k, v, valid = data
    decode = (q[:, :, -1:], k, v, valid[:, :, -1:])
    rows = collect_keep(toptheta.TopK(3, "post"), data=decode)
    union = rows.keep.view(2, 2, 2, 1, 12).any(2).sum()
    run(toptheta.TopK(3, "post"), stats=stats, data=decode)
    assert stats.vrow_kept.sum() == union and stats.vrow_valid.sum() == valid[:, :, -1].sum() * 2
    p, _ = reference_probs(*decode[:2], decode[3], 0.5)
    assert float(stats.decode_kept.sum()) == 2 * 4 * 3
    stats.reset()
    assert stats.kept_attention_fraction is None and stats.kept_vrow_fraction is None


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_dropped_mass_statistic_equals_brute_force(placement):
    q, k, v, valid = data = qkv()
    p, _ = reference_probs(q, k, valid, 0.5)
    thresholds = Thresholds(torch.full((1, 4, 1), -0.5 if placement == "pre" else 0.08), [2], placement)
    for sparsifier in (toptheta.TopK(3, placement), toptheta.TopTheta(thresholds)):
        keep = collect_keep(sparsifier, data=data).keep
        stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
        run(sparsifier, stats=stats, data=data, chunk=5)
        expected = (p * ~keep).sum((0, 2, 3))  # (H,) rows without a valid key hold p = 0
        torch.testing.assert_close(stats.dropped_mass[0], expected, atol=1e-5, rtol=1e-5)
        assert stats.mean_dropped_mass == pytest.approx(float(expected.sum() / stats.rows.sum()), rel=1e-5)


@pytest.mark.parametrize("chunk", [None, 5])
def test_fused_kernel_equals_the_torch_path(monkeypatch, chunk):
    from toptheta.attention import fused

    if not fused.enabled():
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?); the torch path is in use")
    data = qkv(Q=40, K=40, seed=3)
    values = torch.full((1, 4, 31), 0.03)  # rows longer than 30 keys clamp to θ(30)
    values[..., :10] = float("-inf")  # uncalibrated short lengths keep every valid key
    thresholds = Thresholds(values, [4], "post")

    def once():
        stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
        out = run(toptheta.TopTheta(thresholds), [toptheta.VMC()], chunk=chunk, stats=stats, data=data)
        return out, stats

    fast, fast_stats = once()
    monkeypatch.setattr(fused, "extension", lambda: None)  # as on a machine without a compiler
    slow, slow_stats = once()
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    assert torch.equal(fast_stats.prefill_kept, slow_stats.prefill_kept)
    torch.testing.assert_close(fast_stats.dropped_mass, slow_stats.dropped_mass, atol=1e-5, rtol=1e-5)
    assert 0 < fast_stats.kept_attention_fraction < 1
    assert fast_stats.clamped_rows == slow_stats.clamped_rows > 0


class _CountingExtension:
    """The fused extension, counting the calls to each of its functions."""

    def __init__(self, ext):
        self.ext, self.calls = ext, {}

    def __getattr__(self, name):
        def call(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return getattr(self.ext, name)(*args)
        return call


@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("chunk", [None, 5])
def test_fused_topk_equals_the_torch_path(monkeypatch, masked, chunk):
    from toptheta.attention import fused

    if not fused.enabled():
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?); the torch path is in use")
    q, k, v, valid = qkv(Q=40, K=40, seed=5)
    # Equal logits at the k-th value: keys (and values, so that the choice among them cannot change the output)
    # repeated, each row then has ties that the kernel breaks by key order and torch.topk its own way.
    k[:, :, 20:26], v[:, :, 20:26] = k[:, :, 19:20], v[:, :, 19:20]
    data = (q, k, v, valid if masked else None)

    def once(sparsifier):
        stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
        return run(sparsifier, [toptheta.VMC()], chunk=chunk, stats=stats, data=data), stats

    counting = _CountingExtension(fused.extension())
    for kk in (1, 3, 8, 39):
        monkeypatch.setattr(fused, "extension", lambda: counting)
        fast, fast_stats = once(toptheta.TopK(kk, "post"))
        monkeypatch.setattr(fused, "extension", lambda: None)  # as on a machine without a compiler
        slow, slow_stats = once(toptheta.TopK(kk, "post"))
        torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
        assert torch.equal(fast_stats.prefill_kept, slow_stats.prefill_kept)
        torch.testing.assert_close(fast_stats.dropped_mass, slow_stats.dropped_mass, atol=1e-5, rtol=1e-5)
        assert 0 < fast_stats.kept_attention_fraction < 1
    assert counting.calls.get("post_topk", 0) > 0 and "post_threshold" not in counting.calls


def test_fused_topk_keeps_the_first_of_equal_logits():
    from toptheta.attention import fused
    from toptheta.sparsifiers import FusedRule

    if not fused.enabled():
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?); the torch path is in use")
    s = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, float("-inf"), 3.0]]).view(1, 1, 1, 7)
    p = torch.softmax(s, -1)
    kept_sum, counts, empty = fused.post_select(s, FusedRule(whole=torch.tensor([[[False]]]), k=3))
    expected = p * torch.tensor([0, 1, 0, 1, 0, 0, 1.0])  # 3.0, then the first two of the three 2.0s
    torch.testing.assert_close(s, expected)
    assert counts.item() == 3 and empty is None
    torch.testing.assert_close(kept_sum.view(()), expected.sum())


def test_rows_with_everything_below_threshold_keep_their_max_and_stay_finite():
    for placement in ("pre", "post"):
        thresholds = Thresholds(torch.full((1, 4, 1), 1e9), [1], placement)
        rows = collect_keep(toptheta.TopTheta(thresholds))
        assert torch.equal(rows.keep.sum(-1), rows.n.expand(2, 4, 12).clamp(max=1))
        comp = [toptheta.SDC("exp-threshold"), toptheta.VMC()] if placement == "pre" else [toptheta.VMC()]
        assert torch.isfinite(run(toptheta.TopTheta(thresholds), comp)).all()


def test_bfloat16_model_runs_with_float32_statistics():
    model = tiny_4heads("llama").to(torch.bfloat16)
    with torch.no_grad(), toptheta.sparsify(model, toptheta.TopK(4, "pre"), [toptheta.SDC(), toptheta.VMC()]) as stats:
        logits = model(**batch()).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert 0 < stats.kept_attention_fraction < 1


# ---- integration contract -----------------------------------------------------------------------------

def test_a_mask_function_is_registered_with_the_attention_function():
    """Without a mask function of the same name transformers silently passes no causal mask."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with toptheta.sparsify(tiny_4heads("llama", 1)):
        assert "toptheta" in ALL_ATTENTION_FUNCTIONS and "toptheta" in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


def test_context_manager_restores_on_exception_and_refuses_nesting():
    model = tiny_4heads("llama")
    with pytest.raises(ZeroDivisionError), toptheta.sparsify(model):
        1 / 0
    assert model.config._attn_implementation == "sdpa"
    with toptheta.sparsify(model), pytest.raises(RuntimeError, match="already inside"):
        with toptheta.sparsify(model):
            pass


def test_model_outside_the_block_with_our_implementation_fails_clearly():
    model = tiny_4heads("llama")
    with toptheta.sparsify(model):
        pass
    model.set_attn_implementation("toptheta")
    with pytest.raises(RuntimeError, match="outside a toptheta.sparsify"):
        model(**batch())


@pytest.mark.parametrize("sparsifier,comp,message", [
    (toptheta.TopK(4, "post"), [toptheta.SDC()], "needs pre-softmax"),
    (toptheta.TopK(4, "pre"), [toptheta.VMC()], "β is always 0"),
    (toptheta.TopK(4, "pre"), [toptheta.SDC("exp-threshold")], "threshold sparsifier"),
    (toptheta.Dense(), [toptheta.VMC()], "drops nothing"),
])
def test_meaningless_combinations_are_refused(sparsifier, comp, message):
    with pytest.raises(ValueError, match=message):
        with toptheta.sparsify(tiny_4heads("llama", 1), sparsifier, comp):
            pass


def test_thresholds_for_another_model_shape_are_refused():
    thresholds = Thresholds(torch.zeros(3, 4, 1), [2, 2, 2], "post", {"fingerprint": {"layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 16}})
    with pytest.raises(ValueError, match="calibrated for a model with"):
        with toptheta.sparsify(tiny_4heads("llama"), toptheta.TopTheta(thresholds), []):
            pass


@pytest.mark.parametrize("k", [1, 8, 134, 600])
def test_topk_asked_for_the_next_index_keeps_k_and_points_at_the_k_plus_1th_largest(k):
    """Under an observer that reads τ (RowBlock.want_next), TopK.select finds each row's (k + 1)-th largest in the same
    top-k call, and keeps the keys the plain call keeps, on rows with ties at the boundary too (many here); rows of
    n ≤ k stay whole."""
    from toptheta.sparsifiers.base import RowBlock

    g = torch.Generator().manual_seed(k)
    logits = (torch.randn(1, 3, 16, 1000, generator=g) * 4).round() / 4  # many ties at every k-th value
    n = torch.full((1, 1, 16), 1000)
    n[..., :2] = k  # two rows of n = k: kept whole
    logits[..., :2, k:] = float("-inf")
    rows = RowBlock(0, "prefill", logits, n, valid=torch.isfinite(logits[:, :1]))  # (B, 1, Q, K)
    rows.want_next = True
    keep = toptheta.TopK(k, "pre").select(rows)
    assert rows.next_index is not None  # the path under test ran
    plain = RowBlock(0, "prefill", logits, n, valid=torch.isfinite(logits[:, :1]))
    assert torch.equal(keep, toptheta.TopK(k, "pre").select(plain))  # the keys the run's Top-k keeps, ties included
    assert keep[..., 2:, :].sum(-1).eq(k).all() and keep[..., :2, :k].all() and not keep[..., :2, k:].any()
    next_value = logits.gather(-1, rows.next_index)[..., 2:, 0]  # (1, 3, 14)
    assert torch.equal(next_value, logits.sort(-1, descending=True).values[..., 2:, k])


@pytest.mark.parametrize("k", [1, 8, 134, 600])
def test_topk_keeps_the_set_of_a_sorted_topk_on_tied_rows(k):
    """TopK.select asks torch.topk for an unsorted set (cheaper); it must be the sorted call's set, ties included."""
    from toptheta.sparsifiers.base import RowBlock

    g = torch.Generator().manual_seed(k)
    logits = (torch.randn(1, 3, 16, 1000, generator=g) * 4).round() / 4  # many ties at every k-th value
    rows = RowBlock(0, "prefill", logits, torch.full((1, 1, 16), 1000))
    keep = toptheta.TopK(k, "pre").select(rows)
    expected = torch.zeros_like(keep).scatter_(-1, torch.topk(logits, k, dim=-1).indices, True)
    assert torch.equal(keep, expected) and keep.sum(-1).eq(k).all()

"""The baselines top-p and skip-softmax (issue 30), and Top-ρ where it shares their tests: kept sets equal a float64 re-implementation row by row (ties,
masked keys, rows without a key), the kernel's output equals float64 attention over those sets with every
compensation, the fast backends hand them to the plain and torch-decode paths, and a run through the pipeline
stores them, with a fixed parameter or one fitted to sparsifier.target_kept."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch

import toptheta
from conftest import cfg, qkv, sparse_rows, tiny_4heads
from toptheta import pipeline
from toptheta.attention import backends, fused
from toptheta.attention.backends.call import AttentionCall
from toptheta.calibration.target_kept import Unreachable
from toptheta.calibration.target_param import fit_parameter, log_slope
from toptheta.registry import Parameter, sparsifier_kind
from toptheta.sparsifiers.base import RowBlock
from toptheta.sparsifiers.toprho import kept_count

# ---- float64 references, one row at a time ----------------------------------------------------------------------


def ref_topp(scores: list[float], valid: list[bool], p: float) -> list[bool]:
    """The fewest keys (by score) whose float64 softmax mass reaches p, plus every key tied with the last one."""
    keys = [j for j, ok in enumerate(valid) if ok]
    if not keys:
        return [False] * len(scores)
    m = max(scores[j] for j in keys)
    z = sum(math.exp(scores[j] - m) for j in keys)
    boundary, mass = min(scores[j] for j in keys), 0.0
    for j in sorted(keys, key=lambda j: -scores[j]):
        mass += math.exp(scores[j] - m) / z
        if mass >= p:
            boundary = scores[j]
            break
    return [ok and s >= boundary for s, ok in zip(scores, valid)]


def ref_skip(scores: list[float], valid: list[bool], lam: float) -> tuple[list[bool], bool]:
    """(keep s ≥ m + ln(λ/n), the maximum always; whether the rule alone kept nothing)."""
    keys = [j for j, ok in enumerate(valid) if ok]
    if not keys:
        return [False] * len(scores), False
    m = max(scores[j] for j in keys)
    cut = m + math.log(lam / len(keys))
    return [ok and s >= min(cut, m) for s, ok in zip(scores, valid)], cut > m


def ref_toprho(scores: list[float], valid: list[bool], rho: float) -> list[bool]:
    """The ⌈ρ·n⌉ (at least one) largest of the n valid scores, plus every key tied with the last of them; ρ·n is
    taken as the exact fraction of ρ's decimal, so 0.07 · 100 is 7."""
    keys = [j for j, ok in enumerate(valid) if ok]
    if not keys:
        return [False] * len(scores)
    m = max(1, math.ceil(Fraction(str(rho)) * len(keys)))
    boundary = sorted((scores[j] for j in keys), reverse=True)[m - 1]
    return [ok and s >= boundary for s, ok in zip(scores, valid)]


def random_rows(seed: int, B=2, H=3, Q=7, K=11, grid: float | None = 0.5):
    """Logits (B, H, Q, K) with many ties (scores on a grid), random masks, and rows without any valid key."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, H, Q, K, generator=g) * 3
    if grid:
        s = (s / grid).round() * grid
    valid = torch.rand(B, 1, Q, K, generator=g) < 0.7
    valid[:, :, 0] = False  # a fully masked row
    valid[:, :, 1, :] = False
    valid[:, :, 1, 4] = True  # a row with one valid key
    s = s.masked_fill(~valid, float("-inf"))
    return RowBlock(0, "prefill", s, valid.sum(-1), valid=valid)


def reference_keep(rows: RowBlock, fn) -> torch.Tensor:
    B, H, Q, K = rows.logits.shape
    out = torch.zeros(B, H, Q, K, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                out[b, h, i] = torch.tensor(fn(rows.logits[b, h, i].tolist(), rows.valid[b, 0, i].tolist()))
    return out


def topp_promise(rows: RowBlock, keep: torch.Tensor, p: float, grid) -> None:
    """Each row with a key keeps at least a mass p; on a grid, ties at the boundary are kept."""
    kept_mass = (rows.probs.double() * keep).sum(-1)
    live = rows.n.expand_as(kept_mass) > 0
    assert bool((kept_mass[live] >= p - 1e-6).all())
    if grid:  # a tied key is kept exactly when its twin is (the reference set says so): the rows have ties
        assert any(len(set(r)) < len(r) for r in rows.logits[live].tolist())


def toprho_promise(rows: RowBlock, keep: torch.Tensor, rho: float, grid) -> None:
    """At least ⌈ρ·n⌉ keys per row (more only where ties straddle the boundary); exactly that on distinct scores."""
    counts = keep.sum(-1)  # (B, H, Q)
    n = rows.n.expand_as(counts)
    assert bool((counts >= torch.minimum(kept_count(n, rho), n)).all())
    if grid is None:  # none where the row has no key
        assert torch.equal(counts, torch.where(n > 0, kept_count(n, rho), 0))


RANKED_RULES = {  # rules that keep a prefix of the row's ranking: (class, float64 reference, values, what it promises)
    "topp": (toptheta.TopP, ref_topp, [0.05, 0.3, 0.62, 0.9, 0.97, 1.0], topp_promise),
    "toprho": (toptheta.TopRho, ref_toprho, [0.01, 0.1, 0.3, 0.5, 0.75, 1.0], toprho_promise),
}


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rule,value", [(rule, v) for rule, (_, _, values, _) in RANKED_RULES.items() for v in values])
@pytest.mark.parametrize("grid", [0.5, None])
def test_ranked_rules_keep_the_reference_set(seed, rule, value, grid):
    cls, reference, _, promise = RANKED_RULES[rule]
    rows = random_rows(seed, grid=grid)
    keep = cls(value).select(rows)
    expected = reference_keep(rows, lambda s, v: reference(s, v, value))
    keep = rows.valid.expand_as(expected) if keep is None else keep
    assert torch.equal(keep, expected)
    promise(rows, keep, value, grid)


def test_topp_drops_the_last_key_that_is_not_needed():
    logits = torch.tensor([[[[math.log(0.5), math.log(0.3), math.log(0.2)]]]])
    rows = RowBlock(0, "prefill", logits, torch.tensor([[[3]]]), valid=torch.ones(1, 1, 1, 3, dtype=torch.bool))
    assert toptheta.TopP(0.75).select(rows).tolist() == [[[[True, True, False]]]]
    assert toptheta.TopP(0.85).select(rows).tolist() == [[[[True, True, True]]]]
    assert toptheta.TopP(0.4).select(rows).tolist() == [[[[True, False, False]]]]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lam", [1e-3, 0.2, 1.0, 3.0, 50.0])
@pytest.mark.parametrize("grid", [0.5, None])
def test_skipsoftmax_keeps_the_reference_set(seed, lam, grid):
    rows = random_rows(seed, grid=grid)
    keep = toptheta.SkipSoftmax(lam).select(rows)
    B, H, Q, K = rows.logits.shape
    expected, empty = torch.zeros(B, H, Q, K, dtype=torch.bool), torch.zeros(B, H, Q, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(Q):
                kept, nothing = ref_skip(rows.logits[b, h, i].tolist(), rows.valid[b, 0, i].tolist(), lam)
                expected[b, h, i], empty[b, h, i] = torch.tensor(kept), nothing
    assert torch.equal(keep, expected)
    assert torch.equal(rows.empty, empty)  # rows whose cut passed their maximum (λ > n), kept at their maximum
    assert bool(empty.any()) == (lam > 1.0)


def test_skipsoftmax_cut_decides_as_float64():
    """The float32 cut: a float32 score passes it exactly when it passes m + ln(λ/n) in float64."""
    torch.manual_seed(0)
    rows = random_rows(7, grid=None)
    sparsifier = toptheta.SkipSoftmax(0.37)
    cut = sparsifier.cut(rows)  # (B, H, Q, 1)
    exact = torch.minimum(rows.row_max.double() + torch.log(0.37 / rows.n.unsqueeze(-1).double().clamp_min(1)),
                          rows.row_max.double())
    for step in (-2, -1, 0, 1, 2):  # the float32 values around the cut
        probe = cut
        for _ in range(abs(step)):
            probe = torch.nextafter(probe, probe.new_tensor(math.copysign(math.inf, step)))
        assert torch.equal(probe >= cut, probe.double() >= exact)


def test_rows_with_at_most_k_keys_are_kept_whole():
    rows = random_rows(3)
    for sparsifier in (toptheta.TopP(0.3, layer_k={0: 6}), toptheta.SkipSoftmax(0.5, k=6)):
        keep = sparsifier.select(rows)
        short = (rows.n <= 6).squeeze(1)  # (B, Q)
        whole = keep == rows.valid.expand_as(keep)  # (B, H, Q, K)
        assert bool(whole.all(-1).permute(0, 2, 1)[short].all())
        assert not bool(whole.all(-1).permute(0, 2, 1)[~short].all())  # longer rows are sparsified


@pytest.mark.parametrize("bad,message", [(lambda: toptheta.TopP(0.0), r"\(0, 1\]"),
                                         (lambda: toptheta.TopP(1.5), "TopP needs p: a probability mass in"),
                                         (lambda: toptheta.TopRho(0.0), r"\(0, 1\]"),
                                         (lambda: toptheta.TopRho(1.5), "TopRho needs rho: a share of each row's keys"),
                                         (lambda: toptheta.TopRho(True), "got True"),
                                         (lambda: toptheta.TopRho(0.5, k=0), "integer ≥ 1"),
                                         (lambda: toptheta.SkipSoftmax(0.0), "lam: a finite λ > 0"),
                                         (lambda: toptheta.SkipSoftmax(math.inf), "finite"),
                                         (lambda: toptheta.TopP(0.5, k=0), "integer ≥ 1"),
                                         (lambda: toptheta.SkipSoftmax(1.0, "mid"), "placement")])
def test_bad_arguments_name_the_fix(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


# ---- through the kernel: output, compensations, statistics, backends ------------------------------------------

def float64_attention(q, k, v, valid, scale, keep, placement, sdc: bool, vmc: bool):
    """Attention over the kept sets, computed in float64 from scratch (method.md §1-3). (B, Q, H, Dv)"""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = (q.double() @ kk.transpose(-1, -2) * scale).masked_fill(~valid, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # (B, H, Q, K)
    if placement == "post" or sdc:  # post: no renormalisation; exact SDC: the kept keys' dense probabilities
        w = p * keep
    else:
        w = (p * keep) / (p * keep).sum(-1, keepdim=True).clamp_min(1e-300)
    o = w @ vv
    if vmc:
        n = valid.sum(-1, keepdim=True)  # (B, 1, Q, 1)
        v_mean = (valid.double() @ vv) / n.clamp_min(1)
        o = o + (1 - w.sum(-1, keepdim=True)).masked_fill(n == 0, 0.0) * v_mean
    return o.transpose(1, 2)


SPARSIFIERS = [lambda placement: toptheta.TopP(0.8, placement), lambda placement: toptheta.SkipSoftmax(0.3, placement),
               lambda placement: toptheta.TopRho(0.4, placement)]
REFERENCES = {toptheta.TopP: lambda s, m: ref_topp(s, m, 0.8), toptheta.SkipSoftmax: lambda s, m: ref_skip(s, m, 0.3)[0],
              toptheta.TopRho: lambda s, m: ref_toprho(s, m, 0.4)}  # SPARSIFIERS' kept sets
COMPENSATIONS = {"pre": [[], [toptheta.SDC("exact")], [toptheta.SDC("exact"), toptheta.VMC()]],
                 "post": [[], [toptheta.VMC()]]}


@pytest.mark.parametrize("make", SPARSIFIERS)
@pytest.mark.parametrize("placement,comp", [(pl, c) for pl, cs in COMPENSATIONS.items() for c in cs])
@pytest.mark.parametrize("chunk", [None, 5])
def test_kernel_output_equals_float64_attention_over_the_kept_sets(make, placement, comp, chunk):
    q, k, v, valid = qkv()  # the second sequence is left-padded: its first rows have no valid key
    sparsifier = make(placement)
    seen = []
    stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
    out = toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier, compensations=comp,
                                    chunk_size=chunk, stats=stats, observer=seen.append)
    assert stats.backend_calls == {"plain": 1}  # no fast path serves the baselines' (nor Top-ρ's) prefill
    K = k.shape[2]  # chunks see keys 0..(their last valid key): padded back to K (key 0 is valid in sequence 0)
    pad = lambda t, fill: torch.nn.functional.pad(t, (0, K - t.shape[-1]), value=fill)  # noqa: E731
    keep = torch.cat([pad(rows.keep, False) for rows in seen], 2)  # (B, H, Q, K) chunks along Q
    logits = torch.cat([pad(rows.logits, float("-inf")) for rows in seen], 2)
    rows = RowBlock(0, "prefill", logits, valid.sum(-1), valid=valid)
    assert torch.equal(keep, reference_keep(rows, REFERENCES[type(sparsifier)]))
    assert 0 < float(keep.sum()) < float(valid.expand_as(keep).sum())  # something was dropped, something kept
    sdc, vmc = any(isinstance(c, toptheta.SDC) for c in comp), any(isinstance(c, toptheta.VMC) for c in comp)
    expected = float64_attention(q, k, v, valid, 0.5, keep, placement, sdc, vmc)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    # statistics: brute-force counts of the kept sets
    assert float(stats.prefill_kept.sum()) == float(keep.sum())
    assert stats.kept_attention_fraction == pytest.approx(float(keep.sum()) / float(valid.sum() * 4))


@pytest.mark.parametrize("make", SPARSIFIERS)
def test_decode_rows_run_on_torch_decode_and_match_the_plain_kernel(make, monkeypatch):
    q, k, v, valid = qkv()
    decode = dict(query=q[:, :, -1:], key=k, value=v, valid=valid[:, :, -1:])
    sparsifier = make("post")
    outs = {}
    for forced in ("auto", "plain"):
        monkeypatch.setenv("TOPTHETA_BACKEND", forced)
        stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
        outs[forced] = toptheta.sparse_attention(**decode, scaling=0.5, layer=0, sparsifier=sparsifier,
                                                 compensations=[toptheta.VMC()], stats=stats, phase="decode")
        assert stats.backend_calls == {"torch-decode" if forced == "auto" else "plain": 1}
        assert 0 < stats.kept_vrow_fraction < 1
    torch.testing.assert_close(outs["auto"], outs["plain"], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("make", SPARSIFIERS)
def test_fast_backends_refuse_the_baselines_before_the_softmax_with_a_reason(make, monkeypatch):
    """After the softmax the baselines have the fused CPU kernel (below); before it top-p and Top-ρ run on the plain
    kernel on CPU, skip-softmax (a threshold once the row's maximum is known) on the one-pass prefill's two passes
    (test_fast_paths.py; on a GPU, Triton serves skip-softmax: test_triton_kernels.py)."""
    from toptheta.attention import fused_prefill

    q, k, v, valid = qkv()
    call = AttentionCall(q, k, v, None, 0.5, 0, make("pre"), (toptheta.SDC("exact"),), phase="prefill")
    assert call.kind in ("topp", "skipsoftmax", "toprho")  # its registered name
    serving = "cpu-prefill" if call.kind == "skipsoftmax" and fused_prefill.extension() is not None else "plain"
    assert backends.choose(call).name == serving
    refusing = [b for b in backends.backends() if b.name not in ("plain", "torch-decode", serving)]
    assert refusing and all(b.refuse(call) for b in refusing)
    monkeypatch.setenv("TOPTHETA_BACKEND", "cpu-select")
    with pytest.raises(RuntimeError, match="cannot serve"):
        backends.choose(call)


@pytest.mark.parametrize("sparsifier", [toptheta.TopP(0.3, "post", k=3), toptheta.TopP(0.8, "post", k=3),
                                        toptheta.TopP(0.97, "post", k=3), toptheta.SkipSoftmax(0.5, "post", k=3),
                                        toptheta.SkipSoftmax(6.0, "post", k=3)], ids=repr)
@pytest.mark.parametrize("chunk", [None, 5])
@pytest.mark.parametrize("tied", [False, True])
def test_fused_baselines_equal_the_plain_kernel(monkeypatch, sparsifier, chunk, tied):
    """The fused kernel keeps the plain kernel's sets (top-p by a selection, no sort; skip-softmax by its cut), ties
    included, with its output and statistics (skip-softmax's empty rows: λ = 6 exceeds the first rows' n)."""
    if not fused.enabled():
        pytest.skip("the fused CPU kernel could not be built here (no C++ compiler?); the plain kernel serves them")
    q, k, v, valid = qkv(Q=40, K=40, seed=7)
    if tied:  # repeated keys (and values): equal logits around every boundary
        k[:, :, 20:26], v[:, :, 20:26] = k[:, :, 19:20], v[:, :, 19:20]
    outs, stats = {}, {}
    for forced in ("cpu-select", "plain"):
        monkeypatch.setenv("TOPTHETA_BACKEND", forced)
        stats[forced] = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
        outs[forced] = toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier,
                                                 compensations=[toptheta.VMC()], chunk_size=chunk,
                                                 stats=stats[forced])
        assert stats[forced].backend_calls == {forced: 1}
        assert 0 < stats[forced].kept_attention_fraction < 1
    torch.testing.assert_close(outs["cpu-select"], outs["plain"], atol=1e-6, rtol=1e-5)
    assert torch.equal(stats["cpu-select"].prefill_kept, stats["plain"].prefill_kept)
    assert torch.equal(stats["cpu-select"].empty_rows, stats["plain"].empty_rows)
    if isinstance(sparsifier, toptheta.SkipSoftmax) and sparsifier.lam > 3:
        assert stats["plain"].empty_rows.sum() > 0


@pytest.mark.parametrize("make", [lambda placement: toptheta.TopP(0.6, placement),
                                  lambda placement: toptheta.SkipSoftmax(12.0, placement),  # a random model: flat rows
                                  lambda placement: toptheta.TopRho(0.3, placement)])
def test_cached_decode_equals_full_forward_and_generate_runs(make):
    model = tiny_4heads("llama")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (1, 16), generator=g)
    for sparsifier, comp in ((make("post"), [toptheta.VMC()]), (make("pre"), [toptheta.SDC("exact"), toptheta.VMC()])):
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
            full = model(input_ids=ids).logits
            out = model(input_ids=ids[:, :-4], use_cache=True)
            cache, steps = out.cache, []
            for t in range(12, 16):
                out = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
                cache = out.cache
                steps.append(out.logits[:, -1])
            torch.testing.assert_close(torch.stack(steps, 1), full[:, -4:], atol=5e-5, rtol=1e-4)
            assert stats.kept_attention_fraction < 1.0
            generated = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
        assert generated.shape == (1, 12)


def test_checks_refuse_meaningless_compensations():
    with pytest.raises(ValueError, match="threshold sparsifier"):
        toptheta.sparsify(tiny_4heads("llama"), toptheta.TopP(0.9, "pre"), [toptheta.SDC("exp-threshold")]).__enter__()
    with pytest.raises(ValueError, match="needs pre-softmax"):
        toptheta.sparsify(tiny_4heads("llama"), toptheta.SkipSoftmax(1.0, "post"), [toptheta.SDC("exact")]).__enter__()


# ---- matched sparsity: the parameter fitted to a target ---------------------------------------------------------

@pytest.mark.parametrize("name", ["topp", "skipsoftmax", "toprho"])
def test_fit_parameter_finds_a_monotone_parameter(name):
    parameter = sparsifier_kind(name).parameter
    if parameter.keeps_more_when_higher:
        kept = lambda x: 0.02 + 0.98 * x ** 3  # noqa: E731 (kept fraction rising with p)
    else:
        kept = lambda x: 1 / (1 + x ** 0.5)  # noqa: E731 (falling with λ)
    for target in (0.05, 0.1, 1 / 3, 0.8):
        value, got, tried = fit_parameter(target, parameter, kept)
        assert abs(got / target - 1) <= 0.05 and got == kept(value) and tried[-1] == (value, got)
        assert parameter.low <= value <= parameter.high


def test_fit_parameter_interpolates_once_the_bracket_is_measured():
    """A kept fraction that is a power of λ (close to what the calibration rows measure): the midpoint, the
    bisection that measures the bracket's other end, then one interpolation on the target (halving alone took
    six steps on SmolLM2's rows). A jagged one still converges, every slow interpolation followed by a halving."""
    parameter = sparsifier_kind("skipsoftmax").parameter
    power = lambda lam: 0.37 * (lam / 0.1) ** -0.3  # noqa: E731
    value, got, tried = fit_parameter(0.1, parameter, power)
    assert len(tried) == 3 and got == pytest.approx(0.1, rel=1e-9)
    steps = lambda lam: 0.5 / (1 + math.floor(math.log10(lam) + 7) ** 3)  # noqa: E731 (flat, then a jump per decade)
    target = steps(0.05)
    value, got, tried = fit_parameter(target, parameter, steps, tolerance=0.0)
    assert got == target and parameter.low <= value <= parameter.high


def test_fit_parameter_from_a_start_steps_along_a_slope_instead_of_halving_the_range():
    """Top-θ's k search (each k a calibration) starts at Top-k's k with Top-k's slope: on a kept fraction that is a
    power of k, one step from the start lands where halving the range from it takes several; without a slope the
    search is the plain bisection it always was."""
    k_range = Parameter("k", 1, 8192, log=True, keeps_more_when_higher=True)
    kept = lambda k: 0.002 * k ** 0.8  # noqa: E731
    value, got, tried = fit_parameter(0.1, k_range, kept, start=40.0, slope=0.8)
    assert tried[0][0] == 40.0 and len(tried) == 2 and got == pytest.approx(0.1, rel=1e-9)
    # a slope that is off (0.5 for 0.8): the secant of the two values measured corrects it
    value, got, tried = fit_parameter(0.1, k_range, kept, start=40.0, slope=0.5)
    assert len(tried) <= 4 and abs(got / 0.1 - 1) <= 0.05
    halving = fit_parameter(0.1, k_range, kept, start=40.0)[2]  # the start alone: the range's middle next
    assert len(halving) > 2 and halving[1][0] == pytest.approx(math.sqrt(40.0 * 8192))
    assert fit_parameter(0.1, k_range, kept)[2][0][0] == pytest.approx(math.sqrt(8192))
    assert log_slope(k_range, [(10, kept(10)), (100, kept(100))]) == pytest.approx(0.8)
    assert log_slope(k_range, [(10, 0.2), (100, 0.1)]) is None  # the wrong sign for k: no slope
    with pytest.raises(ValueError, match="outside"):
        fit_parameter(0.1, k_range, kept, start=9000.0)


def test_fit_parameter_refuses_an_unreachable_target():
    with pytest.raises(Unreachable, match="layer_k"):  # even the smallest p keeps 0.2
        fit_parameter(0.05, sparsifier_kind("topp").parameter, lambda p: 0.2 + 0.8 * p)


# ---- through the pipeline --------------------------------------------------------------------------------------



@pytest.mark.parametrize("sparsifier,key,value", [("topp", "p", "0.8"), ("skipsoftmax", "lam", "0.5"),
                                                  ("toprho", "rho", "0.4")])
def test_a_pipeline_run_of_each_baseline_is_stored(tmp_path, sparsifier, key, value):
    rows = sparse_rows(tmp_path, f"sparsifier={sparsifier}", f"sparsifier.{key}={value}", "comp=vmc",
                "sparsifier.placement=post", "sparsifier.layer_k=null")
    assert rows and {r["sparsifier"] for r in rows} == {sparsifier} and {r[key] for r in rows} == {value}
    assert all(0 < float(r["kept_attention_fraction"]) < 1 for r in rows)
    assert {r["k"] for r in rows} == {""} and {r["calib_beyond"] for r in rows} == {""}  # no k, no thresholds
    stats = json.loads((tmp_path / "runs" / rows[0]["run_id"] / "stats.json").read_text())
    from toptheta.attention import fused_prefill

    prefill = "cpu-select" if fused.enabled() and sparsifier != "toprho" else "plain"  # post: the fused selection,
    if sparsifier == "skipsoftmax" and fused_prefill.extension() is not None:  # or skip-softmax's cut in the one-pass
        prefill = "cpu-prefill"                                                # prefill's two passes
    assert set(stats["backend_calls"]) <= {prefill, "torch-decode"} and stats["backend_calls"].get(prefill)


@pytest.mark.parametrize("sparsifier,key", [("topp", "p"), ("skipsoftmax", "lam"), ("toprho", "rho")])
def test_target_kept_fits_the_baselines_parameter(tmp_path, sparsifier, key):
    rows = sparse_rows(tmp_path, f"sparsifier={sparsifier}", "comp=vmc", "sparsifier.placement=post",
                "sparsifier.target_kept=0.3", "sparsifier.layer_k=null", "task.fewshot_sampler=first_n")
    assert rows and all(abs(float(r["kept_attention_fraction"]) / 0.3 - 1) <= 0.1 for r in rows)
    stats = json.loads((tmp_path / "runs" / rows[0]["run_id"] / "stats.json").read_text())
    assert stats["target"][key] == pytest.approx(float(rows[0][key])) and stats["target"]["target_kept"] == 0.3
    assert len(stats["target"]["tried"]) >= 1


@pytest.mark.parametrize("overrides,message", [
    (["sparsifier=topp", "sparsifier.p=0"], "sparsifier.p=0"),
    (["sparsifier=topp", "sparsifier.p=1.5"], "a probability mass in"),
    (["sparsifier=skipsoftmax", "sparsifier.lam=-1"], "a finite λ > 0"),
    (["sparsifier=skipsoftmax", "sparsifier.placement=pre", "comp.sdc=calibrated"], "null or exact"),
    (["sparsifier=topk", "sparsifier.p=0.5"], "only sparsifier=topp reads it"),
    (["sparsifier=topp", "sparsifier.k=0"], "rows with at most k keys"),
    (["sparsifier=toprho", "sparsifier.rho=0"], "sparsifier.rho=0"),
    (["sparsifier=toprho", "sparsifier.rho=1.5"], "a share of each row's keys"),
    (["sparsifier=topk", "sparsifier.rho=0.5"], "only sparsifier=toprho reads it"),
])
def test_bad_baseline_configurations_fail_before_any_model_loads(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="invalid configuration") as err:
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", *overrides))
    assert message in str(err.value)


def test_new_fields_leave_existing_run_ids_alone(tmp_path):
    """p and lam ride outside the identity of every other sparsifier; the baselines' ids move with them."""
    base = ("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}")
    topk = pipeline.plan(cfg(*base, "sparsifier=topk"))[-1]
    assert "p" not in topk.sparsifier.settings and "lam" not in topk.sparsifier.settings
    a, b = (pipeline.plan(cfg(*base, "sparsifier=topp", f"sparsifier.p={p}"))[-1] for p in (0.8, 0.9))
    assert a.run_id != b.run_id and a.calib is None
    fitted = pipeline.plan(cfg(*base, "sparsifier=skipsoftmax", "sparsifier.target_kept=0.1"))[-1]
    assert fitted.sparsifier.settings["lam"] is None and fitted.target.settings["task"]  # fitted at run time


def test_wandb_run_names_carry_the_baselines_parameter():
    from types import SimpleNamespace

    from toptheta.results.wandb_logger import run_name

    spec = SimpleNamespace(label="skipsoftmax-pre", run_id="a" * 16)
    rows = [{"model": "m", "k": None, "lam": 0.5, "comp": "none", "task": "smoke", "calib_beyond": None}]
    assert run_name(spec, rows) == "m skipsoftmax-pre lam=0.5 smoke [aaaaaaaa]"

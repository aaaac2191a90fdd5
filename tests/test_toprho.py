"""Top-ρ (top-k with ⌈ρ·n⌉ keys per row): kept sets equal a float64 re-implementation row by row (ties, masked keys,
rows without a key), the kernel's output equals float64 attention over those sets, decode steps and cached
generation agree with the full forward, and a pipeline run stores ρ given or fitted to sparsifier.target_kept."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import cfg, qkv, sparse_rows, tiny_4heads
from test_baselines import float64_attention, random_rows, reference_keep

import toptheta
from toptheta import pipeline
from toptheta.attention import backends
from toptheta.attention.backends.call import AttentionCall
from toptheta.calibration.target_param import fit_parameter
from toptheta.registry import sparsifier_kind
from toptheta.sparsifiers.base import RowBlock
from toptheta.sparsifiers.toprho import kept_count


def ref_toprho(scores: list[float], valid: list[bool], rho: float) -> list[bool]:
    """The ⌈ρ·n⌉ (at least one) largest of the n valid scores, plus every key tied with the last of them; ρ·n is
    taken as the exact fraction of ρ's decimal, so 0.07 · 100 is 7."""
    keys = [j for j, ok in enumerate(valid) if ok]
    if not keys:
        return [False] * len(scores)
    from fractions import Fraction
    m = max(1, math.ceil(Fraction(str(rho)) * len(keys)))
    boundary = sorted((scores[j] for j in keys), reverse=True)[m - 1]
    return [ok and s >= boundary for s, ok in zip(scores, valid)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("rho", [0.01, 0.1, 0.3, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("grid", [0.5, None])
def test_toprho_keeps_the_reference_set(seed, rho, grid):
    rows = random_rows(seed, grid=grid)
    keep = toptheta.TopRho(rho).select(rows)
    expected = reference_keep(rows, lambda s, v: ref_toprho(s, v, rho))
    keep = rows.valid.expand_as(expected) if keep is None else keep
    assert torch.equal(keep, expected)
    counts = keep.sum(-1)  # (B, H, Q): at least ⌈ρ·n⌉ keys (more only where ties straddle the boundary)
    n = rows.n.expand_as(counts)
    assert bool((counts >= torch.minimum(kept_count(n, rho), n)).all())
    if grid is None:  # distinct scores: exactly ⌈ρ·n⌉ (none where the row has no key)
        assert torch.equal(counts, torch.where(n > 0, kept_count(n, rho), 0))


def test_kept_count_is_the_exact_ceiling():
    n = torch.arange(0, 2001)
    for rho in (0.1, 0.3, 1 / 3, 0.05, 0.07, 0.034, 0.007, 1.0):
        from fractions import Fraction
        exact = [max(1, math.ceil(Fraction(str(rho)) * int(v))) for v in n]
        assert kept_count(n, rho).tolist() == exact, rho
    assert 0.07 * 100 > 7  # the float product that would add a key
    assert int(kept_count(torch.tensor(100), 0.07)) == 7


def test_rows_with_at_most_k_keys_are_kept_whole_and_a_longer_row_keeps_more():
    rows = random_rows(3, K=40, Q=9, grid=None)
    keep = toptheta.TopRho(0.3, layer_k={0: 6}).select(rows)
    short = (rows.n <= 6).squeeze(1)  # (B, Q)
    whole = (keep == rows.valid.expand_as(keep)).all(-1).permute(0, 2, 1)  # (B, Q, H)
    assert bool(whole[short].all()) and not bool(whole[~short].all())
    logits = torch.randn(1, 1, 2, 100)
    valid = torch.ones(1, 1, 2, 100, dtype=torch.bool)
    valid[0, 0, 0, 50:] = False  # a row of 50 keys and one of 100
    rows = RowBlock(0, "prefill", logits.masked_fill(~valid, float("-inf")), valid.sum(-1), valid=valid)
    assert toptheta.TopRho(0.1).select(rows).sum(-1).tolist() == [[[5, 10]]]  # Top-k would keep k of both


@pytest.mark.parametrize("bad,message", [(lambda: toptheta.TopRho(0.0), r"\(0, 1\]"),
                                         (lambda: toptheta.TopRho(1.5), "rho in"),
                                         (lambda: toptheta.TopRho(True), "rho in"),
                                         (lambda: toptheta.TopRho(0.5, k=0), "integer ≥ 1"),
                                         (lambda: toptheta.TopRho(0.5, "mid"), "placement")])
def test_bad_arguments_name_the_fix(bad, message):
    with pytest.raises(ValueError, match=message):
        bad()


@pytest.mark.parametrize("placement,comp", [("pre", []), ("pre", [toptheta.SDC("exact"), toptheta.VMC()]),
                                            ("post", []), ("post", [toptheta.VMC()])])
@pytest.mark.parametrize("chunk", [None, 5])
def test_kernel_output_equals_float64_attention_over_the_kept_sets(placement, comp, chunk):
    q, k, v, valid = qkv()  # the second sequence is left-padded: its first rows have no valid key
    seen = []
    stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
    out = toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=toptheta.TopRho(0.4, placement),
                                    compensations=comp, chunk_size=chunk, stats=stats, observer=seen.append)
    assert stats.backend_calls == {"plain": 1}  # no fast path serves Top-ρ's prefill
    K = k.shape[2]
    pad = lambda t, fill: torch.nn.functional.pad(t, (0, K - t.shape[-1]), value=fill)  # noqa: E731
    keep = torch.cat([pad(rows.keep, False) for rows in seen], 2)  # (B, H, Q, K) chunks along Q
    logits = torch.cat([pad(rows.logits, float("-inf")) for rows in seen], 2)
    rows = RowBlock(0, "prefill", logits, valid.sum(-1), valid=valid)
    assert torch.equal(keep, reference_keep(rows, lambda s, m: ref_toprho(s, m, 0.4)))
    assert 0 < float(keep.sum()) < float(valid.expand_as(keep).sum())
    sdc, vmc = any(isinstance(c, toptheta.SDC) for c in comp), any(isinstance(c, toptheta.VMC) for c in comp)
    expected = float64_attention(q, k, v, valid, 0.5, keep, placement, sdc, vmc)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=1e-5)
    assert float(stats.prefill_kept.sum()) == float(keep.sum())


def test_backends_route_it_to_the_plain_and_torch_decode_paths(monkeypatch):
    q, k, v, valid = qkv()
    call = AttentionCall(q, k, v, None, 0.5, 0, toptheta.TopRho(0.3, "post"), (toptheta.VMC(),), phase="prefill")
    assert call.kind == "toprho" and backends.choose(call).name == "plain"
    decode = dict(query=q[:, :, -1:], key=k, value=v, valid=valid[:, :, -1:])
    outs = {}
    for forced in ("auto", "plain"):
        monkeypatch.setenv("TOPTHETA_BACKEND", forced)
        stats = toptheta.SparsityStats(num_layers=1, num_heads=4, num_kv_heads=2)
        outs[forced] = toptheta.sparse_attention(**decode, scaling=0.5, layer=0, sparsifier=toptheta.TopRho(0.3),
                                                 compensations=[toptheta.VMC()], stats=stats, phase="decode")
        assert stats.backend_calls == {"torch-decode" if forced == "auto" else "plain": 1}
        assert 0 < stats.kept_vrow_fraction < 1
    torch.testing.assert_close(outs["auto"], outs["plain"], atol=1e-6, rtol=1e-5)


def test_cached_decode_equals_full_forward_and_generate_runs():
    model = tiny_4heads("llama")
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(1))
    for sparsifier, comp in ((toptheta.TopRho(0.3, "post"), [toptheta.VMC()]),
                             (toptheta.TopRho(0.3, "pre"), [toptheta.SDC("exact"), toptheta.VMC()])):
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
            assert model.generate(ids[:, :8], max_new_tokens=4, do_sample=False).shape == (1, 12)


def test_fit_parameter_finds_rho():
    parameter = sparsifier_kind("toprho").parameter
    assert parameter.key == "rho" and parameter.keeps_more_when_higher and not parameter.accepts(1.5)
    kept = lambda rho: 0.01 + 0.99 * rho  # noqa: E731 (about linear: each row keeps its share)
    for target in (0.05, 0.1, 1 / 3):
        value, got, tried = fit_parameter(target, parameter, kept)
        assert abs(got / target - 1) <= 0.05 and parameter.low <= value <= parameter.high


def test_a_pipeline_run_stores_rho_given_or_fitted(tmp_path):
    rows = sparse_rows(tmp_path, "sparsifier=toprho", "sparsifier.rho=0.4", "comp=vmc", "sparsifier.placement=post",
                       "sparsifier.layer_k=null")
    assert rows and {r["sparsifier"] for r in rows} == {"toprho"} and {r["rho"] for r in rows} == {"0.4"}
    assert all(0 < float(r["kept_attention_fraction"]) < 1 for r in rows) and {r["k"] for r in rows} == {""}
    stats = json.loads((tmp_path / "runs" / rows[0]["run_id"] / "stats.json").read_text())
    assert set(stats["backend_calls"]) <= {"plain", "torch-decode"} and stats["backend_calls"].get("plain")
    fitted = sparse_rows(tmp_path / "fit", "sparsifier=toprho", "comp=vmc", "sparsifier.placement=post",
                         "sparsifier.target_kept=0.3", "sparsifier.layer_k=null", "task.fewshot_sampler=first_n")
    assert fitted and all(abs(float(r["kept_attention_fraction"]) / 0.3 - 1) <= 0.1 for r in fitted)
    stats = json.loads((tmp_path / "fit" / "runs" / fitted[0]["run_id"] / "stats.json").read_text())
    assert stats["target"]["rho"] == pytest.approx(float(fitted[0]["rho"]))


@pytest.mark.parametrize("overrides,message", [
    (["sparsifier=toprho", "sparsifier.rho=0"], "sparsifier.rho=0"),
    (["sparsifier=toprho", "sparsifier.rho=1.5"], "a share of each row's keys"),
    (["sparsifier=topk", "sparsifier.rho=0.5"], "only sparsifier=toprho reads it"),
])
def test_bad_configurations_fail_before_any_model_loads(tmp_path, overrides, message):
    with pytest.raises(ValueError, match="invalid configuration") as err:
        pipeline.plan(cfg("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}", *overrides))
    assert message in str(err.value)


def test_rho_leaves_other_run_ids_alone(tmp_path):
    base = ("model=tiny-llama", "task=smoke", f"results_dir={tmp_path}")
    topk = pipeline.plan(cfg(*base, "sparsifier=topk"))[-1]
    assert "rho" not in topk.sparsifier.settings
    a, b = (pipeline.plan(cfg(*base, "sparsifier=toprho", f"sparsifier.rho={r}"))[-1] for r in (0.1, 0.2))
    assert a.run_id != b.run_id and a.calib is None


def test_toptheta_eval_takes_rho_as_a_model_arg():
    from toptheta.spec import RunSpec

    spec, rest = RunSpec.from_model_args("tiny-llama", sparsifier="toprho", rho=0.2, batch_size=1)
    assert spec.sparsifier.settings["rho"] == 0.2 and spec.sparsifier.k is None and rest == {"batch_size": 1}
    with pytest.raises(ValueError, match=r"rho=2: a share of each row's keys"):
        RunSpec.from_model_args("tiny-llama", sparsifier="toprho", rho=2)

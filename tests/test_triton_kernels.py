"""Triton kernels (attention/triton/) against the plain kernel, the reference (issue 29).

Every kernel runs in Triton's interpreter on CPU (TRITON_INTERPRET=1, set here before triton's first import)
and is compared with ``kernel.sparse_attention`` with the fast paths off: outputs within 1e-5 in float32, per-row
kept counts equal to the plain keep masks, and ``SparsityStats`` equal (counts exactly). The same tests run the
compiled kernels on a GPU with ``TRITON_INTERPRET=0 pytest -m 'gpu or not gpu' tests/test_triton_kernels.py``;
the ``gpu`` tests add realistic shapes in bfloat16 and float32.
"""

import contextlib
import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import; TRITON_INTERPRET=0 for a GPU run

import pytest
import torch

pytest.importorskip("triton")

import toptheta  # noqa: E402
from toptheta.attention import decode as plain_decode  # noqa: E402
from toptheta.attention import prefill as plain_prefill  # noqa: E402
from toptheta.attention.triton import available, lowering  # noqa: E402
from toptheta.attention.triton.common import interpreted, row_bounds  # noqa: E402
from toptheta.calibration import Thresholds  # noqa: E402

# Kernels decorated before the variable was set (another test module imported them) are re-decorated.
_want = os.environ["TRITON_INTERPRET"] not in ("", "0")
for _name in ("toptheta.attention.triton.prefill", "toptheta.attention.triton.decode"):
    _module = sys.modules.get(_name) or importlib.import_module(_name)
    _kernel = getattr(_module, "_prefill_kernel", None) or getattr(_module, "_decode_select")
    if interpreted(_kernel) != _want:
        importlib.reload(_module)
from toptheta.attention.triton.decode import decode_attention  # noqa: E402
from toptheta.attention.triton.prefill import _prefill_kernel, prefill_attention  # noqa: E402

INTERPRETED = interpreted(_prefill_kernel)
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 needs a CUDA device", allow_module_level=True)

H, HKV = 4, 2  # GQA: 2 query heads per KV head
MAX_N = 96


def _thresholds(placement: str, k: int = 3) -> Thresholds:
    """θ per (head, n) that keeps a part of most rows; head 0's θ is above every score: its rows are empty."""
    g = torch.Generator().manual_seed(7)
    n = torch.arange(MAX_N + 1).clamp(min=1).float()
    if placement == "pre":
        values = (0.8 + 0.4 * torch.rand(1, H, 1, generator=g)).expand(1, H, MAX_N + 1).clone()  # scaled logits
        values[0, 0] = 1.0e4
    else:
        values = (1.5 + torch.rand(1, H, 1, generator=g)) / n  # a few times the uniform probability
        values[0, 0] = 2.0  # above any probability
    values[..., :2] = float("nan")
    sdc_mass = torch.rand(1, H, MAX_N + 1, generator=g) * n
    return Thresholds(values.contiguous(), [k], placement, sdc_mass=sdc_mass)


CONFIGS = {  # name: (placement, SDC estimator, VMC)
    "pre": ("pre", None, False),
    "pre-sdc": ("pre", "exact", False),
    "pre-expsdc": ("pre", "exp-threshold", False),
    "pre-calsdc": ("pre", "calibrated", False),
    "pre-sdc-vmc": ("pre", "exact", True),
    "pre-expsdc-vmc": ("pre", "exp-threshold", True),
    "pre-calsdc-vmc": ("pre", "calibrated", True),
    "post": ("post", None, False),
    "post-vmc": ("post", None, True),
}
CASES = [(name, "keep-max") for name in CONFIGS] + [(name, "reference") for name in ("pre", "pre-sdc-vmc", "post-vmc")]


# skip-softmax (one λ; rows of n < λ keep their maximum): name -> (placement, SDC estimator, VMC, λ)
SKIP_CONFIGS = {
    "skip-pre": ("pre", None, False, 0.5),
    "skip-pre-sdc-vmc": ("pre", "exact", True, 6.0),
    "skip-post": ("post", None, False, 6.0),
    "skip-post-vmc": ("post", None, True, 0.5),
}


# Top-k and top-p (decode only: their boundaries are selections over whole rows) -> (placement, SDC estimator, VMC)
RANKED_CONFIGS = {
    "topk-pre": ("pre", None, False),
    "topk-pre-sdc-vmc": ("pre", "exact", True),
    "topk-post": ("post", None, False),
    "topk-post-vmc": ("post", None, True),
    "topp-pre-sdc-vmc": ("pre", "exact", True),
    "topp-post": ("post", None, False),
    "topp-post-vmc": ("post", None, True),
}


def _objects(name: str, empty_rows: str = "keep-max", k: int = 8, p: float = 0.95):
    if name in RANKED_CONFIGS:
        placement, estimator, vmc = RANKED_CONFIGS[name]
        sparsifier = toptheta.TopK(k, placement) if name.startswith("topk") else toptheta.TopP(p, placement, k=k)
    elif name in SKIP_CONFIGS:
        placement, estimator, vmc, lam = SKIP_CONFIGS[name]
        sparsifier = toptheta.SkipSoftmax(lam, placement, k=3)
    else:
        placement, estimator, vmc = CONFIGS[name]
        sparsifier = toptheta.TopTheta(_thresholds(placement), empty_rows=empty_rows)
    comp = ([toptheta.SDC(estimator)] if estimator else []) + ([toptheta.VMC()] if vmc else [])
    return sparsifier, comp


def _lowered(sparsifier, n):
    """({theta or cut_offset: per-row tensor}, clamped rows) for rows of lengths n (B, Q), as the backend lowers."""
    if isinstance(sparsifier, toptheta.SkipSoftmax):
        return {"theta": None, "cut_offset": sparsifier.cut_offsets(0, n[:, None, :])}, 0
    if isinstance(sparsifier, (toptheta.TopK, toptheta.TopP)):
        return {"theta": None, "boundary": lowering.row_boundary(sparsifier, 0)}, 0
    theta, clamped = lowering.row_thresholds(sparsifier, 0, n)
    return {"theta": theta}, clamped


def _data(B, Q, K, D=8, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g) * 2
    q[:, 1] = q[:, 0]  # heads 0 (empty rows) and 1 of KV group 0 see the same scores: head 1 keeps head 0's maximum
    k = torch.randn(B, HKV, K, D, generator=g) * 2
    v = torch.randn(B, HKV, K, D, generator=g)
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def _bounds(B, Q, K, key_start, window=None, q_offset=None):
    ks = torch.tensor(key_start, dtype=torch.int32, device=DEVICE)
    ke = torch.full((B,), K, dtype=torch.int32, device=DEVICE)
    qo = torch.full((B,), K - Q if q_offset is None else q_offset, dtype=torch.int32, device=DEVICE)
    lo, hi = row_bounds(ks, ke, qo, Q, window, causal=True)
    keys = torch.arange(K, device=DEVICE)
    valid = (keys >= lo[..., None]) & (keys < hi[..., None])  # (B, Q, K)
    return ks, valid[:, None], (hi - lo)


def _plain(monkeypatch, q, k, v, valid, sparsifier, comp, phase):
    """(output (B, H, Q, Dv), keep masks, stats) of the plain kernel, the reference."""
    monkeypatch.setattr(plain_decode, "ENABLED", False)
    monkeypatch.setattr(plain_prefill, "ENABLED", False)
    stats = toptheta.SparsityStats(num_layers=1, num_heads=H, num_kv_heads=HKV)
    seen = []
    out = toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier, compensations=comp,
                                    stats=stats, observer=lambda rows: seen.append(rows.keep), phase=phase)
    keep = torch.cat(seen, dim=2) if seen[0] is not None else None  # (B, H, Q, K) over the chunks
    return out.transpose(1, 2), keep, stats


def _triton(fn, q, k, v, n, sparsifier, comp, phase, **kw):
    """(result, stats) of a Triton wrapper, its inputs lowered from the sparsifier as a backend would."""
    placement = sparsifier.placement
    estimator = next((c.estimator for c in comp if isinstance(c, toptheta.SDC)), None)
    rule, clamped = _lowered(sparsifier, n)
    mass = lowering.calibrated_mass(sparsifier.thresholds, 0, n) if estimator == "calibrated" else None
    res = fn(q, k, v, scaling=0.5, placement=placement, sdc=estimator, sdc_mass=mass,
             vmc=any(isinstance(c, toptheta.VMC) for c in comp),
             empty_rows=getattr(sparsifier, "empty_rows", "keep-max"), **rule, **kw)
    stats = toptheta.SparsityStats(num_layers=1, num_heads=H, num_kv_heads=HKV)
    lowering.record(stats, res, layer=0, phase=phase, key_len=k.shape[2], clamped_rows=clamped)
    return res, stats


def _assert_same(res, stats, ref_out, ref_keep, ref_stats, atol=1e-5):
    assert res.tiles.sum() > 0  # the Triton kernel ran
    torch.testing.assert_close(res.out.float(), ref_out.float(), atol=atol, rtol=atol)
    assert torch.equal(res.kept.long(), ref_keep.sum(-1)), "kept keys per row"
    if res.vrows is not None:
        G = H // HKV
        B, _, Q, K = ref_keep.shape
        union = ref_keep.view(B, HKV, G, Q, K).any(2).sum(-1)  # (B, Hkv, Q)
        assert torch.equal(res.vrows.long(), union), "kept V rows"
    for name, x in ref_stats.state_dict().items():
        y = stats.state_dict()[name]
        if name == "dropped_mass":
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5, msg=name)
        else:
            assert torch.equal(x, y), f"{name}: plain {x.tolist()}, Triton {y.tolist()}"
    assert ref_stats.clamped_rows == stats.clamped_rows


def test_available_and_no_triton_on_import():
    import subprocess

    assert available()
    code = "import sys, toptheta, toptheta.attention.triton; print('triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "False", done.stdout + done.stderr


# ---- prefill -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,empty_rows", CASES)
def test_prefill_equals_the_plain_kernel(monkeypatch, name, empty_rows):
    """Top-θ pre/post × SDC estimators × VMC, both empty-row rules, left padding, GQA, two query blocks."""
    B, Q, K = 2, 24, 24
    q, k, v = _data(B, Q, K)
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 5])  # sequence 1 left-padded by 5 keys
    sparsifier, comp = _objects(name, empty_rows)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "prefill")
    res, stats = _triton(prefill_attention, q, k, v, n, sparsifier, comp, "prefill", key_start=ks,
                         block_m=16, block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert ref_stats.empty_rows[0, 0] > 0  # head 0's rows are empty: the rule was exercised
    assert 0 < ref_stats.kept_attention_fraction < 1


@pytest.mark.parametrize("name", ["pre-expsdc-vmc", "post-vmc"])
def test_prefill_with_a_sliding_window_and_a_cached_context(monkeypatch, name):
    """Queries after a cached context (q_offset = K − Q), a window of 9 keys, left padding."""
    B, Q, K, W = 2, 17, 40, 9
    q, k, v = _data(B, Q, K, seed=3)
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 26], window=W)  # sequence 1: the window reaches the padding
    sparsifier, comp = _objects(name, "keep-max")
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "prefill")
    res, stats = _triton(prefill_attention, q, k, v, n, sparsifier, comp, "prefill", key_start=ks, window=W,
                         block_m=16, block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert int(n.max()) == W and int(n.min()) < W


@pytest.mark.parametrize("name", ["pre-expsdc-vmc", "post-vmc"])
def test_rows_without_keys_read_nothing_past_the_keys(monkeypatch, name):
    """A block's padding rows (past Q) sit after the last key, and a window puts their first key past key_end: the
    kernels give such rows the empty range at key_start, so no tile reaches keys past key_end. Here the cache holds
    8 more keys than the sequences use, all NaN: the output is the plain kernel's on the 40 real keys."""
    B, Q, K, W, extra = 2, 17, 40, 9, 8
    q, k, v = _data(B, Q, K, seed=3)
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 26], window=W)
    sparsifier, comp = _objects(name, "keep-max")
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "prefill")
    nan = torch.full((B, HKV, extra, k.shape[-1]), float("nan"), device=DEVICE)
    k_big, v_big = torch.cat([k, nan], 2), torch.cat([v, nan], 2)
    ends = torch.full((B,), K, dtype=torch.int32, device=DEVICE)
    for skip in (False, True):
        res, stats = _triton(prefill_attention, q, k_big, v_big, n, sparsifier, comp, "prefill", key_start=ks,
                             key_end=ends, q_offset=K - Q, window=W, block_m=16, block_n=16, skip_tiles=skip)
        _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    dec = decode_attention(q[:, :, -1:], k_big, v_big, scaling=0.5, theta=None, placement=None, key_start=ks,
                           key_end=ends, q_offset=K - 1, window=W, block_n=16)
    assert not dec.out.isnan().any()


def test_dense_prefill_and_decode_equal_the_plain_kernel(monkeypatch):
    B, Q, K = 2, 20, 20
    q, k, v = _data(B, Q, K, seed=4)
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 3])
    ref, _, _ = _plain(monkeypatch, q, k, v, valid, toptheta.Dense(), [], "prefill")
    # transformers' layout: (B, Q, H, D) tensors seen as (B, H, Q, D) views, not contiguous
    qv, kv, vv = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
    assert not qv.is_contiguous()
    res = prefill_attention(qv, kv, vv, scaling=0.5, theta=None, placement=None, key_start=ks, block_m=16,
                            block_n=16)
    torch.testing.assert_close(res.out, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(res.kept.long(), n[:, None].expand(B, H, Q).long())
    dec = decode_attention(q[:, :, -1:], k, v, scaling=0.5, theta=None, placement=None, key_start=ks, block_n=16)
    torch.testing.assert_close(dec.out, ref[:, :, -1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(SKIP_CONFIGS))
@pytest.mark.parametrize("tied", [False, True])
def test_skipsoftmax_prefill_and_decode_equal_the_plain_kernel(monkeypatch, name, tied):
    """Skip-softmax (one λ, the cut m + ln(λ/n) from each row's true maximum) before and after the softmax, with
    SDC and VMC: the plain kernel's kept sets, empty rows (λ = 6 > n: the maximum kept), outputs and statistics;
    with repeated keys, ties at every row's maximum and around the cut."""
    B, Q, K = 2, 24, 24
    q, k, v = _data(B, Q, K, seed=11)
    if tied:
        k[:, :, 10:15], v[:, :, 10:15] = k[:, :, 9:10], v[:, :, 9:10]
    sparsifier, comp = _objects(name)
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 5])
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "prefill")
    res, stats = _triton(prefill_attention, q, k, v, n, sparsifier, comp, "prefill", key_start=ks, block_m=16,
                         block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert 0 < ref_stats.kept_attention_fraction < 1
    assert (ref_stats.empty_rows.sum() > 0) == (sparsifier.lam > 4)  # rows of 4-5 keys (k = 3) have λ > n

    ks, valid, n = _bounds(B, 1, K, key_start=[0, 5])
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q[:, :, -1:], k, v, valid, sparsifier, comp, "decode")
    res, stats = _triton(decode_attention, q[:, :, -1:], k, v, n, sparsifier, comp, "decode", key_start=ks,
                         block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert 0 < ref_stats.kept_vrow_fraction < 1


def test_skipsoftmax_cut_is_the_float64_cut_rounded_up():
    """The kernels' cut keeps a score exactly when s ≥ m + ln(λ/n) in float64 (the float32 just below the float64 cut
    is dropped, the one at or above it kept), as ``SkipSoftmax.cut``: one row whose second score sits on the cut."""
    lam, n = 0.37, 16
    m = torch.tensor(1.25)
    exact = float(m.double() + torch.log(torch.tensor(lam / n, dtype=torch.float64)))
    on = torch.tensor(exact, dtype=torch.float32)
    below = torch.nextafter(on, torch.tensor(-1e9)) if float(on) >= exact else on
    above = torch.nextafter(below, torch.tensor(1e9))
    sparsifier = toptheta.SkipSoftmax(lam, "post")
    for second, kept in ((below, 2), (above, 3)):
        # query e_0 · keys (scaling 1): logits [m, second, m - 10 ..., third = the maximum again]
        logits = torch.full((n,), float(m) - 10.0)
        logits[0], logits[1], logits[-1] = m, second, m
        q = torch.zeros(1, 1, 1, 16, device=DEVICE)
        q[..., 0] = 1.0
        k = torch.zeros(1, 1, n, 16, device=DEVICE)
        k[0, 0, :, 0] = logits.to(DEVICE)
        v = torch.randn(1, 1, n, 16, device=DEVICE)
        for fn, kw in ((prefill_attention, dict(block_m=16, block_n=16, q_offset=n - 1)), (decode_attention, {})):
            res = fn(q, k, v, scaling=1.0, theta=None, placement="post", cut_offset=sparsifier.cut_offsets(
                0, torch.tensor([[[n]]], device=DEVICE)), causal=False, **kw)
            assert int(res.kept) == kept, (fn.__name__, float(second), exact)


def _skip_data(B=1, Q=32, K=48, D=8):
    """Every query points along u; the keys of tile [16, 32) point against it: no logit there passes θ = 0."""
    q, k, v = _data(B, Q, K, D, seed=5)
    u = torch.ones(D, device=DEVICE) / D ** 0.5
    q = 0.3 * q + 3.0 * u
    k[:, :, 16:32] = -4.0 * u + 0.1 * k[:, :, 16:32]
    return q, k, v


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_tile_where_nothing_passes_theta_is_skipped(monkeypatch, kind):
    """Skipped tiles are counted, and V rows nobody keeps are never read: poisoning them with NaN changes nothing."""
    q, k, v = _skip_data()
    B, Q, K = q.shape[0], q.shape[2], k.shape[2]
    if kind == "decode":
        q = q[:, :, -1:]
        Q = 1
    ks, valid, n = _bounds(B, Q, K, key_start=[0])
    thresholds = Thresholds(torch.zeros(1, H, 1), [1], "pre")
    sparsifier, comp = toptheta.TopTheta(thresholds), [toptheta.SDC("exact"), toptheta.VMC()]
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, kind)
    fn = prefill_attention if kind == "prefill" else decode_attention
    blocks = dict(block_m=16, block_n=16, skip_tiles=True) if kind == "prefill" else dict(block_n=16)
    res, stats = _triton(fn, q, k, v, n, sparsifier, comp, kind, **blocks)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert int(res.skipped_tiles.sum()) > 0
    if kind == "decode":  # one program per KV head, tiles [0,16) [16,32) [32,48): the middle one skipped
        assert res.tiles.tolist() == [[3, 3]] and res.skipped_tiles.tolist() == [[1, 1]]
    # V rows no head keeps, NaN; v̄ passed in from the clean V (a running mean kept beside the cache)
    union = ref_keep.view(B, HKV, H // HKV, Q, K).any(2).any(2)  # (B, Hkv, K)
    assert (~union[:, :, 16:32]).all()
    poisoned = v.masked_fill(~union[..., None], float("nan"))
    lo, hi = row_bounds(ks, torch.full((B,), K, dtype=torch.int32, device=DEVICE),
                        torch.full((B,), K - Q, dtype=torch.int32, device=DEVICE), Q, None, True)
    from toptheta.attention.triton.common import value_means
    v_mean = value_means(v, lo, hi)
    got, _ = _triton(fn, q, k, poisoned, n, sparsifier, comp, kind, v_mean=v_mean, **blocks)
    torch.testing.assert_close(got.out, res.out, atol=0, rtol=0)


# ---- decode --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,empty_rows", CASES)
def test_decode_equals_the_plain_kernel(monkeypatch, name, empty_rows):
    """One query row per sequence over a cache: left padding, a short row kept whole (n ≤ k), GQA."""
    B, K = 3, 40
    q, k, v = _data(B, 1, K, seed=1)
    ks, valid, n = _bounds(B, 1, K, key_start=[0, 5, K - 2])
    sparsifier, comp = _objects(name, empty_rows)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "decode")
    res, stats = _triton(decode_attention, q, k, v, n, sparsifier, comp, "decode", key_start=ks, block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert ref_stats.empty_rows[0, 0] > 0
    assert 0 < ref_stats.kept_vrow_fraction < 1


@pytest.mark.parametrize("name", ["pre-calsdc-vmc", "post-vmc"])
def test_decode_of_several_rows_with_a_window(monkeypatch, name):
    """Three new tokens per step (Q = 3, causal among themselves) with a sliding window of 12 keys."""
    B, Q, K, W = 2, 3, 37, 12
    q, k, v = _data(B, Q, K, seed=2)
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 30], window=W)
    sparsifier, comp = _objects(name, "keep-max")
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "decode")
    res, stats = _triton(decode_attention, q, k, v, n, sparsifier, comp, "decode", key_start=ks, window=W,
                         block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)


@pytest.mark.parametrize("name", ["pre-sdc-vmc", "post-vmc"])
def test_cached_decode_after_a_prefill(monkeypatch, name):
    """Prefill 20 tokens, then decode token 21 over the cache (v̄ from a running V sum): the decode row is the
    plain kernel's decode row, and the last row of a 21-token prefill (the same θ key, method.md §2.4)."""
    B, P = 2, 20
    q, k, v = _data(B, P + 1, P + 1, seed=6)
    sparsifier, comp = _objects(name, "keep-max")
    ks, valid, n = _bounds(B, P, P, key_start=[0, 4])
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q[:, :, :P], k[:, :, :P], v[:, :, :P], valid, sparsifier,
                                          comp, "prefill")
    res, stats = _triton(prefill_attention, q[:, :, :P], k[:, :, :P], v[:, :, :P], n, sparsifier, comp, "prefill",
                         key_start=ks, block_m=16, block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)

    ks1, valid1, n1 = _bounds(B, 1, P + 1, key_start=[0, 4])
    v_sum = (v * valid1[:, :, 0, :, None]).sum(2)  # (B, Hkv, Dv): the running sum a cache would keep
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q[:, :, P:], k, v, valid1, sparsifier, comp, "decode")
    dec, dec_stats = _triton(decode_attention, q[:, :, P:], k, v, n1, sparsifier, comp, "decode", key_start=ks1,
                             v_sum=v_sum, block_n=16)
    _assert_same(dec, dec_stats, ref_out, ref_keep, ref_stats)
    ks, valid, n = _bounds(B, P + 1, P + 1, key_start=[0, 4])
    full, _ = _triton(prefill_attention, q, k, v, n, sparsifier, comp, "prefill", key_start=ks, block_m=16,
                      block_n=16)
    torch.testing.assert_close(dec.out, full.out[:, :, -1:], atol=1e-5, rtol=1e-5)
    assert torch.equal(dec.kept, full.kept[:, :, -1:])


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_float16_inputs_accumulate_in_float32(monkeypatch, kind):
    """float16 Q/K/V (float32 logits, float16 P·V operands, float32 accumulators): the plain kernel's numbers
    within float16 rounding, the same keep decisions (θ is far from every logit here), a float16 output."""
    B, Q, K = 2, 20, 20
    q, k, v = _data(B, Q, K, seed=8, dtype=torch.float16)
    if kind == "decode":
        q, Q = q[:, :, -1:], 1
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 3])
    sparsifier, comp = _objects("post-vmc" if kind == "decode" else "pre-sdc-vmc", "keep-max")
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, kind)
    fn = prefill_attention if kind == "prefill" else decode_attention
    blocks = dict(block_m=16, block_n=16, skip_tiles=True) if kind == "prefill" else dict(block_n=16)
    res, stats = _triton(fn, q, k, v, n, sparsifier, comp, kind, key_start=ks, **blocks)
    assert res.out.dtype == torch.float16
    torch.testing.assert_close(res.out.float(), ref_out.float(), atol=3e-3, rtol=3e-3)
    assert torch.equal(res.kept.long(), ref_keep.sum(-1))
    assert torch.equal(stats.prefill_kept, ref_stats.prefill_kept) and torch.equal(stats.vrow_kept, ref_stats.vrow_kept)


# ---- the wrappers' contracts ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(RANKED_CONFIGS))
def test_topk_and_topp_decode_equal_the_plain_kernel(monkeypatch, name):
    """Top-k (k = 8) and top-p (p = 0.95, rows of n ≤ 8 whole) decode: one row per sequence with left padding and a
    row of n = 2 kept whole, then three rows per sequence (causal among themselves) in a sliding window, then
    k ≥ K (every row whole)."""
    import toptheta.attention.triton.decode as decode_module

    B, K = 3, 40
    q, k, v = _data(B, 1, K, seed=1)
    ks, valid, n = _bounds(B, 1, K, key_start=[0, 5, K - 2])
    sparsifier, comp = _objects(name)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "decode")
    decode_attention(q, k, v, scaling=0.5, theta=None, placement=None, block_n=16)  # the held buffers exist
    for held in decode_module._HELD.values():  # stale logits above any score where a row has no key (left padding)
        held["scratch"].fill_(1.0e4)
    res, stats = _triton(decode_attention, q, k, v, n, sparsifier, comp, "decode", key_start=ks, block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert res.kept[2].eq(2).all() and 0 < ref_stats.kept_vrow_fraction < 1
    if name.startswith("topk"):
        assert res.kept[:2].eq(8).all()
    else:  # the nucleus of p = 0.6 varies with the row
        assert len(set(res.kept[:2].flatten().tolist())) > 2

    Q, W = 3, 12
    q, k, v = _data(2, Q, 37, seed=2)
    ks, valid, n = _bounds(2, Q, 37, key_start=[0, 30], window=W)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "decode")
    res, stats = _triton(decode_attention, q, k, v, n, sparsifier, comp, "decode", key_start=ks, window=W,
                         block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)

    whole, _ = _objects(name, k=64)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, whole, comp, "decode")
    res, stats = _triton(decode_attention, q, k, v, n, whole, comp, "decode", key_start=ks, window=W, block_n=16)
    if ref_keep is None:  # the plain kernel selects nothing when K ≤ k: every valid key kept
        ref_keep = valid.expand(2, H, Q, 37)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)


def _tied_group(B=2, K=40):
    """Two decode rows per sequence (left padding in the second) over keys whose 9-14 are six copies of one key and
    its V row, along the group's queries (a large logit, so the copies lead many rows): (q, k, v, key_start, valid, n)."""
    q, k, v = _data(B, 2, K, seed=3)
    lead = q.view(B, HKV, H // HKV * 2, -1).sum(2, keepdim=True)
    k[:, :, 9:15], v[:, :, 9:15] = lead / lead.norm(dim=-1, keepdim=True) * 4, v[:, :, 9:10]
    return (q, k, v, *_bounds(B, 2, K, key_start=[0, 4]))


@pytest.mark.parametrize("name", ["topk-pre-sdc-vmc", "topk-post-vmc"])
def test_topk_decode_breaks_ties_at_the_kth_logit_by_key_order(monkeypatch, name):
    """``_tied_group``'s six copies of one key, k = 3: the
    rows keep exactly k keys, the first of the tied ones (the float64 rule: a stable sort, so the V rows kept are
    the group's union under it), and the plain kernel's output and counts, whichever copies it kept."""
    q, k, v, ks, valid, n = _tied_group()
    sparsifier, comp = _objects(name, k=3)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "decode")
    res, stats = _triton(decode_attention, q, k, v, n, sparsifier, comp, "decode", key_start=ks, block_n=16)
    logits = torch.einsum("bhqd,bhkd->bhqk", q.double().cpu(), k.double().cpu().repeat_interleave(H // HKV, 1))
    logits = logits.masked_fill(~valid.cpu(), float("-inf"))
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :3]
    by_key_order = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, True).to(DEVICE)
    kth = logits.gather(-1, order[..., -1:])
    straddling = ((logits > kth).sum(-1) + (logits == kth).sum(-1) > 3) & ((logits == kth).sum(-1) > 1)
    assert straddling.sum() >= 4, "rows whose k-th logit is tied with keys beyond it"
    assert torch.equal(res.kept.long(), ref_keep.sum(-1)) and res.kept.eq(3).all()
    torch.testing.assert_close(res.out, ref_out, atol=1e-5, rtol=1e-5)
    ref_stats.vrow_kept.copy_(stats.vrow_kept)  # the plain kernel's copies may differ: checked against the rule
    _assert_same(res, stats, ref_out, by_key_order, ref_stats)


@pytest.mark.parametrize("name", ["topp-pre-sdc-vmc", "topp-post-vmc"])
def test_topp_decode_keeps_every_key_tied_with_its_boundary(monkeypatch, name):
    """The six copies of one key of the Top-k tie test: a nucleus that ends inside them keeps all six (the plain
    kernel's rule: the set depends on the scores only), so some rows keep more keys than the mass needed."""
    q, k, v, ks, valid, n = _tied_group()
    sparsifier, comp = _objects(name, k=3, p=0.5)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "decode")
    res, stats = _triton(decode_attention, q, k, v, n, sparsifier, comp, "decode", key_start=ks, block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert (ref_keep[..., 9:15].sum(-1) == 6).sum() >= 4  # rows whose nucleus took the whole tied group


def test_wrappers_refuse_bad_inputs():
    q, k, v = _data(1, 4, 4)
    offset = torch.zeros(1, 1, 4, dtype=torch.float64, device=DEVICE)
    for fn in (prefill_attention, decode_attention):
        with pytest.raises(ValueError, match="not both"):
            fn(q[:, :, -1:], k, v, scaling=1.0, theta=offset.float()[..., -1:], cut_offset=offset[..., -1:])
        with pytest.raises(ValueError, match="SDC\\('exact'\\)"):
            fn(q[:, :, -1:], k, v, scaling=1.0, theta=None, cut_offset=offset[..., -1:], sdc="exp-threshold")
        with pytest.raises(ValueError, match="keep-max"):
            fn(q[:, :, -1:], k, v, scaling=1.0, theta=None, cut_offset=offset[..., -1:], empty_rows="reference")
    top2 = lowering.topk_boundary(2)
    with pytest.raises(ValueError, match="one rule"):
        decode_attention(q[:, :, -1:], k, v, scaling=1.0, theta=offset.float()[..., -1:], placement="pre",
                         boundary=top2)
    with pytest.raises(ValueError, match="SDC\\('exact'\\)"):
        decode_attention(q[:, :, -1:], k, v, scaling=1.0, theta=None, placement="pre", sdc="exp-threshold",
                         boundary=top2)
    with pytest.raises(ValueError, match="placement='pre' or 'post'"):
        decode_attention(q[:, :, -1:], k, v, scaling=1.0, theta=None, placement=None, boundary=top2)
    with pytest.raises(ValueError, match="keep-max"):
        decode_attention(q[:, :, -1:], k, v, scaling=1.0, theta=None, placement="pre", empty_rows="reference",
                         boundary=top2)
    with pytest.raises(ValueError, match="integer"):
        lowering.topk_boundary(0)
    with pytest.raises(ValueError, match="multiple"):
        prefill_attention(q[:, :3], k, v, scaling=1.0, theta=None)
    with pytest.raises(ValueError, match="placement='pre'"):
        prefill_attention(q, k, v, scaling=1.0, theta=None, placement="post", sdc="exact")
    with pytest.raises(ValueError, match="sdc_mass"):
        decode_attention(q[:, :, -1:], k, v, scaling=1.0, theta=None, sdc="calibrated")
    with pytest.raises(ValueError, match="powers of two"):
        prefill_attention(q, k, v, scaling=1.0, theta=None, block_m=8)
    if INTERPRETED:  # the interpreter's tl.dot multiplies bfloat16 bit patterns: refused rather than wrong
        with pytest.raises(ValueError, match="bfloat16"):
            prefill_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scaling=1.0, theta=None)


@pytest.mark.skipif(not INTERPRETED, reason="CPU tensors are the interpreter's")
def test_compiled_kernels_refuse_cpu_tensors(monkeypatch):
    from toptheta.attention.triton import prefill as triton_prefill

    class Compiled:  # a kernel as decorated without TRITON_INTERPRET
        pass

    monkeypatch.setattr(triton_prefill, "_prefill_kernel", Compiled())
    q, k, v = _data(1, 4, 4)
    with pytest.raises(ValueError, match="CUDA tensors"):
        prefill_attention(q, k, v, scaling=1.0, theta=None)


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu():
    """What the interpreter cannot check: each kernel family lowers to a cubin for sm_90 (ptxas from the triton
    wheel) within the shared memory of an H100/H200. About a minute of CPU."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "toptheta.attention.triton.compile_check", "--quick"], env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout + done.stderr
    # prefill and the three decode launches × 2 dtypes × 3 rules, and the boundary rules' three decode launches × 2
    assert done.stdout.count("ok ") == 30, done.stdout
    assert done.stdout.count("skip-softmax") == 8 and done.stdout.count("top-k/top-p") == 6, done.stdout


# ---- compiled kernels on a GPU: realistic shapes ------------------------------------------------------

LONG_CACHE = 16384  # keys of the gpu tests' long decode cache


def _gpu_case(dtype, B=2, Hq=32, Hkv=8, Q=512, K=1024, D=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Q, D, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(B, Hkv, K, D, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(B, Hkv, K, D, device="cuda", generator=g, dtype=torch.float32).to(dtype)
    return q, k, v


def _gpu_thresholds(placement: str, Hq: int, max_n: int) -> Thresholds:
    n = torch.arange(max_n + 1).clamp(min=1).float()
    if placement == "pre":  # logits of D=128 unit normals scaled by 1/√D are ~N(0, 1): keep the top few percent
        values = torch.full((1, Hq, 1), 1.8)
    else:
        values = (2.0 / n).expand(1, Hq, max_n + 1).contiguous()
    return Thresholds(values, [64], placement)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["pre-sdc-vmc", "pre-expsdc-vmc", "post-vmc", "skip-pre-sdc-vmc", "skip-post-vmc"])
def test_compiled_kernels_on_realistic_shapes(monkeypatch, dtype, name):
    """Prefill after a cached context and a decode step on a 32/8-head GQA layer (D = 128, left padding), the
    compiled kernels against the plain kernel on the same GPU.

    33M logits: a handful lie within rounding of θ (the two paths sum q·k in different orders; bf16 P·V), so
    keep decisions are compared in total and per row (all but 0.1 % of rows equal), outputs on the rows whose
    kept counts agree."""
    B, Hq, Hkv, Q, K, D = 2, 32, 8, 512, 1024, 128
    if name in SKIP_CONFIGS:  # λ = 200: rows of ~1k N(0, 1) logits keep those above m + ln(0.2), a few percent
        placement, estimator, vmc, _ = SKIP_CONFIGS[name]
        sparsifier = toptheta.SkipSoftmax(200.0, placement, k=64)
    else:
        placement, estimator, vmc = CONFIGS[name]
        sparsifier = toptheta.TopTheta(_gpu_thresholds(placement, Hq, K))
    comp = ([toptheta.SDC(estimator)] if estimator else []) + ([toptheta.VMC()] if vmc else [])
    q, k, v = _gpu_case(dtype, B, Hq, Hkv, Q, K, D)
    scaling = D ** -0.5
    ks = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    lo, hi = row_bounds(ks, torch.full((B,), K, dtype=torch.int32, device="cuda"),
                        torch.full((B,), K - Q, dtype=torch.int32, device="cuda"), Q, None, True)
    keys = torch.arange(K, device="cuda")
    valid = ((keys >= lo[..., None]) & (keys < hi[..., None]))[:, None]  # (B, 1, Q, K)
    n = hi - lo
    monkeypatch.setattr(plain_decode, "ENABLED", False)
    monkeypatch.setattr(plain_prefill, "ENABLED", False)
    for kind, rows in (("prefill", slice(None)), ("decode", slice(Q - 1, Q))):
        qq, vv, nn = q[:, :, rows], valid[:, :, rows], n[:, rows]
        ref_stats = toptheta.SparsityStats(1, Hq, Hkv)
        seen = []
        ref = toptheta.sparse_attention(qq, k, v, vv, scaling=scaling, layer=0, sparsifier=sparsifier,
                                        compensations=comp, stats=ref_stats, phase=kind,
                                        observer=lambda r: seen.append(r.keep.sum(-1))).transpose(1, 2)
        ref_kept = torch.cat(seen, dim=2)  # (B, H, Q)
        rule, clamped = _lowered(sparsifier, nn)
        fn = prefill_attention if kind == "prefill" else decode_attention
        res = fn(qq, k, v, scaling=scaling, placement=placement, sdc=estimator, vmc=vmc, key_start=ks,
                 q_offset=K - Q if kind == "prefill" else K - 1, **rule)
        stats = toptheta.SparsityStats(1, Hq, Hkv)
        lowering.record(stats, res, layer=0, phase=kind, key_len=K, clamped_rows=clamped)
        assert res.out.dtype == dtype and int(res.tiles.sum()) > 0
        same = res.kept.long() == ref_kept  # (B, H, Q)
        assert same.float().mean() >= 0.999, f"{kind}: {int((~same).sum())} rows keep other keys"
        atol = 1e-4 if dtype == torch.float32 else 3e-2  # bf16: P·V operands and the output in bf16
        torch.testing.assert_close(res.out.float()[same], ref.float()[same], atol=atol, rtol=atol)
        for counter in ("prefill_kept", "decode_kept", "vrow_kept"):
            a, b = float(getattr(ref_stats, counter).sum()), float(getattr(stats, counter).sum())
            assert abs(a - b) <= 1e-4 * max(1.0, a), (counter, a, b)
        for counter in ("prefill_valid", "decode_valid", "vrow_valid", "rows"):
            assert torch.equal(getattr(ref_stats, counter), getattr(stats, counter)), counter
        assert 0 < float(stats.prefill_kept.sum() + stats.decode_kept.sum()) < float(n.sum() * Hq)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or not torch.cuda.is_available(), reason="needs CUDA and TRITON_INTERPRET=0")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["topk-pre-sdc-vmc", "topk-post-vmc", "topp-post-vmc"])
def test_compiled_boundary_rules_on_a_long_cache(monkeypatch, dtype, name):
    """A decode step over 16k cached keys (D = 128, GQA, left padding): Top-k (k = 256) and top-p
    (p = 0.5) through the compiled decode kernel against the plain kernel on the same GPU. The two paths sum q·k in
    different orders, so a boundary can fall on another key in a few rows: kept counts per row agree on all but
    1 % of rows (Top-k: exactly k everywhere), outputs on the rows that agree."""
    B, Hkv, K, D = 2, HKV, LONG_CACHE, 128
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(B, h, r, D, device=DEVICE, generator=g).to(dtype) for h, r in ((H, 1), (Hkv, K), (Hkv, K)))
    q = q * (2 * D ** -0.5)  # the helpers' scaling 0.5: logits q·k/√D, about N(0, 1)
    sparsifier, comp = _objects(name, k=256, p=0.5)
    ks = torch.tensor([0, 1000], dtype=torch.int32, device=DEVICE)
    keys = torch.arange(K, device=DEVICE)
    valid = (keys >= ks[:, None].long())[:, None, None, :]  # (B, 1, 1, K)
    n = (K - ks.long())[:, None]  # (B, 1)
    monkeypatch.setattr(plain_decode, "ENABLED", False)
    ref_stats, seen = toptheta.SparsityStats(1, H, Hkv), []
    ref = toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier,
                                    compensations=comp, stats=ref_stats, phase="decode",
                                    observer=lambda r: seen.append(r.keep.sum(-1))).transpose(1, 2)
    res, stats = _triton(decode_attention, q, k, v, n, sparsifier, comp, "decode", key_start=ks)
    assert res.out.dtype == dtype and int(res.tiles.sum()) > 0
    same = res.kept.long() == torch.cat(seen, dim=2)  # (B, H, 1)
    assert same.float().mean() >= 0.99, f"{int((~same).sum())} rows keep another number of keys"
    if name.startswith("topk"):
        assert res.kept.eq(256).all()
    atol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(res.out.float()[same], ref.float()[same], atol=atol, rtol=atol)
    assert 0 < stats.kept_vrow_fraction < 0.5 and abs(stats.kept_vrow_fraction - ref_stats.kept_vrow_fraction) < 0.01


def test_the_running_value_sum_adds_new_rows_and_restarts_on_another_cache():
    """VMC's v̄ in a decode step on the Triton path: Σ V over [key_start, K) kept per layer, the new rows of a cache
    that grows in place added, a cache in another tensor summed afresh (no host read either way)."""
    from toptheta.attention import decode as plain
    from toptheta.attention.backends.triton import running_value_sum

    plain.reset()
    g = torch.Generator().manual_seed(3)
    buffer = torch.randn(2, HKV, 64, 8, generator=g)  # a cache with room to grow, as cache.GrowingLayer's
    key_start = torch.tensor([0, 5], dtype=torch.int32)

    def expected(v):
        keys = torch.arange(v.shape[2])
        return (v.double() * (keys[None, :] >= key_start[:, None])[:, None, :, None]).sum(2)

    for K in (20, 21, 22, 30):
        view = buffer[:, :, :K]
        torch.testing.assert_close(running_value_sum(0, view, key_start), expected(view), rtol=1e-12, atol=1e-12)
    assert plain._VSUMS[("triton", 0, 2, HKV, 8, torch.float32, torch.device("cpu"))][2] == 30
    other = buffer[:, :, :31].clone()  # same values, another tensor: summed whole; then its rows changed
    other[:, :, :3] += 1.0
    torch.testing.assert_close(running_value_sum(0, other, key_start), expected(other), rtol=1e-12, atol=1e-12)
    plain.reset()
    assert not plain._VSUMS


@pytest.mark.parametrize("name", ["pre-sdc-vmc", "post-vmc"])
def test_prefill_with_and_without_tile_skipping_gives_the_same_numbers(monkeypatch, name):
    """skip_tiles=False (the default) reads every V tile of the key range (weights 0 where nothing is kept) without
    the per-tile branch, skip_tiles=True skips empty tiles: the plain kernel's output and counts both times."""
    B, Q, K = 2, 24, 24
    q, k, v = _data(B, Q, K, seed=9)
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 5])
    sparsifier, comp = _objects(name, "keep-max")
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, "prefill")
    res, stats = _triton(prefill_attention, q, k, v, n, sparsifier, comp, "prefill", key_start=ks, block_m=16,
                         block_n=16)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert int(res.skipped_tiles.sum()) == 0
    res, stats = _triton(prefill_attention, q, k, v, n, sparsifier, comp, "prefill", key_start=ks, block_m=16,
                         block_n=16, skip_tiles=True)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)
    assert int(res.skipped_tiles.sum()) > 0


# ---- addressing past 2^31 elements -----------------------------------------------------------------------

def _far_apart(tensors, stride: int, where):
    """Copies of (B, ·, ·, ·) tensors laid out in one storage whose batch stride is ``stride`` elements, so
    sequence b of each starts b · stride elements in. In the interpreter the storage is a sparse memory-mapped
    file: only the pages the copies touch take memory or disk (8 GiB of float32 is mostly a hole)."""
    B = tensors[0].shape[0]
    slab = [t[0].numel() for t in tensors]
    size = (B - 1) * stride + sum(slab)
    if INTERPRETED:
        path = where / "storage.bin"
        with open(path, "wb") as f:
            f.truncate(size * tensors[0].element_size())
        base = torch.from_file(str(path), shared=True, size=size, dtype=tensors[0].dtype)
    else:
        base = torch.empty(size, dtype=tensors[0].dtype, device=DEVICE)
    views, offset = [], 0
    for t, n in zip(tensors, slab):
        strides = (stride, *t[0].stride())
        view = base.as_strided(t.shape, strides, storage_offset=offset)
        view.copy_(t)
        views.append(view)
        offset += n
    return views


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_sequences_more_than_two_to_the_31_elements_in(monkeypatch, tmp_path, kind):
    """A batch whose third sequence starts past 2^31 elements into its tensors, each stride fitting 32 bits (a long
    KV cache times a batch: 8 KV heads × 128k keys × 128 dims is 2^27 elements a sequence, so sequence 16 starts at
    2^31): the kernels address it in 64 bits and give the plain kernel's numbers. In 32 bits b · stride wraps
    negative and the kernel reads another sequence's memory, or none. (A stride of 2^31 or more would not tell:
    Triton passes such an integer argument as int64.)"""
    B, Q, K = 3, 20, 20
    q, k, v = _data(B, Q, K, seed=9)
    if kind == "decode":
        q, Q = q[:, :, -1:].contiguous(), 1
    ks, valid, n = _bounds(B, Q, K, key_start=[0, 3, 7])
    sparsifier, comp = _objects("pre-sdc-vmc" if kind == "prefill" else "post-vmc", "keep-max")
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, kind)
    stride = 2 ** 30 + 4096
    fq, fk, fv = _far_apart([q, k, v], stride, tmp_path)
    assert stride < 2 ** 31 <= fk.storage_offset() + (B - 1) * fk.stride(0) and torch.equal(fk, k)
    fn = prefill_attention if kind == "prefill" else decode_attention
    blocks = dict(block_m=16, block_n=16) if kind == "prefill" else dict(block_n=16)
    res, stats = _triton(fn, fq, fk, fv, n, sparsifier, comp, kind, key_start=ks, **blocks)
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)


def test_the_prefill_grid_stays_within_cudas_limits(monkeypatch):
    """CUDA allows at most 65,535 programs along grid axes 1 and 2: a batch of 8,192 short sequences of 9 heads (a
    small model's lm-eval batch, 73,728 sequence-heads) launches within them, every (query block, head, sequence)
    once. The launch is recorded, not run (the interpreter would take minutes over 73,728 programs)."""
    import toptheta.attention.triton.prefill as module

    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(module, "_prefill_kernel", Recorder())
    monkeypatch.setattr(module, "check_device", lambda kernel, *tensors: tensors[0].device)
    B, Hq, Hkv, D = 8192, 9, 3, 16
    q, kv = torch.zeros(B, Hq, 1, D), torch.zeros(B, Hkv, 1, D)
    module.prefill_attention(q, kv, kv, scaling=1.0, theta=None, placement=None)
    (grid,) = grids
    assert grid == (1, Hq, B) and max(grid[1:]) <= 65535


# ---- a model spread over GPUs ------------------------------------------------------------------------------

def test_kernels_launch_on_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device, not the tensors': the wrappers make the tensors' device current
    around their launches (``launching_on``), so the layers a ``device_map=auto`` model puts on cuda:1 run there.
    Here the context each wrapper enters is recorded; ``launching_on`` itself picks CUDA's device context for a
    CUDA device (built without touching CUDA) and nothing off CUDA."""
    import toptheta.attention.triton.decode as decode_module
    import toptheta.attention.triton.prefill as prefill_module
    from toptheta.attention.triton.common import launching_on

    entered = []

    @contextlib.contextmanager
    def recording(device):
        entered.append(device)
        yield

    for module in (prefill_module, decode_module):
        monkeypatch.setattr(module, "launching_on", recording)
    q, k, v = _data(2, 8, 8)
    prefill_module.prefill_attention(q, k, v, scaling=0.5, theta=None, placement=None, block_m=16, block_n=16)
    decode_module.decode_attention(q[:, :, -1:], k, v, scaling=0.5, theta=None, placement=None, block_n=16)
    assert entered == [q.device, q.device]
    context = launching_on(torch.device("cuda", 1))
    assert isinstance(context, torch.cuda.device) and context.idx == 1
    assert isinstance(launching_on(torch.device("cpu")), contextlib.nullcontext)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED or torch.cuda.device_count() < 2, reason="needs two CUDA devices and TRITON_INTERPRET=0")
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_kernels_on_the_second_gpu_while_the_first_is_current(monkeypatch, kind):
    """Tensors on cuda:1 while cuda:0 is current (a layer of a model spread over two GPUs): the plain kernel's numbers."""
    B, Q, K = 2, 20, 20
    q, k, v = (t.to("cuda:1") for t in _data(B, Q, K, seed=10))
    if kind == "decode":
        q, Q = q[:, :, -1:].contiguous(), 1
    ks, valid, n = (t.to("cuda:1") for t in _bounds(B, Q, K, key_start=[0, 3]))
    sparsifier, comp = _objects("pre-sdc-vmc" if kind == "prefill" else "post-vmc", "keep-max")
    torch.cuda.set_device(0)
    ref_out, ref_keep, ref_stats = _plain(monkeypatch, q, k, v, valid, sparsifier, comp, kind)
    fn = prefill_attention if kind == "prefill" else decode_attention
    blocks = dict(block_m=16, block_n=16) if kind == "prefill" else dict(block_n=16)
    res, stats = _triton(fn, q, k, v, n, sparsifier, comp, kind, key_start=ks, **blocks)
    assert res.out.device == torch.device("cuda", 1) and torch.cuda.current_device() == 0
    _assert_same(res, stats, ref_out, ref_keep, ref_stats)


def test_decode_steps_reuse_their_internal_buffers():
    """A decode call holds its 9 internal buffers (logits scratch, per-chunk partials) for the next call: a second step
    allocates only what it returns, and a longer cache regrows them. Same numbers either way."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import toptheta.attention.triton.decode as decode_module

    class Empties(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ in ("empty", "empty_strided")
            return func(*args, **(kwargs or {}))

    def step(K):
        q, k, v = _data(2, 1, K, seed=11)
        counter = Empties()
        with counter:
            out = decode_module.decode_attention(q, k, v, scaling=0.5, theta=None, placement=None, block_n=16).out
        return out, counter.count

    decode_module.release_buffers()
    first, fresh = step(40)
    again, reused = step(40)
    assert torch.equal(first, again) and fresh - reused == 9
    longer, grown = step(400)
    assert grown > reused  # the logits scratch (and more chunks' partials) outgrew the held buffers
    q, k, v = _data(2, 1, 400, seed=11)
    decode_module.release_buffers()
    assert torch.equal(longer, decode_module.decode_attention(q, k, v, scaling=0.5, theta=None, placement=None,
                                                              block_n=16).out)


@pytest.mark.skipif(not INTERPRETED, reason="the GPU run is test_backends' test_generate_on_cuda_gives_the_cpu_tokens...")
@pytest.mark.parametrize("name", ["topk-post-vmc", "topk-pre-sdc-vmc", "topp-post-vmc"])
def test_generate_with_topk_or_topp_runs_its_decode_steps_on_triton(monkeypatch, name):
    """Greedy decoding with left padding as the registry chooses on a GPU: Triton takes Top-k's and top-p's decode
    steps and refuses their prefill (a prefill row's boundary is a selection over the whole row), which a torch or C++
    kernel serves; the tokens and counts of the plain kernel alone."""
    from conftest import tiny_6heads

    from toptheta.attention import backends
    from toptheta.attention.backends import triton as triton_backend

    class OnCpu(triton_backend.TritonBackend):
        """The Triton backend choosing for CPU tensors as it chooses for CUDA ones."""

        def refuse_device(self, call):
            return None

    sparsifier, comp = _objects(name, k=3, p=0.5)  # a tiny random model's attention is nearly uniform
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    model = tiny_6heads("llama")

    def generate():
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        return out, stats

    monkeypatch.setenv("TOPTHETA_BACKEND", "plain")
    ref, ref_stats = generate()
    monkeypatch.delenv("TOPTHETA_BACKEND")
    backends.register(OnCpu(importlib.import_module("toptheta.attention.triton")))  # in the registered one's place
    try:
        got, stats = generate()
    finally:
        backends.unregister("triton")
        if triton_backend.BACKEND is not None:
            backends.register(triton_backend.BACKEND)
    assert stats.backend_calls["triton"] == 5 * 2, stats.backend_calls  # 5 decode steps × 2 layers
    assert sum(stats.backend_calls.values()) == 6 * 2 and ref_stats.backend_calls == {"plain": 12}
    assert torch.equal(got, ref)
    for counter in ("prefill_kept", "decode_kept", "vrow_kept", "prefill_valid", "decode_valid", "vrow_valid"):
        assert torch.equal(getattr(stats, counter), getattr(ref_stats, counter)), counter
    assert 0 < stats.kept_vrow_fraction < 1

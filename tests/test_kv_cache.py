"""Copies of a KV cache for scoring from shared prefixes (``attention.cache.select_rows``, ``dropping_appends``) and
the one-pass prefill kernel reading a growing cache's views in place: the same tensors as the direct copies, the
same bits as contiguous inputs, and no copy where none is needed."""

from __future__ import annotations

import pytest
import torch

from conftest import HKV, configs, prefill_data
from toptheta.attention import cache as kv
from toptheta.attention import prefill
from toptheta.evaluation import prefix_cache


def _filled(B=3, K=10, D=4, seed=0) -> tuple[kv.DynamicCache, torch.Tensor, torch.Tensor]:
    """A two-layer growing cache holding K random positions of B rows, and its keys and values (B, HKV, K, D)."""
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(B, HKV, K, D, generator=g), torch.randn(B, HKV, K, D, generator=g)
    cache = kv.DynamicCache()
    kv.set_cache_layers(cache, [kv.GrowingLayer(), kv.GrowingLayer()])
    for layer in cache.layers:
        layer.update(keys, values)
    return cache, keys, values


def test_selected_rows_are_copies_with_room_the_next_append_writes_into():
    cache, keys, values = _filled()
    rows = torch.tensor([2, 0, 2])  # repeats allowed
    copy = kv.select_rows(cache, rows, room=5)
    for layer in copy.layers:
        assert isinstance(layer, kv.GrowingLayer) and layer._owns_views()
        assert torch.equal(layer.keys, keys[rows]) and torch.equal(layer.values, values[rows])
        buffer = layer._kbuf.data_ptr()
        new = torch.randn(3, HKV, 5, 4)
        k, _ = layer.update(new, new)
        assert layer._kbuf.data_ptr() == buffer  # written into the room: no copy of the cache
        assert torch.equal(k, torch.cat([keys[rows], new], 2))
    for layer in cache.layers:  # the source is untouched
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)


def test_re_padding_moves_each_rows_valid_positions_to_the_end():
    """Right-padded rows (row b: its first ends[b] positions valid) come out left-padded: the rotation the earlier
    gather made, the valid positions last and the padding's entries before them."""
    cache, keys, values = _filled(K=9)
    ends = torch.tensor([9, 4, 6])
    moved = prefix_cache.move_padding_left(cache, ends, 9, room=3)
    for b, end in enumerate(ends.tolist()):
        for got, x in ((moved.layers[1].keys, keys), (moved.layers[1].values, values)):
            assert torch.equal(got[b], torch.roll(x[b], 9 - end, dims=1))
            assert torch.equal(got[b, :, 9 - end:], x[b, :, :end])
    assert moved.layers[0]._kbuf.shape[-2] == 12 and torch.equal(cache.layers[0].keys, keys)
    with pytest.raises(ValueError, match="not 8"):
        prefix_cache.move_padding_left(cache, ends, 8)


def test_dropping_appends_restores_each_layers_length_and_keeps_its_buffer():
    cache, keys, _ = _filled()
    layer = cache.layers[0]
    buffer = layer._kbuf.data_ptr()
    for step in range(2):  # a second batch reuses the room the first wrote into
        with kv.dropping_appends(cache):
            new = torch.full((3, HKV, 2, 4), float(step))
            k, _ = layer.update(new, new)
            assert torch.equal(k[:, :, 10:], new)
        assert torch.equal(layer.keys, keys) and layer._owns_views() and layer._kbuf.data_ptr() == buffer
    plain = kv.DynamicCache()
    kv.set_cache_layers(plain, [kv.DynamicLayer()])
    with pytest.raises(ValueError, match="growing layers"):
        with kv.dropping_appends(plain):
            pass


@pytest.mark.parametrize("name", ["dense", "theta-post-vmc", "theta-pre-sdc-vmc"])
def test_prefill_kernel_reads_cache_views_in_place_with_the_same_bits(monkeypatch, name):
    """K and V as views of buffers with spare room (a growing cache's layout): not copied before the kernel, and
    the same output as from contiguous copies."""
    from toptheta.attention import fused_prefill

    if fused_prefill.extension() is None:
        pytest.skip("the one-pass prefill kernel could not be built here (no C++ compiler?)")
    monkeypatch.setattr(prefill, "KEY_BLOCK", 16)
    sparsifier, comp = configs()[name]
    q, k, v, valid = prefill_data(K=50)
    kbuf, vbuf = torch.randn(2, HKV, 80, 8), torch.randn(2, HKV, 80, 8)
    kbuf[:, :, :50], vbuf[:, :, :50] = k, v
    kview, vview = kbuf[:, :, :50], vbuf[:, :, :50]
    assert not kview.is_contiguous() and prefill._slabs(kview).data_ptr() == kbuf.data_ptr()
    call = dict(scaling=0.5, layer=0, sparsifier=sparsifier, compensations=comp)
    for mask in (valid, None):
        viewed = prefill.attention(q, kview, vview, mask, **call)
        copied = prefill.attention(q, k.clone(), v.clone(), mask, **call)
        assert viewed is not None and torch.equal(viewed, copied)

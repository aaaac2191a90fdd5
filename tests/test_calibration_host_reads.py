"""Calibration on the GPU path reads nothing on the host inside a layer call (issue 29, item 4).

The collectors' device path (``Collector(device_path=True)``, the default off the CPU) is run here on CPU tensors:
every tensor-to-Python conversion made inside the observer calls of a calibration forward is counted (there is
none), and the thresholds are bit-identical to the host path's (the CPU default) and to golden hashes of the
values ``calibrate`` gave before the device path existed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib

import pytest
import torch

import toptheta
from toptheta.calibration import OrderStatCollector, TargetKCollector
from toptheta.models import build_tiny_model

calibrate_module = importlib.import_module("toptheta.calibration.calibrate")
READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy")

# sha256[:16] of the threshold values (and calibrated SDC masses) of `calibrate` on this file's model and
# documents, computed with the collector before its device path was added (commit ce385ba).
GOLDEN = {
    ("order", "post", 1.0, True, "layer-head-n"): "9350ef84e307e5f7",
    ("order", "post", 1.0, True, "layer"): "a79689acbbe90759",
    ("order", "pre", 0.5, True, "layer-head-n"): "61a9393a75cc220f",
    ("order", "pre", 0.5, True, "layer"): "e4a0402bc041b3dd",
    ("order", "post", 0.5, False, "layer-head-n"): "c62e554348b6bd70",
    ("target-k", "post", 1.0, True, "layer-head-n"): "f8325992800c7626",
    ("target-k", "pre", 0.5, False, "layer-head-n"): "0f8ea5c0279a753e",
    ("target-k", "pre", 0.5, False, "layer"): "8a9bbfdbc1d04736",
}


@contextlib.contextmanager
def counting_host_reads(tally: list):
    """Record (conversion, shape) of every tensor-to-Python conversion inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        def read(self, *args, **kwargs):
            tally.append((name, tuple(self.shape)))
            return saved[name](self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def counted(cls, tally: list, device_path: bool):
    """A collector class whose observer calls count host reads (only there: not the kernel's, not reduce's)."""
    class Counted(cls):
        def __call__(self, rows):
            self.calls = getattr(self, "calls", 0) + 1
            with counting_host_reads(tally):
                return super().__call__(rows)

    return functools.partial(Counted, device_path=device_path)


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, seed=0)


def documents():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (1, 96), generator=g) for _ in range(3)]


def run_calibrate(model, monkeypatch, device_path: bool, statistic, placement, sample_frac, tac, granularity):
    tally: list = []
    made = []
    for name, cls in (("OrderStatCollector", OrderStatCollector), ("TargetKCollector", TargetKCollector)):
        factory = counted(cls, tally, device_path)
        monkeypatch.setattr(calibrate_module, name, lambda *a, _f=factory, **kw: made.append(_f(*a, **kw)) or made[-1])
    th = toptheta.calibrate(model, documents(), k=8, layer_k={}, granularity=granularity, seed=3, progress=False,
                            statistic=statistic, placement=placement, sample_frac=sample_frac, tac=tac)
    assert len(made) == 1 and made[0].calls > 0  # the collector of this run observed rows
    return th, tally


def digest(th) -> str:
    parts = [th.values] + ([th.sdc_mass] if th.sdc_mass is not None else [])
    return hashlib.sha256(b"".join(p.numpy().tobytes() for p in parts)).hexdigest()[:16]


@pytest.mark.parametrize("config", list(GOLDEN), ids=lambda c: "-".join(map(str, c)))
def test_device_path_reads_nothing_and_matches_golden(model, monkeypatch, config):
    device, reads = run_calibrate(model, monkeypatch, True, *config)
    if config[:2] == ("target-k", "pre"):  # the grid is fitted to each layer's first sampled rows: one read each
        assert [r for r in reads if r[0] != "tolist"] == [] and len(reads) == len(device.k), reads
    else:
        assert reads == []
    assert digest(device) == GOLDEN[config]
    host, host_reads = run_calibrate(model, monkeypatch, False, *config)
    assert host_reads  # the host path does read (free on the CPU): the counter sees conversions
    assert digest(host) == GOLDEN[config]
    assert torch.equal(device.values.nan_to_num(-7.0), host.values.nan_to_num(-7.0))
    assert device.metadata["rows_sampled"] == host.metadata["rows_sampled"]
    assert device.metadata["rows_eligible"] == host.metadata["rows_eligible"]


def test_device_path_with_padding_matches_host_path(model):
    """A left-padded batch (rows of different lengths in one chunk, some not eligible): the same sums."""
    ids = torch.randint(3, 250, (2, 40), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    collectors = [OrderStatCollector([6, 6], 4, "pre", device_path=d) for d in (False, True)]
    for collector in collectors:
        with torch.no_grad(), toptheta.sparsify(model, toptheta.TopK(6, "pre"), stats=False, observer=collector):
            model(input_ids=ids, attention_mask=mask)
    (hv, hc, hs), (dv, dc, ds) = (c.reduce("layer-head-n") for c in collectors)
    assert torch.equal(hc, dc) and torch.equal(hv.nan_to_num(-7.0), dv.nan_to_num(-7.0))
    assert torch.equal(hs.nan_to_num(-7.0), ds.nan_to_num(-7.0))
    assert collectors[0].max_n_seen == collectors[1].max_n_seen == 40
    assert torch.equal(collectors[0].rows_sampled, collectors[1].rows_sampled)

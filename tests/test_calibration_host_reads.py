"""Calibration on the GPU path reads nothing on the host inside a layer call (issue 29, item 4).

The collectors' device path (``Collector(device_path=True)``, the default off the CPU) is run here on CPU tensors:
every tensor-to-Python conversion made inside the observer calls of a calibration forward is counted (there is
none), and the thresholds are bit-identical to the host path's (the CPU default) and to golden hashes of the
values ``calibrate`` gave before the device path existed.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import toptheta
from toptheta.attention.host_reads import counting_host_reads
from toptheta.calibration import OrderStatCollector, TargetKCollector
from toptheta.models import build_tiny_model

calibrate_module = importlib.import_module("toptheta.calibration.calibrate")

# (calibrated entries, mean) of the threshold values (and of the calibrated SDC masses) of `calibrate` on this
# file's model and documents (digest below), recorded on an AMD EPYC machine. They replace bitwise hashes taken before
# the collector's device path was added (commit ce385ba): on this CPU 6 of those 8 hashes differed, at commits before and
# after the device path alike, so the hashes recorded the CPU's rounding rather than the calibration.
GOLDEN = {
    ('order', 'post', 1.0, True, 'layer-head-n'): (704, 0.0184233405),
    ('order', 'post', 1.0, True, 'layer'): (2, 0.0187974265),
    ('order', 'pre', 0.5, True, 'layer-head-n'): (600, 1.94234093, 600, 0.612199638),
    ('order', 'pre', 0.5, True, 'layer'): (2, 2.10382438, 2, 0.628644109),
    ('order', 'post', 0.5, False, 'layer-head-n'): (600, 0.017887945),
    ('target-k', 'post', 1.0, True, 'layer-head-n'): (704, 0.0189964317),
    ('target-k', 'pre', 0.5, False, 'layer-head-n'): (688, 2.1761492, 688, 0.629083225),
    ('target-k', 'pre', 0.5, False, 'layer'): (2, 2.48719382, 2, 0.618612498),
}


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


def digest(th) -> tuple:
    """(calibrated entries, their mean) of θ and of the SDC mass: the golden values hold on any CPU to float
    tolerance (a bitwise hash does not: MKL and the vector units round differently across CPUs, measured here
    between an Intel and an AMD EPYC machine); device against host is compared bitwise, on the same machine."""
    out = []
    for part in [th.values] + ([th.sdc_mass] if th.sdc_mass is not None else []):
        known = part[~torch.isnan(part)].double()
        out += [int(known.numel()), float(known.mean()) if known.numel() else 0.0]
    return tuple(out)


def matches(found: tuple, golden: tuple) -> bool:
    return len(found) == len(golden) and all(a == b if isinstance(b, int) else a == pytest.approx(b, rel=1e-4, abs=1e-6)
                                             for a, b in zip(found, golden))


@pytest.mark.parametrize("config", list(GOLDEN), ids=lambda c: "-".join(map(str, c)))
def test_device_path_reads_nothing_and_matches_golden(model, monkeypatch, config):
    device, reads = run_calibrate(model, monkeypatch, True, *config)
    if config[:2] == ("target-k", "pre"):  # the grid is fitted to each layer's first sampled rows: one read each
        assert [r for r in reads if r[0] != "tolist"] == [] and len(reads) == len(device.k), reads
    else:
        assert reads == []
    assert matches(digest(device), GOLDEN[config]), digest(device)
    host, host_reads = run_calibrate(model, monkeypatch, False, *config)
    assert host_reads  # the host path does read (free on the CPU): the counter sees conversions
    assert matches(digest(host), GOLDEN[config]), digest(host)
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

"""Compensation lowers itself (compensation/lowering.py): kernels read the inputs a compensation declares, never its
type. A compensation defined here alone, which asks for half the exact SDC mass, runs on every backend that serves
SDC and gives what SDC('exact', scale=0.5) gives there, exactly."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import toptheta
from conftest import BACKEND_NAMES, attend, backend_data, configs
from toptheta.attention import backends
from toptheta.attention.backends import AttentionCall
from toptheta.compensation import KernelCompensation, check_compensation, lower


@dataclass
class HalfSDC:
    """Half of the dropped mass back into the denominator: SDC's kernel input with λ = 0.5."""

    label = "HalfSDC"

    def lower(self, into: KernelCompensation, placement):
        return replace(into, sdc=toptheta.SDC("exact", scale=0.5)) if placement == "pre" else into

    def check(self, sparsifier, compensations):
        if sparsifier.placement != "pre":
            raise ValueError("HalfSDC needs pre-softmax selection")


def test_lowering_is_what_each_compensation_declares():
    sdc, vmc = toptheta.SDC("exact"), toptheta.VMC()
    assert lower([sdc, vmc], "pre") == KernelCompensation(sdc=sdc, vmc=True)
    assert lower([vmc], "post") == KernelCompensation(sdc=None, vmc=True)
    assert lower([sdc, vmc], None) == KernelCompensation()  # dense: nothing to put back
    assert lower([HalfSDC()], "post").sdc is None and lower([HalfSDC()], "pre").sdc.scale == 0.5
    pre = configs()["theta-pre"][0]
    check_compensation(pre, [HalfSDC(), toptheta.VMC()])  # VMC sees HalfSDC's denominator: accepted
    with pytest.raises(TypeError, match="compensation objects"):
        check_compensation(pre, [object()])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("shape", ["causal", "masked", "decode"])
def test_a_new_compensation_runs_on_every_backend_without_a_kernel_change(monkeypatch, backend, shape):
    sparsifier = configs()["theta-pre"][0]
    ours, reference = [HalfSDC(), toptheta.VMC()], [toptheta.SDC("exact", scale=0.5), toptheta.VMC()]
    data, phase = backend_data(shape)
    call = AttentionCall(*data, 0.5, 0, sparsifier, tuple(ours), None, None, None, None, None, phase)
    call.forced = True
    if backends.get(backend).refuse(call) is not None:
        pytest.skip(f"{backend} does not serve this call")
    monkeypatch.setenv("TOPTHETA_BACKEND", backend)
    out, stats = attend(data, phase, sparsifier, ours)
    expected, expected_stats = attend(data, phase, sparsifier, reference)
    assert stats.backend_calls == expected_stats.backend_calls == {backend: 1}
    assert torch.equal(out, expected)
    for name, value in stats.state_dict().items():
        assert torch.equal(value, expected_stats.state_dict()[name]), name

"""Count the host reads of a block of code: every tensor-to-Python conversion (``.item()``, ``bool(t)``,
``.tolist()``, ``.cpu()``, ...), each a device synchronisation on a GPU.

It works on any device, so a CPU test can show that a GPU path reads nothing back inside a layer call
(``torch.cuda.set_sync_debug_mode`` needs CUDA), and on meta tensors, which have no values: a conversion of one
gets a stand-in answer (zeros, True, 0), so code that would read can still be walked through at any size.
"""

from __future__ import annotations

import collections
import contextlib

import torch

READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "cpu", "numpy")


@contextlib.contextmanager
def counting_host_reads(tally: list):
    """Append (conversion, tensor shape) to ``tally`` for every tensor-to-Python conversion inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        original = saved[name]

        def read(self, *args, **kwargs):
            tally.append((name, tuple(self.shape)))
            if self.device.type != "meta":
                return original(self, *args, **kwargs)
            if name in ("cpu", "tolist", "numpy"):
                zeros = torch.zeros(self.shape, dtype=self.dtype)
                return zeros if name == "cpu" else getattr(zeros, name)()
            return {"__bool__": True, "__float__": 0.0}.get(name, 0)

        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def by_kind(tally: list) -> dict[str, int]:
    """How many reads of each conversion a tally holds."""
    return dict(collections.Counter(name for name, _ in tally))

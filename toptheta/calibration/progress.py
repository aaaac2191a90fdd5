"""Saved progress of a calibration: ``calibrate(progress_file=...)`` goes on where a killed run stopped.

Calibrating on long documents takes hours (the 20 long_documents texts, up to 12.9k tokens, took 6,511 s on 2 CPU
cores), and a preempted cluster job or a session that ends loses all of it. With a progress file, every ``every``
seconds, once a unit of work has finished (a batch, or a group of sequences that share a prefix), the collector's
state (its float64 sums, row counters and sampling generator), the units done and the counts of the provenance
are written to the file (a temporary file, then a rename, so a kill never leaves half a file). A rerun of the same
calibration loads it, skips the units it holds and runs the others in the same order: its thresholds equal those of
a run never stopped, bit for bit. The file is removed when the calibration returns.

The file records a digest of what the sums depend on: the model (identity, shape, dtype, a sample of its weights),
the inputs' token ids and every setting of the collector and of the calibration forwards. A file of another
calibration is refused, naming the fix, before any forward runs.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import torch

from ..atomic import atomic_write
from ..cachedir import identity_key

log = logging.getLogger("toptheta")

VERSION = 1
SAVE_EVERY = 300.0  # seconds between saves by default: a few seconds of writing an hour, at most 5 minutes lost
WEIGHT_SAMPLE = 4096  # elements of the first and last parameter hashed: tells two checkpoints of one shape apart


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of a sample of the weights (the first ``WEIGHT_SAMPLE`` elements of the first and last parameter)."""
    params = list(model.parameters())
    digest = hashlib.sha256()
    for p in (params[0], params[-1]):
        sample = p.detach().flatten()[:WEIGHT_SAMPLE].float().cpu()
        digest.update(str(tuple(p.shape)).encode() + sample.numpy().tobytes())
    return digest.hexdigest()


def inputs_digest(batches) -> str:
    """sha256 of calibration batches, each an (input_ids (B, T), attention_mask or None) pair."""
    digest = hashlib.sha256()
    for ids, mask in batches:
        digest.update(str(tuple(ids.shape)).encode() + ids.long().numpy().tobytes())
        digest.update(b"-" if mask is None else mask.long().numpy().tobytes())
    return digest.hexdigest()


class Progress:
    """Where a calibration stands: units done, the provenance counts, and (with a ``path``) the saved state.

    Args:
        path: the progress file; None keeps nothing (the counts are still kept here).
        identity: what the calibration's sums depend on (JSON-able); its digest must match a file to resume it.
        every: seconds between saves (0: after every unit; None: ``SAVE_EVERY``).
    """

    def __init__(self, path: str | Path | None, identity: dict, every: float | None = None):
        every = SAVE_EVERY if every is None else every
        if every < 0:
            raise ValueError(f"progress_every must be ≥ 0 seconds, got {every}")
        self.path = Path(path) if path is not None else None
        self.digest = identity_key({"version": VERSION, **identity})
        self.every = float(every)
        self.units = 0
        self.counts = {"sequences": 0, "tokens": 0, "tokens_run": 0}
        self._saved_at = time.monotonic()

    def resume(self, collector) -> int:
        """Load a saved state into ``collector`` and return the units it holds (0 without a file)."""
        if self.path is None or not self.path.is_file():
            return 0
        state = torch.load(self.path, weights_only=True)
        if state.get("digest") != self.digest:
            raise ValueError(f"{self.path} holds the progress of another calibration (other model, inputs or "
                             "settings); delete it to calibrate from the start, or rerun the calibration that wrote it")
        collector.load_state_dict(state["collector"])
        self.units, self.counts = int(state["units"]), {name: int(v) for name, v in state["counts"].items()}
        log.info("calibration: resuming from %s (%d units, %d sequences done)", self.path, self.units,
                 self.sequences_done)
        return self.units

    @property
    def sequences_done(self) -> int:
        """Sequences finished (the prefix-sharing path counts them as ``finished``; batches count as they end)."""
        return self.counts.get("finished", self.counts["sequences"])

    def unit_done(self, collector, units: int) -> None:
        """Note that ``units`` units are done; save when ``every`` seconds have passed since the last save."""
        self.units = units
        if self.path is None or time.monotonic() - self._saved_at < self.every:
            return
        state = {"digest": self.digest, "units": self.units, "counts": dict(self.counts),
                 "collector": collector.state_dict()}
        atomic_write(self.path, lambda tmp: torch.save(state, tmp))
        self._saved_at = time.monotonic()
        log.info("calibration: progress saved to %s (%d units, %d sequences done)", self.path, self.units,
                 self.sequences_done)

    def finish(self) -> None:
        """The calibration returned: its progress file has served."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)

"""A run's copy of a thresholds table too large to track in git is kept sampled (store/threshold_copy.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from toptheta.calibration import Thresholds
from toptheta.results import storage, threshold_plots
from toptheta.store import threshold_copy
from toptheta.store.runs import RunStore
from toptheta.thresholds.table import SampledCopy

LIMIT = 40_000  # bytes: the table below is ~77 kB (values and counts, 2 × 3 × 1,601 float32 each)


def _table(tmp_path, lengths: int = 1601):
    torch.manual_seed(0)
    values = torch.randn(2, 3, lengths)
    values[..., 0] = float("nan")  # row length 0 is never calibrated
    counts = torch.randint(1, 9, (2, 3, lengths)).float()
    path = Thresholds(values, [4, 4], "post", {"granularity": "head_n"}, counts=counts).save(tmp_path / "t.safetensors")
    return path, values, counts


def test_a_large_table_is_kept_sampled_exactly_at_its_lengths(tmp_path, monkeypatch):
    source, values, counts = _table(tmp_path)
    monkeypatch.setattr(threshold_copy, "COPY_LIMIT_BYTES", LIMIT)
    store = RunStore(tmp_path / "results")
    run = store.write_run("r1", config={"model": {"name": "tiny"}}, lm_eval_results={"results": {}}, stats={},
                          thresholds_ref=str(source), copies={"thresholds.safetensors": source})

    assert not (run / "thresholds.safetensors").exists()
    sampled = run / "thresholds.sampled.safetensors"
    assert sampled.stat().st_size <= LIMIT
    tensors, record = threshold_copy.read_sampled(sampled)
    assert record["shape"] == [2, 3, 1601] and record["bytes"] == source.stat().st_size
    assert record["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest() and record["header"]["k"] == [4, 4]
    kept = ~np.isnan(tensors["counts"][0, 0])
    assert kept[-1] and kept.sum() < 1601 / 2  # the longest length is kept, at least every second one left out
    lengths = np.flatnonzero(kept)
    assert np.array_equal(np.diff(lengths)[:-1], np.full(len(lengths) - 2, record["stride"]))
    np.testing.assert_array_equal(tensors["values"][..., lengths], values[..., lengths].numpy())
    np.testing.assert_array_equal(tensors["counts"][..., lengths], counts[..., lengths].numpy())

    with pytest.raises(SampledCopy, match="recalibrate"):
        Thresholds.load(sampled)
    # the figures and the storage table read it as the full table it came from
    assert threshold_plots.threshold_files(store.results_dir) == [sampled]
    assert threshold_plots.load_values(sampled)[0].shape == (2, 3, 1601)
    assert threshold_plots.summary_table(sampled)["max_n"].tolist() == [1600, 1600]
    measured = storage.measured_table(store.results_dir)
    assert measured[["layers", "heads", "row_lengths"]].values.tolist() == [[2, 3, 1600]]
    assert f"{source.stat().st_size} bytes" in measured["source"][0]


def test_a_small_table_is_copied_whole(tmp_path):
    source, _, _ = _table(tmp_path, lengths=40)
    run = RunStore(tmp_path / "results").write_run("r1", config={"model": {"name": "tiny"}}, lm_eval_results={"results": {}}, stats={},
                                                   thresholds_ref=str(source), copies={"thresholds.safetensors": source})
    assert (run / "thresholds.safetensors").read_bytes() == source.read_bytes()
    assert not (run / "thresholds.sampled.safetensors").exists()


def test_sample_store_replaces_only_large_copies_and_is_idempotent(tmp_path):
    source, _, _ = _table(tmp_path)
    small, _, _ = _table(tmp_path / "small", lengths=40)
    for run_id, path in (("big", source), ("small", small)):
        (tmp_path / "results" / "runs" / run_id).mkdir(parents=True)
        (tmp_path / "results" / "runs" / run_id / "thresholds.safetensors").write_bytes(path.read_bytes())
    runs = tmp_path / "results" / "runs"
    assert threshold_copy.sample_store(tmp_path / "results", LIMIT) == [runs / "big" / "thresholds.sampled.safetensors"]
    assert sorted(p.name for p in runs.glob("*/*")) == ["thresholds.safetensors", "thresholds.sampled.safetensors"]
    assert threshold_copy.sample_store(tmp_path / "results", LIMIT) == []


def test_a_large_file_that_is_not_thresholds_is_refused(tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * (LIMIT + 1))
    with pytest.raises(ValueError, match="not a toptheta thresholds file"):
        threshold_copy.keep_copy(other, tmp_path / "copy.bin", LIMIT)


def test_no_file_in_the_committed_store_is_over_the_limit():
    """The store is tracked in git: a run written by an older toptheta (a full copy of a large table) is sampled
    with `python -m toptheta.store.threshold_copy results` before it is committed."""
    runs = Path(__file__).resolve().parents[1] / "results" / "runs"
    large = [f"{p} ({p.stat().st_size} bytes)" for p in runs.glob("*/*") if p.stat().st_size > threshold_copy.COPY_LIMIT_BYTES]
    assert not large, "sample them: python -m toptheta.store.threshold_copy results\n" + "\n".join(large)

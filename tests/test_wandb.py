"""wandb logging: one offline run per configuration, flat keys, settings in the config, thresholds artifact.

The runs are real offline wandb runs; the test reads their `.wandb` files back (a LevelDB-style log of
protobuf records) rather than trusting a stand-in for wandb.init.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from toptheta import SparsityStats
from toptheta.spec import RunSpec
from toptheta.results.wandb_logger import make_logger, resolve_mode

BLOCK = 32768  # the log's block size; a record header is 7 bytes: crc32 (4), length (2), type (1)


def read_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def read_run(path: Path) -> dict:
    import json

    out = {"config": {}, "history": {}, "artifacts": []}
    for record in read_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out.update(name=record.run.display_name, group=record.run.run_group, job_type=record.run.job_type)
            out["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            out["history"].update({i.key or "/".join(i.nested_key): i.value_json for i in record.history.item})
        elif kind == "artifact":
            out["artifacts"].append((record.artifact.type, [e.path for e in record.artifact.manifest.contents]))
    return out


def _spec(label, run_id, sparsifier, comp, thresholds=None):
    identity = {"model": {"name": "tiny-llama"}, "sparsifier": sparsifier, "comp": comp, "task": {"name": "smoke"},
                "calib": thresholds}
    return RunSpec.from_identity(identity, run_id=run_id, label=label)


def _rows(run_id, sparsifier, k, comp, acc):
    base = {"run_id": run_id, "model": "tiny-llama", "sparsifier": sparsifier, "placement": "post", "k": k,
            "comp": comp, "granularity": "layer-head-n", "task": "smoke", "num_fewshot": 0, "limit": 2}
    return [{**base, "metric": "acc,none", "value": acc, "stderr": 0.1},
            {**base, "metric": "acc_norm,none", "value": acc + 0.1, "stderr": 0.2}]


def test_one_offline_run_per_configuration_with_flat_keys_and_a_thresholds_artifact(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    thresholds = tmp_path / "abc.safetensors"
    thresholds.write_bytes(b"not really safetensors")
    stats = SparsityStats(num_layers=2, num_heads=4, num_kv_heads=2)
    stats.prefill_kept += 1.0
    stats.prefill_valid += 4.0  # kept_attention_fraction = 0.25

    logger = make_logger({"name": "wandb", "project": "toptheta-test"}, {"sweep": "multirun/sweep-1", "job": "job0"})
    dense = _spec("dense", "d" * 16, {"name": "dense", "k": None}, {"sdc": None, "vmc": False})
    sparse = _spec("toptheta-post", "t" * 16, {"name": "toptheta", "k": 16, "placement": "post"},
                   {"sdc": None, "vmc": True}, thresholds={"task": "smoke"})
    logger.log_run(dense, _rows(dense.run_id, "dense", None, "none", 0.5), stats)
    logger.log_run(sparse, _rows(sparse.run_id, "toptheta", 16, "vmc", 0.4), stats, str(thresholds))
    logger.finish()

    files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 2  # one wandb run per configuration, not one per sweep
    runs = {r["job_type"]: r for r in map(read_run, files)}
    assert set(runs) == {"dense", "toptheta-post"}
    run = runs["toptheta-post"]
    assert run["group"] == "multirun/sweep-1" == runs["dense"]["group"]
    assert run["name"] == "tiny-llama toptheta-post k=16 vmc smoke [tttttttt]"
    assert {"acc", "acc_norm", "acc_stderr", "acc_norm_stderr", "kept_attention_fraction"} <= set(run["history"])
    assert float(run["history"]["acc_norm"]) == pytest.approx(0.5)
    assert float(run["history"]["kept_attention_fraction"]) == pytest.approx(0.25)
    config = run["config"]
    assert (config["sparsifier"], config["k"], config["placement"], config["comp"]) == ("toptheta", 16, "post", "vmc")
    assert config["vmc"] is True and config["run_id"] == "t" * 16 and "value" not in config
    thresholds_artifacts = lambda r: [a for a in r["artifacts"] if a[0] == "thresholds"]  # noqa: E731
    assert thresholds_artifacts(run) == [("thresholds", ["thresholds.safetensors"])]
    assert thresholds_artifacts(runs["dense"]) == []
    assert ("run_table", ["per_layer.table.json"]) in run["artifacts"]  # the per-layer kept fractions


def test_mode_is_offline_unless_asked_and_honours_wandb_mode(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_mode(None) == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode(None) == "disabled"
    assert resolve_mode("online") == "online"  # logger.mode, when set, wins
    monkeypatch.setenv("WANDB_MODE", "sometimes")
    with pytest.raises(ValueError, match=r"\$WANDB_MODE='sometimes'; valid: offline"):
        resolve_mode(None)

"""Claims (toptheta/store/claims.py): one job computes a run or thresholds file, the others wait and reuse."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import filelock
import pytest

from conftest import cfg
from toptheta.store import claims
from toptheta.store.runs import RunStore

ROOT = Path(__file__).resolve().parents[1]

# A second process that takes the claim, says so, and holds it until its stdin closes (or it is killed).
# claims.py is loaded by path: importing the toptheta package (torch, transformers) would take seconds.
HOLDER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("claims", sys.argv[2])
claims = importlib.util.module_from_spec(spec)
spec.loader.exec_module(claims)
with claims.claim(sys.argv[1], "test") as held:
    print("held" if held else "busy", flush=True)
    sys.stdin.read()
"""


def _holder(lock: Path, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), claims.__file__], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("kind", ["flock", "soft"])
def test_a_held_claim_excludes_other_processes_until_released(tmp_path, monkeypatch, kind):
    monkeypatch.setenv(claims.LOCK_ENV, kind)
    lock = tmp_path / "claims" / "run.lock"
    proc = _holder(lock, {claims.LOCK_ENV: kind})
    try:
        with claims.claim(lock, "run", wait=False) as held:
            assert held is False
    finally:
        proc.communicate("")  # closes stdin: the holder releases and exits
    with claims.claim(lock, "run", wait=False) as held:
        assert held is True


def test_a_waiting_claim_gets_the_lock_when_the_holder_finishes(tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv(claims.LOCK_ENV, "flock")
    lock = tmp_path / "run.lock"
    proc = _holder(lock, {})
    threading.Timer(1.0, proc.stdin.close).start()  # the holder finishes after a second
    t0 = time.time()
    with claims.claim(lock, "run") as held:
        assert held is True
        assert time.time() - t0 >= 0.9
    proc.wait(10)


def test_a_crashed_soft_holder_blocks_for_about_one_lease_not_forever(tmp_path, monkeypatch):
    env = {claims.LOCK_ENV: "soft", claims.LEASE_ENV: "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    lock = tmp_path / "run.lock"
    proc = _holder(lock, env)
    proc.send_signal(signal.SIGKILL)  # no release, no cleanup: the marker file stays behind
    proc.wait(10)
    assert lock.exists()
    t0 = time.time()
    with claims.claim(lock, "run") as held:
        assert held is True
    assert time.time() - t0 < 20


def test_auto_falls_back_to_soft_leases_where_flock_fails(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.delenv(claims.LOCK_ENV, raising=False)
    claims._flock_works.cache_clear()
    monkeypatch.setattr(fcntl, "flock", no_flock)
    try:
        assert claims.lock_kind(tmp_path) == "soft"
        assert isinstance(claims.make_lock(tmp_path / "x.lock"), filelock.SoftFileLease)
    finally:
        claims._flock_works.cache_clear()
    monkeypatch.undo()
    assert claims.lock_kind(tmp_path) == "flock"


def test_bad_settings_fail_naming_the_valid_values(tmp_path, monkeypatch):
    monkeypatch.setenv(claims.LOCK_ENV, "nfs")
    with pytest.raises(ValueError, match="auto, flock, soft"):
        claims.make_lock(tmp_path / "x.lock")
    monkeypatch.setenv(claims.LOCK_ENV, "soft")
    monkeypatch.setenv(claims.LEASE_ENV, "-3")
    with pytest.raises(ValueError, match="positive number of seconds"):
        claims.make_lock(tmp_path / "x.lock")


def test_run_directory_keeps_the_thresholds_and_the_invocation(tmp_path):
    store = RunStore(tmp_path)
    source = tmp_path / "t.safetensors"
    source.write_bytes(b"thresholds")
    since = time.time() - 1
    run = store.write_run("abc", config={}, lm_eval_results={}, stats={}, thresholds_ref=str(source),
                          texts={"invocation.json": json.dumps({"argv": ["run.py", "k=8"]})},
                          copies={"thresholds.safetensors": source})
    assert (run / "thresholds.safetensors").read_bytes() == b"thresholds"
    assert json.loads((run / "invocation.json").read_text())["argv"] == ["run.py", "k=8"]
    assert store.finished_since("abc", since) and not store.finished_since("abc", time.time() + 60)
    with pytest.raises(ValueError, match="plain file name"):
        store.write_run("abd", config={}, lm_eval_results={}, stats={}, thresholds_ref=None, texts={"../x": ""})


def test_a_run_finished_by_another_job_while_waiting_is_reused_not_recomputed(tmp_path, monkeypatch):
    """The pipeline looks for the run again once it holds the claim (the other job may have stored it)."""
    import contextlib

    from toptheta import pipeline

    config = cfg("model=tiny-llama", "task=smoke", "sparsifier=topk", "sparsifier.k=8", "sparsifier.layer_k=null",
                 "baseline=false", f"results_dir={tmp_path}")
    (spec,) = pipeline.plan(config)
    claimed = []

    @contextlib.contextmanager
    def claim_after_the_other_job(self, run_id, wait=True):
        claimed.append(run_id)  # while "waiting", the other job stores the run
        self.write_run(run_id, config={}, lm_eval_results={}, stats={}, thresholds_ref=None)
        yield True

    def execute(*args, **kwargs):
        raise AssertionError("computed a run that another job had just stored")

    monkeypatch.setattr(RunStore, "claim", claim_after_the_other_job)
    monkeypatch.setattr(pipeline, "execute", execute)
    pipeline.run(config)
    assert claimed == [spec.run_id]


@pytest.mark.slow
def test_two_parallel_jobs_of_one_configuration_compute_each_run_once(tmp_path):
    """Two `python run.py` of the same tiny configuration at once: one computes, the other reuses."""
    import pandas as pd

    env = {**os.environ, "TOPTHETA_CACHE": str(tmp_path / "cache"), "TOPTHETA_FUSED": "0"}
    args = [sys.executable, "run.py", "model=tiny-llama", "task=smoke", "task.limit=2", "sparsifier=toptheta",
            "sparsifier.k=16", "sparsifier.layer_k=null", "comp=vmc", "calib.num_samples=2",
            f"results_dir={tmp_path / 'results'}"]
    jobs = [subprocess.Popen([*args, f"hydra.run.dir={tmp_path / f'hydra{i}'}"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [job.communicate(timeout=600)[0] for job in jobs]
    assert all(job.returncode == 0 for job in jobs), logs
    evaluated = [log.count("evaluating ") for log in logs]
    calibrated = [log.count("calibrating on ") for log in logs]
    assert sum(evaluated) == 2, (evaluated, logs)  # the dense baseline and the Top-θ run, once each
    assert sum(calibrated) == 1, (calibrated, logs)  # the thresholds, once
    summary = pd.read_csv(tmp_path / "results" / "summary.csv", dtype={"run_id": str})
    assert len(summary) == summary[["run_id", "task", "metric"]].drop_duplicates().shape[0] == 4
    runs = sorted((tmp_path / "results" / "runs").iterdir())
    assert len(runs) == 2 and (runs[0] / "invocation.json").is_file()
    assert any((run / "thresholds.safetensors").is_file() for run in runs)


def test_a_job_runs_its_own_configuration_before_waiting_on_a_claimed_baseline(tmp_path, monkeypatch):
    """In a sweep every job shares the dense baseline: a job that finds it claimed runs its sparse run first (instead
    of holding an idle GPU while it waits), then waits for the baseline and reuses or computes it."""
    from toptheta import pipeline

    monkeypatch.setenv(claims.LOCK_ENV, "flock")
    config = cfg("model=tiny-llama", "task=smoke", "sparsifier=topk", "sparsifier.k=4", "sparsifier.layer_k=null",
                 f"results_dir={tmp_path}")
    specs = pipeline.plan(config)
    baseline = next(s for s in specs if s.sparsifier.settings["name"] == "dense")
    holder = _holder(tmp_path / ".claims" / f"{baseline.run_id}.lock", {claims.LOCK_ENV: "flock"})
    order = []

    def execute(spec, *args, **kwargs):
        order.append(spec.sparsifier.settings["name"])
        if spec is not baseline and spec.run_id != baseline.run_id:
            holder.communicate("")  # the other job finishes its baseline (without storing it: computed here then)

    monkeypatch.setattr(pipeline, "execute", execute)
    import threading

    deadline = threading.Timer(60, lambda: holder.poll() is None and holder.stdin.close())  # a job that waits first
    deadline.start()  # would wait forever here: released after a minute, it then fails the order below
    try:
        pipeline.run(config)
    finally:
        deadline.cancel()
        if holder.poll() is None:
            holder.communicate("")
    assert order == ["topk", "dense"]

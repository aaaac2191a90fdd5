"""A calibration killed midway goes on from its progress file (calibration/progress.py) to the thresholds of a run never
stopped, bit for bit; a file of another calibration is refused; the pipeline keeps one beside its thresholds cache."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from transformers import LlamaForCausalLM

import toptheta
from conftest import cfg
from test_calibration import VOCAB, model  # noqa: F401  (model: the calibration tests' fixture)
from toptheta import pipeline, thresholds_cache
from toptheta.calibration import calibrate, progress

pytestmark = pytest.mark.usefixtures("one_thread")


class Killed(Exception):
    """Stands for the job being killed."""


@contextlib.contextmanager
def forwards(model, kill_at: int | None = None):
    """Count the model's forwards (a list holding the count); raise Killed when forward ``kill_at`` starts."""
    count = [0]

    def hook(module, args, kwargs):
        count[0] += 1
        if kill_at is not None and count[0] == kill_at:
            raise Killed
    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


def draw(g, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def shared_sequences() -> list[list[list[int]]]:
    """Batches of one sequence each: two groups that share a prefix (three units of work with the singletons), and
    sequences that share nothing."""
    g = torch.Generator().manual_seed(5)
    first, second = draw(g, 60), draw(g, 40)
    seqs = [first + draw(g, n) for n in (20, 30, 25)] + [second + draw(g, n) for n in (30, 18)]
    seqs += [draw(g, n) for n in (50, 35, 44, 61)]
    return [[s] for s in seqs]


def padded_batches() -> list[list[list[int]]]:
    """Batches of three sequences of unequal length (left-padded by ``as_batch``)."""
    g = torch.Generator().manual_seed(6)
    return [[draw(g, n) for n in lengths] for lengths in ((40, 33, 28), (45, 45, 20), (31, 50, 38), (36, 29, 47))]


CASES = {  # name: (inputs, calibrate options)
    "shared prefixes, pre + SDC": (shared_sequences, dict(placement="pre", compensations=[toptheta.SDC("exact")])),
    "padded batches, post + VMC": (padded_batches, dict(placement="post", compensations=[toptheta.VMC()])),
    "sampled rows": (padded_batches, dict(placement="post", sample_frac=0.5, seed=3)),
    "target-k pre (grids fitted to the first rows)": (padded_batches, dict(placement="pre", statistic="target-k")),
    "decode rows": (padded_batches, dict(placement="post", generate_tokens=3)),
}


def same_thresholds(a, b) -> None:
    assert torch.equal(a.values.nan_to_num(-7.0), b.values.nan_to_num(-7.0))
    assert torch.equal(a.counts, b.counts)
    assert (a.sdc_mass is None) == (b.sdc_mass is None)
    if a.sdc_mass is not None:
        assert torch.equal(a.sdc_mass.nan_to_num(-7.0), b.sdc_mass.nan_to_num(-7.0))
    for name in ("sequences", "tokens", "tokens_run", "rows_eligible", "rows_sampled"):
        assert a.metadata[name] == b.metadata[name], name


@pytest.mark.parametrize("case", list(CASES))
def test_a_killed_calibration_goes_on_to_the_thresholds_of_one_never_stopped(model, tmp_path, case):
    make, options = CASES[case]
    options = dict(k=6, progress=False, **options)
    with forwards(model) as whole_count:
        whole = calibrate(model, make(), **options)
    file = tmp_path / "progress.pt"
    kill_at = whole_count[0] // 2 + 1
    with forwards(model, kill_at=kill_at), pytest.raises(Killed):
        calibrate(model, make(), progress_file=file, progress_every=0, **options)
    assert file.is_file() and not list(tmp_path.glob(".*.tmp"))  # what was done is saved, nothing half-written
    with forwards(model) as resumed_count:
        resumed = calibrate(model, make(), progress_file=file, progress_every=0, **options)
    assert 0 < resumed_count[0] <= whole_count[0] - (kill_at - 1) // 2  # the saved units did not run again
    same_thresholds(resumed, whole)
    assert not file.exists()  # it has served


def test_progress_is_saved_only_when_due(model, tmp_path):
    file = tmp_path / "progress.pt"
    with forwards(model, kill_at=3), pytest.raises(Killed):
        calibrate(model, padded_batches(), k=6, progress=False, progress_file=file, progress_every=3600)
    assert not file.exists()


@pytest.mark.parametrize("other", [dict(k=5), dict(placement="pre"), dict(inputs="other"), dict(weights=True)])
def test_the_progress_of_another_calibration_is_refused_before_any_forward(model, tmp_path, other):
    file = tmp_path / "progress.pt"
    with forwards(model, kill_at=3), pytest.raises(Killed):
        calibrate(model, padded_batches(), k=6, placement="post", progress=False, progress_file=file,
                  progress_every=0)
    inputs = padded_batches()[::-1] if other.pop("inputs", None) else padded_batches()
    subject = model
    if other.pop("weights", False):  # the same shape, other weights
        torch.manual_seed(1)
        subject = LlamaForCausalLM(model.config).eval()
    options = {"k": 6, "placement": "post", **other}
    with forwards(subject) as count, pytest.raises(ValueError, match="another calibration.*delete it"):
        calibrate(subject, inputs, progress=False, progress_file=file, progress_every=0, **options)
    assert count[0] == 0 and file.is_file()


def test_the_pipeline_keeps_progress_beside_its_thresholds_cache(tmp_path, monkeypatch, tokenizer):
    """A run killed while calibrating leaves <key>.progress.pt in the thresholds cache; the rerun goes on from it to
    the thresholds a calibration never stopped gives, and removes it."""
    from toptheta.models import build_tiny_model

    monkeypatch.setattr(progress, "SAVE_EVERY", 0.0)
    spec = pipeline.plan(cfg("model=tiny-llama", "task=smoke", "sparsifier=toptheta", f"results_dir={tmp_path}",
                             "sparsifier.k=4",
                             "sparsifier.layer_k=null", "task.num_fewshot=2", "calib.num_samples=6"))[-1]
    model = build_tiny_model()
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "reference"))
    with forwards(model) as whole_count:
        reference, _ = thresholds_cache.obtain_thresholds(spec, model, tokenizer)
    assert whole_count[0] >= 4
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    with forwards(model, kill_at=whole_count[0] // 2 + 1), pytest.raises(Killed):
        thresholds_cache.obtain_thresholds(spec, model, tokenizer)
    saved = list((tmp_path / "cache").rglob("*.progress.pt"))
    assert len(saved) == 1 and saved[0].parent == thresholds_cache.thresholds_dir() / spec.model.name
    with forwards(model) as resumed_count:
        resumed, path = thresholds_cache.obtain_thresholds(spec, model, tokenizer)
    assert resumed_count[0] < whole_count[0]
    same_thresholds(resumed, reference)
    assert path.endswith(".safetensors") and saved[0].name == path.split("/")[-1].replace(".safetensors", ".progress.pt")
    assert not saved[0].exists()


def test_another_spelling_of_the_same_documents_reuses_their_calibration(tmp_path, monkeypatch, tokenizer):
    """calib.max_length unset and set to the model's limit (tiny-llama: 512) give the same sequences under two
    thresholds keys: the second run loads the first's calibration (filed under its sequences) without a forward,
    and from then on finds it under its own key. Another count of documents calibrates anew."""
    from toptheta.models import build_tiny_model

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    base = ("model=tiny-llama", "task=smoke", "sparsifier=toptheta", f"results_dir={tmp_path}", "sparsifier.k=4",
            "sparsifier.layer_k=null", "task.num_fewshot=2")
    unset, spelled, fewer = (pipeline.plan(cfg(*base, *extra))[-1] for extra in (
        ("calib.num_samples=6",), ("calib.num_samples=6", "calib.max_length=512"), ("calib.num_samples=5",)))
    model = build_tiny_model()
    assert thresholds_cache.thresholds_path(unset, model) != thresholds_cache.thresholds_path(spelled, model)
    with forwards(model) as first:
        calibrated, _ = thresholds_cache.obtain_thresholds(unset, model, tokenizer)
    assert first[0] >= 4
    with forwards(model) as second:
        reused, path = thresholds_cache.obtain_thresholds(spelled, model, tokenizer)
    assert second[0] == 0 and path == str(thresholds_cache.thresholds_path(spelled, model))
    same_thresholds(reused, calibrated)
    assert os.path.samefile(path, thresholds_cache.thresholds_path(unset, model))  # one file, two names
    with forwards(model) as third:
        thresholds_cache.obtain_thresholds(fewer, model, tokenizer)
    assert third[0] >= 4


def test_two_spellings_calibrating_at_once_calibrate_once(tmp_path, monkeypatch, tokenizer):
    """Two jobs with two spellings of the same documents (two thresholds keys, so two claims) start at once: the one
    that comes second waits on the claim of the sequences while the first calibrates, then loads what it filed."""
    import logging
    import threading

    from toptheta.models import build_tiny_model
    from toptheta.store import claims

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(claims.LOCK_ENV, "flock")
    base = ("model=tiny-llama", "task=smoke", "sparsifier=toptheta", f"results_dir={tmp_path}", "sparsifier.k=4",
            "sparsifier.layer_k=null", "task.num_fewshot=2", "calib.num_samples=6")
    unset, spelled = (pipeline.plan(cfg(*base, *extra))[-1] for extra in ((), ("calib.max_length=512",)))
    waiting = threading.Event()  # the second job is blocked on the sequences' claim

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting" in record.getMessage() and "sequences" in record.getMessage():
                waiting.set()
    handler, logger = Waiting(), logging.getLogger(claims.__name__)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    calibrated = []
    calibrate = thresholds_cache.calibrate_on_task

    def first_waits(*args, **kwargs):
        calibrated.append(kwargs["k"])
        assert waiting.wait(60), "the second job never waited on the claim of the sequences"
        return calibrate(*args, **kwargs)
    monkeypatch.setattr(thresholds_cache, "calibrate_on_task", first_waits)
    found = {}

    def job(name, spec):
        found[name] = thresholds_cache.obtain_thresholds(spec, build_tiny_model(), tokenizer)
    first = threading.Thread(target=job, args=("unset", unset))
    try:
        first.start()
        while not calibrated and first.is_alive():  # the first job holds the claim and calibrates
            first.join(0.05)
        job("spelled", spelled)
        first.join(60)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert calibrated == [4] and set(found) == {"unset", "spelled"}
    same_thresholds(found["spelled"][0], found["unset"][0])
    assert os.path.samefile(found["spelled"][1], found["unset"][1])

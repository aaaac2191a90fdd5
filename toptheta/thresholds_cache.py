"""Thresholds calibrated once per key and cached: the key, the cache folder, the claim parallel jobs share, and the
calibration on one of our tasks.

A run's thresholds come from a model folder that carries them (``Thresholds.save_pretrained``), else from the cache
(``$TOPTHETA_CACHE/thresholds/<model>/<key>.safetensors``), else from a calibration that is cached for the next run
with the same key (a damaged cache file is moved aside and calibrated again). The key hashes the settings, and two
spellings of the same documents (``calib.num_samples: null`` or the task's count, ``calib.max_length`` unset or the
model's limit) hash differently; so every calibration is also filed under the sequences it ran
(``thresholds/<model>/sequences/<key>.safetensors``, a hard link), and a key that misses finds a calibration of the
same token sequences there before it calibrates (``sequences_key``); parallel jobs with two spellings hold one claim
on the sequences, so they calibrate once. A calibration saves its progress beside
it (``<key>.progress.pt``, every 5 minutes), so a job killed while calibrating goes on from there when rerun.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from array import array
from pathlib import Path
from typing import TYPE_CHECKING

from . import calibration
from .atomic import atomic_write
from .cachedir import cache_dir, identity_key
from .calibration import Thresholds, calibration_compensation, compensation_labels, model_fingerprint
from .thresholds.checkpoint import budget_record, calibration_budget, matching, run_settings
from .thresholds.table import DamagedThresholds
from .store.claims import claim

if TYPE_CHECKING:
    from .spec import RunSpec

log = logging.getLogger("toptheta")


def thresholds_identity(spec: RunSpec, fingerprint: dict) -> dict:
    """Every setting that changes the calibrated thresholds (run-time lookup options excluded), as ``thresholds_key``
    hashes them.

    The compensation enters as what calibration applies (e.g. ["VMC"]), not as calib.compensation or the
    run's comp, so settings that calibrate alike share one file.
    """
    sparsifier, calib = spec.sparsifier, spec.calib
    applied = calibration_compensation(spec.comp.objects(), sparsifier.placement, calib.compensation, calib.tac)
    return {"model": spec.model.source, "revision": spec.model.revision, "dtype": spec.model.dtype,
            "fingerprint": fingerprint, "k": sparsifier.k,
            "layer_k": sparsifier.settings.get("layer_k"),  # as given (absent: None), so keys stay as they were
            "placement": sparsifier.placement, "calib": calib.key_settings(),
            "calibration_compensation": compensation_labels(applied),
            "data": spec.data_dir, "max_length": spec.model.max_length,
            **{key: value for key, value in budget_record(sparsifier.settings).items() if value}}  # top-k: absent,
    # so keys stay as they were


def thresholds_key(spec: RunSpec, fingerprint: dict) -> str:
    """Hash of every setting that changes the calibrated thresholds (``thresholds_identity``)."""
    return identity_key(thresholds_identity(spec, fingerprint))


# calib settings that only choose and cut the calibration documents: the sequences they give stand for them in
# sequences_key (seed stays: it also draws calib.sample_frac's rows)
DOCUMENT_SETTINGS = ("task", "num_samples", "num_fewshot", "fewshot_sampler", "cover_shots", "max_length")


def sequences_key(spec: RunSpec, fingerprint: dict, sequences: list[list[int]]) -> str:
    """The thresholds key with the settings that choose the calibration documents (``DOCUMENT_SETTINGS``, the data
    folder, model.max_length) replaced by the token sequences they give: equal for every spelling of the same
    documents."""
    identity = thresholds_identity(spec, fingerprint)
    identity["calib"] = {k: v for k, v in identity["calib"].items() if k not in DOCUMENT_SETTINGS}
    del identity["data"], identity["max_length"]
    digest = hashlib.sha256()
    for ids in sequences:
        digest.update(len(ids).to_bytes(8, "little") + array("q", ids).tobytes())
    identity["sequences"] = digest.hexdigest()
    return identity_key(identity)


def thresholds_dir() -> Path:
    return cache_dir("thresholds")


def thresholds_path(spec: RunSpec, model) -> Path:
    """Where the cache keeps this run's calibrated thresholds (the file exists once some run calibrated them)."""
    return thresholds_dir() / spec.model.name / f"{thresholds_key(spec, model_fingerprint(model))}.safetensors"


def sequences_path(spec: RunSpec, model, sequences: list[list[int]]) -> Path:
    """Where a calibration of ``sequences`` with this run's other settings is filed (``sequences_key``)."""
    return thresholds_dir() / spec.model.name / "sequences" / \
        f"{sequences_key(spec, model_fingerprint(model), sequences)}.safetensors"


def calibration_documents(spec: RunSpec) -> dict:
    """The keyword arguments of ``calibration_sequences`` a run's calib settings give."""
    calib = spec.calib
    return dict(data_dir=spec.data_dir_path, num_fewshot=calib.num_fewshot, num_samples=calib.num_samples,
                max_length=calib.max_length or spec.model.max_length, seed=calib.seed,
                fewshot_sampler=calib.fewshot_sampler, cover_shots=int(calib.cover_shots or 0))


def thresholds_filed(model, tokenizer):
    """``filed(spec)``: whether the cache holds thresholds for ``spec`` (a run with calib settings), under its own key
    or calibrated on the same token sequences under another spelling of its settings (``sequences_key``), which
    ``obtain_thresholds`` then loads without calibrating. The sequences are built once for each set of documents."""
    built: dict[str, list[list[int]]] = {}

    def filed(spec: RunSpec) -> bool:
        if thresholds_path(spec, model).is_file():
            return True
        documents = calibration_documents(spec)
        name = repr((spec.calib.task, sorted(documents.items())))
        if name not in built:
            built[name] = calibration_sequences(model, tokenizer, spec.calib.task, **documents)
        return sequences_path(spec, model, built[name]).is_file()

    return filed


def calibrate_on_task(model, tokenizer, task: str, *, data_dir, num_fewshot: int | None, num_samples: int | None,
                      max_length: int | None = None, seed: int = 0, fewshot_sampler: str | None = None,
                      cover_shots: int = 0, sequences: list[list[int]] | None = None, **options):
    """Thresholds calibrated on the first `num_samples` train documents of one of our tasks
    (``calibration_sequences``; given as `sequences` where the caller built them already); `options` go to
    toptheta.calibrate (k, placement, layer_k, statistic, ...)."""
    if sequences is None:
        sequences = calibration_sequences(model, tokenizer, task, data_dir=data_dir, num_fewshot=num_fewshot,
                                          num_samples=num_samples, max_length=max_length, seed=seed,
                                          fewshot_sampler=fewshot_sampler, cover_shots=cover_shots)
    log.info("calibrating on %d sequences of %s (train split)", len(sequences), task)
    return calibration.calibrate(model, [[r] for r in sequences], seed=seed, **options)  # tests replace calibrate


def calibration_sequences(model, tokenizer, task: str, *, data_dir, num_fewshot: int | None,
                          num_samples: int | None, max_length: int | None = None, seed: int = 0,
                          fewshot_sampler: str | None = None, cover_shots: int = 0) -> list[list[int]]:
    """The token sequences of the first `num_samples` train documents of one of our tasks (None: all; the
    `seed`-th block of `num_samples` documents after them for seed > 0, so seeds are disjoint draws), each
    as its lm-eval request is (`num_fewshot` shots drawn by `fewshot_sampler`, cut to `max_length`, the
    model's limit by default).

    `cover_shots` > 0 calibrates the same documents a second time at `num_fewshot + cover_shots` shots, so the
    calibrated row lengths reach past the longest evaluated request (with fixed exemplars the longest test question
    is longer than any train question after the same exemplars); first_n exemplars then are the first
    `num_fewshot + cover_shots` train documents for both passes, which no calibration document is."""
    from .evaluation.lm_eval_adapter import calibration_requests, hflm_max_length  # lm-eval: heavy, only to calibrate

    shots = num_fewshot or 0
    reserve = cover_shots if fewshot_sampler == "first_n" else 0
    build = dict(data_dir=data_dir, limit=num_samples, max_length=max_length or hflm_max_length(model, tokenizer),
                 seed=seed, fewshot_sampler=fewshot_sampler, draw=seed)
    requests = calibration_requests(tokenizer, task, num_fewshot=num_fewshot, reserve=reserve, **build)
    if cover_shots:
        longer = calibration_requests(tokenizer, task, num_fewshot=shots + cover_shots, **build)
        log.info("calibrating also at %d shots (calib.cover_shots=%d): rows up to %d keys, against %d at %d shots",
                 shots + cover_shots, cover_shots, max(map(len, longer)), max(map(len, requests)), shots)
        requests += longer
    return requests


def obtain_thresholds(spec: RunSpec, model, tokenizer):
    """Load cached thresholds for this calibration key, or calibrate and cache them."""
    calib, sparsifier = spec.calib, spec.sparsifier
    path = thresholds_path(spec, model)
    options = {"lookup": calib.lookup, "smooth_sigma": calib.smooth_sigma}
    beyond = calib.beyond  # rows past the calibrated lengths (thresholds/beyond.py): at run time
    loading = {**options, "beyond": beyond}
    found = checkpoint_thresholds(spec, model, loading)  # a model folder that carries its own (save_pretrained)
    if found is not None:
        return found
    damaged = None  # this key's file moved aside: its twin under sequences/ is the same damaged file
    if path.is_file():
        try:
            thresholds = Thresholds.load(path, model, **loading)
            log.info("thresholds: reusing %s", path)
            return thresholds, str(path)
        except DamagedThresholds as err:  # e.g. a job killed mid-write by an older toptheta: recalibrate
            aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
            os.replace(path, aside)
            damaged = aside
            log.warning("thresholds: %s is damaged (%s); moved aside to %s, calibrating again", path, err, aside.name)
    documents = calibration_documents(spec)
    sequences = calibration_sequences(model, tokenizer, calib.task, **documents)  # seconds: tokenizing
    filed = sequences_path(spec, model, sequences)
    # a job calibrating the same sequences under another key holds this claim: wait, then load what it filed
    with claim(filed.with_suffix(".lock"), f"thresholds of the sequences {filed.stem}"):
        if filed.is_file() and not (damaged is not None and os.path.samefile(filed, damaged)):  # the same
            # sequences calibrated under other settings (another spelling of the documents)
            try:
                thresholds = Thresholds.load(filed, model, **loading)
            except DamagedThresholds as err:
                log.warning("thresholds: %s is damaged (%s); calibrating", filed, err)
            else:
                link(filed, path)  # this key finds it directly from now on
                log.info("thresholds: reusing %s, calibrated on the same %d sequences under other settings (%s)",
                         path, len(sequences), filed.name)
                return thresholds, str(path)
        t0 = time.time()
        thresholds = calibrate_on_task(
            model, tokenizer, calib.task, sequences=sequences, **documents, k=sparsifier.k,
            placement=sparsifier.placement, layer_k=sparsifier.settings.get("layer_k"), statistic=calib.statistic,
            sigma_add=calib.sigma_add, granularity=calib.granularity, tac=calib.tac, sample_frac=calib.sample_frac,
            compensations=spec.comp.objects(), compensation=calib.compensation,
            generate_tokens=int(calib.decode_tokens or 0), **calibration_budget(sparsifier.settings),
            progress_file=path.with_name(f"{path.stem}.progress.pt"),  # a killed calibration goes on from there
            metadata={"model": spec.model.source, "revision": spec.model.revision,
                      "calibration_task": calib.task, "calibration_split": "train",
                      "calibration_documents": calib.num_samples, "num_fewshot": calib.num_fewshot,
                      **({"cover_shots": calib.cover_shots} if calib.cover_shots else {}),
                      **({"fewshot_sampler": calib.fewshot_sampler} if calib.fewshot_sampler else {})},
            **options,
        )
        thresholds.save(path)
        log.info("calibrated in %.0f s -> %s (%d bytes)", time.time() - t0, path, thresholds.nbytes())
        link(path, filed)
    if beyond != "clamp":  # the file holds what was calibrated; the rule is how it is read
        thresholds = Thresholds.load(path, model, **loading)
    return thresholds, str(path)


def link(source: Path, target: Path) -> None:
    """``target`` becomes the file ``source`` is (a hard link; a copy where the file system has none), atomically."""
    def write(tmp: str) -> None:
        os.unlink(tmp)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)

    atomic_write(target, write)


def checkpoint_thresholds(spec: RunSpec, model, options: dict):
    """(thresholds, file) a model folder (model.source) carries for exactly this run's settings, else None."""
    source = os.path.expanduser(str(spec.model.source))
    if not os.path.isdir(source):
        return None
    applied = calibration_compensation(spec.comp.objects(), spec.sparsifier.placement, spec.calib.compensation,
                                       spec.calib.tac)
    wanted = run_settings(spec.sparsifier, spec.calib, compensation_labels(applied),
                          model.config.get_text_config().num_hidden_layers)
    return matching(source, wanted, model, **options)


def thresholds_claim(spec: RunSpec, model):
    """The claim on calibrating this thresholds key: parallel jobs calibrate it once, the others wait and reuse."""
    path = thresholds_path(spec, model)
    return claim(path.with_suffix(".lock"), f"thresholds {path.stem}")

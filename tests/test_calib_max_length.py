"""calib.max_length: the tokens a calibration sequence is cut to (long documents calibrate uncut), in the run id only
when set, and what calibration receives in place of model.max_length."""

from __future__ import annotations

import pytest

from conftest import cfg
from toptheta import pipeline, thresholds_cache

BASE = ("model=tiny-llama", "task=smoke", "sparsifier=toptheta")


def test_calib_max_length_enters_the_run_id_only_when_set(tmp_path):
    default, longer = (pipeline.plan(cfg(*BASE, f"results_dir={tmp_path}", *extra))[-1]
                       for extra in ((), ("calib.max_length=4096",)))
    assert "max_length" not in default.calib.settings and default.calib.max_length is None
    assert longer.calib.max_length == 4096 and longer.run_id != default.run_id
    fingerprint = {"layers": 2}
    assert thresholds_cache.thresholds_key(longer, fingerprint) != thresholds_cache.thresholds_key(default, fingerprint)


@pytest.mark.parametrize(("extra", "cut"), [((), 512), (("calib.max_length=300",), 300)])
def test_calibration_sequences_are_cut_at_calib_max_length_else_the_models(tmp_path, monkeypatch, tokenizer, extra,
                                                                           cut):
    from toptheta.models import build_tiny_model

    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path / "cache"))
    spec = pipeline.plan(cfg(*BASE, f"results_dir={tmp_path}", *extra))[-1]
    assert spec.model.max_length == 512  # conf/model/tiny-llama.yaml
    seen = {}

    class Stop(Exception):
        pass

    def calibrate_on_task(model, tokenizer, task, **options):
        seen.update(options)
        raise Stop

    monkeypatch.setattr(thresholds_cache, "calibrate_on_task", calibrate_on_task)
    with pytest.raises(Stop):
        thresholds_cache.obtain_thresholds(spec, build_tiny_model(), tokenizer)
    assert seen["max_length"] == cut


def test_a_calib_max_length_below_two_is_refused_with_the_setting_named(tmp_path):
    with pytest.raises(ValueError, match="calib.max_length=1"):
        pipeline.plan(cfg(*BASE, f"results_dir={tmp_path}", "calib.max_length=1"))

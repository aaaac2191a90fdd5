"""The thresholds artefact (method.md §2.1, §2.5, §9.4, §9.18): lookup rules, storage, refusals."""

import os

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from toptheta.calibration import (Thresholds, check_sdc_source, check_thresholds_fit, model_fingerprint, model_identity,
                                  storage_bytes)

NAN = float("nan")


def config(layers=2, heads=4, kv_heads=2, hidden=64):
    return LlamaConfig(vocab_size=50, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads)


def sparse_row(points: dict[int, float], width: int = 31) -> torch.Tensor:
    """(1, 1, width) values, NaN except at the given row lengths."""
    row = torch.full((1, 1, width), NAN)
    for n, v in points.items():
        row[0, 0, n] = v
    return row


def lookup(thresholds: Thresholds, lengths: list[int]) -> tuple[list[float], int]:
    theta, clamped = thresholds.lookup(0, torch.tensor(lengths).view(1, 1, -1))  # n: (B, 1, Q)
    return theta.flatten().tolist(), clamped


def full() -> Thresholds:
    """Per (layer, head, n) thresholds for the ``config()`` shape, with counts, SDC mass and options."""
    torch.manual_seed(0)
    values = torch.rand(2, 4, 21)
    values[:, :, :5] = NAN
    counts = torch.randint(0, 9, values.shape).float()
    metadata = {"fingerprint": model_fingerprint(config()), "task": "arc", "note": [1, 2]}
    return Thresholds(values, [4, 4], "pre", metadata, counts=counts, sdc_mass=torch.rand(values.shape),
                      lookup="linear", smooth_sigma=0.5)


# --- lookup -------------------------------------------------------------------------------------------


def test_nearest_lookup_ties_go_to_the_shorter_length():
    th = Thresholds(sparse_row({10: 1.0, 20: 2.0}), [4], "post")
    values, clamped = lookup(th, [10, 14, 15, 16, 20, 5])
    assert values == [1.0, 1.0, 1.0, 2.0, 2.0, 1.0]  # 15 is 5 from both: the shorter (10) wins
    assert clamped == 0


def test_linear_lookup_interpolates_and_holds_the_ends():
    th = Thresholds(sparse_row({10: 1.0, 20: 3.0}), [4], "pre", lookup="linear")
    values, _ = lookup(th, [10, 15, 12, 20, 7])
    assert values == pytest.approx([1.0, 2.0, 1.4, 3.0, 1.0])


def test_rows_beyond_the_longest_calibrated_length_are_clamped_and_counted():
    th = Thresholds(sparse_row({10: 1.0, 20: 2.0}), [4], "pre")
    assert th.max_n == 20
    values, clamped = lookup(th, [19, 20, 21, 30, 500])
    assert values == [2.0] * 5 and clamped == 3  # 21, 30 (inside the table) and 500 (past it)


def test_smoothing_keeps_constants_and_flattens_a_spike():
    flat = Thresholds(sparse_row({n: 0.5 for n in range(5, 26)}), [4], "pre", smooth_sigma=2.0)
    assert lookup(flat, list(range(5, 26)))[0] == pytest.approx([0.5] * 21)
    spike = sparse_row({n: 0.0 for n in range(5, 26)})
    spike[0, 0, 15] = 1.0
    values = lookup(Thresholds(spike, [4], "pre", smooth_sigma=2.0), list(range(5, 26)))[0]
    assert max(values) < 0.25 and values[10] == max(values) and sum(values) == pytest.approx(1.0, abs=1e-5)


def test_coarse_granularities_and_uncalibrated_heads():
    values = torch.tensor([[[0.1], [NAN]]])  # (L=1, H=2, 1): head 1 never calibrated
    th = Thresholds(values, [4], "post")
    assert th.metadata["granularity"] == "layer-head" and th.max_n == 0
    theta, clamped = th.lookup(0, torch.tensor([[[7, 900]]]))
    assert theta[0, 0].tolist() == pytest.approx([0.1, 0.1]) and clamped == 0
    assert theta[0, 1].tolist() == [float("-inf")] * 2  # θ = −inf: an uncalibrated head never drops
    per_n = Thresholds(torch.full((1, 1, 9), NAN), [4], "pre")
    assert lookup(per_n, [8])[0] == [float("-inf")]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one budget per layer"):
        Thresholds(torch.zeros(2, 1, 1), [4], "pre")
    with pytest.raises(ValueError, match="counts must have the shape"):
        Thresholds(torch.zeros(1, 1, 3), [4], "pre", counts=torch.zeros(1, 1, 2))
    with pytest.raises(ValueError, match="placement"):
        Thresholds(torch.zeros(1, 1, 1), [4], "middle")


def test_storage_size_matches_the_paper():
    assert storage_bytes(80, 64, 1200) == 12_288_000  # LLaMA-3-70B, fp16: the paper's "~12 MB"


# --- storage ------------------------------------------------------------------------------------------


def test_save_load_round_trip(tmp_path):
    th = full()
    loaded = Thresholds.load(th.save(tmp_path / "sub" / "th.safetensors"))
    torch.testing.assert_close(loaded.values, th.values, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(loaded.counts, th.counts, rtol=0, atol=0)
    torch.testing.assert_close(loaded.sdc_mass, th.sdc_mass, rtol=0, atol=0)
    assert loaded.k == th.k and loaded.placement == "pre" and loaded.metadata == th.metadata
    assert (loaded.lookup_rule, loaded.smooth_sigma) == ("linear", 0.5)
    n = torch.arange(0, 40).view(1, 1, -1)
    assert torch.equal(loaded.lookup(1, n)[0], th.lookup(1, n)[0])
    assert Thresholds.load(tmp_path / "sub" / "th.safetensors", lookup="nearest").lookup_rule == "nearest"


def test_loading_for_a_model_of_another_shape_names_both(tmp_path):
    path = full().save(tmp_path / "th.safetensors")
    Thresholds.load(path, model=config())  # the shape it was made for
    with pytest.raises(ValueError) as err:
        Thresholds.load(path, model=config(layers=3, heads=8, kv_heads=8))
    message = str(err.value)
    assert "'layers': 2" in message and "'layers': 3" in message and "'heads': 8" in message


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_files_are_refused_with_the_fix(tmp_path, damage):
    path = full().save(tmp_path / "th.safetensors")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(300), "empty": b""}[damage])
    with pytest.raises(ValueError, match="calibrate again"):
        Thresholds.load(path)


def test_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibrate first"):
        Thresholds.load(tmp_path / "nothing.safetensors")


def test_save_is_atomic(tmp_path, monkeypatch):
    """A failure while writing leaves neither a partial file nor a temporary, and keeps an old file."""
    import safetensors.torch

    def broken_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    th = full()
    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        th.save(tmp_path / "th.safetensors")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    path = th.save(tmp_path / "th.safetensors")
    before = path.read_bytes()
    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with pytest.raises(OSError):
        th.save(path)
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == before


# --- filling uncalibrated lengths in O(N) (method.md §2.1) -------------------------------------------------


def brute_force_nearest(known: list[int], values: list[float], width: int) -> list[float]:
    """For every n, the value of the calibrated length with the smallest |n − key|, ties to the smaller key."""
    return [values[min(range(len(known)), key=lambda i: (abs(n - known[i]), known[i]))] for n in range(width)]


@pytest.mark.parametrize("seed", range(6))
def test_filling_matches_brute_force_on_random_keys_with_ties(seed):
    from toptheta.thresholds.table import _fill

    g = torch.Generator().manual_seed(seed)
    width = int(torch.randint(20, 400, (1,), generator=g))
    count = int(torch.randint(1, 12, (1,), generator=g))
    known = sorted(set(torch.randint(0, width, (count,), generator=g).tolist()) | {width // 3, width // 3 + 4})
    values = torch.rand(len(known), generator=g).tolist()
    row = torch.full((1, 1, width), NAN)  # width // 3 + 2 lies 2 from both forced keys: a tie
    row[0, 0, known] = torch.tensor(values)
    nearest = _fill(row, "nearest", 0.0)[0, 0].tolist()
    assert nearest == brute_force_nearest(known, values, width)
    linear = _fill(row, "linear", 0.0)[0, 0]
    expected = torch.tensor(np.interp(np.arange(width), known, values), dtype=torch.float32)  # ends held
    torch.testing.assert_close(linear, expected, rtol=1e-6, atol=1e-6)


# --- identity: the model, the file, the calibrated-SDC source ----------------------------------------------


def named(name: str, revision: str | None = None, **shape) -> LlamaConfig:
    c = config(**shape)
    c._name_or_path, c._commit_hash = name, revision
    return c


def calibrated_on(tmp_path, name: str, revision: str | None):
    th = full()
    th.metadata["identity"] = model_identity(named(name, revision))
    return th.save(tmp_path / "th.safetensors")


def test_loading_for_another_checkpoint_names_both_unless_allowed(tmp_path):
    path = calibrated_on(tmp_path, "org/base", "abc123")
    Thresholds.load(path, model=named("org/base", "abc123"))
    Thresholds.load(path, model=named("org/base"))  # an unknown revision is not compared
    for other, words in [(named("org/instruct", "abc123"), ["org/base", "org/instruct"]),
                         (named("org/base", "def456"), ["abc123", "def456"])]:
        with pytest.raises(ValueError, match="allow_other_model=True") as err:
            Thresholds.load(path, model=other)
        assert all(w in str(err.value) for w in words)
        allowed = Thresholds.load(path, model=other, allow_other_model=True)
        allowed.check_model(other)  # what toptheta.sparsify calls: the override sticks to the object
    with pytest.raises(ValueError, match="'layers': 3"):  # the override never lifts the shape check
        Thresholds.load(path, model=named("org/instruct", layers=3), allow_other_model=True)


def test_identity_of_a_local_checkout_is_its_folder_name(tmp_path):
    folder = tmp_path / "smollm2-135m-0123456789ab"
    folder.mkdir()
    assert model_identity(named(str(folder) + "/")) == {"name": "smollm2-135m-0123456789ab", "revision": None}
    assert model_identity(named("org/name", "c0ffee")) == {"name": "org/name", "revision": "c0ffee"}
    assert model_identity(config()) == {"name": None, "revision": None}


@pytest.mark.parametrize("drop", ["k", "placement", "values"])
def test_a_file_missing_a_field_is_a_value_error(tmp_path, drop):
    import json

    from safetensors.torch import save_file

    header = {"format": 1, "k": [4, 4], "placement": "pre", "metadata": {}}
    header.pop(drop, None)
    tensors = {"values": torch.zeros(2, 1, 1)} if drop != "values" else {"counts": torch.zeros(2, 1, 1)}
    save_file(tensors, str(tmp_path / "th.safetensors"), metadata={"toptheta": json.dumps(header)})
    with pytest.raises(ValueError, match=f"lacks {drop}.*calibrate again"):
        Thresholds.load(tmp_path / "th.safetensors")


def test_calibrated_sdc_source_must_match_the_sparsifier_and_model():
    from toptheta import TopK, TopTheta

    source = full()  # pre-softmax, k = [4, 4], the config() shape
    check_sdc_source(source, TopK(4, "pre"), model=config())
    check_sdc_source(source, TopTheta(source), model=config())
    with pytest.raises(ValueError, match=r"k per layer \[4, 4\].*\[8, 4\]"):
        check_sdc_source(source, TopK(4, "pre", {0: 8}))
    with pytest.raises(ValueError, match="placement='pre'.*'post'"):
        check_sdc_source(source, TopK(4, "post"))
    with pytest.raises(ValueError, match="'heads': 8"):
        check_sdc_source(source, TopK(4, "pre"), model=config(heads=8, kv_heads=8))
    no_mass = Thresholds(source.values, source.k, "pre")
    with pytest.raises(ValueError, match="dropped-mass statistic"):
        check_sdc_source(no_mass, TopK(4, "pre"))


def test_check_thresholds_fit_covers_the_sparsifier_and_the_calibrated_sdc_source():
    """The check toptheta.sparsify runs: the Top-θ thresholds and a separate calibrated-SDC source alike."""
    from toptheta import SDC, VMC, TopK, TopTheta

    source = full()
    check_thresholds_fit(config(), TopK(4, "pre"), [SDC("calibrated", thresholds=source), VMC()])
    check_thresholds_fit(config(), TopTheta(source), [SDC("calibrated")])  # the sparsifier's own masses
    check_thresholds_fit(config(), TopK(8, "pre"), [SDC("exact")])  # nothing calibrated to check
    with pytest.raises(ValueError, match="k per layer"):
        check_thresholds_fit(config(), TopK(8, "pre"), [SDC("calibrated", thresholds=source)])
    with pytest.raises(ValueError, match="'layers': 3"):
        check_thresholds_fit(config(layers=3), TopK(4, "pre"), [SDC("calibrated", thresholds=source)])
    with pytest.raises(ValueError, match="'layers': 3"):
        check_thresholds_fit(config(layers=3), TopTheta(source), [])

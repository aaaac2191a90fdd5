"""The thresholds artefact (method.md §2.1, §2.5, §9.4, §9.18): lookup rules, storage, refusals."""

import os

import pytest
import torch
from transformers import LlamaConfig

from toptheta.calibration import Thresholds, model_fingerprint, storage_bytes

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

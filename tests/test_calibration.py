"""Calibration (method.md §2.2, §3.1, §4): properties a wrong statistic or a leaky collector cannot pass."""

import math
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import toptheta
from toptheta.calibration import OrderStatCollector, TargetKCollector, Thresholds, calibrate
from toptheta.calibration.calibrate import as_batch

L, H, VOCAB, T = 3, 4, 97, 40


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matrices: one thread is faster, and far steadier


@pytest.fixture(scope="module")
def model():
    # initializer_range 0.1 spreads the attention scores, so rows are far from uniform
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=L,
                         num_attention_heads=H, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def sequences(count: int, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, length), generator=torch.Generator().manual_seed(seed))


def batches(count: int, size: int = 4, length: int = T, seed: int = 1) -> list[torch.Tensor]:
    ids = sequences(count, length, seed)
    return list(ids.split(size))


def kept_per_row(model, sparsifier, ids) -> dict[int, torch.Tensor]:
    """Kept keys of every sparsified row (n > k), per layer: (rows, H) float64."""
    kept: dict[int, list] = {}

    def observe(rows):
        long = rows.n[:, 0] > sparsifier.k_for(rows.layer)  # (B, Q)
        kept.setdefault(rows.layer, []).append(rows.keep.sum(-1).permute(0, 2, 1)[long].double())

    with torch.no_grad(), toptheta.sparsify(model, sparsifier, [], observer=observe):
        model(input_ids=ids)
    return {layer: torch.cat(v) for layer, v in kept.items()}


# --- the paper's statistic -------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_theta_from_one_row_keeps_exactly_k(model, placement):
    """θ = each row's (k+1)-th largest score (one sample, σ = 0) keeps exactly k on that row."""
    ids, k = sequences(1), 8
    dense_cal = calibrate(model, [ids], k=k, placement=placement, sigma_add=0.0, tac=False, progress=False)
    kept = kept_per_row(model, toptheta.TopTheta(dense_cal), ids)
    assert kept[0].eq(k).all()  # deeper layers see other inputs once layer 0 is sparse
    # With TAC, calibration ran exact top-k, so Top-θ reproduces top-k in every layer.
    tac_cal = calibrate(model, [ids], k=k, placement=placement, sigma_add=0.0, tac=True, progress=False)
    kept = kept_per_row(model, toptheta.TopTheta(tac_cal), ids)
    assert all(v.eq(k).all() for v in kept.values())
    assert (tac_cal.counts[:, :, k + 1:] == 1).all() and (tac_cal.counts[:, :, :k + 1] == 0).all()


@pytest.mark.parametrize("tac", ["dense", "keep-mask", "selection"])
def test_collector_tau_is_rowblock_kth_largest(model, tac):
    """The collector's τ is exactly RowBlock.kth_largest(k + 1) (method.md §2.2): sorted again on dense rows, read off
    the TAC keep-mask (an observer that does not ask for the index), or found by the TAC selection itself."""
    k, seen = 6, []
    for placement in ("pre", "post"):
        collector = OrderStatCollector([k] * L, H, placement, topk_keep=tac != "dense")
        sparsifier = toptheta.TopK(k, placement) if tac != "dense" else toptheta.Dense()

        class Observe:
            wants_next_index = tac == "selection"

            def __call__(self, rows):
                assert (rows.next_index is not None) == (tac == "selection")  # which path ran
                collector(rows)
                expected = rows.kth_largest(k + 1, placement)  # (B, H, Q)
                long = rows.n[:, 0] > k
                seen.append((expected.permute(0, 2, 1)[long], rows.n[:, 0][long], rows.layer))

        with torch.no_grad(), toptheta.sparsify(model, sparsifier, [], observer=Observe()):
            model(input_ids=sequences(1))
        for tau, n, layer in seen:
            torch.testing.assert_close(collector.sums["tau"][layer][:, n].T.float(), tau, rtol=0, atol=0)
        seen.clear()


@pytest.mark.parametrize("placement, statistic, comps", [("pre", "order", "sdc"), ("post", "order", "vmc"),
                                                         ("pre", "target-k", "")])  # post target-k reads no τ
def test_tac_calibration_reads_tau_off_the_selection_with_the_thresholds_of_a_second_pass(model, monkeypatch,
                                                                                          placement, statistic, comps):
    """Calibration with TAC takes each row's τ from the top-k selection (one pass, k + 1 wide) and gets the thresholds
    the keep-mask pass gives, bit for bit, in prefill and decode rows."""
    from toptheta.calibration import collector as collector_module

    comp = {"sdc": [toptheta.SDC("exact")], "vmc": [toptheta.VMC()], "": []}[comps]
    options = dict(k=6, placement=placement, statistic=statistic, compensations=comp, generate_tokens=3,
                   progress=False)
    data = batches(4, size=2, length=24)
    read = []
    tau = collector_module.SampledRows.tau
    monkeypatch.setattr(collector_module.SampledRows, "tau",
                        lambda self, p: read.append(self.next is not None) or tau(self, p))
    selection = calibrate(model, data, **options)
    assert read and all(read)
    read.clear()
    monkeypatch.setattr(collector_module.Collector, "wants_next_index", property(lambda self: False,
                                                                                 lambda self, value: None),
                        raising=False)
    second_pass = calibrate(model, data, **options)
    assert read and not any(read)
    assert torch.equal(selection.values.nan_to_num(-7.0), second_pass.values.nan_to_num(-7.0))
    assert torch.equal(selection.counts, second_pass.counts)
    if placement == "pre":
        assert torch.equal(selection.sdc_mass.nan_to_num(-7.0), second_pass.sdc_mass.nan_to_num(-7.0))


def test_granularities_pool_the_same_samples(model):
    """Every granularity has its shape and equals mean + σ·std (ddof=0) of the pooled τ."""
    k, sigma, taus = 5, 0.3, []

    def record(rows):  # an independent list of every τ, for the check only
        long = rows.n[:, 0] > k
        taus.append((rows.layer, rows.kth_largest(k + 1, "post").permute(0, 2, 1)[long], rows.n[:, 0][long]))

    data = batches(4, size=2, length=24)
    with torch.no_grad(), toptheta.sparsify(model, toptheta.Dense(), [], observer=record):
        for ids in data:
            model(input_ids=ids)
    tau = {layer: torch.cat([t for l_, t, _ in taus if l_ == layer]).double() for layer in range(L)}  # (rows, H)
    n = {layer: torch.cat([m for l_, _, m in taus if l_ == layer]) for layer in range(L)}
    expected_shapes = {"layer": (L, 1, 1), "layer-n": (L, 1, 25), "layer-head": (L, H, 1), "layer-head-n": (L, H, 25)}
    for granularity, shape in expected_shapes.items():
        th = calibrate(model, data, k=k, sigma_add=sigma, tac=False, granularity=granularity, progress=False)
        assert tuple(th.values.shape) == shape and th.metadata["granularity"] == granularity
        layer = 1
        if granularity == "layer":
            x = tau[layer].flatten()
            want = x.mean() + sigma * x.std(correction=0)
            assert th.values[layer, 0, 0].item() == pytest.approx(want.item(), rel=1e-5)
        if granularity == "layer-head-n":
            for head, length in [(0, 6), (2, 23)]:
                x = tau[layer][n[layer] == length, head]
                want = x.mean() + sigma * x.std(correction=0)
                assert th.values[layer, head, length].item() == pytest.approx(want.item(), rel=1e-5)
                assert th.counts[layer, head, length] == len(x) == 4
        assert torch.isnan(th.values[..., :k + 1]).all() if shape[2] > 1 else not torch.isnan(th.values).any()


def test_theta_decreases_as_k_grows(model):
    data = batches(4)
    for placement in ("pre", "post"):
        small = calibrate(model, data, k=4, placement=placement, sigma_add=0.0, tac=False, progress=False).values
        large = calibrate(model, data, k=12, placement=placement, sigma_add=0.0, tac=False, progress=False).values
        both = ~torch.isnan(small) & ~torch.isnan(large)
        assert both.sum() > 0 and (large[both] <= small[both]).all() and (large[both] < small[both]).any()


def test_sigma_add_moves_the_kept_count(model):
    """A larger σ_add raises θ, so fewer elements are kept (method.md §2.2)."""
    data, held_out, k = batches(8), sequences(2, seed=7), 8
    mean_kept = []
    for sigma in (0.0, 0.1, 1.0):
        th = calibrate(model, data, k=k, sigma_add=sigma, tac=False, progress=False)
        mean_kept.append(kept_per_row(model, toptheta.TopTheta(th), held_out)[0].mean().item())
    assert mean_kept[0] > mean_kept[1] > mean_kept[2]


def test_layer_k_and_uncalibrated_layers(model):
    """Layers whose k exceeds every row length are left uncalibrated, and never drop anything."""
    th = calibrate(model, batches(2), k=6, layer_k={0: 64}, tac=True, progress=False)
    assert th.k == [64, 6, 6] and th.metadata["rows_sampled"][0] == 0
    assert torch.isnan(th.values[0]).all() and not torch.isnan(th.values[1, :, 7:]).any()
    kept = kept_per_row(model, toptheta.TopTheta(th), sequences(1, length=80, seed=3))
    n = torch.arange(65, 81, dtype=torch.float64)  # layer 0 rows with n > 64: θ = −inf keeps them whole
    assert torch.equal(kept[0], n[:, None].expand(-1, H))


# --- target mean k (MKC in bounded memory) -----------------------------------------------------------


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_target_k_hits_k_on_held_out_inputs(model, placement):
    k = 8
    th = calibrate(model, batches(16), k=k, placement=placement, statistic="target-k", progress=False)
    assert th.metadata["grid_clamped"] == 0
    kept = kept_per_row(model, toptheta.TopTheta(th), sequences(16, seed=11))
    for layer, rows in kept.items():
        assert rows.mean().item() == pytest.approx(k, rel=0.08), layer


def test_target_k_inverts_a_known_histogram():
    """One row with logits 0..9 and k = 3: θ must fall in [6, 7), where exactly 3 logits are above it."""
    from toptheta.sparsifiers.base import RowBlock

    logits = torch.arange(10.0).view(1, 1, 1, 10)  # (B, H, Q, K)
    e = torch.exp(logits - 9.0)
    rows = RowBlock(layer=0, phase="decode", logits=logits, exp_scores=e, row_sum=e.sum(-1, keepdim=True),
                    row_max=torch.full((1, 1, 1, 1), 9.0), valid=torch.ones(1, 1, 1, 10, dtype=torch.bool),
                    n=torch.full((1, 1, 1), 10))
    for placement in ("pre", "post"):
        collector = TargetKCollector([3], 1, placement, grid_size=4096)
        collector(rows)
        values, counts, _ = collector.reduce("layer-head-n")
        theta = values[0, 0, 10].item()
        x = logits.flatten() if placement == "pre" else (e / e.sum()).flatten()
        assert int((x > theta).sum()) == 3 and counts[0, 0, 10] == 1


def test_target_k_buckets_cover_every_length():
    collector = TargetKCollector([4], 1, "post", exact_n=8, per_octave=2)
    keys = collector.key_of(torch.arange(1, 200))
    assert torch.equal(keys[:7], torch.arange(1, 8))  # exact below exact_n
    assert (keys.diff() >= 0).all() and (keys.diff() <= 1).all()  # monotone, no gaps
    assert keys[-1] == 8 + math.floor(2 * math.log2(199 / 8))  # two buckets per doubling


# --- sampling, memory, decode, SDC mass ----------------------------------------------------------------


def test_sample_frac_is_honoured_and_seeded(model):
    data = batches(8)
    runs = [calibrate(model, data, k=4, sample_frac=0.3, seed=s, tac=False, progress=False) for s in (0, 0, 1)]
    eligible = torch.tensor(runs[0].metadata["rows_eligible"], dtype=torch.float64)
    sampled = torch.tensor(runs[0].metadata["rows_sampled"], dtype=torch.float64)
    assert eligible.eq(8 * (T - 4)).all()  # every row with n > k, each layer
    frac = sampled.sum() / eligible.sum()
    assert abs(frac - 0.3) < 4 * math.sqrt(0.3 * 0.7 / eligible.sum())  # binomial, 4σ
    assert torch.equal(runs[0].counts, runs[1].counts)
    assert torch.equal(runs[0].values.nan_to_num(), runs[1].values.nan_to_num())
    assert not torch.equal(runs[0].counts, runs[2].counts)
    assert runs[0].counts.sum() == sampled.sum() * H


@pytest.mark.parametrize("collector_cls", [OrderStatCollector, TargetKCollector])
def test_collector_memory_is_flat_in_the_number_of_samples(model, collector_cls):
    collector = collector_cls([4] * L, H, "pre")
    data = batches(100, size=10, length=24)
    shapes = []
    with torch.no_grad(), toptheta.sparsify(model, toptheta.Dense(), [], stats=False, observer=collector):
        for i, ids in enumerate(data):
            model(input_ids=ids)
            if i in (0, len(data) - 1):  # after 10 and after 100 sequences
                shapes.append((collector.shapes(), collector.nbytes()))
    assert shapes[0] == shapes[1]
    assert collector.rows_sampled.sum() == L * 100 * (24 - 4)


def test_decode_rows_share_the_prefill_key(model):
    """Generation calibrates decode rows under key n = KV length (method.md §2.4)."""
    prompt, new = sequences(1, length=20), 4
    th = calibrate(model, [prompt], k=6, generate_tokens=new, phases=("decode",), tac=False, progress=False)
    counts = th.counts[0, 0]
    # the first new token comes from the prefill; the next three are decode steps with KV 21, 22, 23
    assert counts.nonzero().flatten().tolist() == [21, 22, 23]
    both = calibrate(model, [prompt], k=6, generate_tokens=new, tac=False, progress=False)
    assert both.counts[0, 0, 7:24].eq(1).all() and both.metadata["generate_tokens"] == new


def test_sdc_mass_is_the_mean_dropped_mass_of_top_k(model):
    """Calibrated SDC stores the mean Σ_{j ∉ top-k} exp(s_j − m) per (layer, head, n) (method.md §3.1)."""
    k, ids, dropped = 5, sequences(1), {}

    def record(rows):
        mass = rows.exp_scores.masked_fill(rows.keep, 0.0).sum(-1)  # (B, H, Q); keep = exact top-k
        long = rows.n[0, 0] > k
        dropped[rows.layer] = (mass[0][:, long], rows.n[0, 0][long])

    th = calibrate(model, [ids], k=k, placement="pre", tac=True, progress=False)
    with torch.no_grad(), toptheta.sparsify(model, toptheta.TopK(k, "pre"), [], observer=record):
        model(input_ids=ids)
    for layer, (mass, n) in dropped.items():
        torch.testing.assert_close(th.sdc_mass[layer][:, n], mass, rtol=1e-5, atol=1e-7)
    dense = calibrate(model, [ids], k=k, placement="pre", tac=False, progress=False)  # sorts instead
    mass, n = dropped[0]  # layer 0 sees the same inputs with or without TAC
    torch.testing.assert_close(dense.sdc_mass[0][:, n], mass, rtol=1e-5, atol=1e-7)
    assert calibrate(model, [ids], k=k, placement="post", progress=False).sdc_mass is None


# --- the artefact and the API ------------------------------------------------------------------------


def test_metadata_and_round_trip(model, tmp_path):
    th = calibrate(model, batches(2), k=6, layer_k={0: 8}, lookup="linear", smooth_sigma=1.0,
                   metadata={"task": "tiny", "split": "train"}, progress=False)
    meta = th.metadata
    assert meta["fingerprint"] == {"layers": L, "heads": H, "kv_heads": 2, "head_dim": 16}
    assert meta["k_per_layer"] == [8, 6, 6] and meta["layer_k"] == {0: 8} and meta["statistic"] == "order"
    assert meta["sequences"] == 2 and meta["tokens"] == 2 * T and meta["task"] == "tiny"
    assert {"toptheta_version", "date", "sigma_add", "tac", "sample_frac", "seed"} <= set(meta)
    assert th.lookup_rule == "linear" and th.smooth_sigma == 1.0
    loaded = Thresholds.load(th.save(tmp_path / "th.safetensors"), model=model)
    torch.testing.assert_close(loaded.values, th.values, equal_nan=True)
    assert loaded.k == th.k and loaded.lookup_rule == "linear"


def test_inputs_are_normalised():
    ids, mask = as_batch([[1, 2, 3], [4, 5]])
    assert ids.tolist() == [[1, 2, 3], [0, 4, 5]] and mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    assert as_batch(torch.tensor([1, 2]))[0].shape == (1, 2) and as_batch(torch.tensor([1, 2]))[1] is None
    assert as_batch({"input_ids": [[1, 2]]})[0].tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="left-padded"):
        as_batch({"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0]])})
    with pytest.raises(ValueError, match="integer token ids"):
        as_batch(torch.ones(1, 3))


@pytest.mark.parametrize("kwargs,message", [
    (dict(statistic="median"), "statistic"),
    (dict(granularity="head"), "granularity"),
    (dict(layer_k={7: 4}), "layer_k names layers"),
    (dict(lookup="cubic"), "lookup"),
    (dict(sample_frac=0.0), "sample_frac"),
    (dict(compensation="always"), "calibration compensation"),
    (dict(phases=("decode",)), "generate_tokens"),
    (dict(k=100), "no calibration row was longer than k"),
])
def test_bad_arguments_fail_clearly(model, kwargs, message):
    with pytest.raises(ValueError, match=message):
        calibrate(model, batches(1), **{"k": 4, **kwargs, "progress": False})


# --- compensation during calibration (method.md §2.2 step 5) -----------------------------------------------


def kept_with(model, sparsifier, comp, ids) -> dict[int, torch.Tensor]:
    """kept_per_row, with compensation on."""
    kept: dict[int, list] = {}

    def observe(rows):
        long = rows.n[:, 0] > sparsifier.k_for(rows.layer)
        kept.setdefault(rows.layer, []).append(rows.keep.sum(-1).permute(0, 2, 1)[long].double())

    with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp, observer=observe):
        model(input_ids=ids)
    return {layer: torch.cat(v) for layer, v in kept.items()}


@pytest.mark.parametrize("placement,comp", [("post", [toptheta.VMC()]),
                                            ("pre", [toptheta.SDC("exact"), toptheta.VMC()])])
def test_tac_calibration_applies_the_runs_compensation(model, placement, comp):
    """θ from one row (σ = 0) under TAC + the run's compensation reproduces top-k in every layer of a
    Top-θ run with that compensation; calibrated without it, deeper layers saw other activations."""
    ids, k = sequences(1), 8
    run = calibrate(model, [ids], k=k, placement=placement, sigma_add=0.0, compensations=comp, progress=False)
    assert run.metadata["calibration_compensation"] == toptheta.calibration.compensation_labels(comp)
    kept = kept_with(model, toptheta.TopTheta(run), comp, ids)
    assert all(v.eq(k).all() for v in kept.values())
    bare = calibrate(model, [ids], k=k, placement=placement, sigma_add=0.0, compensations=comp,
                     compensation="none", progress=False)
    assert bare.metadata["calibration_compensation"] == []
    assert torch.equal(bare.values[0].nan_to_num(), run.values[0].nan_to_num())  # layer 0: the same inputs
    assert not torch.allclose(bare.values[1:], run.values[1:], equal_nan=True)
    kept = kept_with(model, toptheta.TopTheta(bare), comp, ids)
    assert not all(v.eq(k).all() for v in kept.values())


def test_calibration_compensation_modes(model):
    from toptheta.calibration import calibration_compensation, compensation_labels

    sdc_vmc = [toptheta.SDC("calibrated", scale=2.0), toptheta.VMC()]

    def labels(comp, placement, mode, tac=True):
        return compensation_labels(calibration_compensation(comp, placement, mode, tac))

    assert labels(sdc_vmc, "pre", "run") == ["SDC(exact, λ=2.0)", "VMC"]  # SDC estimators need calibration output
    assert labels(sdc_vmc, "pre", "reference") == []  # [R]: no SDC, so pre-softmax VMC has β = 0
    assert labels([toptheta.VMC()], "post", "reference") == labels([toptheta.VMC()], "post", "run") == ["VMC"]
    assert labels(sdc_vmc, "pre", "none") == labels(sdc_vmc, "pre", "run", tac=False) == []
    with pytest.raises(ValueError, match="run"):
        calibration_compensation([], "post", "always")
    # the estimator is replaced by the exact mass; the reference rule equals renormalised top-k
    data, k = batches(2), 6
    exact = calibrate(model, data, k=k, placement="pre", compensations=[toptheta.SDC("exact", scale=2.0)],
                      progress=False)
    estimated = calibrate(model, data, k=k, placement="pre", compensations=sdc_vmc[:1], progress=False)
    assert torch.equal(exact.values.nan_to_num(), estimated.values.nan_to_num())
    reference = calibrate(model, data, k=k, placement="pre", compensations=sdc_vmc, compensation="reference",
                          progress=False)
    plain = calibrate(model, data, k=k, placement="pre", progress=False)
    assert torch.equal(reference.values.nan_to_num(), plain.values.nan_to_num())


def test_thresholds_cache_key_includes_the_calibration_compensation(tmp_path):
    from hydra import compose, initialize_config_dir

    from toptheta import config, pipeline, thresholds_cache
    from toptheta.calibration import model_fingerprint

    config.register()  # the typed schema conf/config.yaml composes into
    conf = str(Path(__file__).resolve().parents[1] / "conf")

    def key(*overrides):
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose("config", overrides=["model=tiny-llama", "task=smoke", "sparsifier=toptheta",
                                               f"results_dir={tmp_path}", "baseline=false", *overrides])
        spec = pipeline.plan(cfg)[-1]
        return thresholds_cache.thresholds_key(spec, model_fingerprint(LlamaConfig()))

    vmc, none = key("comp=vmc"), key("comp=none")  # post-softmax
    assert vmc != none == key("comp=vmc", "calib.compensation=none")
    assert vmc == key("comp=vmc", "calib.compensation=reference")  # post-softmax: [R] applies VMC too
    assert key("comp=vmc", "calib.tac=false") == key("comp=none", "calib.tac=false")  # dense: nothing to put back
    pre = key("comp=sdc+vmc")  # pre-softmax
    reference = key("comp=sdc+vmc", "calib.compensation=reference")
    assert len({pre, reference, key("comp=sdc+vmc", "comp.sdc_scale=2.0")}) == 3
    assert reference == key("comp=sdc+vmc", "calib.compensation=none")  # no SDC: renormalised rows, β = 0
    assert pre == key("comp=sdc+vmc", "comp.sdc=calibrated")  # calibrated alike: one file


# --- a model split over devices (device_map="auto") --------------------------------------------------------


def test_each_layer_keeps_its_statistics_on_its_own_device(model):
    """Layer 1's rows live on another device, here ``meta``: like a second GPU it refuses to be mixed with
    CPU tensors. Its sums must stay there, the other layers' on the CPU, with the same values as an
    all-CPU collector. (The row lengths n stay on the CPU: a meta tensor has no values to copy.)"""
    from toptheta.sparsifiers.base import RowBlock

    k = 6
    for placement in ("pre", "post"):
        reference, split = (OrderStatCollector([k] * L, H, placement, topk_keep=True) for _ in range(2))

        def observe(rows):
            reference(rows)
            if rows.layer == 1:
                moved = RowBlock(rows.layer, rows.phase, rows.logits.to("meta"), rows.n)
                moved.keep = rows.keep.to("meta")
                rows = moved
            split(rows)

        with torch.no_grad(), toptheta.sparsify(model, toptheta.TopK(k, placement), [], observer=observe):
            model(input_ids=sequences(2))
        names = {"count", "tau", "tau_sq"} | ({"sdc"} if placement == "pre" else set())
        assert set(split.sums) == set(reference.sums) == names
        for name, per_layer in split.sums.items():
            assert [t.device.type for t in per_layer] == ["cpu", "meta", "cpu"], name
            assert per_layer[1].shape == reference.sums[name][1].shape
            for layer in (0, 2):
                assert torch.equal(per_layer[layer], reference.sums[name][layer]), (name, layer)


def test_reduce_pads_layers_of_different_widths():
    """Layers fill their key axis independently (and one not at all); reduce meets them on one table."""
    from toptheta.sparsifiers.base import RowBlock

    def causal_rows(layer, length, seed):
        logits = torch.randn(1, H, length, length, generator=torch.Generator().manual_seed(seed))
        logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        return RowBlock(layer, "prefill", logits, torch.arange(1, length + 1).view(1, 1, length))

    k, collector = 4, OrderStatCollector([4] * L, H, "pre", sigma_add=0.0)
    blocks = {0: causal_rows(0, 12, 1), 1: causal_rows(1, 8, 2)}  # layer 2 sees no row
    for rows in blocks.values():
        collector(rows)
    assert collector.shapes()["tau"] == [(H, 13), (H, 9), None]
    values, counts, sdc = collector.reduce("layer-head-n")
    assert values.shape == counts.shape == sdc.shape == (L, H, 13)
    for layer, rows in blocks.items():
        n = rows.logits.shape[-1]
        tau = rows.kth_largest(k + 1, "pre")[0]  # (H, Q): one sample per length, θ = τ
        torch.testing.assert_close(values[layer, :, k + 1:n + 1], tau[:, k:], rtol=0, atol=0)
        assert torch.isnan(values[layer, :, n + 1:]).all() and counts[layer, :, n + 1:].eq(0).all()
    assert torch.isnan(values[2]).all() and counts[2].eq(0).all()



@pytest.mark.parametrize("collector_cls", [OrderStatCollector, TargetKCollector])
def test_tables_widened_chunk_by_chunk_grow_with_room_and_sum_as_exact_widening(monkeypatch, collector_cls):
    """A causal prefill in chunks of 16 rows widens the key axis at every chunk: with room to spare (GROWTH, MIN_ROOM)
    the tables are reallocated a few times, not once per chunk, and the sums, shapes and bytes in use are those of
    exact widening (GROWTH = 1, MIN_ROOM = 0)."""
    from toptheta.calibration import collector as collector_module
    from toptheta.sparsifiers.base import RowBlock

    length, step = 512, 16
    logits = torch.randn(1, H, length, length, generator=torch.Generator().manual_seed(5))
    logits = logits.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))

    def collect(growth: float, room: int):
        monkeypatch.setattr(collector_module, "GROWTH", growth)
        monkeypatch.setattr(collector_module, "MIN_ROOM", room)
        collector, table, tables = collector_cls([4] * L, H, "post"), None, 0
        for q0 in range(0, length, step):  # the chunk's keys end at its last row, as the plain kernel's
            rows = RowBlock(0, "prefill", logits[:, :, q0:q0 + step, :q0 + step].contiguous(),
                            torch.arange(q0 + 1, q0 + step + 1).view(1, 1, step))
            collector(rows)
            now = collector.sums.get("count", [None])[0]
            tables, table = tables + (now is not table), now  # a table allocated for this chunk
        return collector, tables

    room = collector_module.GROWTH, collector_module.MIN_ROOM
    (exact, exact_tables), (grown, grown_tables) = collect(1.0, 0), collect(*room)
    assert grown_tables <= 8 < 20 <= exact_tables  # nearly one per chunk (length // step of them) without room
    assert grown.shapes() == exact.shapes() and grown.nbytes() == exact.nbytes()
    a, b = exact.stacked(), grown.stacked()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def few_shot_like(seed: int = 3) -> list[list[int]]:
    """Sequences as a fixed-exemplar task builds them: one long shared prefix, each question's context shared by
    its choices, choices of varied length, and one sequence that shares nothing."""
    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    exemplars, out = draw(90), []
    for length in (20, 35, 50):
        context = draw(length)
        out += [exemplars + context + draw(n) for n in (1, 7, 19)]
    return out + [draw(70)]


@pytest.mark.parametrize("placement, statistic, comps", [
    ("pre", "order", "sdc+vmc"), ("post", "order", "vmc"), ("post", "target-k", "")])
def test_shared_prefixes_calibrate_as_whole_sequences(model, placement, statistic, comps):
    """Prefix sharing runs far fewer tokens and counts every row as running each sequence whole does: the same
    counts, row totals and (up to float rounding) thresholds and SDC masses."""
    comp = {"sdc+vmc": [toptheta.SDC("exact"), toptheta.VMC()], "vmc": [toptheta.VMC()], "": []}[comps]
    data = [[s] for s in few_shot_like()]
    whole, shared = (calibrate(model, data, k=6, placement=placement, statistic=statistic, compensations=comp,
                               progress=False, share_prefixes=share) for share in (False, True))
    assert whole.metadata["tokens_run"] == whole.metadata["tokens"]
    assert shared.metadata["tokens_run"] < 0.6 * shared.metadata["tokens"]  # the 90 exemplars ran once, not 9 times
    assert torch.equal(whole.counts, shared.counts)
    assert whole.metadata["rows_sampled"] == shared.metadata["rows_sampled"]
    torch.testing.assert_close(shared.values, whole.values, rtol=1e-5, atol=1e-6, equal_nan=True)
    if placement == "pre":
        torch.testing.assert_close(shared.sdc_mass, whole.sdc_mass, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_calibrations_that_cannot_share_run_whole(model):
    """Sampled rows, pre-softmax target-k (its grid follows the first rows seen) and padded batches run every
    sequence whole; the collector refuses to count a sampled row twice."""
    data = [[s] for s in few_shot_like()]
    for options in (dict(sample_frac=0.5), dict(statistic="target-k", placement="pre")):
        th = calibrate(model, data, k=6, progress=False, **options)
        assert th.metadata["tokens_run"] == th.metadata["tokens"]
    padded = calibrate(model, [few_shot_like()[:3]], k=6, progress=False)  # one left-padded batch of three
    assert padded.metadata["tokens_run"] == padded.metadata["tokens"]
    with pytest.raises(ValueError, match="sample_frac"):
        with OrderStatCollector([4] * L, H, "pre", sample_frac=0.5).repeated(2):
            pass


@pytest.mark.parametrize("collector_cls", [OrderStatCollector, TargetKCollector])
@pytest.mark.parametrize("device_path", [False, True])
def test_repeated_rows_count_as_that_many_copies(model, collector_cls, device_path):
    """A forward observed under ``repeated(3)`` adds what three forwards of the same rows add, on the host path and on
    the device path (which a GPU takes): counts and histograms exactly, float64 sums to rounding."""
    ids = sequences(1)
    once, thrice = (collector_cls([5] * L, H, "pre", topk_keep=True, device_path=device_path) for _ in range(2))
    with torch.no_grad(), toptheta.sparsify(model, toptheta.TopK(5, "pre"), [], observer=once):
        for _ in range(3):
            model(input_ids=ids)
    with torch.no_grad(), toptheta.sparsify(model, toptheta.TopK(5, "pre"), [], observer=thrice), thrice.repeated(3):
        model(input_ids=ids)
    assert torch.equal(thrice.rows_sampled, once.rows_sampled) and torch.equal(thrice.rows_eligible, once.rows_eligible)
    for name in once.sums:
        for a, b in zip(once.sums[name], thrice.sums[name]):
            if name in ("count", "hist"):
                assert torch.equal(a, b), name
            else:
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_prefixes_calibrate_as_whole_sequences_on_cuda(model):
    cuda = model.to("cuda")
    try:
        data = [[torch.tensor(s)] for s in few_shot_like()]
        whole, shared = (calibrate(cuda, data, k=6, placement="pre", compensations=[toptheta.SDC("exact")],
                                   progress=False, share_prefixes=share) for share in (False, True))
    finally:
        model.to("cpu")
    assert shared.metadata["tokens_run"] < 0.6 * shared.metadata["tokens"]
    assert torch.equal(whole.counts, shared.counts)
    torch.testing.assert_close(shared.values, whole.values, rtol=1e-4, atol=1e-5, equal_nan=True)

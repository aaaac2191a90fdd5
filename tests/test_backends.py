"""The kernel registry (toptheta/attention/backends/): each backend serves exactly what it declares.

Every backend is forced (``TOPTHETA_BACKEND``) on a grid of calls: where it declares support it must give the plain
kernel's output and statistics and be the backend the statistics name; where it refuses, the forced call must fail
with its reason. CPU kernels must refuse tensors of other devices (``meta`` here, CUDA where present), and the
accelerator path must never read a tensor value on the host (``meta`` tensors cannot be read: a read raises).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import toptheta
from conftest import BACKEND_NAMES, assert_same_stats, attend, backend_data, configs, prefill_data, tiny_6heads
from toptheta.attention import backends, fused, fused_decode, fused_prefill
from toptheta.attention.backends import AttentionCall

CONFIGS = ["dense", "topk-post-vmc", "topk-pre-sdc-vmc", "theta-post-vmc", "theta-pre", "theta-pre-sdc-vmc",
           "theta-pre-calsdc-vmc", "skip-pre-sdc-vmc", "skip-post-vmc", "topp-post-vmc"]
SHAPES = ["causal", "masked", "decode", "decode-bf16"]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", CONFIGS)
def test_each_backend_serves_exactly_what_it_declares(monkeypatch, backend, shape, name):
    sparsifier, comp = configs()[name]
    data, phase = backend_data(shape)
    call = AttentionCall(*data, 0.5, 0, sparsifier, tuple(comp), None, None, None, None, None, phase)
    call.forced = True
    reason = backends.get(backend).refuse(call)
    monkeypatch.setenv("TOPTHETA_BACKEND", "plain")
    reference, reference_stats = attend(data, phase, sparsifier, comp)
    monkeypatch.setenv("TOPTHETA_BACKEND", backend)
    if reason is not None:
        with pytest.raises(RuntimeError, match=re.escape(reason)):
            attend(data, phase, sparsifier, comp)
        return
    out, stats = attend(data, phase, sparsifier, comp)
    tol = 1e-2 if shape == "decode-bf16" else 1e-5
    torch.testing.assert_close(out.float(), reference.float(), atol=tol, rtol=tol)
    assert_same_stats(stats, reference_stats)
    assert stats.backend_calls == {backend: 1} and reference_stats.backend_calls == {"plain": 1}


# Today's choices on CPU (with the kernels built): the fast paths where they were before the registry existed.
CHOICES = {
    ("dense", "causal"): "cpu-prefill", ("dense", "decode"): "cpu-decode", ("dense", "decode-bf16"): "torch-decode",
    ("topk-post-vmc", "causal"): "cpu-select", ("topk-post-vmc", "decode"): "torch-decode",
    ("topk-pre-sdc-vmc", "masked"): "plain", ("topk-pre-sdc-vmc", "decode"): "torch-decode",
    ("theta-post-vmc", "masked"): "cpu-prefill", ("theta-post-vmc", "decode"): "cpu-decode",
    ("theta-pre-sdc-vmc", "causal"): "cpu-prefill", ("theta-pre-sdc-vmc", "decode-bf16"): "torch-decode",
}


@pytest.mark.parametrize("name,shape", list(CHOICES))
def test_the_registry_chooses_todays_fast_path_on_cpu(monkeypatch, name, shape):
    if any(m.extension() is None for m in (fused, fused_prefill, fused_decode)):
        pytest.skip("the C++ kernels could not be built here")
    monkeypatch.delenv("TOPTHETA_BACKEND", raising=False)
    sparsifier, comp = configs()[name]
    data, phase = backend_data(shape)
    _, stats = attend(data, phase, sparsifier, comp)
    assert stats.backend_calls == {CHOICES[name, shape]: 1}
    assert stats.summary()["backend_calls"] == {CHOICES[name, shape]: 1}
    assert toptheta.SparsityStats.from_json(stats.to_json()).backend_calls == stats.backend_calls


def test_an_unknown_forced_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TOPTHETA_BACKEND", "cuda-magic")
    sparsifier, comp = configs()["dense"]
    data, phase = backend_data("causal")
    with pytest.raises(ValueError, match="names no attention backend; known: .*plain"):
        attend(data, phase, sparsifier, comp)


def test_a_new_backend_is_one_registration(monkeypatch):
    """A backend added from outside the package is asked first by priority and named in the statistics."""

    class Doubling:  # serves dense prefill only, by calling the plain kernel
        name, priority = "test-dense", 99

        def refuse(self, call):
            return None if call.kind == "dense" and call.phase == "prefill" else "dense prefill only"

        def run(self, call):
            from toptheta.attention.kernel import plain_attention

            return plain_attention(call)

    monkeypatch.delenv("TOPTHETA_BACKEND", raising=False)
    backends.register(Doubling())
    try:
        _, stats = attend(*backend_data("causal"), *configs()["dense"])
        assert stats.backend_calls == {"test-dense": 1}
        _, stats = attend(*backend_data("causal"), *configs()["theta-pre"])
        assert "test-dense" not in stats.backend_calls
    finally:
        backends.unregister("test-dense")


# ---- no CPU kernel sees another device's tensors; no host reads off the CPU -------------------------------------

CPU_BACKENDS = ["cpu-prefill", "cpu-decode", "cpu-select", "torch-decode"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_backends_refuse_meta_tensors(monkeypatch, backend):
    name = "theta-post-vmc"
    sparsifier, comp = configs()[name]
    data, phase = backend_data("decode" if "decode" in backend else "causal")
    data = tuple(t.to("meta") if t is not None else None for t in data)
    monkeypatch.setenv("TOPTHETA_BACKEND", backend)
    with pytest.raises(RuntimeError, match="on meta"):
        attend(data, phase, sparsifier, comp)


def test_the_cpp_kernels_refuse_meta_tensors():
    if any(m.extension() is None for m in (fused, fused_prefill, fused_decode)):
        pytest.skip("the C++ kernels could not be built here")
    meta = dict(device="meta")
    message = "CPU kernel was handed tensors on another device"
    s, theta, whole = torch.zeros(4, 8, **meta), torch.zeros(4, **meta), torch.zeros(4, dtype=torch.bool, **meta)
    with pytest.raises(RuntimeError, match=message):
        fused.extension().post_threshold(s, theta, whole)
    with pytest.raises(RuntimeError, match=message):
        fused.extension().post_topk(s, 2, whole)
    q, k = torch.zeros(1, 2, 4, 16, **meta), torch.zeros(1, 1, 4, 16, **meta)
    empty = torch.empty(0)
    with pytest.raises(RuntimeError, match=message):
        fused_prefill.extension().prefill(q, k, k, torch.empty(0, dtype=torch.bool), empty, empty, empty, empty, empty,
                                          0, 0, 0.0, 16, 16, False)
    with pytest.raises(RuntimeError, match=message):
        fused_decode.extension().decode(q[:, :, 0].contiguous(), k, k, torch.empty(0, dtype=torch.bool), empty, empty,
                                        empty, empty, False, 0, 0.0, False, 512,
                                        torch.empty(0, dtype=torch.float64), [], 0)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("shape", ["causal", "masked", "decode"])
def test_off_the_cpu_no_layer_call_reads_a_tensor_on_the_host(monkeypatch, name, shape):
    """Meta tensors have no values: any .item(), bool(), int() or .cpu() of one raises. The statistics stay on the
    device and name the backend (sdpa for dense, the plain kernel otherwise)."""
    monkeypatch.delenv("TOPTHETA_BACKEND", raising=False)
    sparsifier, comp = configs()[name]
    data, phase = backend_data(shape)
    data = tuple(t.to("meta") if t is not None else None for t in data)
    out, stats = attend(data, phase, sparsifier, comp)
    assert out.device.type == "meta"
    assert stats.backend_calls == {"sdpa" if name == "dense" else "plain": 1}
    assert list(stats._on_device) == [torch.device("meta")]  # counted there, not yet read


def test_device_counters_are_read_once_and_add_to_the_cpu_ones():
    """The statistics' accelerator branch, with CPU tensors standing in for a device's counters."""
    stats = toptheta.SparsityStats(1, 2, 1)
    sums = stats._sums(torch.device("cpu"))
    assert sums is stats._counters  # the CPU adds at once
    stats._on_device[torch.device("meta")] = {name: torch.ones_like(v) for name, v in stats._counters.items()}
    stats._on_device[torch.device("meta")]["clamped"] = torch.tensor(3)
    assert stats.prefill_valid.sum() == 2 and stats.clamped_rows == 3 and not stats._on_device


# ---- statistics: the backend is named; the batch-size probe is not counted -----------------------------------

def test_statistics_name_the_backend_of_every_layer_call(monkeypatch):
    monkeypatch.delenv("TOPTHETA_BACKEND", raising=False)
    model = tiny_6heads("llama")
    sparsifier, comp = configs(layers=2)["topk-pre-sdc-vmc"]
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    with toptheta.sparsify(model, sparsifier, comp) as stats:
        model(ids)
    assert stats.backend_calls == {"plain": 2}  # one call per layer
    monkeypatch.setenv("TOPTHETA_BACKEND", "plain")
    sparsifier, comp = configs(layers=2)["dense"]
    with toptheta.sparsify(model, sparsifier, comp) as stats:
        model(ids)
    assert stats.backend_calls == {"plain": 2}


def test_paused_statistics_record_nothing():
    model = tiny_6heads("llama")
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
    with toptheta.sparsify(model, toptheta.TopK(3, "post")) as stats:
        with stats.paused():
            model(ids)
        assert stats.summary()["prefill_attention_elements"] == 0 and stats.backend_calls == {}
        model(ids)
    assert stats.summary()["prefill_attention_elements"] > 0 and stats.enabled


def test_the_batch_size_probe_is_not_counted(monkeypatch):
    """batch_size="auto" on an accelerator runs HFLM's probe (forwards at the maximum length) inside the block: they
    must not enter the kept fractions, which then equal a fixed batch size's."""
    from lm_eval.models.huggingface import HFLM

    from conftest import load_tasks
    from toptheta.evaluation import batched_lm
    from toptheta.evaluation.calibration_inputs import build_requests
    from toptheta.evaluation.shared_context_lm import BatchedHFLM, SharedContextHFLM
    from toptheta.models import build_tiny_model, build_tiny_tokenizer

    tokenizer, model = build_tiny_tokenizer(), build_tiny_model("llama")
    task = load_tasks(["smoke"], None)["smoke"]
    build_requests(task, num_fewshot=1, limit=3, seed=0)
    requests = task.instances
    sparsifier, comp = toptheta.TopK(k=8, placement="post"), [toptheta.VMC()]

    def probe(self, requests=None, pos=0):  # what HFLM's probe does: all-ones forwards at the maximum length
        self.model(torch.ones(2, 96, dtype=torch.long))
        return 4

    def score(batch_size, probing: bool):
        lm = SharedContextHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        with toptheta.sparsify(model, sparsifier, comp) as stats:
            if probing:
                with monkeypatch.context() as m:  # the accelerator branch of the probe, on this CPU
                    m.setattr(HFLM, "_detect_batch_size", probe)
                    m.setattr(BatchedHFLM, "device", property(lambda self: torch.device("cuda")))
                    assert lm._detect_batch_size() == 4
            lm.loglikelihood(requests, disable_tqdm=True)
        return stats.summary()

    fixed, auto = score(4, probing=False), score("auto", probing=True)
    for name in ("prefill_attention_elements", "kept_attention_fraction", "mean_dropped_mass"):
        assert auto[name] == pytest.approx(fixed[name], rel=1e-6), name
    with monkeypatch.context() as m:  # the same test without the pause fails: the probe's rows are counted
        m.setattr(batched_lm, "statistics_paused", lambda model: contextlib.nullcontext())
        counted = score("auto", probing=True)
    assert counted["prefill_attention_elements"] > fixed["prefill_attention_elements"]


# ---- accelerators ----------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_cpu_backends_refuse_cuda_tensors(monkeypatch, backend):
    sparsifier, comp = configs()["theta-post-vmc"]
    data, phase = backend_data("decode" if "decode" in backend else "causal")
    data = tuple(t.cuda() if t is not None else None for t in data)
    monkeypatch.setenv("TOPTHETA_BACKEND", backend)
    with pytest.raises(RuntimeError, match="on cuda"):
        attend(data, phase, sparsifier, comp)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("shape", ["causal", "masked", "decode"])
def test_cuda_equals_the_cpu_reference_without_synchronising(monkeypatch, name, shape):
    monkeypatch.delenv("TOPTHETA_BACKEND", raising=False)
    sparsifier, comp = configs()[name]
    data, phase = backend_data(shape)
    monkeypatch.setenv("TOPTHETA_BACKEND", "plain")
    reference, reference_stats = attend(data, phase, sparsifier, comp)
    monkeypatch.delenv("TOPTHETA_BACKEND")
    data = tuple(t.cuda() if t is not None else None for t in data)
    attend(data, phase, sparsifier, comp)  # warm-up: the threshold tables move to the device once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, stats = attend(data, phase, sparsifier, comp)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.cpu(), reference, atol=1e-4, rtol=1e-4)
    assert_same_stats(stats, reference_stats)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["theta-pre-sdc-vmc", "theta-post-vmc"])
def test_no_host_read_inside_a_layer_call_on_cuda(name):
    """A sparsified forward with left padding synchronises with the host only outside the layers (transformers'
    mask function, our check of the mask's form, generate's own stopping checks): the count does not grow with the
    layers (2 and 4 here), for one forward and for a whole generate call. The Triton kernels serve the Top-θ calls."""
    import warnings

    def counted(fn) -> int:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # "called a synchronizing CUDA operation" per host read; not torch's once-per-process note on the mode itself
        return sum("called a synchronizing" in str(w.message) for w in seen)

    def syncs(layers: int) -> tuple[int, int, dict]:
        model = tiny_6heads("llama", layers=layers).cuda()
        sparsifier, comp = configs(layers=layers)[name]
        ids = torch.randint(0, 97, (2, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :7] = 0  # left padding
        generate = lambda: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,  # noqa: E731
                                          do_sample=False, pad_token_id=0)
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
            generate()  # warm-up: compilation, threshold tables on the device
            forward = counted(lambda: model(ids, attention_mask=mask))
            steps = counted(generate)
        return forward, steps, dict(stats.backend_calls)

    forward2, generate2, served = syncs(2)
    forward4, generate4, _ = syncs(4)
    assert "triton" in served, served
    # H200, torch 2.11, transformers 5.24 (2026-12-04): 3 per forward (transformers' mask function 2, our mask-form
    # check 1), 21 per generate call of 4 tokens (generate's own 13 besides), at either depth
    assert forward4 == forward2 and generate4 == generate2, (forward2, forward4, generate2, generate4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", ["theta-post-vmc", "theta-pre-sdc-vmc", "skip-pre-sdc-vmc", "skip-post-vmc",
                                  "topk-post-vmc", "topk-pre-sdc-vmc", "topp-post-vmc"])
def test_generate_on_cuda_gives_the_cpu_tokens_and_counts(name):
    """Greedy decoding with left padding on a GPU (Triton serving the Top-θ and skip-softmax calls and Top-k's and
    top-p's decode steps, the plain kernel their prefill) against the plain kernel on CPU:
    the same tokens and the same kept counts in float32; bfloat16 generates without error and keeps a part."""
    sparsifier, comp = configs(layers=2)[name]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    runs = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        model = tiny_6heads("llama").to(device, dtype)
        with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=8,
                                 do_sample=False, pad_token_id=0)
        runs[device, dtype] = out.cpu(), stats
    (ref, ref_stats), (got, stats) = runs["cpu", torch.float32], runs["cuda", torch.float32]
    assert "triton" in stats.backend_calls, stats.backend_calls
    if name.startswith(("topk", "topp")):  # prefill on the plain kernel (a whole-row boundary), decode on Triton
        assert stats.backend_calls["triton"] == 7 * 2 and "plain" in stats.backend_calls, stats.backend_calls
    assert torch.equal(got, ref)
    for counter in ("prefill_kept", "decode_kept", "vrow_kept"):
        a, b = float(getattr(ref_stats, counter).sum()), float(getattr(stats, counter).sum())
        assert abs(a - b) <= 1e-3 * max(1.0, a), (counter, a, b)
    half, half_stats = runs["cuda", torch.bfloat16]
    assert half.shape == ref.shape and "triton" in half_stats.backend_calls
    assert 0 < half_stats.kept_attention_fraction < 1


# ---- building the C++ kernels: no stale-lock hang ----------------------------------------------------------------

def test_a_build_removes_a_killed_builds_lock_and_a_held_one_times_out(tmp_path, monkeypatch, caplog):
    """torch's extension builder waits forever on the lock file of a build that was killed; ours holds an OS lock
    (released when its holder dies), so a lock file found under it is stale and removed, and a live holder makes
    a build wait BUILD_LOCK_TIMEOUT at most, then fall back."""
    import fcntl
    import logging
    from pathlib import Path

    import torch.utils.cpp_extension as cpp

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("TOPTHETA_FUSED", "1")
    seen = {}

    def load_inline(name, build_directory, **kwargs):
        seen["stale lock left"] = (Path(build_directory) / "lock").exists()
        return "module"

    monkeypatch.setattr(cpp, "load_inline", load_inline)
    suffix = fused._target()[0]
    directory = fused.build_directory(f"toptheta_test_{suffix}")
    (directory / "lock").write_text("")  # torch's baton of a build that was killed
    with caplog.at_level(logging.WARNING, logger="toptheta"):
        assert fused.build("toptheta_test", "", [], "a test kernel", "nothing") == "module"
    assert seen == {"stale lock left": False} and "stale build lock" in caplog.text
    monkeypatch.setattr(fused, "BUILD_LOCK_TIMEOUT", 0.6)
    with open(directory / "toptheta.lock", "a+") as other:  # another process building now
        fcntl.flock(other, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger="toptheta"):
            assert fused.build("toptheta_test", "", [], "a test kernel", "nothing") is None
        assert "could not be built" in caplog.text and "building in" in caplog.text


# ---- the Triton seam: what the backend hands the wrappers (the kernels' own tests live beside them) ------------

def test_the_triton_backend_lowers_masks_thresholds_and_statistics(monkeypatch):
    """A stand-in for ``toptheta.attention.triton`` records what the backend passes and answers with the plain
    kernel's output, adding the rows' true counts to the counter row it is handed as a kernel would: the backend must
    derive each sequence's key range from a left-padded mask, hand the lowered θ rows and the layer's counters, and
    return transformers' layout."""
    import types

    from toptheta.attention.backends import triton as triton_backend

    seen = {}
    sparsifier, comp = configs()["theta-pre-sdc-vmc"]
    data, phase = backend_data("masked")
    monkeypatch.setenv("TOPTHETA_BACKEND", "plain")
    reference, reference_stats = attend(data, phase, toptheta.Dense(), [])
    B, H, Q, _ = data[0].shape

    def prefill_attention(query, key, value, **kwargs):
        seen.update(kwargs)
        n = data[3].sum(-1).expand(B, H, Q).int()  # the true row lengths of the mask
        if kwargs.get("stats_row") is not None:  # what the kernel adds to the layer's counters (dense: no drops)
            from toptheta.attention.triton.common import STATS_COUNTERS

            row, at = kwargs["stats_row"], dict(zip(STATS_COUNTERS, kwargs["stats_columns"]))
            row[at["kept"]:at["kept"] + H] += n.sum((0, 2)).double()
            row[at["valid"]:at["valid"] + H] += float(n[:, 0].sum())
            row[at["rows"]:at["rows"] + H] += float((n[:, 0] > 0).sum())
        return types.SimpleNamespace(out=reference.transpose(1, 2), kept=n, kept_mass=torch.ones(B, H, Q),
                                     empty=torch.zeros(B, H, Q, dtype=torch.bool), vrows=None)

    fake = types.SimpleNamespace(prefill_attention=prefill_attention, decode_attention=None)
    backends.register(triton_backend.TritonBackend(fake))
    monkeypatch.setenv("TOPTHETA_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        out, stats = attend(data, phase, toptheta.Dense(), [])
        assert seen["key_start"].tolist() == [0, 5] and seen["q_offset"] == 0 and seen["theta"] is None
        torch.testing.assert_close(out, reference)
        assert_same_stats(stats, reference_stats)
        assert stats.backend_calls == {"triton": 1}
        out, stats = attend(data, phase, sparsifier, comp)
        call = AttentionCall(*data, 0.5, 0, sparsifier, tuple(comp), None, None, None, None, None, phase)
        n = data[3].sum(-1)  # (B, 1, Q)
        assert torch.equal(seen["theta"], call.thetas(n, causal=False)[0])
        assert seen["placement"] == "pre" and seen["sdc"] == "exact" and seen["vmc"] is True
        window = data[3] & torch.ones(Q, Q, dtype=torch.bool).triu(-3)  # a sliding window: not one key range
        with pytest.raises(RuntimeError, match="not causal with left padding"):
            attend((*data[:3], window), phase, sparsifier, comp)
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(RuntimeError, match="CUDA tensors"):
            attend(data, phase, sparsifier, comp)
    finally:
        backends.unregister("triton")
        if triton_backend.BACKEND is not None:
            backends.register(triton_backend.BACKEND)


def test_a_section_holds_the_backend_calls_made_inside_it(monkeypatch):
    monkeypatch.delenv("TOPTHETA_BACKEND", raising=False)
    stats = toptheta.SparsityStats(1, 6, 2)
    q, k, v, valid = prefill_data()
    run = lambda: toptheta.sparse_attention(q, k, v, None, scaling=0.5, layer=0, sparsifier=toptheta.TopK(3, "pre"),  # noqa
                                            stats=stats)
    run()
    with stats.section() as part:
        run()
        run()
    assert part.backend_calls == {"plain": 2} and stats.backend_calls == {"plain": 3}

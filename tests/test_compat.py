"""The transformers and lm-eval internals ``toptheta.compat`` relies on: one test each, naming what moved.

When a release moves one of them, the failing test says which internal and where toptheta uses it, so the fix
is in ``toptheta/compat.py`` (and the caller it names), not a hunt through a stack trace.
"""

from __future__ import annotations

import inspect
import re

import lm_eval
import pytest
import torch
import transformers
from lm_eval import utils as lm_eval_utils
from lm_eval.api import samplers
from lm_eval.api.model import TemplateLM
from lm_eval.models.huggingface import HFLM
from transformers import DynamicCache, masking_utils

from toptheta import compat
from toptheta.evaluation.batched_lm import BatchedHFLM
from toptheta.models import build_tiny_model, build_tiny_tokenizer

VERSIONS = f"transformers {transformers.__version__}, lm-eval {lm_eval.__version__}"


def require(ok: bool, internal: str, used_by: str) -> None:
    if not ok:
        pytest.fail(f"{internal} moved or changed in {VERSIONS}; toptheta uses it in {used_by}: update toptheta/compat.py")


# --- transformers ---------------------------------------------------------------------------------------


def test_dynamic_cache_layers_hold_keys_and_values_per_layer():
    model = build_tiny_model("llama", num_layers=2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 5, 6, 7], [1, 8, 9, 10]]), cache=cache, use_cache=True)
    layers = compat.cache_layers(cache) if hasattr(cache, "layers") else None
    require(isinstance(layers, list) and len(layers) == 2, "DynamicCache.layers (a list, one entry per layer)",
            "evaluation/prefix_cache.py, attention/cache.py")
    require(all(tuple(layer.keys.shape) == (2, 2, 4, 16) and tuple(layer.values.shape) == (2, 2, 4, 16)
                for layer in layers), "a DynamicCache layer's keys/values (B, Hkv, K, D)", "evaluation/prefix_cache.py")
    copy = DynamicCache(config=model.config)
    compat.set_cache_layers(copy, list(layers))
    copy.batch_select_indices(torch.tensor([1]))
    require(copy.get_seq_length() == 4 and compat.cache_layers(copy)[0].keys.shape[0] == 1,
            "DynamicCache.layers as the cache's storage (batch_select_indices acts on it)", "evaluation/prefix_cache.py")


def test_sdpa_mask_takes_our_keywords():
    params = inspect.signature(masking_utils.sdpa_mask).parameters
    positional = ["batch_size", "q_length", "kv_length", "q_offset", "kv_offset"]
    require(list(params)[:5] == positional, f"masking_utils.sdpa_mask's leading parameters {positional}",
            "attention/backend.py (_mask)")
    for keyword in compat.SDPA_MASK_KEYWORDS:
        require(keyword in params, f"masking_utils.sdpa_mask's keyword {keyword!r}", "attention/backend.py (_mask)")


def test_an_attention_function_and_its_mask_register_under_one_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def attention(*args, **kwargs):
        raise AssertionError("never called")

    def mask(*args, **kwargs):
        raise AssertionError("never called")

    compat.register_attention("toptheta-compat-test", attention, mask)
    require(AttentionInterface._global_mapping.get("toptheta-compat-test") is attention
            if hasattr(AttentionInterface, "_global_mapping") else "toptheta-compat-test" in compat.registered_attention(),
            "transformers.AttentionInterface.register", "attention/backend.py (register)")
    require(AttentionMaskInterface._global_mapping.get("toptheta-compat-test") is mask,
            "transformers.masking_utils.AttentionMaskInterface.register (without it the causal mask becomes None)",
            "attention/backend.py (register)")


def test_a_models_hub_commit_is_read_from_its_config():
    model = build_tiny_model("llama", num_layers=1)
    require(compat.commit_hash(model.config) is None, "config._commit_hash (None for a model built in code)",
            "thresholds/table.py (model_identity), calibration/calibrate.py")


def test_attention_functions_registry_lists_the_backends():
    names = compat.registered_attention()
    require({"eager", "sdpa"} <= names, "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS",
            "models/loading.py (_check_attn_implementation)")


def test_from_pretrained_keeps_a_quantizer_on_the_model():
    source = inspect.getsource(transformers.modeling_utils)
    require(re.search(r"\bmodel\.hf_quantizer\s*=", source) is not None,
            "PreTrainedModel.hf_quantizer (set by from_pretrained for quantized weights)",
            "models/gguf_cache.py (a GGUF must be fully dequantized before it is cached)")
    require(not compat.is_quantized(build_tiny_model("llama")), "PreTrainedModel.hf_quantizer (absent: not quantized)",
            "models/gguf_cache.py")


# --- lm-eval --------------------------------------------------------------------------------------------


def test_hflm_private_methods_we_override_keep_their_signatures():
    for name in compat.HFLM_OVERRIDES:
        require(callable(getattr(HFLM, name, None)), f"HFLM.{name}", "evaluation/batched_lm.py, shared_context_lm.py")
        theirs = list(inspect.signature(getattr(HFLM, name)).parameters)
        ours = list(inspect.signature(getattr(BatchedHFLM, name)).parameters)
        require(ours == theirs, f"HFLM.{name}'s parameters {theirs} (ours: {ours})", "evaluation/batched_lm.py")


def test_hflm_attributes_we_read_and_set():
    lm = HFLM(pretrained=build_tiny_model("llama"), tokenizer=build_tiny_tokenizer(), batch_size=1)
    for name in compat.HFLM_ATTRIBUTES:
        require(hasattr(lm, name), f"HFLM().{name}", "evaluation/batched_lm.py, lm_eval_model.py")


def test_harness_cli_parses_and_executes():
    require(all(callable(getattr(compat.HarnessCLI, name, None)) for name in ("parse_args", "execute")),
            "lm_eval._cli.harness.HarnessCLI (parse_args, execute)", "cli.py (toptheta-eval)")


def test_template_rendering_goes_through_apply_template_and_env():
    require(list(inspect.signature(lm_eval_utils.apply_template).parameters) == ["template", "doc"],
            "lm_eval.utils.apply_template(template, doc)", "compat.compile_templates_once")
    require(hasattr(lm_eval_utils.env, "from_string"), "lm_eval.utils.env (the Jinja environment)",
            "compat.compile_templates_once")
    compat.compile_templates_once()
    rendered = lm_eval_utils.apply_template("Q: {{question}}", {"question": "why?"})
    assert rendered == lm_eval_utils.apply_template.stock("Q: {{question}}", {"question": "why?"}) == "Q: why?"


def test_fewshot_samplers_are_registered_by_name():
    class Task:
        sampler = None

        def fewshot_docs(self):
            return [{"q": 1}, {"q": 2}]

    for name in ("default", "first_n"):
        try:
            task = Task()
            compat.replace_sampler(task, name)
        except Exception as err:  # noqa: BLE001  (any failure means the registry moved)
            pytest.fail(f"lm_eval.api.samplers.get_sampler({name!r})(docs, rnd=None) failed ({err}) in {VERSIONS}; "
                        "toptheta uses it in evaluation/task_loading.py: update toptheta/compat.py")
        require(isinstance(task.sampler, samplers.ContextSampler), f"lm_eval.api.samplers.get_sampler({name!r})",
                "evaluation/task_loading.py")


def test_max_length_and_generation_budget_rules():
    model, tokenizer = build_tiny_model("llama"), build_tiny_tokenizer()
    require(compat.hflm_max_length(model, tokenizer) == 2048, "lm_eval.models.utils.resolve_max_length",
            "thresholds_cache.py, matched.py (calibration at HFLM's context length)")
    require(compat.max_gen_toks({"max_gen_toks": 7}, 256) == 7 and compat.max_gen_toks({}, 256) == 256,
            "lm_eval.models.utils.normalize_gen_kwargs(...)['max_gen_toks']", "evaluation/longbench_lm.py")


def test_encode_pair_is_still_the_split_we_copy():
    params = list(inspect.signature(TemplateLM._encode_pair).parameters)
    require(params == ["self", "context", "continuation"], "TemplateLM._encode_pair(context, continuation)",
            "compat.encode_request (its copy; tests/test_tasks.py compares the two on real requests)")
    tokenizer = build_tiny_tokenizer()
    lm = HFLM(pretrained=build_tiny_model("llama"), tokenizer=tokenizer, batch_size=1)
    for context, continuation in (("Question: 2+2? Answer:", " 4"), ("Ends with spaces  ", "x")):
        require(compat.encode_request(tokenizer, context, continuation) == tuple(lm._encode_pair(context, continuation)),
                "TemplateLM._encode_pair's split", "compat.encode_request")


def test_the_attention_library_runs_without_lm_eval():
    """A GPU image with torch and transformers alone: ``import toptheta`` and a sparse forward need no lm-eval."""
    import subprocess
    import sys

    script = """
import importlib.abc, sys
class NoLmEval(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoLmEval())
import torch, toptheta
from toptheta.models import build_tiny_model
model = build_tiny_model("llama", num_layers=2)
with toptheta.sparsify(model, toptheta.TopK(k=2), [toptheta.VMC()]) as stats:
    model(torch.arange(12).view(1, 12))
assert not any(m.split(".")[0] == "lm_eval" for m in sys.modules), "lm_eval was imported"
print("kept", round(stats.kept_attention_fraction, 3))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("kept 0."), done.stdout

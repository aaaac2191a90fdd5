"""Batched greedy decoding (evaluation/batched_generation.py) against model.generate, one prompt at a time."""

import pytest
import torch

import toptheta
from conftest import configs, tiny_6heads
from toptheta.attention import decode
from toptheta.evaluation.batched_generation import eos_ids, greedy_generate_batch, unsupported_settings

PROMPT_LENGTHS = (5, 12, 20, 9)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 97, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def _one_at_a_time(model, prompts, limits):
    """The reference: model.generate per prompt, tokens after the prompt (the end-of-sequence token included)."""
    out = []
    for p, limit in zip(prompts, limits):
        if limit == 0:
            out.append([])
            continue
        ids = torch.tensor([p])
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=limit,
                             do_sample=False, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def _counts(stats) -> dict[str, torch.Tensor]:
    return {name: getattr(stats, name).clone() for name in ("prefill_valid", "decode_valid", "vrow_valid", "rows",
                                                            "prefill_kept", "decode_kept", "vrow_kept")}


@pytest.mark.parametrize("arch,name", [("llama", "theta-post-vmc"), ("qwen2", "theta-pre-sdc-vmc"),
                                       ("llama", "topk-post"), ("qwen2", "dense")])
def test_a_batch_decodes_each_prompts_own_tokens_and_counts_no_row_past_its_end(arch, name):
    model = tiny_6heads(arch)
    sparsifier, comp = configs(layers=2)[name]
    prompts, limits = _prompts(), [6, 3, 8, 0]
    with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp):
        free = _one_at_a_time(model, prompts, [8] * len(prompts))
    eos = model.generation_config.eos_token_id = free[0][2]  # prompt 0 stops by its end token
    decode.reset()
    with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
        expected = _one_at_a_time(model, prompts, limits)
    reference = _counts(stats)
    finished = []
    decode.reset()
    with toptheta.sparsify(model, sparsifier, comp) as stats:
        got = greedy_generate_batch(model, prompts, max_new_tokens=limits, pad_token_id=0,
                                    eos_token_ids=eos_ids(model, None), on_finish=lambda i, t: finished.append(i))
    assert got == expected
    assert got[0] == free[0][:free[0].index(eos) + 1]
    assert all(len(t) == limit or t[-1] == eos for t, limit in zip(got, limits))
    assert sorted(finished) == [0, 1, 2, 3] and finished[0] == 3  # the empty one first, then as each one ends
    counts = _counts(stats)
    for key in ("prefill_valid", "decode_valid", "vrow_valid", "rows"):  # same rows and keys: exactly
        assert torch.equal(counts[key], reference[key]), key
    for key in ("prefill_kept", "decode_kept", "vrow_kept"):  # same decisions up to a near-tie of the GEMMs' rounding
        torch.testing.assert_close(counts[key], reference[key], rtol=0.01, atol=2, msg=key)
    if name != "dense":
        assert 0 < stats.kept_vrow_fraction < 1


def test_batch_of_one_is_model_generate_exactly():
    model = tiny_6heads("llama")
    prompt = _prompts()[1]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    got = greedy_generate_batch(model, [prompt], max_new_tokens=[10], pad_token_id=0, eos_token_ids={2})
    assert got[0] == ref.sequences[0, len(prompt):].tolist()


def test_bad_arguments_and_unhonoured_generation_settings_are_refused():
    model = tiny_6heads("llama")
    with pytest.raises(ValueError, match="2 prompts but 1 token limits"):
        greedy_generate_batch(model, [[5], [6]], max_new_tokens=[3], pad_token_id=0, eos_token_ids={2})
    with pytest.raises(ValueError, match="at least one token"):
        greedy_generate_batch(model, [[]], max_new_tokens=[3], pad_token_id=0, eos_token_ids={2})
    assert unsupported_settings(model) == []
    model.generation_config.repetition_penalty = 1.1
    assert unsupported_settings(model) == ["repetition_penalty=1.1"]
    from toptheta.evaluation.generation import check_decoding

    check_decoding({"decode_batch": 1}, model)  # one at a time: generate honours every setting
    with pytest.raises(ValueError, match="task.decode_batch=8 decodes greedily .* leave it unset"):
        check_decoding({"decode_batch": 8}, model)
    with pytest.raises(ValueError, match="task.share_prefix=true decodes greedily .* leave it unset"):
        check_decoding({"share_prefix": True}, model)


def test_passkey_task_decoded_in_batches_has_the_samples_and_per_length_stats_of_one_at_a_time():
    from toptheta.evaluation.generation import run_passkey
    from toptheta.models import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("llama", num_layers=2, num_heads=4, num_kv_heads=2)
    n = torch.arange(1025).clamp(min=1).float()
    thresholds = toptheta.Thresholds((torch.full((2, 4, 1), 1.5) / n).contiguous(), [3, 3], "post")
    task = {"kind": "passkey", "lengths": [400, 600], "depths": [0.2, 0.5, 0.8], "seed": 0}
    runs = []
    for batch in (None, 2):
        with toptheta.sparsify(model, toptheta.TopTheta(thresholds), [toptheta.VMC()]) as stats:
            runs.append(run_passkey({**task, "decode_batch": batch}, model, tokenizer, chat_template=False,
                                    stats=stats))
    one, batched = runs
    assert [s["generation"] for s in batched["samples"]] == [s["generation"] for s in one["samples"]]
    assert [s["id"] for s in batched["samples"]] == [s["id"] for s in one["samples"]]
    assert batched["results"] == one["results"]
    for length in ("passkey_400", "passkey_600"):
        a, b = one["task_stats"][length], batched["task_stats"][length]
        for key in ("prefill_attention_elements", "clamped_rows", "empty_rows"):
            assert b[key] == a[key], key
        for key in ("kept_attention_fraction", "kept_vrow_fraction", "decode_kept_attention_fraction"):
            assert b[key] == pytest.approx(a[key], rel=1e-3), key
        assert 0 < b["kept_vrow_fraction"] < 1


def test_lm_eval_generate_until_batches_stop_each_sequence_at_its_own_end(monkeypatch):
    """BatchedHFLM's greedy generate_until batches: batch 1's texts, and exactly its rows in the statistics (each
    sequence leaves at its stop string or token limit; model.generate would run finished ones to the batch's end)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from conftest import tiny_model, tiny_tokenizer
    from toptheta.evaluation.shared_context_lm import BatchedHFLM

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    contexts = ["Q: 2+2?\nA:", "The cat", "Once upon a time there was", "x"]
    requests = [Instance("generate_until", {}, (c, {"until": ["w", "m"], "max_gen_toks": 12}), i)
                for i, c in enumerate(contexts)]

    def run(batch_size, **kwargs):
        lm = BatchedHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=64, **kwargs)
        with toptheta.sparsify(model, toptheta.TopK(3, "post"), [toptheta.VMC()]) as stats:
            texts = lm.generate_until(requests)
        assert lm.batch_size == batch_size  # decode_batch leaves the scoring batch as it was
        return texts, _counts(stats)

    (one, one_counts), (four, four_counts) = run(1), run(4)
    assert four == one and len(set(map(len, one))) > 1  # some stopped at a stop string, some ran to 12 tokens
    for key, value in one_counts.items():
        assert torch.equal(four_counts[key], value), key
    widths = []
    batched = BatchedHFLM._model_generate
    monkeypatch.setattr(BatchedHFLM, "_model_generate",
                        lambda self, context, *a, **kw: widths.append(len(context)) or batched(self, context, *a, **kw))
    for decode_batch, expected in ((4, [4]), (3, [3, 1]), (1, [1, 1, 1, 1])):  # generation batches, scoring at 1
        widths.clear()
        texts, counts = run(1, decode_batch=decode_batch)
        assert widths == expected and texts == one
        for key, value in one_counts.items():
            assert torch.equal(counts[key], value), key
    with pytest.raises(ValueError, match="decode_batch must be None"):
        BatchedHFLM(pretrained=model, tokenizer=tokenizer, decode_batch=0)
    monkeypatch.undo()
    monkeypatch.setattr(BatchedHFLM, "_model_generate", HFLM._model_generate)  # model.generate for the batch
    stock, stock_counts = run(4)
    assert stock == one and stock_counts["decode_valid"].sum() > one_counts["decode_valid"].sum()
    stock_one, stock_one_counts = run(1)  # batches of one: model.generate with transformers' own cache
    assert stock_one == one
    for key, value in one_counts.items():
        assert torch.equal(stock_one_counts[key], value), key


@pytest.mark.parametrize("decode_batch", [1, 2])
def test_generation_limits_count_the_prompt_as_the_model_sees_it(decode_batch):
    """max_new_tokens as a function of the prompt's length gets the chat-wrapped length (humaneval's max_length)."""
    from toptheta.evaluation.generation import encode_prompt, generate_all
    from toptheta.models import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<user> {{ m['content'] }} </user>{% endfor %}<assistant>"
    model = build_tiny_model("llama", num_layers=1, num_heads=2, num_kv_heads=1)
    model.generation_config.eos_token_id = None  # every prompt runs to its limit
    prompts = ["the grass is green", "a boat rests on the shore of the lake"]
    lengths = [len(encode_prompt(tokenizer, p, chat_template=True)) for p in prompts]
    assert lengths[0] > len(encode_prompt(tokenizer, prompts[0]))  # the template adds tokens
    seen = []

    def limit(n: int) -> int:
        seen.append(n)
        return 40 - n
    out = generate_all(model, tokenizer, prompts, max_new_tokens=limit, chat_template=True, decode_batch=decode_batch)
    assert seen == lengths and [o["prompt_tokens"] for o in out] == lengths
    fixed = generate_all(model, tokenizer, prompts, max_new_tokens=[40 - n for n in lengths], chat_template=True,
                         decode_batch=decode_batch)
    assert [o["text"] for o in out] == [o["text"] for o in fixed]
    with pytest.raises(ValueError, match="2 prompts but 1 token limits"):
        generate_all(model, tokenizer, prompts, max_new_tokens=[3], chat_template=True)


def _shared_prompts() -> list[list[int]]:
    """Prompts that agree up to where each holds its own 'key' (4 tokens), like passkey prompts with one filler."""
    g = torch.Generator().manual_seed(5)
    filler = torch.randint(3, 97, (60,), generator=g).tolist()
    return [filler[:cut] + [90 + i, 91, 92 + i, 93] + filler[cut:] for i, cut in enumerate((3, 20, 38, 57, 20))]


@pytest.mark.parametrize("arch,name", [("llama", "theta-post-vmc"), ("qwen2", "theta-pre-sdc-vmc"),
                                       ("llama", "topk-post-vmc"), ("qwen2", "dense")])
def test_shared_prefixes_run_once_with_each_prompts_tokens_and_statistics(arch, name):
    from toptheta.evaluation.prefix_sharing import generate_shared, plan

    model = tiny_6heads(arch)
    model.generation_config.eos_token_id = None
    sparsifier, comp = configs(layers=2)[name]
    prompts, limits = _shared_prompts(), [6, 3, 0, 8, 5]
    base, shared = plan([p for p, n in zip(prompts, limits) if n])
    # The base: the key at 57; its own shared part stops 16 tokens before its end, the one at 3 is too short.
    assert base == 1 and shared == [0, 48, 20, 20]
    decode.reset()
    with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp) as stats:
        expected = _one_at_a_time(model, prompts, limits)
    reference = _counts(stats)
    seen = []  # tokens entering the model per forward
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].numel()))
    decode.reset()
    finished = []
    with toptheta.sparsify(model, sparsifier, comp) as stats:
        got = generate_shared(model, prompts, max_new_tokens=limits, pad_token_id=0, eos_token_ids=set(),
                              on_finish=lambda i, t: finished.append(i))
    hook.remove()
    assert got == expected and sorted(finished) == [0, 1, 2, 3, 4]
    assert sum(seen) == 20 + 28 + (64 + 16 + 44 + 44) + sum(n - 1 for n in limits if n)  # segments, rests, steps
    counts = _counts(stats)
    for key in ("prefill_valid", "decode_valid", "vrow_valid", "rows"):
        assert torch.equal(counts[key], reference[key]), key
    for key in ("prefill_kept", "decode_kept", "vrow_kept"):
        if name.startswith("topk"):  # the plain kernel's chunks round differently: a near-tie may flip
            torch.testing.assert_close(counts[key], reference[key], rtol=0.01, atol=2, msg=key)
        else:
            assert torch.equal(counts[key], reference[key]), key


def test_prefix_sharing_refuses_what_it_cannot_do():
    from toptheta.attention.cache import cache_prefix, growing_cache
    from toptheta.evaluation.generation import check_decoding, generate_all
    from toptheta.models import build_tiny_model

    gemma = build_tiny_model("gemma3", num_layers=2, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="sliding-window layers .* leave task.share_prefix unset"):
        check_decoding({"share_prefix": True}, gemma)
    model = tiny_6heads("llama")
    check_decoding({"share_prefix": True}, model)
    cache = growing_cache(model)
    with pytest.raises(ValueError, match="holds 0 positions"):
        cache_prefix(cache, 4)
    with pytest.raises(ValueError, match="one prompt at a time"):
        generate_all(model, None, [], max_new_tokens=1, chat_template=False, decode_batch=2, share_prefix=True)

"""V-row popularity during generation (issue 10 item 10): the recorder's counts agree with the session's
V-row and decode statistics, record one generation only, and refuse what they cannot record."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import toptheta
from toptheta.attention.popularity import VRowPopularity


def tiny_gqa_llama() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=97, hidden_size=96, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def generate(model, recorder, sparsifier, prompts=1, new_tokens=9):
    comp = [] if isinstance(sparsifier, toptheta.Dense) else [toptheta.VMC()]
    with torch.no_grad(), toptheta.sparsify(model, sparsifier, comp, observer=recorder) as stats:
        for seed in range(prompts):
            ids = torch.randint(0, 97, (1, 14), generator=torch.Generator().manual_seed(seed))
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        return stats


@pytest.mark.parametrize("layer", [0, 1])
def test_counts_add_up_to_the_sessions_decode_statistics(layer):
    model = tiny_gqa_llama()
    recorder = VRowPopularity.for_model(model, layer)
    stats = generate(model, recorder, toptheta.TopK(5, "post"))
    assert len(recorder.steps) == 8 and recorder.heads_per_group == 3  # 9 new tokens: the first comes from the prompt
    both = torch.stack([recorder.counts(g) for g in range(2)])  # (groups, steps, keys)
    assert int(both.max()) <= 3 and both.shape[-1] == 14 + 8
    # every kept attention element is one head keeping one V row; a V row counts once per group if any head keeps it
    assert int(both.sum()) == int(stats.decode_kept[layer].sum())
    assert int((both > 0).sum()) == int(stats.vrow_kept[layer].sum())
    assert all(int(recorder.counts(0)[i].gt(0).sum()) >= 5 for i in range(8))  # top-5 per head, union ≥ 5
    assert torch.all(recorder.counts(0)[0, 14 + 1:] == 0)  # step 0 has 15 keys: later ones did not exist yet


def test_one_generation_is_recorded_and_max_steps_stops_it():
    model = tiny_gqa_llama()
    first = VRowPopularity.for_model(model, 1)
    generate(model, first, toptheta.TopK(5, "post"), prompts=2)
    assert len(first.steps) == 8 and first.finished  # the second prompt's steps did not continue the record
    short = VRowPopularity.for_model(model, 1, max_steps=3)
    generate(model, short, toptheta.TopK(5, "post"))
    record = short.to_dict(group=1)
    assert record["steps"] == 3 and record["layer"] == 1 and record["group"] == 1 and len(record["counts"][0]) == 17


def test_dense_reads_every_v_row_by_every_head():
    model = tiny_gqa_llama()
    recorder = VRowPopularity.for_model(model, 0, max_steps=4)
    generate(model, recorder, toptheta.Dense())
    counts = recorder.counts(0)
    for step in range(4):
        assert torch.all(counts[step, : 15 + step] == 3) and torch.all(counts[step, 15 + step:] == 0)


def test_bad_arguments_are_refused():
    model = tiny_gqa_llama()
    with pytest.raises(ValueError, match="layer must be in"):
        VRowPopularity.for_model(model, 2)
    with pytest.raises(ValueError, match="max_steps"):
        VRowPopularity(0, 2, max_steps=0)
    with pytest.raises(ValueError, match="group must be"):
        recorder = VRowPopularity.for_model(model, 0, max_steps=2)
        generate(model, recorder, toptheta.TopK(5, "post"))
        recorder.counts(5)


def test_sections_split_the_sessions_statistics_exactly():
    model = tiny_gqa_llama()
    with torch.no_grad(), toptheta.sparsify(model, toptheta.TopK(5, "post"), [toptheta.VMC()]) as stats:
        parts = []
        for seed, length in ((0, 10), (1, 30)):
            with stats.section() as part:
                ids = torch.randint(0, 97, (1, length), generator=torch.Generator().manual_seed(seed))
                model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            parts.append(part)
    for name, total in stats.state_dict().items():
        assert torch.equal(getattr(parts[0], name) + getattr(parts[1], name), total), name
    short, long = (p.summary()["kept_vrow_fraction"] for p in parts)
    assert long < stats.summary()["kept_vrow_fraction"] < short  # the pooled fraction hides the per-length ones

"""A tiny Llama model and a byte-level tokenizer, built in code (no downloads), for fast tests.

The tokenizer is byte-level BPE with no merges: every UTF-8 byte is one token, so any text
encodes, and the vocabulary is 256 bytes + 3 specials. Like Llama's, it prepends BOS.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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

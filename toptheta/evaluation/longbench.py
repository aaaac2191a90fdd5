"""LongBench (Bai et al. 2023) conventions that lm-eval's own LongBench tasks leave to the model wrapper.

The paper's LongBench runs ([R2], shared/docs/method.md §5) go through lm-eval's stock ``longbench`` tasks
(their prompts, generation budgets and metrics, e.g. Rouge-L for qmsum and gov_report), fed from our offline
copies (``tasks/longbench_docs.py``). Two of LongBench's rules (its `pred.py`) are not in those tasks and live here:

* the truncation rule: a prompt longer than `max_length` tokens keeps its first and last
  `max_length // 2` tokens, decoded back to text (the middle of the context goes), applied by
  ``longbench_lm.MiddleTruncatingHFLM``;
* chat templates are applied except for the few-shot / code subsets in `NO_CHAT_TEMPLATE`
  (``lm_eval_adapter`` reads it).
"""

from __future__ import annotations

from typing import Protocol, Sequence

# Few-shot and code subsets: LongBench feeds the raw prompt even to chat models.
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})


class Tokenizer(Protocol):
    """What the truncation needs; a Hugging Face tokenizer satisfies it."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def truncate_middle(prompt: str, tokenizer: Tokenizer, max_length: int, *,
                    skip_special_tokens: bool = True) -> str:
    """LongBench's rule: over `max_length` tokens, keep the first and last `max_length // 2`.

    The prompt is unchanged (not re-decoded) when it fits. Tokens are counted with
    `tokenizer.encode`, which for Hugging Face tokenizers includes the BOS token, as in
    LongBench's `tokenizer(prompt).input_ids`; special tokens are dropped when decoding, as in
    LongBench, unless `skip_special_tokens=False` (for an already chat-templated prompt).
    """
    ids = list(tokenizer.encode(prompt))
    if len(ids) <= max_length:
        return prompt
    half = max_length // 2
    return (tokenizer.decode(ids[:half], skip_special_tokens=skip_special_tokens)
            + tokenizer.decode(ids[-half:], skip_special_tokens=skip_special_tokens))

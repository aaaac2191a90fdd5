"""lm-eval's HFLM with LongBench's truncation: an over-long prompt loses its middle, not its head.

HFLM's generate_until keeps the last `max_length - max_gen_toks` tokens of a context (left
truncation), which for LongBench would cut the instruction at the top of every prompt. LongBench
(Bai et al. 2023, `pred.py`) keeps the first and the last half of the budget instead; this class
does that to each context before HFLM sees it, so HFLM's own truncation never fires (it stays as a
safety net). Loglikelihood requests are scored as BatchedHFLM scores them (which also keeps
batch_size="auto" from probing max_length-sized batches on CPU).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING

from ..compat import max_gen_toks
from .batched_lm import BatchedHFLM
from .longbench import truncate_middle

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance


class MiddleTruncatingHFLM(BatchedHFLM):
    """HFLM whose generate_until contexts over budget keep head and tail (see the module docstring).

    budget = max_length - max_gen_toks of the request: the room HFLM leaves for the prompt.
    Tokens are counted and cut with HFLM's own encoding (tok_encode: BOS added unless the text
    starts with it) and decoded keeping special tokens, so a chat-templated context keeps its
    role markers and the BOS kept at the head stops HFLM from adding a second one. For a plain
    prompt this is LongBench's rule exactly: BOS + first half - 1 tokens + last half tokens.
    """

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        fitted = []
        for request in requests:
            context, gen_kwargs, *rest = request.args
            budget = self.max_length - max_gen_toks(gen_kwargs, self.max_gen_toks)
            arguments = (self.fit_context(context, budget), gen_kwargs, *rest)
            fitted.append(dataclasses.replace(request, arguments=arguments))
        return super().generate_until(fitted, disable_tqdm=disable_tqdm)

    def fit_context(self, context: str, budget: int) -> str:
        """`context` cut to at most `budget` tokens by dropping its middle (unchanged if it fits).

        Re-encoding the joined head and tail can merge tokens differently at the seam; the rare
        excess is taken from the middle too, never from the ends.
        """
        if budget < 2:
            return context  # HFLM refuses such a configuration itself, with its own message
        tokens = SimpleNamespace(encode=self.tok_encode, decode=self.tok_decode)
        target = budget
        while True:
            fitted = truncate_middle(context, tokens, target, skip_special_tokens=False)
            excess = len(self.tok_encode(fitted)) - budget
            if excess <= 0 or target <= 2:
                return fitted
            target = max(2, target - excess)

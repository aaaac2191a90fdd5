"""LongBench (Bai et al. 2023) helpers: read a subset, build its prompt, truncate, score.

The paper's LongBench runs ([R2], shared/docs/method.md §5) use qmsum and gov_report with the
standard LongBench metric, Rouge-L. What here is LongBench's own convention (reproduced as facts,
from its `config/dataset2prompt.json`, `dataset2maxlen.json`, `pred.py` and `metrics.py`):

* the prompt templates of the English subsets and the generation budgets per subset;
* the truncation rule: a prompt longer than `max_length` tokens keeps its first and last
  `max_length // 2` tokens, decoded back to text (the middle of the context goes);
* chat templates are applied except for the few-shot / code subsets in `NO_CHAT_TEMPLATE`;
* scoring: max over the reference answers, mean over records, times 100, rounded to 2 places;
  trec / triviaqa / samsum / lsht score only the first line of the prediction;
* QA subsets: token F1 after normalisation (lowercase, drop punctuation, drop the articles
  a/an/the, collapse whitespace).

One deliberate difference: LongBench computes Rouge-L with the `rouge` package, which splits
texts into sentences at "." and takes a summary-level union LCS, with an F that uses
beta = P/R. We use Google's `rouge_score` `rougeL`: one LCS over the whole token sequence and
F1 = 2PR / (P + R), with LongBench's tokenisation (plain whitespace split, case kept, no
stemming). Both give the same value when P = R (e.g. identical texts: 1.0) and stay close
otherwise, but our numbers are not bit-identical to LongBench's published ones; comparisons
inside this project (dense vs sparse attention) are exact.
"""

from __future__ import annotations

import json
import os
import re
import string
from collections import Counter
from typing import Iterable, Protocol, Sequence

LONGBENCH_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")

_QA_HEAD = "Answer the question based on the given passages. Only give me the answer and do not output any other words."
PROMPT_TEMPLATES: dict[str, str] = {
    # "asconcisely" (sic) is LongBench's own text.
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "hotpotqa": _QA_HEAD + "\n\nThe following are given passages.\n{context}\n\n" + _QA_HEAD + "\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": _QA_HEAD + "\n\nThe following are given passages.\n{context}\n\n" + _QA_HEAD + "\n\nQuestion: {input}\nAnswer:",
    "musique": _QA_HEAD + "\n\nThe following are given passages.\n{context}\n\n" + _QA_HEAD + "\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# Ours, not LongBench's: for a subset without a template (e.g. a custom JSONL in the same schema).
GENERIC_TEMPLATE = ("Read the following text and answer the question.\n\n{context}\n\n"
                    "Now, answer the question based on the above text.\n\nQuestion: {input}\nAnswer:")

MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32,
    "musique": 32, "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32,
    "samsum": 128, "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}
GENERIC_MAX_NEW_TOKENS = 128

# Few-shot and code subsets: LongBench feeds the raw prompt even to chat models.
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# Subsets whose prediction is cut to its first line before scoring.
FIRST_LINE_ONLY = frozenset({"trec", "triviaqa", "samsum", "lsht"})

METRICS: dict[str, str] = {
    **{s: "qa_f1" for s in ("narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa",
                            "musique", "triviaqa")},
    **{s: "rouge_l" for s in ("gov_report", "qmsum", "multi_news", "samsum")},
}


class Tokenizer(Protocol):
    """What the truncation needs; a Hugging Face tokenizer satisfies it."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


def read_longbench(data_dir: str | os.PathLike, subset: str, limit: int | None = None) -> list[dict]:
    """Records of `<data_dir>/<subset>.jsonl` (LongBench's files), checked for the schema."""
    path = os.path.join(os.fspath(data_dir), f"{subset}.jsonl")
    if not os.path.isfile(path):
        found = sorted(f[:-6] for f in os.listdir(data_dir) if f.endswith(".jsonl")) \
            if os.path.isdir(data_dir) else []
        raise FileNotFoundError(f"no LongBench file {path}; subsets in {data_dir}: {found or 'none'}. "
                                "Point data_dir at a folder of LongBench <subset>.jsonl files.")
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            missing = [k for k in ("input", "context", "answers") if k not in record]
            if missing:
                raise ValueError(f"{path}:{line_no} lacks LongBench fields {missing}; "
                                 f"expected {list(LONGBENCH_FIELDS)}")
            if not isinstance(record["answers"], list):
                raise ValueError(f"{path}:{line_no}: 'answers' must be a list of strings")
            records.append(record)
            if limit is not None and len(records) >= limit:
                break
    return records


def prompt_template(subset: str) -> str:
    return PROMPT_TEMPLATES.get(subset, GENERIC_TEMPLATE)


def max_new_tokens(subset: str) -> int:
    return MAX_NEW_TOKENS.get(subset, GENERIC_MAX_NEW_TOKENS)


def build_prompt(record: dict, subset: str | None = None) -> str:
    """The subset's template filled with the record's context and input (before truncation)."""
    subset = subset or record.get("dataset") or ""
    return prompt_template(subset).format(context=record["context"], input=record.get("input", ""))


def prompt_budget(context_window: int, subset: str) -> int:
    """Tokens left for the prompt: the model's context window minus the generation budget."""
    budget = context_window - max_new_tokens(subset)
    if budget < 2:
        raise ValueError(f"context window {context_window} leaves no room for a prompt after "
                         f"{max_new_tokens(subset)} new tokens of {subset!r}")
    return budget


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


_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench / SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1_score(prediction: str, reference: str) -> float:
    """Token-level F1 between normalised prediction and reference, in [0, 1]."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


class _WhitespaceTokenizer:
    """LongBench's Rouge tokenisation: split on whitespace, keep case and punctuation."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


_rouge = None


def rouge_l_score(prediction: str, reference: str) -> float:
    """Rouge-L F1 over whitespace tokens (see the module docstring), in [0, 1]."""
    global _rouge
    if _rouge is None:
        try:
            from rouge_score import rouge_scorer
        except ImportError as e:
            raise ImportError("Rouge-L needs the `rouge-score` package: pip install rouge-score") from e
        _rouge = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False, tokenizer=_WhitespaceTokenizer())
    if not prediction.strip() or not reference.strip():
        return 0.0  # LongBench's `rouge` raises on empty text and scores it 0
    return _rouge.score(reference, prediction)["rougeL"].fmeasure


_METRIC_FUNCTIONS = {"qa_f1": qa_f1_score, "rouge_l": rouge_l_score}


def score_prediction(subset: str, prediction: str, answers: Sequence[str]) -> float:
    """Best metric value over the reference answers, in [0, 1]."""
    if subset not in METRICS:
        raise ValueError(f"no metric implemented for LongBench subset {subset!r}; implemented: "
                         f"{sorted(METRICS)}")
    if subset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = _METRIC_FUNCTIONS[METRICS[subset]]
    return max((metric(prediction, ref) for ref in answers), default=0.0)


def score_subset(subset: str, predictions: Sequence[str], answers: Iterable[Sequence[str]]) -> float:
    """LongBench's subset score: mean of per-record best scores, times 100, rounded to 2 places."""
    answers = list(answers)
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"need one prediction per record, got {len(predictions)} for {len(answers)}")
    total = sum(score_prediction(subset, p, a) for p, a in zip(predictions, answers))
    return round(100 * total / len(predictions), 2)

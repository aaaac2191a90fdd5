"""LongBench helpers: reading, prompts, head+tail truncation, Rouge-L and QA F1."""

import json
import re
from pathlib import Path

import pytest

from toptheta.evaluation.longbench import (MAX_NEW_TOKENS, PROMPT_TEMPLATES, build_prompt,
                                           max_new_tokens, normalize_answer, prompt_budget,
                                           qa_f1_score, read_longbench, rouge_l_score,
                                           score_prediction, score_subset, truncate_middle)

SHIPPED_MULTI_NEWS = Path(__file__).resolve().parents[1] / "toptheta" / "data" / "longbench" / "multi_news.jsonl.gz"


class PieceTokenizer:
    """Offline stand-in for a SentencePiece tokenizer: a piece is a word with its trailing
    whitespace, `encode` adds a BOS (id 0) and `decode` drops it when asked, like HF's."""

    def __init__(self):
        self.vocab: dict[str, int] = {"<s>": 0}

    def pieces(self, text: str) -> list[str]:
        return re.findall(r"\S+\s*|\s+", text)

    def encode(self, text: str) -> list[int]:
        return [0] + [self.vocab.setdefault(p, len(self.vocab)) for p in self.pieces(text)]

    def decode(self, ids, skip_special_tokens=False) -> str:
        inverse = {i: p for p, i in self.vocab.items()}
        return "".join(inverse[i] for i in ids if not (skip_special_tokens and i == 0))


def test_truncation_keeps_exactly_head_and_tail():
    tok = PieceTokenizer()
    prompt = " ".join(f"w{i}" for i in range(100))  # BOS + 100 pieces = 101 tokens
    pieces = tok.pieces(prompt)
    out = truncate_middle(prompt, tok, max_length=21)  # half = 10 tokens from each end
    assert out == "".join(pieces[:9]) + "".join(pieces[-10:])  # the head's first token is the BOS
    assert len(tok.encode(out)) == 1 + 19
    assert truncate_middle(prompt, tok, max_length=101) == prompt  # fits: returned untouched
    out = truncate_middle(prompt, tok, max_length=100)  # BOS + w0..w48, then w50..w99
    assert out.startswith("w0 ") and out.endswith("w99") and "w48 w50 " in out and "w49 " not in out


def test_prompts_and_generation_budgets():
    record = {"context": "CTX", "input": "Q?", "answers": ["a"]}
    assert build_prompt(record, "multi_news") == (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\nCTX"
        "\n\nNow, write a one-page summary of all the news.\n\nSummary:")
    assert build_prompt(record, "qmsum").endswith("Query: Q?\nAnswer:")
    assert build_prompt(record, "gov_report").startswith("You are given a report by a government agency.")
    assert "CTX" in build_prompt(record, "my_custom_subset") and "Q?" in build_prompt(record, "my_custom_subset")
    assert all("{context}" in t for t in PROMPT_TEMPLATES.values())
    assert max_new_tokens("multi_news") == max_new_tokens("qmsum") == max_new_tokens("gov_report") == 512
    assert MAX_NEW_TOKENS["hotpotqa"] == 32 and max_new_tokens("unknown") == 128
    assert prompt_budget(4096, "qmsum") == 3584
    with pytest.raises(ValueError, match="no room"):
        prompt_budget(512, "qmsum")


def test_qa_f1_with_longbench_normalisation():
    assert normalize_answer("The  Eiffel-Tower, in Paris!") == "eiffeltower in paris"
    assert qa_f1_score("The Eiffel Tower", "eiffel tower") == 1.0
    assert qa_f1_score("Paris, France", "Paris") == pytest.approx(2 / 3)
    assert qa_f1_score("London", "Paris") == 0.0
    assert qa_f1_score("", "Paris") == 0.0


def test_rouge_l_is_whitespace_lcs_f1():
    assert rouge_l_score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    # LCS("a b c d", "a c e") = "a c": P = 2/4, R = 2/3, F1 = 4/7.
    assert rouge_l_score("a b c d", "a c e") == pytest.approx(4 / 7)
    assert rouge_l_score("The cat.", "the cat.") == pytest.approx(0.5)  # case and punctuation kept
    assert rouge_l_score("", "anything") == 0.0


def test_subset_score_is_best_reference_mean_times_100():
    preds = ["a b c d", "x y"]
    answers = [["a c e", "a b c d"], ["z"]]
    assert score_prediction("qmsum", preds[0], answers[0]) == pytest.approx(1.0)
    assert score_subset("qmsum", preds, answers) == 50.0
    assert score_subset("hotpotqa", ["Paris, France"], [["Paris"]]) == 66.67
    assert score_prediction("samsum", "\nfirst line\nsecond line", ["first line"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no metric"):
        score_prediction("passage_count", "3", ["3"])
    with pytest.raises(ValueError, match="one prediction per record"):
        score_subset("qmsum", ["a"], [])


def test_reading_a_jsonl_subset(tmp_path):
    rows = [{"input": f"q{i}", "context": f"c{i}", "answers": [f"a{i}"], "length": 3, "dataset": "qmsum",
             "language": "en", "all_classes": None, "_id": str(i)} for i in range(3)]
    (tmp_path / "qmsum.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert read_longbench(tmp_path, "qmsum") == rows
    assert len(read_longbench(tmp_path, "qmsum", limit=2)) == 2
    with pytest.raises(FileNotFoundError, match=r"\['qmsum'\]"):
        read_longbench(tmp_path, "gov_report")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"input": "q"}) + "\n")
    with pytest.raises(ValueError, match="lacks LongBench fields"):
        read_longbench(tmp_path, "bad")


def test_shipped_multi_news_file(tmp_path):
    import gzip

    (tmp_path / "multi_news.jsonl").write_bytes(gzip.decompress(SHIPPED_MULTI_NEWS.read_bytes()))
    records = read_longbench(tmp_path, "multi_news")
    assert len(records) == 200
    assert all(r["dataset"] == "multi_news" and r["answers"] for r in records)
    prompt = build_prompt(records[0])  # subset taken from the record's `dataset`
    assert prompt.startswith("You are given several news passages.") and records[0]["context"] in prompt

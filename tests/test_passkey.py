"""Passkey records: deterministic, the needle where asked, lengths at the target, exact scoring."""

import re

import pytest

from toptheta.evaluation.passkey import (FILLER_SENTENCES, INTRO, NEEDLE, QUESTION,
                                         build_passkey_records, extract_passkey, passkey_accuracy,
                                         score_passkey, token_counter)


class WordPieceTokenizer:
    """Offline stand-in for a real tokenizer: words and punctuation marks are tokens, plus a BOS."""

    def encode(self, text: str) -> list[int]:
        return [0] + [hash(t) % 50_000 + 1 for t in re.findall(r"\w+|[^\w\s]", text)]


TOK = WordPieceTokenizer()


def needle_depth(prompt: str, key: str) -> float:
    """Fraction of the filler text (in characters) that comes before the needle."""
    body = prompt[len(INTRO):-len(QUESTION)]
    needle = NEEDLE.format(key=key).strip()
    at = body.index(needle)
    return at / max(1, len(body) - len(needle))


def test_same_seed_same_records_other_seed_other_records():
    a = build_passkey_records(TOK, lengths=(512,), depths=(0.3,), samples_per_cell=2, seed=7)
    b = build_passkey_records(TOK, lengths=(512,), depths=(0.3,), samples_per_cell=2, seed=7)
    c = build_passkey_records(TOK, lengths=(512,), depths=(0.3,), samples_per_cell=2, seed=8)
    assert a == b
    assert [r["prompt"] for r in a] != [r["prompt"] for r in c]
    assert a[0]["prompt"] != a[1]["prompt"]  # samples of one cell differ
    assert set(a[0]) >= {"id", "prompt", "answer", "length_tokens", "depth"}
    assert len({r["id"] for r in a + c}) == 2  # ids name the cell and sample, not the seed


def test_shared_filler_prompts_of_a_length_differ_only_from_the_key_on():
    depths = (0.1, 0.5, 0.9)
    shared = build_passkey_records(TOK, lengths=(1024,), depths=depths, seed=2, filler="shared")
    independent = build_passkey_records(TOK, lengths=(1024,), depths=depths, seed=2)
    assert independent == build_passkey_records(TOK, lengths=(1024,), depths=depths, seed=2, filler="independent")
    assert [r["answer"] for r in shared] == [r["answer"] for r in independent]  # the same keys, drawn first
    for record, depth in zip(shared, depths):
        head = record["prompt"][:record["prompt"].index("The pass key")]
        assert shared[-1]["prompt"].startswith(head)  # the deepest prompt's text holds every shorter prefix
        assert needle_depth(record["prompt"], record["answer"]) == pytest.approx(depth, abs=0.02)
    heads = [r["prompt"][:r["prompt"].index("The pass key")] for r in independent]
    assert not independent[-1]["prompt"].startswith(heads[1])  # independent orders share only the introduction
    with pytest.raises(ValueError, match="filler must be one of independent, shared"):
        build_passkey_records(TOK, lengths=(512,), filler="same")


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_needle_is_in_the_prompt_at_the_requested_depth(depth):
    (rec,) = build_passkey_records(TOK, lengths=(2048,), depths=(depth,), seed=1)
    key = rec["answer"]
    assert re.fullmatch(r"\d{5}", key)
    assert rec["prompt"].startswith(INTRO) and rec["prompt"].endswith(QUESTION)
    assert rec["prompt"].count(key) == 2  # stated twice in the needle, nowhere else
    assert needle_depth(rec["prompt"], key) == pytest.approx(depth, abs=0.02)
    assert not re.search(r"\d", " ".join(FILLER_SENTENCES))  # no competing numbers


@pytest.mark.parametrize("target", [1024, 4096, 16384])
def test_lengths_hit_the_target_within_one_sentence(target):
    (rec,) = build_passkey_records(TOK, lengths=(target,), depths=(0.5,), seed=3)
    assert rec["length_tokens"] == len(TOK.encode(rec["prompt"]))
    assert target - 16 <= rec["length_tokens"] <= target
    assert rec["target_tokens"] == target


def test_other_tokenizer_forms_and_errors():
    chars = build_passkey_records(lambda s: len(s), lengths=(3000,), depths=(0.5,))  # callable -> int
    assert 2900 <= chars[0]["length_tokens"] <= 3000
    words = token_counter(str.split)  # callable -> list
    assert words("a b  c") == 3
    with pytest.raises(TypeError, match="encode"):
        token_counter(42)
    with pytest.raises(ValueError, match="longer target"):
        build_passkey_records(TOK, lengths=(10,), depths=(0.5,))
    with pytest.raises(ValueError, match="depth"):
        build_passkey_records(TOK, lengths=(512,), depths=(1.5,))


def test_scorer_takes_the_first_number():
    assert extract_passkey("The pass key is 12345.") == "12345"
    assert score_passkey(" 12345. Remember it.", "12345")
    assert score_passkey("12345", 12345)
    assert not score_passkey("1234", "12345")
    assert not score_passkey("It is 54321, not 12345", "12345")
    assert not score_passkey("I do not know.", "12345")
    assert extract_passkey("none") is None
    records = [{"answer": "11111"}, {"answer": "22222"}]
    assert passkey_accuracy(records, ["11111", "nope"]) == 50.0
    with pytest.raises(ValueError, match="one generation per record"):
        passkey_accuracy(records, ["11111"])


def test_lengths_beyond_the_models_context_are_refused_with_the_lengths_that_fit():
    from toptheta.evaluation.generation import check_context

    task = {"kind": "passkey", "lengths": [1024, 4096, 16384]}
    with pytest.raises(ValueError, match=r"context of 8192.*task.lengths=\[1024, 4096\]"):
        check_context(task, 8192, "smollm2-135m")
    check_context(task, 32768, "qwen2.5-coder-0.5b")  # fits
    check_context(task, None, "unknown")  # no known context: nothing to check
    with pytest.raises(ValueError, match="task.max_length=2048"):
        check_context({"kind": "humaneval", "max_length": 4096}, 2048, "tiny")

"""HumanEval scoring on real problems from the installed package, with hand-written completions."""

import math
import sys

import pytest

from toptheta.evaluation.humaneval import (STOP_SEQUENCES, build_program, estimate_pass_at_k,
                                           evaluate_completions, extract_code, load_problems,
                                           pass_at_k, truncate_at_stop)
from toptheta.evaluation.sandbox import SandboxLimits

LIMITS = SandboxLimits(timeout_s=3.0)
CLOSE_OK = """    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if abs(a - b) < threshold:
                return True
    return False
"""
CLOSE_WRONG = "    return False\n"
TRUNCATE_OK = "    return number - int(number)\n"
TRUNCATE_WRONG = "    return number\n"


@pytest.fixture(scope="module")
def problems():
    return load_problems()


def test_all_164_problems_load_in_order(problems):
    assert len(problems) == 164
    assert list(problems)[:3] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert problems["HumanEval/0"].entry_point == "has_close_elements"
    assert list(load_problems(limit=2)) == ["HumanEval/0", "HumanEval/1"]
    with pytest.raises(ValueError, match="limit"):
        load_problems(limit=0)


def test_program_is_prompt_completion_test_check(problems):
    p = problems["HumanEval/2"]
    program = build_program(p, TRUNCATE_OK)
    assert program == p.prompt + TRUNCATE_OK + "\n" + p.test + "\n" + "check(truncate_number)\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
def test_pass_at_1_on_correct_and_incorrect_completions(problems):
    p0 = problems["HumanEval/0"]
    completions = {
        "HumanEval/0": [CLOSE_OK, CLOSE_WRONG, p0.canonical_solution],
        # The reference code writes prompt + continuation: the repeated def is harmless.
        "HumanEval/2": [problems["HumanEval/2"].prompt + TRUNCATE_OK, TRUNCATE_WRONG,
                        "    import sys\n    sys.exit(0)\n"],
    }
    report = evaluate_completions(problems, completions, ks=(1, 2, 3), limits=LIMITS)
    verdicts = {(r.task_id, r.sample_index): r.passed for r in report.results}
    assert verdicts == {("HumanEval/0", 0): True, ("HumanEval/0", 1): False, ("HumanEval/0", 2): True,
                        ("HumanEval/2", 0): True, ("HumanEval/2", 1): False, ("HumanEval/2", 2): False}
    assert report.num_problems == 2 and report.num_samples == 6
    assert report.pass_at_k[1] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert report.pass_at_k[2] == pytest.approx((1.0 + (1 - 1 / 3)) / 2)
    assert report.pass_at_k[3] == pytest.approx(1.0)
    assert report.to_dict()["pass_at_k"]["pass@1"] == pytest.approx(0.5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
def test_pairs_input_and_chat_answers(problems):
    chat = ("Sure! Here is the solution:\n\n```python\nfrom typing import List\n\n"
            "def has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
            + CLOSE_OK + "```\n\nThis runs in O(n^2).")
    pairs = [("HumanEval/0", extract_code(chat, "has_close_elements")), ("HumanEval/2", TRUNCATE_WRONG)]
    report = evaluate_completions(problems, pairs, limits=LIMITS)
    assert [r.passed for r in report.results] == [True, False]
    assert report.pass_at_k == {1: 0.5}


def test_bad_completions_input_is_rejected(problems):
    with pytest.raises(KeyError, match="HumanEval/0"):
        evaluate_completions(problems, {"HumanEval/999": ["x"]})
    with pytest.raises(TypeError, match="list of strings"):
        evaluate_completions(problems, {"HumanEval/0": "    return True\n"})
    with pytest.raises(ValueError, match="at least 2 samples"):
        pass_at_k({"HumanEval/0": [True]}, ks=(2,))


def test_truncation_at_stop_sequences():
    body = "    return number % 1.0\n"
    assert truncate_at_stop(body + "\n\ndef helper():\n    pass\n") == body + "\n"
    assert truncate_at_stop(body + "\nif __name__ == '__main__':\n    main()") == body
    assert truncate_at_stop(body + "\nprint(truncate_number(3.5))") == body
    assert truncate_at_stop(body + "\nclass Foo:\n    pass") == body
    assert truncate_at_stop(body + "\n# Example usage\n") == body
    kept = "    # an indented comment stays\n    x = 1\n    if x:\n        return x\n"
    assert truncate_at_stop(kept) == kept
    assert truncate_at_stop(body + "\ndefault = 3") == body + "\ndefault = 3"  # "\ndef " needs the space
    assert "\n#" in STOP_SEQUENCES


def test_extract_code_from_chat_answers():
    answer = ("First a helper:\n```python\ndef helper(x):\n    return x\n```\n"
              "Then the function:\n```python\ndef f(x):\n    return helper(x)\n```")
    assert extract_code(answer, "f") == "def f(x):\n    return helper(x)\n"
    assert extract_code(answer) == "def helper(x):\n    return x\n"
    assert extract_code("```\ndef f():\n    pass\n```", "f") == "def f():\n    pass\n"
    assert extract_code("    return 1\n") == "    return 1\n"  # bare code: unchanged
    assert extract_code("```python\ndef f():\n    return 2\n", "f") == "def f():\n    return 2\n"  # unclosed


def test_pass_at_k_estimator_values():
    assert estimate_pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert estimate_pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert estimate_pass_at_k(10, 0, 5) == 0.0
    assert estimate_pass_at_k(10, 10, 1) == 1.0
    assert estimate_pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples
    for n, c, k in [(20, 7, 5), (200, 13, 10), (7, 1, 7)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert estimate_pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)
    assert pass_at_k({"a": [True, False], "b": [False, False]}, ks=(1, 2)) == {1: 0.25, 2: 0.5}
    with pytest.raises(ValueError):
        estimate_pass_at_k(3, 4, 1)

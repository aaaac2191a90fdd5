"""The kernel registry: every way of computing one attention call, each a file of this package.

A backend is an object with a ``name``, a ``priority`` and two methods:

* ``refuse(call) -> str | None``: why it cannot serve this :class:`~.call.AttentionCall` (device, dtype, phase,
  sparsifier kind, placement, compensation, masks), or None when it can. ``supports(call)`` is
  ``refuse(call) is None``. Cheap checks first; a backend that needs a compiled module builds it last.
* ``run(call) -> Tensor``: the output (B, Q, H, Dv) in the query's dtype, the statistics recorded into
  ``call.stats`` when ``call.counting``.

Each module here defines ``BACKEND`` (or nothing, when its kernels are absent: see ``triton.py``). The modules are
found on first use (no central list), and :func:`register` adds one from anywhere (a test, a plugin). For each call
the registry asks the backends in order of decreasing priority and the first that supports the call runs it;
``kernel.py``'s plain torch kernel (``plain.py``, priority 0) supports every call and is the reference the others are
tested against. ``TOPTHETA_BACKEND=<name>`` forces one backend: a call it refuses raises its reason.

Which backend ran is logged once per backend and statistics session, and counted in ``SparsityStats.backend_calls``.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from .call import AttentionCall, forced_backend

log = logging.getLogger("toptheta")


class Backend:
    """Base class of the backends here (any object with these four members can be registered)."""

    name: str = ""
    priority: int = 0

    def refuse(self, call: AttentionCall) -> str | None:
        """Why this backend cannot serve ``call``, or None."""
        raise NotImplementedError

    def supports(self, call: AttentionCall) -> bool:
        return self.refuse(call) is None

    def run(self, call: AttentionCall):
        """The output (B, Q, H, Dv) in the query's dtype; statistics recorded into ``call.stats``."""
        raise NotImplementedError


_REGISTRY: dict[str, Backend] = {}
_ORDER: list[Backend] = []  # _REGISTRY by decreasing priority, rebuilt when it changes (asked on every call)
_DISCOVERED = False
_LOGGED: set[str] = set()  # backends announced without a statistics object


def register(backend: Backend) -> Backend:
    """Add (or replace, by name) a backend; returns it."""
    _REGISTRY[backend.name] = backend
    _ORDER.clear()
    return backend


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    _ORDER.clear()


def backends() -> list[Backend]:
    """Every registered backend, highest priority first."""
    _discover()
    if not _ORDER:
        _ORDER.extend(sorted(_REGISTRY.values(), key=lambda b: -b.priority))
    return list(_ORDER)


def get(name: str) -> Backend:
    _discover()
    if name not in _REGISTRY:
        raise ValueError(f"TOPTHETA_BACKEND={name!r} names no attention backend; known: {', '.join(sorted(_REGISTRY))} "
                         "(or unset it / 'auto' to let the registry choose)")
    return _REGISTRY[name]


def supports(backend: Backend, call: AttentionCall) -> bool:
    return backend.refuse(call) is None


def choose(call: AttentionCall) -> Backend:
    """The backend that runs ``call``: the forced one (or an error naming why it cannot), else the first that can."""
    name = forced_backend()
    if name is not None:
        backend = get(name)
        call.forced = True
        reason = backend.refuse(call)
        if reason is not None:
            B, H, Hkv, Q, K = call.shape
            raise RuntimeError(f"TOPTHETA_BACKEND={name} cannot serve this attention call ({call.kind} "
                               f"{call.placement or ''} {call.phase}, {call.query.dtype} on {call.device}, B={B} H={H} "
                               f"Hkv={Hkv} Q={Q} K={K}): {reason}. Unset TOPTHETA_BACKEND to let the registry choose")
        return backend
    if not _DISCOVERED or not _ORDER:
        backends()
    for backend in _ORDER:
        if backend.refuse(call) is None:
            return backend
    raise RuntimeError("no attention backend serves this call (the plain backend should serve every call)")


def dispatch(call: AttentionCall):
    """Run ``call`` on the chosen backend, counting the choice in the statistics."""
    backend = choose(call)
    stats = call.stats
    if stats is not None and stats.enabled:
        if stats.record_backend(backend.name):
            log.info("toptheta: attention backend %r serves %s %s calls (layer %d first, %s on %s)", backend.name,
                     call.kind, call.phase, call.layer, call.query.dtype, call.device)
    elif backend.name not in _LOGGED:
        _LOGGED.add(backend.name)
        log.info("toptheta: attention backend %r serves %s %s calls", backend.name, call.kind, call.phase)
    return backend.run(call)


def _discover() -> None:
    """Import every module of this package once; each that defines ``BACKEND`` registers it."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    _DISCOVERED = True
    for info in pkgutil.iter_modules(__path__):
        if info.name == "call":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        backend = getattr(module, "BACKEND", None)
        if backend is not None and backend.name not in _REGISTRY:
            register(backend)


__all__ = ["AttentionCall", "Backend", "backends", "choose", "dispatch", "get", "register", "supports", "unregister"]

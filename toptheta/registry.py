"""Name -> class registries: how a setting names a sparsifier or a compensation, with no central list to edit.

A class joins with a decorator in its own file (``@SPARSIFIERS.register("topk")``); the config checks, the builders,
``toptheta-eval`` and the figure labels ask the registry. Importing ``toptheta`` imports the built-in classes, so they
are registered; a user's class (or a test's) is registered when its module runs. Nothing here imports anything else
of toptheta (a floor every layer can build on).
"""

from __future__ import annotations

from collections.abc import Callable


class Registry:
    """Classes by name, in the order they registered."""

    def __init__(self, kind: str):
        self.kind = kind
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: register the class under ``name`` (sets ``cls.name``); a name registers once."""
        def add(cls: type) -> type:
            if name in self._classes and self._classes[name] is not cls:
                raise ValueError(f"{self.kind} {name!r} is registered already ({self._classes[name].__qualname__}); "
                                 "pick another name")
            cls.name = name
            self._classes[name] = cls
            return cls
        return add

    def unregister(self, name: str) -> None:
        self._classes.pop(name, None)

    def get(self, name: str) -> type:
        if name not in self._classes:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self._classes)}")
        return self._classes[name]

    def names(self) -> list[str]:
        return list(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes


SPARSIFIERS = Registry("sparsifier")
COMPENSATIONS = Registry("compensation")

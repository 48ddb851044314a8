"""Name -> method class. A new method adds itself with `@register`."""

from __future__ import annotations

import importlib
import pkgutil

from kvstack.errors import unknown_name
from kvstack.methods.base import Stage

METHODS: dict[str, type[Stage]] = {}
# folders of methods/
FAMILIES = ("evict", "learned", "retrieve", "allocate", "quantize", "merge", "lowrank", "crosslayer")
_LOADED: list[bool] = []


def register(cls: type[Stage]) -> type[Stage]:
    """Class decorator: make a method available by its `name` in specs and the CLI."""
    METHODS[cls.name] = cls
    return cls


def method_class(name: str) -> type[Stage]:
    """The class registered under `name`, or a one-line error naming the closest ones."""
    _load_all()
    if name not in METHODS:
        raise unknown_name("method", name, list(METHODS))
    return METHODS[name]


def provider(statistic: str) -> Stage:
    """A stage, with its defaults, whose `prompt_done` hook records `statistic` (KVzip's
    "reconstruction"), for a cache that observes it without such a stage in its stack."""
    _load_all()
    for cls in METHODS.values():
        if statistic in cls.provides:
            return cls()
    raise ValueError(f"no method records the statistic {statistic!r}")


def all_methods() -> dict[str, type[Stage]]:
    """Every registered method, by name."""
    _load_all()
    return dict(sorted(METHODS.items()))


def _load_all() -> None:
    """Import every module of the method families once (each registers its stages) and `auto`:
    the plugin catalog, the one place that loads every method by name. A new method is a new
    file in its family's folder; nothing lists it."""
    if _LOADED:
        return
    for family in FAMILIES:
        package = importlib.import_module(f"kvstack.methods.{family}")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
    import kvstack.planning.auto  # noqa: F401  (registers `auto`, the rate-distortion planner)

    _LOADED.append(True)

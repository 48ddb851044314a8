"""Name -> method class. A new method adds itself with `@register`."""

from __future__ import annotations

from kvstack.errors import unknown_name
from kvstack.methods.base import Stage

METHODS: dict[str, type[Stage]] = {}


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


def all_methods() -> dict[str, type[Stage]]:
    """Every registered method, by name."""
    _load_all()
    return dict(sorted(METHODS.items()))


def _load_all() -> None:
    import kvstack.methods.allocate  # noqa: F401  (registers the budget allocators)
    import kvstack.methods.auto  # noqa: F401  (registers `auto`, the rate-distortion planner)
    import kvstack.methods.crosslayer  # noqa: F401  (registers the cross-layer stages)
    import kvstack.methods.evict  # noqa: F401  (registers the eviction family)
    import kvstack.methods.lowrank  # noqa: F401  (registers the low-rank stages)
    import kvstack.methods.merge  # noqa: F401  (registers the merging family)
    import kvstack.methods.quantize  # noqa: F401  (registers the quantizers)

"""A stack: compression stages applied together under one budget, written as a spec string.

`snapkv`, `streaming(sinks=4)`, `h2o(recent=0.25, every=1)`; an allocator or a re-scorer takes
the stage it wraps as its first argument: `pyramid(snapkv)`, `adakv(keydiff, alpha=0.1)`,
`pyramid(adakv(snapkv))`. Stages are joined with `+` (`snapkv+kivi(bits=2)` once quantizers
exist). Parsing is pure: text -> dataclasses.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import MISSING, dataclass, fields
from functools import cached_property
from typing import Any

from kvstack.cache.budget import Budget
from kvstack.errors import UserError, unknown_name
from kvstack.methods.allocate.base import Allocator
from kvstack.methods.base import RANGES, SELECTION, Method, Stage
from kvstack.methods.lowrank.base import Projected, Projector, can_follow_projection
from kvstack.methods.registry import method_class


@dataclass(frozen=True)
class Stack:
    """The parsed stages of a spec; at most one selection stage (an evictor, maybe wrapped).

    What the stages' structure says (evictor, quantizer, needs, ...) is worked out once and kept
    (`cached_property`): the cache reads it at every layer of every decoding step."""

    stages: tuple[Stage, ...]

    @classmethod
    def parse(cls, spec: str) -> Stack:
        """Parse a spec such as `streaming(sinks=4)`; errors are one line naming the fix."""
        text = spec.strip()
        if not text:
            raise UserError("empty method spec: give a method name such as snapkv (see `kvstack methods`)")
        if len(text) > MAX_SPEC:
            raise UserError(f"method spec of {len(text)} characters: write one of at most {MAX_SPEC}")
        if text.startswith("plan:"):  # a plan saved by `kvstack plan --save`, its path maybe quoted
            path = text[5:].strip()
            if path[:1] in ("'", '"'):
                path = _value("plan", "path", path)  # type: ignore[assignment]
            if not isinstance(path, str) or not path.strip():
                raise UserError("plan: needs a path: plan:p.json (a plan written by `kvstack plan --save`)")
            return cls((_parse_stage(f"auto(plan={path!r})"),))
        stages = tuple(_parse_stage(part) for part in _split_top(text, "+"))
        if len(stages) > 1 and any(s.plays("planner") for s in stages):
            raise UserError(f"'{spec}': auto chooses the whole stack (scorers, tokens, bits): use it alone")
        evictors = [s for s in stages if s.family in SELECTION]
        if len(evictors) > 1:
            names = " + ".join(s.name for s in evictors)
            raise UserError(f"'{spec}' stacks two eviction methods ({names}): keep one")
        storing = [p for s in stages for p in s.chain() if p.plays("storer")]
        projectors = [p for p in storing if isinstance(p, Projector)]
        quantizers = [p for p in storing if not isinstance(p, Projector)]
        for kind, found in (("quantizers", quantizers), ("projections (low-rank or rotation)", projectors)):
            if len(found) > 1:
                raise UserError(f"'{spec}' stacks two {kind} ({' + '.join(q.name for q in found)}): keep one")
        if projectors and quantizers:
            projector, quantizer = projectors[0], quantizers[0]
            if not projector.codes_coefficients:
                raise UserError(
                    f"'{spec}': {projector.name} keeps per-chunk factors, not coefficients on fixed axes, so no "
                    f"quantizer can code them: drop {quantizer.name} (snapkv+{projector.name})"
                )
            why = can_follow_projection(quantizer) if quantizer.family == "quantize" else "it is an evictor"
            if why:
                raise UserError(
                    f"'{spec}': {quantizers[0].name} cannot code {projectors[0].name}'s coefficients ({why}): "
                    "use kivi, int, adaquant, quantile or gear with a projection"
                )
        joiners = [s for s in stages if s.plays("joiner")]
        if len(joiners) > 1:
            raise UserError(f"'{spec}' stacks two cross-layer stages: keep one")
        stack = cls(stages)
        retriever = stack.retriever
        if retriever is not None and (storing or joiners):
            other = (storing or joiners)[0].name
            raise UserError(
                f"'{spec}': {retriever.name} keeps the tokens it lets go in full precision in its slow tier, which "
                f"{other} cannot code yet: drop {other}"
            )
        if stack.merger is not None and stack.compensates:
            raise UserError(f"'{spec}': razor's compensation token and merging both fold evicted tokens: keep one")
        if (storing or joiners) and stack.compensates:
            raise UserError(
                f"'{spec}': razor's compensation token cannot average encoded tokens: "
                f"use razor(..., compensate=False) with a {'quantizer' if storing else 'cross-layer stage'}"
            )
        return stack

    @cached_property
    def selection(self) -> list[Stage]:
        """The selection stage and everything it wraps, outermost first (allocators, then the scorer)."""
        for stage in self.stages:
            if stage.family in SELECTION and stage.family != "reference":
                return stage.chain()
        return []

    @cached_property
    def evictor(self) -> Method | None:
        """The method whose scores decide which tokens to keep, or None for `full`."""
        for stage in self.selection:
            if isinstance(stage, Method):
                return stage if stage.compresses else None
        return None

    @cached_property
    def retriever(self) -> Any:
        """The stage that moves what it does not keep resident to a slow tier and retrieves from it
        at each attention call (`methods/retrieve/`), or None."""
        return next((s for s in self.selection if s.plays("retriever")), None)

    @property
    def cadence(self) -> Method | None:
        """The method whose `every` and `decode_window` the cache follows while decoding: the
        evictor, or for a re-scorer such as `graphkv(snapkv)` the scorer it wraps (so it
        re-scores as rarely as snapkv does)."""
        method = self.evictor
        while method is not None and method.cadence_from_inner and isinstance(method.inner, Method):
            method = method.inner
        return method

    @property
    def every(self) -> int | None:
        """Decoding steps between compressions (None: a block the cache chooses, `decode_block`). A
        merging stack folds each token into a kept one as it leaves, so it keeps a cadence of 1:
        a block would fold tokens before their time."""
        every = self.cadence.every if self.cadence is not None else 1
        return 1 if every is None and self.merger is not None else every

    @property
    def decode_window(self) -> int:
        """Newest tokens never evicted while decoding."""
        return self.cadence.decode_window if self.cadence is not None else 0

    @cached_property
    def quantizer(self) -> Any:
        """What decides how kept tokens are stored (a `Quantizer`, MiKV, a low-rank `Projector`, or
        a projector whose coefficients a quantizer codes), or None."""
        storing = [part for stage in self.stages for part in stage.chain() if part.plays("storer")]
        if len(storing) == 2:
            projector = next(p for p in storing if isinstance(p, Projector))
            return Projected(projector, next(p for p in storing if p is not projector))
        return storing[0] if storing else None

    @cached_property
    def merger(self) -> Any:
        """The selection stage that merges the tokens it leaves out into kept ones, or None."""
        return next((s for s in self.selection if s.plays("merger")), None)

    @cached_property
    def joiner(self) -> Any:
        """The cross-layer stage that joins adjacent layers' states (MiniCache, xKV), or None."""
        return next((s for s in self.stages if s.plays("joiner")), None)

    @property
    def demotes(self) -> bool:
        """True when tokens the selection leaves out are kept at low precision (MiKV), not evicted."""
        return self.evictor is not None and self.evictor.plays("demoter")

    @property
    def compensates(self) -> bool:
        """True when evicted tokens are averaged into a compensation token per head (RazorAttention)."""
        return any(s.plays("folder") for s in self.selection)

    @cached_property
    def allocators(self) -> list[Allocator]:
        """The budget allocators around the evictor, outermost first."""
        return [s for s in self.selection if s.plays("allocator")]  # type: ignore[misc]

    @cached_property
    def planner(self) -> Any:
        """The stage that plans the whole stack per head (`auto`), or None."""
        return next((s for s in self.selection if s.plays("planner")), None)

    @property
    def whole_prompt(self) -> bool:
        """True when an allocator needs every layer's view of the prompt before compressing."""
        return any(a.whole_prompt for a in self.allocators)

    @cached_property
    def parts(self) -> list[Stage]:
        """Every stage of the stack and every stage they wrap, outermost first."""
        return [part for stage in self.stages for part in stage.chain()]

    @cached_property
    def needs(self) -> frozenset[str]:
        """Statistics the attention pass must record for this stack."""
        return frozenset().union(*(part.needs for s in self.stages for part in s.chain()))

    @cached_property
    def query_window(self) -> int:
        return max((getattr(p, "query_window", 0) for s in self.stages for p in s.chain()), default=0)

    @property
    def min_tokens(self) -> int:
        return max((s.min_tokens for s in self.stages if getattr(s, "compresses", False)), default=1)

    def check_budget(self, budget: Budget) -> None:
        """One-line error when a token budget is below what this stack needs per head."""
        if budget.tokens is not None and self.evictor is not None and budget.tokens < self.min_tokens:
            raise UserError(f"budget {budget} is below what {self.evictor.name} needs: use at least {self.min_tokens}t")
        q = self.quantizer
        if q is not None and budget.tokens is not None and q.residual > budget.tokens:
            raise UserError(
                f"{q.name}'s residual window ({q.residual} tokens) is larger than the budget {budget}: "
                f"use {q.name}(residual={budget.tokens}) or a larger budget"
            )

    def __str__(self) -> str:
        return "+".join(_format_stage(s) for s in self.stages)

    @property
    def label(self) -> str:
        """The spec with only the parameters that differ from their defaults: `snapkv`, `streaming(sinks=8)`."""
        return "+".join(_format_stage(s, changed_only=True) for s in self.stages)


MAX_SPEC = 2000  # characters in one method spec
MAX_DEPTH = 8  # stages wrapping stages: pyramid(adakv(snapkv)) is 3
OPENING = {"(": ")", "[": "]", "{": "}"}
BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]*")  # a value written without quotes: kvzip, p.json
MAX_INT = 2**31 - 1  # no count or cadence of a stage comes near it


def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside brackets and quoted strings; one-line error when they do not close."""
    parts: list[str] = []
    cur: list[str] = []
    closing: list[str] = []
    quote, escaped = "", False
    for ch in text:
        if quote:
            escaped, quote = (not escaped and ch == "\\"), ("" if ch == quote and not escaped else quote)
        elif ch in "'\"":
            quote = ch
        elif ch in OPENING:
            closing.append(OPENING[ch])
        elif ch in ")]}":
            if not closing or closing.pop() != ch:
                raise UserError(f"unbalanced '{ch}' in method spec '{text}'")
        elif ch == sep and not closing:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if quote:
        raise UserError(f"unclosed quote {quote} in method spec '{text}'")
    if closing:
        raise UserError(f"unbalanced parentheses in method spec '{text}'")
    return [*parts, "".join(cur)]


def _parse_stage(text: str, depth: int = 1) -> Stage:
    text = text.strip()
    if depth > MAX_DEPTH:
        raise UserError(f"method spec nests stages more than {MAX_DEPTH} deep: wrap at most {MAX_DEPTH} stages")
    name, _, rest = text.partition("(")
    name = name.strip().lower()
    if not name:
        raise UserError(f"empty stage in method spec near '{text}'")
    cls = method_class(name)
    kwargs: dict[str, object] = {}
    if rest:
        if not rest.rstrip().endswith(")"):
            raise UserError(f"stage '{text}' must end with ')'")
        body = rest.rstrip()[:-1].strip()
        declared = {f.name: f for f in fields(cls)}
        items = _split_top(body, ",") if body else []
        if items and not items[-1].strip():  # a trailing comma, as Python allows
            items.pop()
        for i, item in enumerate(items):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq or "(" in key:
                if i == 0 and "scorer" in declared:  # the wrapped stage: pyramid(snapkv)
                    kwargs["scorer"] = _parse_stage(item, depth + 1)
                    continue
                raise UserError(f"{name}: parameters are written key=value, got '{item.strip()}'")
            if key == "scorer" and "scorer" in declared:
                kwargs["scorer"] = _parse_stage(raw, depth + 1)
                continue
            if key not in declared:
                raise unknown_name(f"parameter of {name}", key, list(declared))
            if key in kwargs:
                raise UserError(f"{name}: {key} is given twice")
            kwargs[key] = typed(name, key, str(declared[key].type), _value(name, key, raw.strip()))
    try:
        return cls(**kwargs)  # type: ignore[arg-type]
    except (ValueError, TypeError) as err:
        raise UserError(str(err)) from None


def _value(stage: str, key: str, raw: str) -> object:
    """A parameter's value: a Python literal (number, 'string', True, (tuple)) or a bare word."""
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        if BARE.fullmatch(raw):
            return raw
        raise UserError(
            f"{stage}: cannot read {key}={raw[:40]}: write a number, True/False, a 'string' or a (tuple)"
        ) from None


def typed(stage: str, key: str, kind: str, value: object) -> object:
    """`value` checked against the field's declared type (`int`, `float`, `bool`, `str`, `int | None`,
    `tuple[str, ...]`, `tuple[int, ...]`); one-line error naming the parameter, the value and what
    it takes. An int is a float; a lone string is a one-element tuple of strings."""
    shown = repr(value) if not isinstance(value, str) else f"'{value[:40]}'"
    optional = kind.endswith(" | None")
    base = kind.removesuffix(" | None")
    if value is None and optional:
        return None
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{stage}: {key} must be an integer{' or None' if optional else ''}, got {shown}")
        low, high = RANGES.get(key, (-MAX_INT, MAX_INT))
        if not low <= value <= high:
            raise UserError(f"{stage}: {key}={value} is out of range: give an integer from {low} to {high}")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise UserError(f"{stage}: {key} must be a number, got {shown}")
        if not math.isfinite(value):
            raise UserError(f"{stage}: {key} must be a finite number, got {shown}")
        return value  # an int stays an int, so the label prints what was written
    if base == "bool":
        if not isinstance(value, bool):
            raise UserError(f"{stage}: {key} must be True or False, got {shown}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise UserError(f"{stage}: {key} must be a string, e.g. {key}='...', got {shown}")
        return value
    if base.startswith("tuple["):
        item = base.removeprefix("tuple[").split(",")[0]
        values = (value,) if isinstance(value, str) and item == "str" else value
        if not isinstance(values, tuple | list):
            raise UserError(f"{stage}: {key} must be a tuple, e.g. {key}=(...), got {shown}")
        return tuple(typed(stage, key, item, v) for v in values)
    return value


def _format_stage(stage: Stage, changed_only: bool = False) -> str:
    params = stage.params()
    if changed_only:
        defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory() for f in fields(stage)}
        params = {k: v for k, v in params.items() if v != defaults[k] or k == "scorer"}
    if not params:
        return stage.name
    inner = params.pop("scorer", None)
    args = [_format_stage(inner, changed_only)] if isinstance(inner, Stage) else []
    args += [f"{k}={v!r}" for k, v in params.items()]
    return f"{stage.name}({', '.join(args)})"

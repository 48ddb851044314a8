"""How the reuse task joins documents cached apart: named modes, each with options one may set.

`--modes kvlink,relay(tokens=64),kvlink(link=128,sink=4)`: a mode is a name from `JOINS`, optionally
with integer options in parentheses that override its defaults, so a sweep can measure how many
recomputed tokens a join needs (`kvstack.reuse.kvlink.join`'s `link`, `relay` and `sink`; `reencode`
0 or 1). The mode's text, options included, names its rows in the results.
"""

from __future__ import annotations

import re
from typing import Any

from kvstack.errors import UserError, unknown_name

JOINS: dict[str, dict[str, int]] = {
    "kvlink": {"reencode": 1},  # KVLink: positions re-encoded
    "concat": {"reencode": 0},  # the caches concatenated as they are
    "kvlink+link": {"reencode": 1, "link": 8},  # and each later document's last 8 tokens recomputed
    "relay": {"reencode": 1, "relay": 16},  # RelayCaching: each later document's first 16 recomputed
    "kvcomm": {},  # KVCOMM: each later document corrected by its deviation after another prefix
    "kvlink+sink": {"reencode": 1, "sink": 4},  # each later document cached after the prompt's first 4 tokens
}
OPTIONS = ("reencode", "link", "relay", "sink")  # `kvlink.join`'s, for every mode but kvcomm
ALIASES = {"tokens": "relay"}  # relay(tokens=64): RelayCaching's own word
_SPEC = re.compile(r"^([a-z+]+)(?:\((.*)\))?$")


def join_options(mode: str) -> dict[str, int] | None:
    """The options of `kvlink.join` a join mode stands for, or None for a mode that joins nothing
    (`agnostic`, `aware`); a malformed mode, an unknown option or a negative count is one line."""
    match = _SPEC.match(mode.replace(" ", ""))
    if match is None or match.group(1) not in JOINS:
        if match is not None and match.group(1) in ("agnostic", "aware") and match.group(2) is None:
            return None
        raise unknown_name("mode", mode.partition("(")[0], ["agnostic", "aware", *JOINS])
    name, body = match.groups()
    options = dict(JOINS[name])
    for item in filter(None, (body or "").split(",")):
        key, _, value = item.partition("=")
        key = ALIASES.get(key, key) if name == "relay" else key
        if name == "kvcomm" or key not in OPTIONS:
            allowed = "none" if name == "kvcomm" else ", ".join(OPTIONS)
            raise UserError(f"mode {mode}: unknown option {key!r} (options of {name}: {allowed})")
        if not value.isdigit():
            raise UserError(f"mode {mode}: {key} takes a whole number of tokens >= 0, e.g. {name}({key}=64)")
        options[key] = int(value)
    return options


def join_name(mode: str) -> str:
    """The mode's name without its options: `relay(tokens=64)` -> `relay`."""
    return mode.partition("(")[0].strip()


def is_join(mode: str) -> bool:
    """Whether `mode` joins documents cached apart (the reuse task's modes)."""
    return join_options(mode) is not None


def join_arguments(mode: str) -> dict[str, Any]:
    """Keyword arguments of `kvlink.join` for a join mode other than kvcomm."""
    options = join_options(mode) or {}
    return {k: bool(v) if k == "reencode" else v for k, v in options.items()}

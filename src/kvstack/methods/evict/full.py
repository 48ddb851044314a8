"""`full`: the uncompressed reference; nothing is ever evicted."""

from __future__ import annotations

from dataclasses import dataclass

from kvstack.methods.base import Method
from kvstack.methods.registry import register


@register
@dataclass
class Full(Method):
    """Keep every token: the reference every method is measured against."""

    name = "full"
    family = "reference"
    paper = "-"

    @property
    def compresses(self) -> bool:
        return False

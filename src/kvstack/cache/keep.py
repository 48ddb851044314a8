"""A decision the cache executes: which held tokens each head of a layer keeps (plain data)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Keep:
    """A decision for one layer: per head, the held tokens to keep.

    index: (b, h, k) positions in the layer's dense view, sorted by slot, with the real
    entries first; count: (b, h) how many entries of `index` are real.
    """

    index: torch.Tensor
    count: torch.Tensor

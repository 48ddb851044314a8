"""Building blocks for tests: a hand-filled layer, and generation through the kvstack loop."""

from __future__ import annotations

import torch

from kvstack.cache.layer import CompressedLayer
from kvstack.cache.sequence import SequenceState
from kvstack.generate import Prompt, generate_ids
from kvstack.methods.base import Observation


def layer_with(
    keys: torch.Tensor, values: torch.Tensor | None = None, groups: int = 1, queries: torch.Tensor | None = None
) -> CompressedLayer:
    """A layer holding keys (b, h, t, d) at slots 0..t-1, optionally with observed queries (b, h*g, w, d)."""
    b, h, t, d = keys.shape
    layer = CompressedLayer(0, 1, h, groups, d**-0.5, None, SequenceState())
    layer.append(keys, values if values is not None else torch.zeros_like(keys), torch.arange(t))
    if queries is not None:
        w = queries.shape[2]
        layer.observe_queries(queries, torch.arange(t - w, t), w)
    return layer


def observe(layer: CompressedLayer, keep: int) -> Observation:
    return Observation(layer, torch.full((layer.batch, layer.n_kv_heads), keep), layer.seq.token_index())


def ids_of(model, rows, method="full", budget=1.0, agnostic=False, new=12):
    prompts = [Prompt(context=c, question=q) for c, q in rows]
    return generate_ids(model, prompts, method, budget, agnostic, new, eos_ids=set(), pad_id=0)

"""Building blocks for tests: a hand-filled layer, and generation through the kvstack loop."""

from __future__ import annotations

import torch

from kvstack.cache.cache import KVCache
from kvstack.cache.encoded import Where
from kvstack.cache.layer import CompressedLayer
from kvstack.cache.levels import LevelCodes
from kvstack.cache.packed import Packed
from kvstack.cache.sequence import SequenceState
from kvstack.generate import Prompt, Runner, generate_ids
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


def decoded_logits(model, spec, budget, kernel, monkeypatch, padded=True):
    """Logits of a batch of two (the first padded by 20), prefilled then decoded 16 tokens, with or
    without the native kernels; and whether a kernel read some layer's codes."""
    monkeypatch.setenv("KVSTACK_KERNELS", "1" if kernel else "0")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 97, (2, 90), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :20] = 0 if padded else 1
    cache = KVCache(model, spec, budget)
    runner = Runner(model, cache)
    out = [runner.forward(ids, mask)]
    for _ in range(16):
        out.append(runner.forward(torch.randint(3, 97, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.long)))
    read = [p for layer in cache.layers for h in range(layer.n_kv_heads) for p in layer.head_parts(h)[0]]
    read += [p for layer in cache.layers for p in (layer.layer_kv() or ([], []))[0]]
    return torch.stack(out), any(isinstance(p, Packed | LevelCodes) for p in read)


def coded_heads(codec, b, h, n, d, keep, seed):
    """h heads' parts of n random tokens each, coded by `codec`, thinned to `keep` tokens when given."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for head in range(h):
        x = torch.randn(b, n, d, generator=g) * 3 + torch.randn(1, 1, d, generator=g)
        enc = codec.encode(x.to(torch.bfloat16), Where(0, head, "key"))
        if keep:  # the same positions in every head, so the parts stay alike
            index = torch.sort(torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:keep]).values
            enc = enc.take(index.expand(b, -1))
        parts.append(enc)
    return parts

"""Distortion curves: how much each head's attention output moves when it keeps a fraction of
its tokens, picked by a scorer, stored by an option, measured once per model on prose.

For each calibration row the model reads `tokens` tokens of State of the Union prose in which
three spans of `NEEDLE` tokens drawn at random from the row sit at a quarter, half and three
quarters of the context; then probes: the text's own continuation (what fidelity asks) and, per
span, KVzip's "repeat the part of the context starting with ..." followed by the words before
the span and the span itself (what retrieval asks: prose a model can continue from its own
recent tokens, a random span only by attending back to it, as HeadKV's calibration recalls
random ids). The probes' queries attend to the context held by each head; distortion is the
squared error of the head's attention output, normalised by the layer's output energy for that
probe (so heads of a layer add up), averaged over the probes.
"""

from __future__ import annotations

from typing import Any

import torch

from kvstack.cache.encoded import Where
from kvstack.methods.base import Method, Observation
from kvstack.planning.options import Storage, codecs, coded_count

FRACTIONS = tuple(2 ** (-k / 2) for k in range(19))  # tokens kept per head: 1 down to 1/512
NEEDLE = 16  # tokens per random span the retrieval probes recall
LEAD = 8  # context tokens before a span that a retrieval probe repeats first


def attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """(q, d) softmax(Q K^T scale) V for queries (q, d), keys and values (t, d)."""
    return torch.softmax(queries @ keys.T * scale, dim=-1) @ values


def stored(x: torch.Tensor, count: int, storage: Storage, where: Where) -> torch.Tensor:
    """(t, d) float: x (t, d) as a head holds it, its `count` oldest rows encoded and decoded."""
    pair = codecs(storage, x.shape[-1])
    if pair is None or count == 0:
        return x.float()
    codec = pair[0] if where.kind == "key" else pair[1]
    coded = codec.encode(x[None, :count], where).decode()[0]
    return torch.cat([coded, x[count:]]).float()


def head_errors(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scores: list[torch.Tensor],
    storages: list[Storage],
    scale: float,
    least: int,
    where: Where,
    segments: list[int] | None = None,
) -> torch.Tensor:
    """(S, Q, F, P) summed squared error of one head's attention output, per scorer, storage,
    fraction in `FRACTIONS` and probe: queries (q, d) are the probes' queries one after another,
    `segments` how many each has (default: one probe); keys, values (t, d) in storage order (by
    position) in the model's dtype; scores: per scorer (t,), higher kept first."""
    reference = attend(queries.float(), keys.float(), values.float(), scale)
    t = keys.shape[0]
    probe = torch.repeat_interleave(torch.arange(len(segments or [1])), torch.tensor(segments or [len(queries)]))
    out = torch.zeros(len(scores), len(storages), len(FRACTIONS), len(segments or [1]))
    for s, score in enumerate(scores):
        order = torch.argsort(score, descending=True, stable=True)
        for f, fraction in enumerate(FRACTIONS):
            k = min(t, max(least, round(fraction * t)))
            index = order[:k].sort().values
            kept_k, kept_v = keys[index], values[index]
            for q, storage in enumerate(storages):
                coded = coded_count(k, storage)
                k_held = stored(kept_k, coded, storage, where)
                v_held = stored(kept_v, coded, storage, Where(where.layer, where.head, "value"))
                error = (attend(queries.float(), k_held, v_held, scale) - reference).pow(2).sum(-1)
                out[s, q, f] = torch.zeros(out.shape[-1]).index_add_(0, probe, error.cpu())
    return out


def probe_set(
    row: torch.Tensor, tokens: int, part: list[int], generator: torch.Generator
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(context (tokens,), probes): the row's first `tokens` ids with three random spans of
    `NEEDLE` of its ids written at a quarter, half and three quarters; probes: the row's own
    continuation, then per span `part` ("repeat the part ... starting with") + the `LEAD` ids
    before it + the span. The last `NEEDLE` ids of a recall probe are what retrieval predicts."""
    context = row[:tokens].clone()
    probes = [row[tokens:]]
    for at in (tokens // 4, tokens // 2, 3 * tokens // 4):
        context[at : at + NEEDLE] = row[torch.randint(0, tokens, (NEEDLE,), generator=generator)]
        probes.append(torch.tensor([*part, *context[at - LEAD : at + NEEDLE].tolist()]))
    return context, probes


def measure(
    model: Any,
    scorers: list[Method],
    storages: list[Storage],
    samples: int,
    tokens: int,
    least: int,
    probe: int = 32,
    ticker: Any = None,
) -> torch.Tensor:
    """(S, L, H, Q, F) distortion of every head: mean over `samples` rows of `tokens` tokens of
    its squared attention-output error over the layer's output energy (see module docstring)."""
    from kvstack.cache.cache import KVCache
    from kvstack.calibrate.prose import calibration_ids
    from kvstack.generate import Runner

    needs = frozenset().union(*(s.needs for s in scorers))
    _, part = getattr(model, "_kvstack_repeat_ids", ([], []))
    window = max([len(part) + LEAD + NEEDLE, probe, *(s.query_window for s in scorers)])
    total: torch.Tensor | None = None
    generator = torch.Generator().manual_seed(0)
    tables = {m.name: table for m in scorers if (table := m.load(model)) is not None}  # learned predictors
    for row in calibration_ids(model, samples, tokens + probe):
        context, probes = probe_set(row, tokens, list(part), generator)
        cache = KVCache(model, "full", 1.0, observe=needs, query_window=window)
        runner = Runner(model, cache, hooks=list(scorers))  # their passes (KVzip re-reads the prompt)
        runner.forward(context[None], torch.ones(1, tokens, dtype=torch.long))
        held = []
        for layer in cache.layers:
            obs = Observation(layer, layer.counts(), None, tables=tables)
            valid = obs.valid[0, 0]
            held.append((obs.keys[0][:, valid], obs.values[0][:, valid], [m.score(obs)[0][:, valid] for m in scorers]))
        queries: list[list[torch.Tensor]] = [[] for _ in cache.layers]
        for extra in probes:
            runner.forward(extra[None], torch.ones(1, len(extra), dtype=torch.long))
            for i, layer in enumerate(cache.layers):
                queries[i].append(layer.queries[0, :, -len(extra) :])  # (H*g, w, d)
        segments = [len(extra) for extra in probes]
        errors = []
        for i, layer in enumerate(cache.layers):
            keys, values, scores = held[i]
            q_all = torch.cat(queries[i], dim=1)  # (H*g, sum of w, d)
            per_head, energy = [], torch.zeros(len(probes))
            for h in range(layer.n_kv_heads):
                q = q_all[h * layer.groups : (h + 1) * layer.groups]  # (g, w, d): per probe, the group's queries
                q = torch.cat([x.reshape(-1, q.shape[-1]) for x in q.split(segments, dim=1)])
                group = [n * layer.groups for n in segments]
                probe_of = torch.repeat_interleave(torch.arange(len(probes)), torch.tensor(group))
                out = attend(q.float(), keys[h].float(), values[h].float(), layer.scaling).pow(2).sum(-1)
                energy.index_add_(0, probe_of, out.cpu())
                where = Where(i, h, "key")
                per_head.append(
                    head_errors(
                        q, keys[h], values[h], [s[h] for s in scores], storages, layer.scaling, least, where, group
                    )
                )
                if ticker is not None:
                    ticker.advance()
            errors.append((torch.stack(per_head, 1) / energy.clamp(min=1e-30)).mean(-1))  # (S, H, Q, F)
        table = torch.stack(errors, 1)  # (S, L, H, Q, F)
        total = table if total is None else total + table
    assert total is not None
    return total / samples

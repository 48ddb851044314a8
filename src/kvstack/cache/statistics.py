"""Attention statistics that methods ask for, computed for the queries at hand, per KV head.

`attention_sum`: attention each held token received, summed over queries and the head's
group (H2O); `last_attention`: the newest query's attention, averaged over the group (TOVA);
`max_attention`: the most attention any query of the group gave it (KVzip's reconstruction);
`future_*`: for teachers of learned scorers, over the queries 1 to HORIZON tokens after a token,
how many there were, the sum of the log of the group's mean attention to it, and that log times
the age (query slot - token slot): a least-squares line of log attention by age, per token.
Probabilities are materialised in chunks of queries, only when a method needs them.
"""

from __future__ import annotations

import torch

from kvstack.cache.attention import attention_probs, head_mask
from kvstack.cache.layer import CompressedLayer

FUTURE = frozenset({"future_count", "future_log", "future_log_age"})
STATISTICS = frozenset({"attention_sum", "last_attention", "max_attention"}) | FUTURE
# statistics a pass over the prompt records after it went in (a stage's `prompt_done` hook), not
# the attention: the cache waits for them before it compresses (KVzip's reconstruction scores)
PROMPT_PASSES = frozenset({"reconstruction"})
CHUNK = 256  # queries per chunk when probabilities are materialised
HORIZON = 128  # queries after a token whose attention the `future_*` statistics read
FLOOR = 1e-6  # attention below this is equal (log floor)


def record(
    layer: CompressedLayer,
    needs: frozenset[str],
    query: torch.Tensor,
    query_slots: torch.Tensor,
    padding: torch.Tensor | None,
    window: int | None,
    scale: float,
) -> None:
    """Add the requested statistics for query (b, h*g, q, d) at slots (q,) to `layer`."""
    g = layer.groups
    q_real = None  # padding queries vote for nothing
    if padding is not None:
        q_real = torch.gather(padding, 1, query_slots.unsqueeze(0).expand(padding.shape[0], -1)).float()
    for h in range(layer.n_kv_heads):
        qh, slots, keys = query[:, h * g : (h + 1) * g], layer.head_slots(h), layer.head_keys(h)
        bias = layer.head_bias(h)
        if needs & {"attention_sum", "max_attention"}:
            total = torch.zeros(qh.shape[0], layer.head_len(h), device=query.device)
            most = torch.zeros_like(total)
            for start in range(0, qh.shape[2], CHUNK):
                end = min(start + CHUNK, qh.shape[2])
                p = attention_probs(
                    qh[:, :, start:end], keys, head_mask(slots, query_slots[start:end], padding, window), scale, bias
                )
                if q_real is not None:
                    p = p * q_real[:, None, start:end, None]
                total += p.sum(dim=(1, 2))
                most = torch.maximum(most, p.amax(dim=(1, 2)))
            if "attention_sum" in needs:
                layer.add_stat("attention_sum", h, total, accumulate=True)
            if "max_attention" in needs:
                layer.add_stat("max_attention", h, most, accumulate="max")
        if needs & FUTURE:
            _future(layer, h, qh, query_slots, padding, window, scale, q_real)
        if "last_attention" in needs:
            p = attention_probs(qh[:, :, -1:], keys, head_mask(slots, query_slots[-1:], padding, window), scale, bias)
            layer.add_stat("last_attention", h, p.mean(dim=(1, 2)), accumulate=False)


def _future(
    layer: CompressedLayer,
    h: int,
    qh: torch.Tensor,
    query_slots: torch.Tensor,
    padding: torch.Tensor | None,
    window: int | None,
    scale: float,
    q_real: torch.Tensor | None,
) -> None:
    """Add head h's `future_*` sums for queries qh (b, g, q, d) at slots (q,): over each held token's
    queries aged 1 to HORIZON, the count, the sum of log mean-over-group attention and its
    sum times the age."""
    slots, keys, bias = layer.head_slots(h), layer.head_keys(h), layer.head_bias(h)
    key_slots = slots if slots.dim() == 2 else slots[None]
    count = torch.zeros(qh.shape[0], layer.head_len(h), device=qh.device)
    logs, logs_age = torch.zeros_like(count), torch.zeros_like(count)
    for start in range(0, qh.shape[2], CHUNK):
        end = min(start + CHUNK, qh.shape[2])
        mask = head_mask(slots, query_slots[start:end], padding, window)  # (b or 1, 1, q, t)
        p = attention_probs(qh[:, :, start:end], keys, mask, scale, bias).mean(1)  # (b, q, t)
        age = (query_slots[start:end][None, :, None] - key_slots[:, None, :]).float()  # (b or 1, q, t)
        near = mask[:, 0] & (age >= 1) & (age <= HORIZON)
        weight = near.float() if q_real is None else near.float() * q_real[:, start:end, None]
        log_p = p.clamp(min=FLOOR).log() * weight
        count += weight.sum(1)
        logs += log_p.sum(1)
        logs_age += (log_p * age).sum(1)
    layer.add_stat("future_count", h, count, accumulate=True)
    layer.add_stat("future_log", h, logs, accumulate=True)
    layer.add_stat("future_log_age", h, logs_age, accumulate=True)

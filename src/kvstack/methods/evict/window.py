"""The observation window shared by query-voting scorers: recent queries vote for held tokens.

SnapKV (arXiv 2404.14469) and DapQ (arXiv 2603.11564) both let a window of queries attend to
the held keys and smooth the summed attention; DapQ and TriAttention (arXiv 2604.04921) also
need how far each observed query lies before the next token, to move it along RoPE's position
axis. The window is the last w slots, shared by the batch: in a padded batch its padding queries
do not vote.
Shapes: b batch, h KV heads, g query heads per KV head, w queries, t tokens, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstack.methods.base import Observation


def window_votes(queries: torch.Tensor, obs: Observation, allowed: torch.Tensor) -> torch.Tensor:
    """(b, h, t) attention each held token gets from `queries` (b, h*g, w, d), softmax in float32
    over the keys each query may see (`allowed`, broadcastable to (b, h, g*w, t)), summed over
    the window and averaged over the head's query group."""
    b, h, t, _ = obs.keys.shape
    q = queries.float().reshape(b, h, -1, queries.shape[-1])  # (b, h, g*w, d), group-major
    logits = torch.einsum("bhqd,bhtd->bhqt", q, obs.keys.float()) * obs.scaling
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    real = obs.query_valid.repeat(1, obs.groups)  # (b, g*w) in the same group-major order as q
    return (probs * real[:, None, :, None]).sum(dim=2) / obs.groups


def smooth(scores: torch.Tensor, kernel_size: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(b, h, t) scores averaged over a centred window of `kernel_size` real neighbours (1D average
    pooling); valid (b, h, t) leaves padding and empty places out of every average, so a sequence
    scores the same alone and in a padded batch."""
    b, h, t = scores.shape

    def pool(x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool1d(
            x.reshape(b * h, 1, t), kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=False
        ).reshape(b, h, t)

    if valid is None:
        return pool(scores)
    weight = valid.to(scores.dtype)
    return pool(scores * weight) / pool(weight).clamp(min=1e-12)


def steps_to_next(obs: Observation) -> torch.Tensor:
    """(w,) float: how many positions each observed query lies before the next token (1 for the
    newest): rotating a post-RoPE query by this shift puts it where the next query will sit.

    Counted in slots (`seen - slot`), the same for every row: RoPE scores depend only on the
    distance between query and key, so no row needs its absolute position. It equals the
    distance in positions whenever no padding lies between the query and the newest token
    (always without padding; with left padding, for every real query of a prefill window).
    """
    return (obs.seen - obs.query_slots).float()


def frequencies(obs: Observation, method: str) -> torch.Tensor:
    """(d/2,) the layer's RoPE inverse frequencies, or a one-line error saying how to get them."""
    if obs.inv_freq is None:
        raise ValueError(
            f"{method}: this layer's RoPE frequencies are unknown (obs.inv_freq is None); build the cache "
            "with KVCache(model) so they are read from the model, or set layer.inv_freq"
        )
    return obs.inv_freq

"""`triattention`: TriAttention (Mao et al., 2026): keys scored by the trigonometric distance
preference of the pre-RoPE query centre, plus a norm term."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstack.methods.base import Method, Observation, recent_mask
from kvstack.methods.evict.window import frequencies, steps_to_next
from kvstack.methods.registry import register
from kvstack.models.rope import rotate


def geometric_offsets(max_offset: int) -> torch.Tensor:
    """(n,) float: the future distances 1, 2, 4, ... up to `max_offset`."""
    return 2.0 ** torch.arange(max_offset.bit_length(), dtype=torch.float32)


def offset_phases(inv_freq: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(d/2,) complex c_f = mean over offsets o of exp(i o w_f): the distance preference averaged
    over where future queries will be, relative to the next position. In float64 on the CPU (a
    few dozen numbers): offsets reach 2^16, where float32 angles are off by up to 0.01 rad."""
    angle = offsets.double()[:, None] * inv_freq.detach().cpu().double()[None, :]  # (n, d/2)
    return torch.polar(torch.ones_like(angle), angle).mean(dim=0).to(inv_freq.device, torch.complex64)


def as_complex(x: torch.Tensor) -> torch.Tensor:
    """(..., d/2) complex: channel i and i + d/2 as real and imaginary parts (transformers' RoPE pairs)."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half].float(), x[..., half:].float())


def query_centre(
    queries: torch.Tensor, ahead: torch.Tensor, inv_freq: torch.Tensor, real: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """From observed post-RoPE queries (b, h*g, w, d), each `ahead` (w,) positions before the next
    token T: the complex centre (b, h*g, d/2) of the pre-RoPE queries, rotated to position T
    (mean_i q_i exp(-i p_i w) exp(i T w)), and the mean magnitude (b, h*g, d/2) of each frequency.
    real: (b, w) which queries count (padding does not); None = all."""
    at_next = as_complex(rotate(queries.float(), ahead, inv_freq))  # every query moved to T
    if real is None:
        return at_next.mean(dim=2), at_next.abs().mean(dim=2)
    weight = real.float()[:, None, :, None]  # (b, 1, w, 1)
    n = weight.sum(dim=2).clamp(min=1)
    return (at_next * weight).sum(dim=2) / n, (at_next.abs() * weight).sum(dim=2) / n


def trig_scores(
    centre: torch.Tensor, magnitude: torch.Tensor, keys: torch.Tensor, phases: torch.Tensor, groups: int
) -> torch.Tensor:
    """(b, h, g, t) per query head and key: Re sum_f centre_f conj(k_f) c_f (the expected logit
    of a query at the centre, averaged over the offsets) + sum_f (m_f - |centre_f|) |k_f|.

    centre, magnitude: (b, h*g, d/2); keys (b, h, t, d) post-RoPE; phases (d/2,) complex.
    """
    b, h, t, _ = keys.shape
    k = as_complex(keys)  # (b, h, t, F)
    a = (centre * phases).reshape(b, h, groups, -1)  # (b, h, g, F)
    trig = torch.einsum("bhgf,bhtf->bhgt", a, k.conj()).real
    extra = (magnitude - centre.abs()).reshape(b, h, groups, -1)
    return trig + torch.einsum("bhgf,bhtf->bhgt", extra, k.abs())


def zscore(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """scores (b, h, g, t) standardised over the valid tokens (b, h, 1, t) of each query head."""
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = torch.where(valid, scores, 0.0).sum(dim=-1, keepdim=True) / count
    var = torch.where(valid, (scores - mean) ** 2, 0.0).sum(dim=-1, keepdim=True) / count
    return (scores - mean) / var.sqrt().clamp(min=1e-6)


@register
@dataclass
class TriAttention(Method):
    """TriAttention: efficient long reasoning with trigonometric KV compression (arXiv 2604.04921).

    The paper's idea: pre-RoPE queries and keys concentrate around fixed non-zero centres, so a query
    head's attention to a key depends mostly on their distance, through a trigonometric series
    set by the centres; keys are scored by that series at the coming query positions, plus a
    norm term for what the centre does not explain. In complex form (F = d/2 frequencies w_f,
    k_f = k[f] + i k[f + F] the post-RoPE key, T the next position):

        S = Re sum_f qbar_f conj(k_f) mean_o exp(i (T + o) w_f) + sum_f (m_f - |qbar_f|) |k_f|

    with qbar_f the mean pre-RoPE query, m_f the mean of |q_f|, offsets o = 1, 2, 4, ..., 2^16
    averaged (reference: github.com/WeianMao/triattention, triattention/methods/pruning_utils.py
    `score_keys_for_round` and `compute_frequency_statistics_from_means`;
    triattention/vllm/core/scoring.py for the post-RoPE form; offset_max_length 65536, "mean"
    aggregation). Per query head the scores are z-scored, then the group takes the max (the
    reference's per-head pruning, triattention/methods/triattention.py).

    Deviation: the reference calibrates qbar and m offline on sampled text; we estimate them from
    the last `window_size` observed queries (un-rotating each by its position), so the method needs
    no calibration file and adapts per prompt, at the cost of a noisier centre. `recent` newest
    tokens are kept (+inf): the reference protects 128 (vLLM `window_size`) and 8 (HF worker
    default); 64 matches the query window, whose tokens the centre was estimated from, and our
    snapkv. `every` 16 as our snapkv (the reference compresses every 128 steps: `divide_length`).
    Parameters: `window_size` 64 queries for the centres, `recent` 64, `max_offset` 65536.

    Shapes: queries (b, h*g, w, d), keys (b, h, t, d) -> scores (b, h, t).
    """

    name = "triattention"
    family = "evict"
    paper = "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression (arXiv 2604.04921)"
    window_size: int = 64
    recent: int = 64
    max_offset: int = 65536
    every: int = field(default=16, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size < 1:
            raise ValueError(f"triattention: window_size must be >= 1 (queries for the centre), got {self.window_size}")
        if self.recent < 0:
            raise ValueError(f"triattention: recent must be >= 0 (newest tokens kept), got {self.recent}")
        if self.max_offset < 1:
            raise ValueError(f"triattention: max_offset must be >= 1 (largest future distance), got {self.max_offset}")

    @property
    def query_window(self) -> int:
        return self.window_size

    @property
    def min_tokens(self) -> int:
        return max(self.recent, 1)

    def score(self, obs: Observation) -> torch.Tensor:
        inv_freq = frequencies(obs, self.name).to(obs.keys.device)
        centre, magnitude = query_centre(obs.queries, steps_to_next(obs), inv_freq, obs.query_valid)
        phases = offset_phases(inv_freq, geometric_offsets(self.max_offset))
        per_query_head = trig_scores(centre, magnitude, obs.keys, phases, obs.groups)
        scores = zscore(per_query_head, obs.valid[:, :, None, :]).amax(dim=2)
        if self.recent == 0:
            return scores
        return torch.where(recent_mask(obs, self.recent), torch.full_like(scores, float("inf")), scores)

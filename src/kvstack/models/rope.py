"""Rotary position embeddings as kvstack needs them: each layer's frequencies, and rotation by a shift.

Methods that reason about positions (DapQ's pseudo queries, TriAttention's distance preference)
move post-RoPE queries and keys along the position axis; RoPE rotates each pair of channels
(i, i + d/2) by position x inv_freq, so a shift by delta is one more rotation.
"""

from __future__ import annotations

from typing import Any

import torch

_TURNS: dict[tuple[bytes, str], torch.Tensor] = {}


def layer_frequencies(model_or_config: Any, layer_types: list[str], head_dim: int) -> list[torch.Tensor | None]:
    """Per layer, the inverse frequencies (d/2,) its RoPE uses, read from the model's rotary module
    (so scaled variants are exact) or, for a bare config, computed from its rope theta."""
    model = getattr(model_or_config, "model", None)
    rotary = getattr(model, "rotary_emb", None)
    out: list[torch.Tensor | None] = []
    for kind in layer_types:
        inv = None
        if rotary is not None:
            inv = getattr(rotary, f"{kind}_inv_freq", None)
            inv = getattr(rotary, "inv_freq", None) if inv is None else inv
        if inv is None:
            config = getattr(model_or_config, "config", model_or_config)
            config = config.get_text_config() if hasattr(config, "get_text_config") else config
            params = getattr(config, "rope_parameters", None) or {}
            params = params.get(kind, params) if isinstance(params, dict) else {}
            theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        out.append(inv.detach().float())
    return out


def rotate(x: torch.Tensor, shift: torch.Tensor | float, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (..., d) rotated as if its position moved by `shift` (broadcast over x's leading dims).

    Uses transformers' half-split convention: channel i pairs with channel i + d/2.
    """
    half = x.shape[-1] // 2
    shift = torch.as_tensor(shift, dtype=torch.float32, device=x.device)
    angle = shift.unsqueeze(-1) * inv_freq.to(x.device)  # (..., d/2)
    cos, sin = torch.cos(angle), torch.sin(angle)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def turns(inv_freq: torch.Tensor, count: int) -> torch.Tensor:
    """(P, d) float32 for positions 0..P-1, P >= count: the cosines then the sines of position x
    inv_freq, as `rotate` computes them; kept per frequencies and grown by doubling, so a kernel
    that turns keys by their positions reads a table instead of computing them at every call."""
    key = (inv_freq.detach().float().cpu().numpy().tobytes(), str(inv_freq.device))
    table = _TURNS.get(key)
    if table is None or table.shape[0] < count:
        size = 1 << max(count - 1, 1).bit_length()
        angle = torch.arange(size, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq.float()
        table = _TURNS[key] = torch.cat([torch.cos(angle), torch.sin(angle)], -1).contiguous()
    return table

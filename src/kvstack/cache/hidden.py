"""Hidden-state measurements taken during the forward pass, for allocators that weigh layers by them.

`hidden_cosine` (SqueezeAttention, arXiv 2404.04793): per decoder layer, the cosine similarity
between the residual stream entering the layer (before `input_layernorm`) and the residual
stream after self-attention was added to it (before the MLP), per token over the hidden
dimension, averaged over the prompt's real tokens. A cosine near 1 means attention barely
turned the token's representation: the layer matters less, so its KV cache may shrink.

`install(model)` puts two hooks on every decoder layer (once per model): a forward pre-hook
that keeps the layer's input hidden states (b, q, D) when the call is multi-token (prefill)
and its `past_key_values` is a `KVCache` that needs "hidden_cosine"; and a forward hook on
the module whose output is added to the residual: `self_attn` (Llama), or
`post_attention_layernorm` where the attention output is normalised before the addition
(Gemma 2/3 with their `pre_feedforward_layernorm`). It writes
`cache.signals["hidden_cosine"][layer_idx]` (b,), a running mean over every multi-token call
(so a prompt fed in chunks gives the same value), with the token counts in
`cache.signals["hidden_cosine_tokens"]`.

Timing: the cache compresses a whole-prompt stack inside the last layer's attention, before
that layer's attention output exists. While a hook still owes its layer's value, the layer is
in `cache.pending_signals` and the cache waits; the last hook then calls `cache.policy.compress_all()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvstack.cache.cache import KVCache

SIGNAL = "hidden_cosine"
TOKENS = "hidden_cosine_tokens"
MARKER = "_kvstack_hidden_hooks"


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (`model.model.layers`, or the language model's)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(inner, "language_model", None), "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: cannot find its decoder layers (model.model.layers) to measure hidden states"
        )
    return list(layers)


def token_cosine(residual: torch.Tensor, added: torch.Tensor) -> torch.Tensor:
    """(b, q) cosine between each token's residual stream before (b, q, D) and after `added` (b, q, D)."""
    after = residual + added
    return F.cosine_similarity(residual.float(), after.float(), dim=-1)


def masked_mean_update(
    mean: torch.Tensor | None, count: torch.Tensor | None, values: torch.Tensor, real: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Running mean over real tokens: (mean, count) (b,) or None, plus values (b, q) where real (b, q)."""
    new_sum = (values * real).sum(-1)
    new_count = real.sum(-1).to(values.dtype)
    if mean is None or count is None:
        mean, count = torch.zeros_like(new_sum), torch.zeros_like(new_count)
    total = count + new_count
    merged = (mean * count + new_sum) / total.clamp(min=1)
    return torch.where(total > 0, merged, mean), total


def _real_tokens(kwargs: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
    """(b, q) True for real (non-padding) tokens of this call, from the 2D padding mask when given."""
    b, q = hidden.shape[:2]
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == b and mask.shape[1] >= q:
        return mask[:, -q:].bool()  # the mask covers the whole sequence, this call's tokens last
    return torch.ones(b, q, dtype=torch.bool, device=hidden.device)


def _wants(cache: Any) -> bool:
    """True for a kvstack cache whose stack needs the signal (any other cache has no `needs`)."""
    return SIGNAL in getattr(cache, "needs", frozenset())


def _record(cache: KVCache, layer_idx: int, residual: torch.Tensor, added: torch.Tensor, real: torch.Tensor) -> None:
    started = cache.compress_clock.start(residual.device)
    cos = token_cosine(residual, added)
    per_layer = cache.signals.setdefault(SIGNAL, {})
    counts = cache.signals.setdefault(TOKENS, {})
    per_layer[layer_idx], counts[layer_idx] = masked_mean_update(
        per_layer.get(layer_idx), counts.get(layer_idx), cos, real.to(cos.device)
    )
    cache.compress_clock.stop(started)


def install(model: Any) -> None:
    """Hook every decoder layer of `model` to measure `hidden_cosine` for the caches that need it (idempotent)."""
    if getattr(model, MARKER, False):
        return
    pending: dict[int, tuple[KVCache, torch.Tensor, torch.Tensor]] = {}  # layer -> (cache, residual, real)
    layers = decoder_layers(model)
    for idx, layer in enumerate(layers):

        def before(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], idx: int = idx) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            cache = kwargs.get("past_key_values")
            if hidden is None or hidden.shape[1] < 2 or not _wants(cache):
                pending.pop(idx, None)
                return
            pending[idx] = (cache, hidden.detach(), _real_tokens(kwargs, hidden))
            cache.pending_signals.add(idx)

        def after(module: torch.nn.Module, args: tuple, output: Any, idx: int = idx) -> None:
            entry = pending.pop(idx, None)
            if entry is None:
                return
            cache, residual, real = entry
            added = output[0] if isinstance(output, tuple) else output
            _record(cache, idx, residual, added.detach(), real)
            cache.pending_signals.discard(idx)
            if idx == len(cache.layers) - 1 and cache.stack.whole_prompt and not cache.pending_signals:
                cache.policy.compress_all()  # the prompt waited for this layer's value (see module docstring)

        layer.register_forward_pre_hook(before, with_kwargs=True)
        sandwich = hasattr(layer, "pre_feedforward_layernorm") and hasattr(layer, "post_attention_layernorm")
        (layer.post_attention_layernorm if sandwich else layer.self_attn).register_forward_hook(after)
    setattr(model, MARKER, True)

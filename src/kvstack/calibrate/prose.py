"""Calibration text: the token ids methods learn their tables on (codebooks, projections)."""

from __future__ import annotations

from typing import Any

import torch

from kvstack.cache.factory import full_cache
from kvstack.errors import UserError


def calibration_ids(model: Any, samples: int, tokens: int, skip: int = 0) -> list[torch.Tensor]:
    """`samples` rows of `tokens` ids: State of the Union prose in the model's tokens, after the
    BOS its prompts start with, or random ids when the model has no tokenizer attached (tiny
    test models); `skip` rows are passed over first (held-out rows: what one calibration
    measured, another can check on other text)."""
    encode = getattr(model, "_kvstack_encode", None)
    if encode is None:
        gen = torch.Generator().manual_seed(0)
        vocab = model.config.get_text_config().vocab_size
        return [torch.randint(0, vocab, (tokens,), generator=gen) for _ in range(skip + samples)][skip:]
    from kvstack.bench.data import state_of_the_union

    texts = state_of_the_union()
    if skip + samples > len(texts):
        raise UserError(f"calibration asks for {skip + samples} texts, there are {len(texts)}: use fewer samples")
    picked = texts[len(texts) - skip - samples : len(texts) - skip]  # the most recent addresses
    return [torch.tensor((prompt_prefix(model) + encode(text))[:tokens]) for text in picked]


def prompt_prefix(model: Any) -> list[int]:
    """The ids a prompt to `model` starts with (its BOS where it wants one; none for tiny models)."""
    return list(getattr(model, "_kvstack_prefix", ()))


def calibration_states(model: Any, samples: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values), each (h_kv, N, d) float32 on the CPU: what a full cache holds
    after reading `samples` rows of calibration text (post-RoPE keys), rows concatenated."""
    keys: list[list[torch.Tensor]] = []
    values: list[list[torch.Tensor]] = []
    with torch.no_grad():
        for row in calibration_ids(model, samples, tokens):
            cache = full_cache(model)
            model(row.unsqueeze(0).to(model.device), past_key_values=cache)
            for i, layer in enumerate(cache.layers):
                if len(keys) <= i:
                    keys.append([]), values.append([])
                keys[i].append(torch.stack(list(layer.keys), 0)[:, 0].float().cpu())  # (h, t, d)
                values[i].append(torch.stack(list(layer.values), 0)[:, 0].float().cpu())
    return [(torch.cat(k, 1), torch.cat(v, 1)) for k, v in zip(keys, values, strict=True)]

"""Facts read off a model's config that every layer of kvstack needs."""

from __future__ import annotations

from typing import Any


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs keep it under `text_config`)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def head_dim(config: Any) -> int:
    """Channels of one attention head (configs that omit it split the hidden size evenly)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

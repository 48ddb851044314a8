"""Tiny randomly initialised models built from a config: no download, seconds on CPU."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

VOCAB = 97


def tiny_llama(attn: str = "kvstack", seed: int = 0) -> LlamaForCausalLM:
    """4 layers, 4 query heads over 2 KV heads (GQA), head dim 16."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        attn_implementation=attn,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(attn: str = "kvstack", seed: int = 0) -> Gemma3ForCausalLM:
    """6 layers, pattern 5 sliding (window 16) : 1 global, 2 query heads over 1 KV head."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=16,
        max_position_embeddings=2048,
        attn_implementation=attn,
        query_pre_attn_scalar=32,
    )
    return Gemma3ForCausalLM(config).eval()


def with_attention(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    model.set_attn_implementation(attn)
    return model

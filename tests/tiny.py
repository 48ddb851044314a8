"""Tiny randomly initialised models built from a config: no download, seconds on CPU."""

from __future__ import annotations

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

VOCAB = 97


def tiny_llama(attn: str = "kvstack", seed: int = 0, head_dim: int = 16) -> LlamaForCausalLM:
    """4 layers, 4 query heads over 2 KV heads (GQA), head dim 16 (or `head_dim`)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=2048,
        attn_implementation=attn,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def tiny_gemma3(attn: str = "kvstack", seed: int = 0, head_dim: int = 32) -> Gemma3ForCausalLM:
    """6 layers, pattern 5 sliding (window 16) : 1 global, 2 query heads over 1 KV head of
    `head_dim` channels."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        sliding_window=16,
        max_position_embeddings=2048,
        attn_implementation=attn,
        query_pre_attn_scalar=head_dim,
    )
    return Gemma3ForCausalLM(config).eval()


def with_attention(model: torch.nn.Module, attn: str) -> torch.nn.Module:
    model.set_attn_implementation(attn)
    return model


def char_tokenizer():
    """A character-level tokenizer over printable ASCII whose ids fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Split
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)]  # 95 characters
    vocab = {"<pad>": 0, "<unk>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>")
    assert len(tok) <= VOCAB
    return tok


def tiny_loaded(make=tiny_llama):
    """A tiny model with the char tokenizer, packaged like `kvstack.load` returns it."""
    from kvstack.models.loading import LoadedModel

    return LoadedModel(name="tiny", model=make(), tokenizer=char_tokenizer(), chat=False, add_bos=False)

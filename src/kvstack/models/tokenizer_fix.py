"""Gemma 3's GGUF tokenizer, rebuilt correctly.

transformers 5.2 builds it as a Unigram-like model from BPE-rank scores: no error, only
degenerate text. Rebuilding the backend as byte-fallback BPE whose merges follow the GGUF
scores restores the original tokenization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers.models import BPE
from transformers.convert_slow_tokenizer import generate_merges


def gguf_scores(path: Path) -> dict[str, float]:
    """token -> score from a GGUF file's tokenizer metadata."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    tokens_field = reader.fields["tokenizer.ggml.tokens"]
    scores_field = reader.fields["tokenizer.ggml.scores"]
    tokens = [bytes(tokens_field.parts[i]).decode("utf-8", errors="replace") for i in tokens_field.data]
    scores = [float(scores_field.parts[i][0]) for i in scores_field.data]
    return dict(zip(tokens, scores, strict=True))


def rebuild_bpe(tokenizer: Any, gguf_path: Path) -> None:
    """Replace the tokenizer's backend model with a BPE built from the GGUF's scores (in place)."""
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    by_token = gguf_scores(gguf_path)
    scores = {tok: by_token.get(tok.replace("\u2581", " "), by_token.get(tok, 0.0)) for tok in vocab}
    merges = generate_merges(vocab, scores)
    tokenizer.backend_tokenizer.model = BPE(
        vocab, merges, byte_fallback=True, fuse_unk=True, unk_token=tokenizer.unk_token
    )

"""kvstack: stackable KV-cache compression for Hugging Face causal LMs, with memory really freed."""

from typing import TYPE_CHECKING

from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.stack import Stack

if TYPE_CHECKING:
    from kvstack.models import LoadedModel

__all__ = ["Budget", "KVCache", "Stack", "UserError", "load"]
__version__ = "0.1.0"


def load(name: str, **kwargs: object) -> "LoadedModel":
    """Load a model and tokenizer by name (see `kvstack.models.load`); imported lazily."""
    from kvstack.models import load as _load

    return _load(name, **kwargs)  # type: ignore[arg-type]

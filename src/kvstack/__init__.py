"""kvstack: stackable KV-cache compression for Hugging Face causal LMs, with memory really freed."""

from kvstack.api import answer, answer_cached, compress, load_cache
from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.models import LoadedModel, load
from kvstack.reuse import PrefixStore
from kvstack.stack import Stack

__all__ = [
    "Budget",
    "KVCache",
    "LoadedModel",
    "PrefixStore",
    "Stack",
    "UserError",
    "answer",
    "answer_cached",
    "compress",
    "load",
    "load_cache",
]
__version__ = "0.1.0"

"""kvstack: stackable KV-cache compression for Hugging Face causal LMs, with memory really freed."""

from kvstack.api import answer
from kvstack.cache.budget import Budget
from kvstack.cache.cache import KVCache
from kvstack.errors import UserError
from kvstack.models import LoadedModel, load
from kvstack.stack import Stack

__all__ = ["Budget", "KVCache", "LoadedModel", "Stack", "UserError", "answer", "load"]
__version__ = "0.1.0"

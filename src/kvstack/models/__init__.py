"""Real models: the registry of packaged models and how to load them offline."""

from kvstack.models.loading import LoadedModel, cache_dir, default_dtype, load
from kvstack.models.registry import DEFAULT_MODEL, MODELS, ModelSpec

__all__ = ["DEFAULT_MODEL", "MODELS", "LoadedModel", "ModelSpec", "cache_dir", "default_dtype", "load"]

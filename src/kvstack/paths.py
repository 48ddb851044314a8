"""Where kvstack keeps what it builds on disk (models, calibrations, data)."""

from __future__ import annotations

import os
from pathlib import Path

from platformdirs import user_cache_dir


def cache_dir() -> Path:
    """Where assembled and converted models, calibrations and data live ($KVSTACK_CACHE overrides)."""
    return Path(os.environ.get("KVSTACK_CACHE") or user_cache_dir("kvstack"))

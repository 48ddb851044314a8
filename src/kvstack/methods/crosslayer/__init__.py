"""Cross-layer compression: adjacent layers' states stored once."""

from kvstack.methods.crosslayer import minicache, xkv  # noqa: F401

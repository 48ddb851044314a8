"""Budget allocation over layers and heads, composed with any scorer."""

from kvstack.methods.allocate import adakv, pyramid  # noqa: F401

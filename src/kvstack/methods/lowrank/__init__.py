"""Low-rank storage: keys and values as coefficients on fewer directions."""

from kvstack.methods.lowrank import dar, pca, rotatek, shadowkv  # noqa: F401

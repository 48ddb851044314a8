"""Quantization: store the kept tokens in fewer bits (packed codes, counted in the cache's bytes)."""

from kvstack.methods.quantize import adaquant, cq, gear, int_, kivi, mikv, qaq, quantile, squat  # noqa: F401

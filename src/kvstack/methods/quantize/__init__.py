"""Quantization: store the kept tokens in fewer bits (packed codes, counted in the cache's bytes)."""

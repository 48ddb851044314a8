"""Compression methods, one file each, grouped by family (evict/ now; quant/, merge/, lowrank/ next)."""

"""Compression methods, one file each, grouped by family: evict/ allocate/ quantize/ merge/ lowrank/
crosslayer/. `registry` finds every file; `auto`, the planner over them all, is in `kvstack.planning`."""

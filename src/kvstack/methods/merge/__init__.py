"""Merging: tokens left out by a selection folded into kept ones (`base`); D2O's lives with its
layer allocator (`methods/allocate/d2o.py`)."""

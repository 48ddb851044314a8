"""Learned scorers: a small predictor per head, trained once beside the frozen model (`kvstack train`)."""

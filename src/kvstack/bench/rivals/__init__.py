"""Rival toolkits run on the same samples, model and budgets, each in its own environment."""

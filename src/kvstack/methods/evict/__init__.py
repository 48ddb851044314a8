"""Eviction: score tokens, keep the best within budget."""

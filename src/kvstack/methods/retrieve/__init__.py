"""Retrieval: keep every token, most of them in a slow tier, and bring back what each step needs."""

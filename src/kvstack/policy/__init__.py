"""Policy: a stack and a budget turned into decisions (tokens per head, which tokens, how stored)."""

"""Low-rank storage: keys and values as coefficients on fewer directions."""

"""Budget allocation over layers and heads, composed with any scorer."""

"""Rate-distortion planning for `auto`: distortion curves measured once per model, a Lagrangian
that spends one byte budget over layers and heads, and the plan as plain data."""

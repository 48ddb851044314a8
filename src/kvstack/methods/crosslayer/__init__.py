"""Cross-layer compression: adjacent layers' states stored once."""

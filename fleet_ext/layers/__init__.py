"""fleet_ext.layers (no Paddle import here; see DESIGN.md)."""

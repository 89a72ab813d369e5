"""fleet_ext.parallel (no Paddle import here; see DESIGN.md)."""

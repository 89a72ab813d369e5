"""fleet_ext.training (no Paddle import here; see DESIGN.md)."""

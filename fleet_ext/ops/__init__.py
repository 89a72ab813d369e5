"""fleet_ext.ops (no Paddle import here; see DESIGN.md)."""

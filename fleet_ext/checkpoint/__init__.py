"""fleet_ext.checkpoint (no Paddle import here; see DESIGN.md)."""

"""fleet_ext.framework (no Paddle import here; see DESIGN.md)."""

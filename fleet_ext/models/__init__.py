"""fleet_ext.models (no Paddle import here; see DESIGN.md)."""

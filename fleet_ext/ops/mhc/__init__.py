"""fleet_ext.ops.mhc (no Paddle import here; see DESIGN.md)."""

"""fleet_ext.ops.rope (no Paddle import here; see DESIGN.md)."""

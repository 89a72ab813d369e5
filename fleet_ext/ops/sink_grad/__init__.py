"""fleet_ext.ops.sink_grad (no Paddle import here; see DESIGN.md)."""

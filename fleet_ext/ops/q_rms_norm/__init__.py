"""fleet_ext.ops.q_rms_norm (no Paddle import here; see DESIGN.md)."""

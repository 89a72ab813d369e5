"""fleet_ext.ops.inv_rope_postmix (no Paddle import here; see DESIGN.md)."""

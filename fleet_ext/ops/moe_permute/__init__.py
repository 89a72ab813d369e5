"""fleet_ext.ops.moe_permute (no Paddle import here; see DESIGN.md)."""

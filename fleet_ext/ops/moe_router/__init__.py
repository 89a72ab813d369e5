"""fleet_ext.ops.moe_router (no Paddle import here; see DESIGN.md)."""

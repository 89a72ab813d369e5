"""fleet_ext.ops.moe_experts (no Paddle import here; see DESIGN.md)."""

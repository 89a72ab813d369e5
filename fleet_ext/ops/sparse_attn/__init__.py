"""fleet_ext.ops.sparse_attn (no Paddle import here; see DESIGN.md)."""

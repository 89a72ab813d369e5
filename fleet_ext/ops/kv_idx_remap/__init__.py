"""fleet_ext.ops.kv_idx_remap (no Paddle import here; see DESIGN.md)."""

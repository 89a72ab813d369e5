"""fleet_ext.ops.qkv_prologue (no Paddle import here; see DESIGN.md)."""

"""fleet_ext.specs: composition. The backend provider, the decoder-layer specs and ``TransformerLayer``.

Above ``layers/``: it decides which implementation fills each slot and assembles layers into blocks.
No Paddle import here (DESIGN.md).
"""

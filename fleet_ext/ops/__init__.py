"""Ops: ``<op>/reference.py`` (pure Paddle), ``<op>/kernel.py`` (Triton), ``<op>/function.py`` (PyLayers).

Importing this package selects Triton's interpreter mode on machines without an NVIDIA driver, before
any kernel module (or Triton itself) is imported; it imports neither Paddle nor torch.
"""

from fleet_ext.capability import prepare_triton

prepare_triton()

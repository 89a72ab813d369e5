"""Ops: ``<op>/reference.py`` (pure Paddle), ``<op>/kernel*.py`` (Triton; launchers in ``kernel.py``, larger ops
split their device code by role into ``kernel_<role>.py``), ``<op>/function.py`` (PyLayers).

Importing this package selects Triton's interpreter mode on machines without an NVIDIA driver, before
any kernel module (or Triton itself) is imported; it imports neither Paddle nor torch. Kernel modules
and ``launch.py`` decide nothing about the machine at import (``tests/single_card_tests/test_ops_imports.py``).
"""

from fleet_ext.capability import prepare_triton

prepare_triton()

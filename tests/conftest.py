"""Select Triton's interpreter mode (on machines without an NVIDIA driver) before any test module imports
Triton: transformers imports it, and Triton fixes the mode when its own helpers are decorated."""

import sys
from pathlib import Path

import fleet_ext.ops  # noqa: F401  (side effect: fleet_ext.capability.prepare_triton())

# The shared test helpers (tests/helpers) import as `helpers` from every test directory.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

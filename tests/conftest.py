"""Select Triton's interpreter mode (on machines without an NVIDIA driver) before any test module imports
Triton: transformers imports it, and Triton fixes the mode when its own helpers are decorated."""

import fleet_ext.ops  # noqa: F401  (side effect: fleet_ext.capability.prepare_triton())

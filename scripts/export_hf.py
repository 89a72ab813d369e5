#!/usr/bin/env python
"""Export a training checkpoint to a Hugging Face directory that transformers loads.

    python scripts/export_hf.py out/run/checkpoint-40 out/hf

Reads <checkpoint>/config.yaml and the model FlexCheckpoint in <checkpoint>/model/ (any data-parallel layout),
writes <output>/config.json and <output>/model.safetensors: transformers DeepSeek-V3.2 when every layer is -2,
DeepSeek-V4 otherwise. Exit codes: 0 written; 2 not a complete checkpoint, or a config with no Hugging Face
equivalent (the message says which keys). See fleet_ext/training/hf_interop.py.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # a source checkout works without `pip install -e .`
    sys.path.insert(0, _ROOT)

from fleet_ext.training.hf_interop import export_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(export_main())

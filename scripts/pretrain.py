#!/usr/bin/env python
"""Pretrain a DSv4-class model from a training YAML.

    python scripts/pretrain.py --config configs/dsv4_tiny_cpu.yaml [--KEY VALUE ...]
    python -m paddle.distributed.launch --nproc_per_node 2 --host 127.0.0.1 \\
        scripts/pretrain.py --config configs/dsv4_tiny_cpu.yaml
    python -m paddle.distributed.launch --gpus 0,1,2,3,4,5,6,7 scripts/pretrain.py --config configs/dsv4_flash_gpu.yaml

Writes <output_dir>/metrics.jsonl, <output_dir>/loss.png and <output_dir>/checkpoint-<step>/.
See fleet_ext/training/cli.py for the exit codes.
"""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # a source checkout works without `pip install -e .`
    sys.path.insert(0, _ROOT)

from fleet_ext.training.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

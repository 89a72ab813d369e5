"""fleet_ext: DeepSeek-V4-class model layers for PaddlePaddle distributed training.

Importing this package does not import Paddle (the GPU benchmark machine has none); import the
submodule you need, e.g. ``from fleet_ext.models import DSv4ForCausalLM``.
"""

__version__ = "0.1.0"

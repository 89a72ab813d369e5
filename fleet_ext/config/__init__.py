"""One config tree for fleet_ext, read from and written to a flat training YAML.

Key names follow PaddleFleet's ``TransformerConfig`` (and Megatron-core where PaddleFleet borrows
them) so a PaddleFleet user can move a YAML across. The tree groups keys into sections, one module
each; the YAML itself is flat (PaddleFormers style), each key belonging to exactly one section. Every
key carries a help text (the README's config table is generated from them) and every numeric key a
domain. Every rule that needs only the config fails in ``load_config`` with a ``ValueError`` naming
the key, the value, what is allowed and how to fix it; features declared here but not built yet raise
"not supported yet" so that a YAML never silently asks for something that does not run.

==============  ===========================================================================
module          holds
==============  ===========================================================================
``fields``      the key declaration, numeric domains, coercion and the one per-key check
``model``       ``ModelConfig``: attention kinds, shapes, RoPE, indexers, mHC
``moe``         ``MoEConfig``
``parallel``    ``ParallelConfig``
``recompute``   ``RecomputeConfig``, ``RecomputePlan``, ``recompute_plan``
``checkpoint``  ``CheckpointConfig``
``fusion``      ``FusionConfig``
``training``    ``TrainingConfig``
``names``       ``RENAMED_KEYS`` and ``PADDLEFLEET_ONLY_KEYS``
``tree``        ``FleetExtConfig``, ``SECTIONS``, ``load_config``, ``config_key_table``
==============  ===========================================================================

No module of this package imports Paddle.
"""

from fleet_ext.config.checkpoint import CheckpointConfig
from fleet_ext.config.fusion import FusionConfig
from fleet_ext.config.model import ModelConfig
from fleet_ext.config.moe import MoEConfig
from fleet_ext.config.names import PADDLEFLEET_ONLY_KEYS, RENAMED_KEYS
from fleet_ext.config.parallel import ParallelConfig
from fleet_ext.config.recompute import RECOMPUTE_MODULES, RecomputeConfig, RecomputePlan, module_layers, recompute_plan
from fleet_ext.config.training import LR_SCHEDULER_TYPES, RESUME_AUTO, TrainingConfig
from fleet_ext.config.tree import KEY_TO_SECTION, SECTIONS, FleetExtConfig, config_key_table, load_config

_KEY_TO_SECTION = KEY_TO_SECTION  # the name tests and scripts used before the package split

__all__ = [
    "CheckpointConfig",
    "FleetExtConfig",
    "FusionConfig",
    "KEY_TO_SECTION",
    "LR_SCHEDULER_TYPES",
    "ModelConfig",
    "MoEConfig",
    "PADDLEFLEET_ONLY_KEYS",
    "ParallelConfig",
    "RENAMED_KEYS",
    "RECOMPUTE_MODULES",
    "RESUME_AUTO",
    "RecomputeConfig",
    "RecomputePlan",
    "SECTIONS",
    "TrainingConfig",
    "config_key_table",
    "load_config",
    "module_layers",
    "recompute_plan",
]

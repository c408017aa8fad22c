"""lmrl's configuration: typed defaults, YAML + ``key=value`` loading, verl keys, validation.

- ``Config`` and its sections (``lmrl.config.schema``): every default and its help.
- ``load_config(file, overrides)``: defaults <- YAML <- overrides, verl keys translated
  (``lmrl.config.verl``), resolved and validated; raises ``ConfigError`` naming each bad key.
- ``save_config`` / ``config_to_dict`` / ``config_from_dict``: the resolved config in the run
  directory and back.
- ``format_help()``: the text of ``lmrl train --help``.
"""

from lmrl.config.checks import estimator_needs
from lmrl.config.errors import ConfigError
from lmrl.config.help import format_help
from lmrl.config.loader import (
    REQUIRED_FOR_TRAINING,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_override,
    save_config,
    validate_config,
)
from lmrl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    CriticModelConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    FilterGroupsConfig,
    KLControlConfig,
    ModelConfig,
    OptimConfig,
    OverlongBufferConfig,
    PolicyLossConfig,
    RefConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    RolloutCorrectionConfig,
    TrainerConfig,
    ValKwargsConfig,
)
from lmrl.config.validate import resolve_config

__all__ = [
    "REQUIRED_FOR_TRAINING",
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "CriticModelConfig",
    "CustomRewardFunctionConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "KLControlConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RefConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "TrainerConfig",
    "ValKwargsConfig",
    "config_from_dict",
    "config_to_dict",
    "estimator_needs",
    "format_help",
    "load_config",
    "parse_override",
    "resolve_config",
    "save_config",
    "validate_config",
]

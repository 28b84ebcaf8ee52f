"""Typed run configuration: YAML in, validated dataclasses out.

Modules: ``schema`` (the sections as dataclasses, their defaults and allowed values, what a
config answers), ``rules`` (every value a run cannot train with, each refused naming the field
and the fix), ``loading`` (YAML and ``--set key=value`` overrides into the schema, then the
rules). Every rejected value raises :class:`ConfigError`; nothing here starts Ray or touches the
filesystem beyond reading the YAML file.
"""

from __future__ import annotations

from elastic_llm.config.loading import config_from_dict, load_config
from elastic_llm.config.rules import validate
from elastic_llm.config.schema import (
    SCHEDULES,
    TOKENIZERS,
    PLACEMENT_STRATEGIES,
    RECOVERY_MODES,
    MAX_STANDBY,
    STATE_FORMAT,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    DataConfig,
    SnapshotConfig,
    RecoveryConfig,
    DurableConfig,
    CheckFreeConfig,
    ElasticConfig,
    ChaosKill,
    ChaosHow,
    ChaosDuring,
    ChaosOp,
    CHAOS_KINDS,
    CHAOS_HOW,
    CHAOS_DURING,
    CHAOS_OPS,
    ChaosEvent,
    ChaosConfig,
    RunConfig,
)

__all__ = [
    "CHAOS_DURING", "CHAOS_HOW", "CHAOS_KINDS", "CHAOS_OPS", "ChaosConfig", "ChaosDuring", "ChaosEvent",
    "ChaosHow", "ChaosKill", "ChaosOp", "CheckFreeConfig", "ConfigError", "DataConfig", "DurableConfig",
    "ElasticConfig", "MAX_STANDBY", "ModelConfig", "PLACEMENT_STRATEGIES", "ParallelConfig",
    "RECOVERY_MODES", "RecoveryConfig", "RunConfig", "SCHEDULES", "STATE_FORMAT", "SnapshotConfig",
    "TOKENIZERS", "TrainConfig", "config_from_dict", "load_config", "validate",
]

"""The training controller: Ray session, states, executors and the Trainer that runs them.

Modules: ``session`` (Ray on loopback, placement check), ``states`` (states and pure
transitions), ``actor_group`` (placement group and stage actors), ``recovery`` (observe and carry
out a recovery plan), ``metrics`` (JSON lines), ``trainer`` (the state machine over a run).

The names below are imported on first use, so ``elastic_llm.controller.session`` (what the light
commands ``status`` and ``spot-watcher`` need) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ActorGroup": "actor_group",
    "CapacityUnavailable": "actor_group",
    "MetricsWriter": "metrics",
    "NAMESPACE": "session",
    "PlacementError": "session",
    "check_placement": "session",
    "ensure_auth_token": "session",
    "local_resources": "session",
    "loopback_env": "session",
    "start_ray": "session",
    "RunFailed": "trainer",
    "RunUnrecoverable": "trainer",
    "Trainer": "trainer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'elastic_llm.controller' has no attribute {name!r}")
    return getattr(importlib.import_module(f"elastic_llm.controller.{_WHERE[name]}"), name)

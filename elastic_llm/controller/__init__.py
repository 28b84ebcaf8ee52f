"""The training controller: Ray session, states, executors and the Trainer that runs them.

Modules: ``session`` (Ray on loopback, token authentication, placement check), ``states``
(states and pure transitions), ``parts`` (the executors as small protocols, so the controller runs
on fakes), ``actor_group`` (placement groups and stage actors), ``standby`` (warm standby stage
processes), ``recovery`` (observe and carry out a recovery plan) with ``neighbours`` (the sources
that take state from other stages), ``elastic`` (grow, shrink, move off draining nodes) with
``drains`` (Ray's view of draining nodes), ``liveness`` (dead nodes noticed and told to Ray),
``checkpoints`` (the checkpointing baseline), ``failover`` (what lets a new driver resume a run),
``metrics`` (JSON lines), ``progress`` (the live progress line), ``trainer`` (the state machine
over a run).

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

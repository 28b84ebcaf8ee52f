"""The training controller: Ray session, states, executors and the Trainer that runs them.

Modules: ``session`` (Ray on loopback, placement check), ``states`` (states and pure
transitions), ``actor_group`` (placement group and stage actors), ``recovery`` (observe and carry
out a recovery plan), ``metrics`` (JSON lines), ``trainer`` (the state machine over a run).
"""

from elastic_llm.controller.actor_group import ActorGroup, CapacityUnavailable
from elastic_llm.controller.metrics import MetricsWriter
from elastic_llm.controller.session import NAMESPACE, PlacementError, check_placement, ensure_auth_token, local_resources, loopback_env, start_ray
from elastic_llm.controller.trainer import RunFailed, RunUnrecoverable, Trainer

__all__ = [
    "ActorGroup",
    "CapacityUnavailable",
    "MetricsWriter",
    "NAMESPACE",
    "PlacementError",
    "RunFailed",
    "RunUnrecoverable",
    "Trainer",
    "check_placement",
    "ensure_auth_token",
    "local_resources",
    "loopback_env",
    "start_ray",
]

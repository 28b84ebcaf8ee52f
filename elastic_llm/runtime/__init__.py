"""The Ray runtime: the controller's ports on a Ray cluster (see :mod:`.ray_runtime`).

Modules: ``session`` (Ray on loopback, token authentication, starting or joining Ray, the
placement check), ``placement`` (placement groups and free room), ``actors`` (the stage actors,
spares), ``stage_calls`` (the calls that move state), ``standby`` (warm standby processes),
``liveness`` (the driver's node probes), ``drains`` (Ray's draining nodes), ``failover`` (what a
new driver finds of a run: the GCS key-value store, the detached managers, the keepalive),
``ray_runtime`` (:class:`RayRuntime` and :func:`ray_trainer`).

The names below are imported on first use, so ``elastic_llm.runtime.session`` (what the light
commands ``status`` and ``spot-watcher`` need) loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"RayRuntime": "ray_runtime", "ray_trainer": "ray_runtime", "ActorGroup": "actors"}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'elastic_llm.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"elastic_llm.runtime.{_WHERE[name]}"), name)

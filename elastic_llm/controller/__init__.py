"""The training controller: its states, the orchestration that carries plans out, and the Trainer.

Modules: ``ports`` (what the controller needs of a runtime, as protocols: Ray's in
:mod:`elastic_llm.runtime`, a simulated fleet's in :mod:`elastic_llm.sim`), ``states`` (states and
pure transitions), ``drains`` (what the controller learns about nodes), ``setup`` (a run's parts
and where its first step comes from), ``stepping`` (a step and the jobs after it), ``recovery``
(observe and carry out a recovery plan) with ``neighbours`` (the sources that take state from
other stages), ``elastic`` (the elastic policy; grow, shrink, move off draining nodes),
``checkpoints`` (the checkpointing baseline), ``metrics`` (JSON lines), ``progress`` (the live
progress line), ``ticks`` (time per state), ``trainer`` (the state machine over a run). None of
them imports Ray.

The names below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "CapacityUnavailable": "ports",
    "MetricsWriter": "metrics",
    "RunFailed": "states",
    "RunUnrecoverable": "states",
    "Trainer": "trainer",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'elastic_llm.controller' has no attribute {name!r}")
    return getattr(importlib.import_module(f"elastic_llm.controller.{_WHERE[name]}"), name)

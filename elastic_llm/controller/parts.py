"""The executors the controller drives, as small protocols, so it can run on fakes.

Owns: what the :class:`~elastic_llm.controller.trainer.Trainer` needs of the stage actors'
group (:class:`Group`), of recovery (:class:`Recovery`: observe after a failure, carry out a
plan), of elastic width (:class:`Elastic`: look after a step, grow, evacuate draining nodes) and
of steps (:class:`~elastic_llm.pipeline.executor.StepExecutor`), and :class:`Parts`, the bundle a
caller injects instead of the Ray-backed ones. Never implements any of them: the Ray versions
live in :mod:`.actor_group`, :mod:`.recovery`, :mod:`.elastic` and
:mod:`elastic_llm.pipeline.executor`; tests pass fakes (tests/test_controller_fake.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from elastic_llm.clock import Clock
from elastic_llm.config import RunConfig
from elastic_llm.controller.drains import Drain
from elastic_llm.controller.states import Capacity
from elastic_llm.pipeline.executor import StepExecutor
from elastic_llm.recovery.policy import Observation, RecoveryPlan
from elastic_llm.snapshot.records import ShardKey


class Group(Protocol):
    """The stage actors: ``actors[replica][stage]``, where they run, whether they can be placed."""

    width: int
    actors: list[list[Any]]
    ready: set[ShardKey]
    nodes: dict[ShardKey, str]
    pids: dict[ShardKey, int]

    def keys(self) -> list[ShardKey]: ...

    def place(self) -> None: ...  # raises CapacityUnavailable

    def spawn_all(self) -> None: ...

    def replace(self, keys: list[ShardKey]) -> None: ...

    def placed(self) -> bool: ...

    def capacity(self) -> Capacity: ...

    def members(self) -> list[Any]: ...

    def shutdown(self) -> None: ...


class Recovery(Protocol):
    def observe(self, executor: Any, failed_step: int) -> Observation: ...

    def execute(self, plan: RecoveryPlan, obs: Observation, step: int) -> Any: ...  # RecoveryOutcome


class Elastic(Protocol):
    def look(self, seen: set[str] | frozenset[str]) -> tuple[tuple[Drain, ...], int | None]: ...

    def grow(self) -> Any: ...  # ResizeOutcome; raises CapacityUnavailable

    def evacuate(self, nodes: frozenset[str], deadline: float | None) -> Any: ...  # Evacuation


@dataclass
class Parts:
    """What a Trainer runs on instead of Ray (then it starts no Ray and no monitor actor).
    ``snapshots``: a :class:`~elastic_llm.snapshot.coordinator.SnapshotCoordinator` on injected
    manager calls (a simulation); without one ``snapshot.enabled`` must be false. ``clock``: the
    controller's clock (None: the machine's)."""

    group: Group
    recovery: Recovery
    elastic: Elastic
    make_executor: Callable[[list[list[Any]], RunConfig], StepExecutor]
    snapshots: Any = None
    clock: Clock | None = None

"""Handing a run's stage actors from a dead driver to the next one (``--resume RUN_ID``).

Owns: the run's *roster* (:func:`roster`: each actor of the width by its Ray name and the
id of its placement group, JSON, published by the driver at every change of membership) and taking
a roster over (:func:`take_over`: the actors that still answer become this driver's, with
their state in place; a step they were left running is aborted; the groups of those that did not
answer are kept for their replacements, or made afresh where their node went), and which actors a
driver's keepalive must reach (:func:`leased`: with ``recovery.driver_grace_s`` > 0 the
stage actors, spares and warm standbys are detached and end themselves without one, see
:mod:`elastic_llm.lease`), as functions of the :class:`~elastic_llm.runtime.actors.ActorGroup`
whose methods they are.
Never decides what state an adopted actor keeps (the controller compares its steps with the
committed snapshot) and never restores anything.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from elastic_llm.controller.membership import Column, Membership
from elastic_llm.controller.ports import Roster, RosterRow, Standbys
from elastic_llm.runtime.placement import Reservations
from elastic_llm.runtime.spares import RaySpares
from elastic_llm.snapshot.records import ShardKey

log = logging.getLogger("elastic_llm.runtime")
ANSWER_S = 10.0  # longest an adopted actor may take to say what it is (it answers in its "status" thread, even mid-step)
CONTROL = "control"  # the stage actors' thread for the driver's control calls (see elastic_llm.pipeline.stage_actor.CONCURRENCY_GROUPS)


class Held(Protocol):
    """What a handover reads and sets of the :class:`~elastic_llm.runtime.actors.ActorGroup` whose methods call it."""

    stages: int
    spawned: bool
    generation: int
    names: dict[Any, str]
    slots: Reservations
    pool: Standbys | None
    table: Membership
    handles: Column[Any]
    spares: RaySpares

    @property
    def width(self) -> int: ...
    @property
    def actors(self) -> list[list[Any]]: ...
    def keys(self) -> list[ShardKey]: ...
    def actor(self, key: ShardKey) -> Any: ...
    def hold(self, key: ShardKey, actor: Any, name: str) -> None: ...
    def record(self, key: ShardKey, info: Any) -> None: ...


def name_generation(name: str) -> int:
    """The start counter a stage actor's name ends with (``stage-<run>-<stage>-<replica>.<n>``); 0 if none."""
    tail = name.rpartition(".")[2]
    return int(tail) if tail.isdigit() else 0


def leased(group: Held) -> list[tuple[Any, str | None]]:
    """Every stage-class actor of the run (the width's, spares', stage spares', warm standbys'),
    each with the thread group its keepalive goes to."""
    out = [a for row in list(group.actors) for a in list(row) if a is not None]
    out += [a for sp in group.spares.replicas() for a in sp.actors]
    out += [sp.actor for sp in group.spares.of().values() if sp.actor is not None]
    if group.pool is not None:
        out += group.pool.actors()
    return [(a, CONTROL) for a in out]

def roster(group: Held) -> Roster:
    """The width's actors as a next driver finds them: by name and placement group (JSON)."""
    rows: list[RosterRow] = []
    for k in group.keys():
        actor, pg = group.actor(k), group.slots.groups.get(k)
        rows.append({"stage": k.stage, "replica": k.replica, "name": group.names.get(actor) if actor is not None else None,
                     "group": pg.id.hex() if pg is not None else None})
    return {"width": group.width, "stages": group.stages, "actors": rows}

def take_over(group: Held, roster: Roster) -> tuple[set[ShardKey], list[Any]]:
    """Make the roster's actors ``group``'s (an :class:`~elastic_llm.runtime.actors.ActorGroup`):
    those that answer within :data:`ANSWER_S` are adopted with their state (a step they still run
    is aborted), the others are left for its ``replace`` (their placement group kept if it
    lives). Returns the adopted keys and the actors the caller ends (found, but not answering as
    the roster says)."""
    import ray
    from ray._raylet import PlacementGroupID  # type: ignore[attr-defined]  # a compiled module: no stubs
    from ray.util.placement_group import PlacementGroup

    if roster.get("stages") != group.stages:
        raise ValueError(f"the run's roster has {roster.get('stages')} stages, this driver {group.stages}")
    group.table.width = int(roster["width"])
    group.spawned = True
    table = group.slots.table()
    asks: dict[Any, ShardKey] = {}
    for row in roster["actors"]:
        key = ShardKey(int(row["stage"]), int(row["replica"]))
        gid = row.get("group")
        if gid and table.get(gid, {}).get("state") not in (None, "REMOVED"):
            group.slots.groups[key] = PlacementGroup(PlacementGroupID(bytes.fromhex(gid)))
        name = row.get("name")
        if not name:
            continue
        group.generation = max(group.generation, name_generation(name))
        try:
            actor = ray.get_actor(name)
        except ValueError:  # it died while no driver ran
            continue
        group.hold(key, actor, name)
        asks[actor.info.options(concurrency_group="status").remote()] = key
    ray.wait(list(asks), num_returns=len(asks), timeout=ANSWER_S)
    adopted, ended = set(), []
    for ref, key in asks.items():
        actor = group.actor(key)
        try:
            info = ray.get(ref, timeout=0)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
            log.info("%s of the run did not answer the new driver (%s): it is replaced", key, type(e).__name__)
            ended.append(actor)
            group.handles.pop(key, None)
            continue
        if (info.stage, info.replica) != (key.stage, key.replica):
            log.warning("%s of the roster says it is stage %d replica %d: it is replaced", key, info.stage, info.replica)
            ended.append(actor)
            group.handles.pop(key, None)
            continue
        if info.links >= 0:  # a step the dead driver left running stops at its next layer or receive
            actor.abort_step.options(concurrency_group=CONTROL).remote(info.links)
        group.record(key, info)
        adopted.add(key)
    lost = [k for k in group.keys() if k not in adopted]
    if lost:
        group.slots.renew(lost)  # a group whose node went is made afresh
    return adopted, ended

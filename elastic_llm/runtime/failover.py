"""Driver failover: what lets a new driver pick a run up where a dead one left it.

With ``recovery.driver_grace_s`` > 0 (the default), a run's snapshot managers, stage actors (with
their placement groups), spares and warm standbys are detached Ray actors: they outlive the driver
that started them, the managers holding the run's newest committed in-memory snapshot and the
stages their live state, for ``driver_grace_s`` after the last keepalive of a driver; then each
ends itself (:mod:`elastic_llm.lease`), so a run nobody resumes leaks nothing. ``elastic-llm
train --resume RUN_ID`` (or the same command in a resubmitted Ray job) starts a driver that takes
the run's roster over (:mod:`elastic_llm.runtime.handover`: the stage actors that answer keep
their process and state; those whose state is past the committed snapshot roll back to it) and
restores only what was lost, as a recovery would; without the managers it falls back to the run's
newest durable checkpoint.

Owns: the run's entries in Ray's GCS key-value store (namespace ``elastic-llm``:
``run/<id>/config``, the run's config as JSON, and ``run/<id>/driver``, its Ray job id, written
at start; ``run/<id>/committed``, the newest committed snapshot version's record as JSON,
rewritten at every commit; ``run/<id>/roster``, the stage actors of the width by name and
placement group, rewritten at every change of membership), the :class:`Keepalive` thread that
tells the run's detached actors a driver lives, finding a run's surviving managers by their
names (:func:`find_managers`), and retiring a dead driver (:func:`retire_old_driver`: refused
while its Ray job runs; its leftover actors that are not taken over ended, so their names are free).
Never decides what to restore (the trainer does, from what is found) and never unpickles: the
records are JSON (:func:`~elastic_llm.snapshot.records.record_from_json`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_llm.controller.ports import ResumeError, Roster
from elastic_llm.lease import KV_NAMESPACE, driver_alive, read_run, run_key
from elastic_llm.snapshot.records import VersionRecord, record_from_json, record_json

log = logging.getLogger("elastic_llm.runtime")
OLD_ACTORS_S = 30.0  # longest a resuming driver waits for the dead driver's actors to be gone


def publish(run_id: str, what: str, text: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(run_key(run_id, what), text.encode(), overwrite=True, namespace=KV_NAMESPACE)


def forget(run_id: str) -> None:
    """A run that ended cleanly: nothing is left to resume."""
    from ray.experimental.internal_kv import _internal_kv_del

    for what in ("config", "driver", "committed", "epoch", "roster"):
        _internal_kv_del(run_key(run_id, what), namespace=KV_NAMESPACE)


def publish_committed(run_id: str, record: VersionRecord) -> None:
    publish(run_id, "committed", record_json(record))


def published_committed(run_id: str) -> VersionRecord | None:
    text = read_run(run_id, "committed")
    return record_from_json(text) if text is not None else None


def check_same_model(run_id: str, config: dict[str, Any]) -> None:
    """Raise :class:`ResumeError` unless run ``run_id`` was started (on this cluster) with the same
    model and stage count as ``config``."""
    text = read_run(run_id, "config")
    if text is None:
        raise ResumeError(
            f"--resume {run_id}: no run {run_id} is known to this Ray cluster (it ended, or ran on another cluster): "
            "give a run id that `elastic-llm status` lists, or a durable checkpoint directory"
        )
    then = json.loads(text)
    for section, keys in (("model", None), ("parallel", ("stages",))):
        a, b = then.get(section, {}), config.get(section, {})
        diff = sorted(k for k in (keys or set(a) | set(b)) if a.get(k) != b.get(k))
        if diff:
            raise ResumeError(
                f"--resume {run_id}: the run was started with other {section} settings ({', '.join(f'{section}.{k}={a.get(k)!r}' for k in diff)}): "
                "resume it with the config it was started with"
            )


def find_managers(namespace: str, run_id: str) -> dict[str, Any]:
    """The live snapshot managers of run ``run_id``, by node id (asked for their node)."""
    import ray

    handles = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith(f"smp-{run_id}-"):
            try:
                handles.append(ray.get_actor(entry["name"], namespace=namespace))
            except ValueError:  # gone since it was listed
                continue
    states = [h.state.remote() for h in handles]
    out: dict[str, Any] = {}
    for h, ref in zip(handles, states):
        try:
            out[ray.get(ref, timeout=30).node_id] = h
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):  # a manager that does not answer is one that is not there
            continue
    return out


def publish_driver(run_id: str) -> None:
    """Record this driver's Ray job as the run's (a resuming driver checks that it is dead)."""
    import ray

    publish(run_id, "driver", ray.get_runtime_context().get_job_id())


def retire_old_driver(namespace: str, run_id: str, keep: frozenset[str] = frozenset(), keep_standbys: bool = False,
                      seconds: float = OLD_ACTORS_S) -> None:
    """Before a new driver takes run ``run_id`` over: refuse if the old driver's job still runs;
    else end what is left of its actors that the new driver does not take over (the run's
    monitor, stage actors not named in ``keep`` (the roster's), spares, and the warm standbys
    unless ``keep_standbys``: Ray ends a dead job's own actors, but not always at once, and never
    its detached ones) and wait until their names are free."""
    import ray

    if driver_alive(run_id):
        raise ResumeError(
            f"--resume {run_id}: the run's driver (Ray job {read_run(run_id, 'driver')}) is still running: stop it first "
            "(`ray job stop`, or kill its process), or let it train"
        )
    prefixes = (f"stage-{run_id}-", f"run-{run_id}") + (() if keep_standbys else (f"standby-{run_id}-",))

    def left() -> list[str]:
        return [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                if e["namespace"] == namespace and e["name"].startswith(prefixes) and e["name"] not in keep]

    for name in left():
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # gone since it was listed
            continue
    deadline = time.monotonic() + seconds
    while left():
        if time.monotonic() > deadline:
            raise ResumeError(f"--resume {run_id}: actors of the old driver are still registered after {seconds:.0f} s ({', '.join(sorted(left())[:4])})")
        time.sleep(0.1)


class Keepalive:
    """Tells every actor ``handles()`` returns (with the thread group its call goes to, None: the
    actor's default) that a driver lives, every ``period_s``, on a thread of its own (fire and
    forget: a dead actor is a later failure, not this thread's). :meth:`stop` ends the thread and
    waits for it."""

    def __init__(self, handles: Callable[[], list[tuple[Any, str | None]]], period_s: float) -> None:
        self.handles = handles
        self.period_s = period_s
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="elastic-llm-keepalive", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            for h, group in list(self.handles()):
                try:
                    (h.keepalive if group is None else h.keepalive.options(concurrency_group=group)).remote()
                except Exception as e:  # noqa: BLE001 - the next round tries again; the first error is said
                    if self.errors == 0:
                        log.warning("keepalive to an actor of the run failed (%s: %s); it goes on", type(e).__name__, e)
                    self.errors += 1


class RayRegistry:
    """The :class:`~elastic_llm.controller.ports.RunRegistry` of a Ray cluster: the GCS key-value
    store, the run's named detached managers, and the keepalive thread."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.driver_epoch = 0  # this driver's epoch once it published the run (elastic_llm.runtime.ray_runtime: link generations)

    def check_same_model(self, run_id: str, config: dict[str, Any]) -> None:
        check_same_model(run_id, config)

    def retire_old_driver(self, run_id: str, keep: frozenset[str] = frozenset(), keep_standbys: bool = False) -> None:
        retire_old_driver(self.namespace, run_id, keep, keep_standbys)

    def publish_roster(self, run_id: str, roster: Roster) -> None:
        publish(run_id, "roster", json.dumps(roster))

    def roster(self, run_id: str) -> Roster | None:
        text = read_run(run_id, "roster")
        return json.loads(text) if text is not None else None

    def find(self, run_id: str) -> tuple[dict[str, Any], VersionRecord | None]:
        return find_managers(self.namespace, run_id), published_committed(run_id)

    def epoch(self, run_id: str) -> int:
        text = read_run(run_id, "epoch")
        return int(text) if text is not None and text.isdigit() else 0

    def publish_run(self, run_id: str, config: dict[str, Any], epoch: int) -> None:
        publish(run_id, "config", json.dumps(config))
        publish(run_id, "epoch", str(epoch))
        publish_driver(run_id)
        self.driver_epoch = epoch

    def publish_committed(self, run_id: str, record: VersionRecord) -> None:
        publish_committed(run_id, record)

    def keepalive(self, handles: Callable[[], list[tuple[Any, str | None]]], period_s: float) -> Keepalive:
        k = Keepalive(handles, period_s)
        k.start()
        return k

    def forget(self, run_id: str) -> None:
        forget(run_id)

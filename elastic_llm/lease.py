"""The lease of an actor that outlives its driver: it ends itself when no driver renews it.

Owns: :class:`Lease`, what the run's detached actors (snapshot managers, stage actors, warm
standbys) hold while ``recovery.driver_grace_s`` > 0: a driver's keepalive renews it
(:meth:`Lease.renew`); once nobody has for ``grace_s`` seconds, the lease releases what the actor
holds in the cluster (``release``: e.g. its placement group, which Ray keeps after the process
ends) and ends the process, so a run nobody resumes leaks nothing. Time is read from the
:class:`~elastic_llm.clock.Clock` its holder passes (the machine's in an actor; a test's own).
Never decides how long the grace is (the config does) and never talks to a driver.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from elastic_llm.clock import Clock

log = logging.getLogger("elastic_llm.lease")


class Lease:
    """Ends this process (``os._exit``) ``grace_s`` seconds of ``clock.monotonic()`` after the last
    :meth:`renew`, first calling ``release`` (its errors are logged: the process ends anyway). Its
    watch thread looks (:meth:`expire_if_due`) at least every ``poll_s`` real seconds; it is a
    daemon that either ends the process or is stopped by :meth:`stop` (joined there)."""

    def __init__(self, grace_s: float, what: str, clock: Clock, release: Callable[[], object] | None = None,
                 exit: Callable[[int], None] = os._exit, poll_s: float = 1.0) -> None:
        if grace_s <= 0:
            raise ValueError(f"a lease needs a grace of more than 0 seconds (got {grace_s}): without one the actor ends with its driver")
        self.grace_s = grace_s
        self.what = what
        self.clock = clock
        self.release = release
        self.exit = exit  # os._exit; a test passes its own
        self.poll_s = poll_s
        self.contact = clock.monotonic()
        self.expired = False
        self._lock = threading.Lock()  # one expiry, whether the watch thread or a caller looks
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="elastic-llm-lease", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        self.contact = self.clock.monotonic()

    def left_s(self) -> float:
        return self.grace_s - (self.clock.monotonic() - self.contact)

    def expire_if_due(self) -> bool:
        """One look: once the grace has passed since the last renewal, release and end (once).
        Returns whether the lease has expired."""
        with self._lock:
            if self.expired or self.left_s() > 0:
                return self.expired
            self.expired = True
        log.warning("%s: no driver for %.0f s (recovery.driver_grace_s): ending", self.what, self.grace_s)
        if self.release is not None:
            try:
                self.release()
            except Exception as e:  # noqa: BLE001 - the process ends either way; what could not be released is said
                log.warning("%s: could not release what it holds (%s: %s)", self.what, type(e).__name__, e)
        self.exit(0)
        return True

    def _watch(self) -> None:
        while not self.expire_if_due():
            if self._stop.wait(min(max(self.left_s(), 0.0), self.poll_s)):
                return

    def stop(self, timeout: float = 5.0) -> None:
        """Stop watching (the actor ends by other means: a clean shutdown, or an in-process test)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout)


KV_NAMESPACE = "elastic-llm"  # where a run's records live in Ray's GCS key-value store (elastic_llm.runtime.failover writes them)


def run_key(run_id: str, what: str) -> bytes:
    return f"run/{run_id}/{what}".encode()


def read_run(run_id: str, what: str) -> str | None:
    """Record ``what`` of run ``run_id`` from the GCS key-value store (None: not there)."""
    from ray.experimental.internal_kv import _internal_kv_get

    got = _internal_kv_get(run_key(run_id, what), namespace=KV_NAMESPACE)
    return got.decode() if got is not None else None


def driver_alive(run_id: str) -> bool:
    """Whether the Ray job that last took run ``run_id`` on (``run/<id>/driver``) still runs."""
    import ray

    job = read_run(run_id, "driver")
    if job is None:
        return False
    info = ray._private.worker.global_worker.gcs_client.get_all_job_info()
    return any(j.hex() == job and not data.is_dead for j, data in info.items())


def group_prefix(run_id: str) -> str:
    """The name prefix of run ``run_id``'s detached placement groups (one per stage actor)."""
    return f"pg-{run_id}-"


def remove_run_groups(run_id: str) -> int:
    """Remove every placement group of run ``run_id`` still in the cluster (a lease's release: Ray
    keeps a detached group after its actor ended, holding its CPUs), unless a driver of the run
    runs (a lease that expired unseen by it, e.g. of a manager it did not find, must not take its
    actors' groups away). Returns how many."""
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup
    from ray._raylet import PlacementGroupID  # type: ignore[attr-defined]  # a compiled module: no stubs

    if driver_alive(run_id):
        log.warning("run %s has a live driver: its placement groups are left to it", run_id)
        return 0
    n = 0
    for gid, row in placement_group_table().items():
        if row.get("name", "").startswith(group_prefix(run_id)) and row.get("state") != "REMOVED":
            try:
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(gid))))
                n += 1
            except ValueError:  # removed meanwhile (by another of the run's leases)
                continue
    return n

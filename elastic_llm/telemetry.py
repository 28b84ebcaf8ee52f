"""Ray metrics of a run (``ray.util.metrics``): their names, descriptions and tags, in one place.

Owns: every application metric elastic-llm exports and the tags it carries (``run``, and
``stage`` / ``replica`` / ``node`` / ``source`` where they apply). Ray exports them with a
``ray_`` prefix on every node's Prometheus endpoint (``--metrics-export-port``) and the dashboard's
Metrics page, e.g. ``ray_elastic_llm_step{run="3f2a9c"}``.
Never decides anything and never fails a run: outside a Ray worker or driver every call does
nothing, and an error from Ray's metrics is swallowed (the metrics are a view, not the run).

Who sets what: stage actors their own step, snapshot version and bytes
(:class:`~elastic_llm.pipeline.stage.StageWorker`), snapshot managers what their node holds
(:class:`~elastic_llm.snapshot.manager.SnapshotManager`), and the run's monitor actor everything
about the run as a whole (:class:`~elastic_llm.monitor.RunMonitor`).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("elastic_llm.telemetry")

PREFIX = "elastic_llm_"

# name -> (kind, description, tag keys)
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # the run (monitor actor)
    "step": ("gauge", "completed training steps of the run", ("run",)),
    "loss": ("gauge", "training loss of the last step", ("run",)),
    "tokens_per_s": ("gauge", "training tokens per second of the last step", ("run",)),
    "width": ("gauge", "data-parallel replicas training now", ("run",)),
    "snapshot_committed_version": ("gauge", "step of the newest committed in-memory snapshot", ("run",)),
    "snapshot_lag_steps": ("gauge", "steps the newest committed snapshot trails training", ("run",)),
    "erasure_groups": ("gauge", "erasure groups of the newest committed snapshot", ("run",)),
    "erasure_groups_protected": ("gauge", "erasure groups of the newest committed snapshot with every node alive", ("run",)),
    "recoveries": ("counter", "stage actors restored, by where their state came from", ("run", "source")),
    "resizes": ("counter", "changes of the data-parallel width", ("run",)),
    "drains": ("counter", "draining nodes the run moved off", ("run",)),
    "capacity_wait_seconds": ("counter", "seconds the run waited for capacity", ("run",)),
    # one stage actor
    "stage_step": ("gauge", "completed optimizer steps of a stage actor", ("run", "stage", "replica")),
    "stage_snapshot_version": ("gauge", "newest step a stage actor copied for a snapshot", ("run", "stage", "replica")),
    "stage_bytes_held": ("gauge", "bytes of state and snapshot copy buffers a stage actor holds", ("run", "stage", "replica")),
    # one snapshot manager
    "manager_versions_held": ("gauge", "snapshot versions a node's manager holds", ("run", "node")),
    "manager_bytes_held": ("gauge", "bytes of snapshot pieces and parity a node's manager holds", ("run", "node")),
}


def _known(name: str) -> None:
    if name not in METRICS:  # a programming error, unlike a failure of Ray's metrics
        raise KeyError(f"no metric {name!r} in elastic_llm.telemetry.METRICS")


class Metrics:
    """Lazily created Ray metrics of one process. ``set`` / ``inc`` never raise."""

    def __init__(self) -> None:
        self._made: dict[str, Any] = {}
        self.enabled: bool | None = None  # decided at the first call
        self.failed = 0  # records that could not be exported (the first one is logged)

    def _metric(self, name: str) -> Any:
        if self.enabled is None:
            try:
                import ray

                self.enabled = ray.is_initialized()
            except Exception:  # pragma: no cover - Ray always imports here
                self.enabled = False
        if not self.enabled:
            return None
        if name not in self._made:
            from ray.util import metrics

            kind, description, tags = METRICS[name]
            cls = metrics.Gauge if kind == "gauge" else metrics.Counter
            self._made[name] = cls(PREFIX + name, description=description, tag_keys=tags)
        return self._made[name]

    def set(self, name: str, value: float, **tags: Any) -> None:
        self._record("set", name, value, tags)

    def inc(self, name: str, value: float = 1.0, **tags: Any) -> None:
        self._record("inc", name, value, tags, skip=value <= 0)  # a counter only goes up

    def _record(self, method: str, name: str, value: float, tags: dict[str, Any], skip: bool = False) -> None:
        _known(name)
        if skip:
            return
        try:
            m = self._metric(name)
            if m is not None:
                getattr(m, method)(float(value), tags={k: str(v) for k, v in tags.items()})
        except Exception as e:  # noqa: BLE001 - a metric that cannot be exported must not stop training; the first is said
            if not self.failed:
                log.warning("Ray metric %s not exported (%s: %s); the others go on", name, type(e).__name__, e)
            self.failed += 1

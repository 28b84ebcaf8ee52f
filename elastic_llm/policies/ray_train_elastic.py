"""``recovery.policy: ray-train-elastic``: Ray Train v2's elastic training.

Models:
- The worker count is a range (``ScalingConfig(num_workers=(min, max))``), here
  ``elastic.min_replicas`` to ``elastic.max_replicas`` data-parallel replicas.
- Any failure ends every worker. The worker group starts again at the width the live nodes
  hold, and every worker loads the latest reported checkpoint.
- A resize does the same, once room for another replica appears. Ray Train looks for room
  periodically; here the look is ``elastic.grow_check_s`` = 60 s.
- Preemption notices are not used (``elastic.drains: false``). Ray's RFC ray-project/ray#63968
  proposes acting on them; Ray 2.60 does not.

Leaves out:
- Ray Train's controller polling and its worker-group health checks. The run's own failure
  detection stands in for them.
- ``FailureConfig(max_failures)``. The run's ``recovery.max_failures`` applies as for every
  policy.

Parameters and their sources:
- Resize period: 60 s. Ray Train v2 considers a resize at most once a minute by default
  (ray-project/ray, ``python/ray/train/v2``, elastic scaling policy).
- Checkpoint interval: the run's ``durable.every``, as for :mod:`~elastic_llm.policies.restart`.
  Ray Train checkpoints whenever the training function reports one.
- Restart cost: a process start for every stage (``actor_start_s`` of the cost model) and a read
  of the checkpoint (``flush_mb_s``).
- Warm standbys: none (``recovery.standby: 0``).
"""

from __future__ import annotations

from elastic_llm.policies.base import Policy

RESIZE_S = 60.0  # Ray Train v2's default period between resize decisions

POLICY = Policy(
    "ray-train-elastic",
    "width in a range, restart every worker from the latest checkpoint at any failure or resize, resizes looked at every 60 s, notices unused (Ray Train v2)",
    settings=(
        ("elastic.grow_check_s", RESIZE_S),
        ("elastic.drains", False),
        ("recovery.standby", 0),
    ),
    restart_all=True,
    restart_on_resize=True,
)
